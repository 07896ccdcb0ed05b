import pytest
from tidal.placement import PlacementConfig, ResourceShortageError
from tidal.placement.config import parse_ray_env
from tidal.placement.plan import NodeResources, ResourcePlan, check_resources


def test_gpu_arithmetic_colocated_and_decoupled():
    co = PlacementConfig(
        actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=8, rollout_num_gpus_per_engine=2, colocate=True
    )
    assert (co.num_actor_gpus, co.num_engines, co.num_gpus) == (8, 4, 8)
    de = PlacementConfig(
        actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=8, rollout_num_gpus_per_engine=2, colocate=False
    )
    assert de.num_gpus == 16
    none = PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=0)  # engines run elsewhere
    assert (none.num_engines, none.num_gpus, ResourcePlan.from_config(none).engine_positions) == (0, 2, [])


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2, "actor_num_gpus_per_node": 4}, "--rollout-num-gpus"),
        ({"rollout_num_gpus": 8, "actor_num_gpus_per_node": 4, "colocate": True}, "--colocate"),
        (
            {
                "rollout_num_gpus": 6,
                "rollout_num_gpus_per_engine": 3,
                "actor_num_nodes": 2,
                "actor_num_gpus_per_node": 4,
                "colocate": True,
            },
            "span two nodes",
        ),
        (
            {
                "rollout_num_gpus_per_engine": 8,
                "rollout_num_gpus": 8,
                "actor_num_gpus_per_node": 4,
                "actor_num_nodes": 2,
                "colocate": True,
            },
            "span two nodes",
        ),
        ({"actor_num_nodes": 0}, "--actor-num-nodes"),
        ({"rollout_num_gpus": -1}, "--rollout-num-gpus"),
        ({"actor_num_gpus_per_node": True}, "--actor-num-gpus-per-node"),
        ({"placement_timeout_s": 0}, "--placement-timeout"),
        ({"num_cpus_per_bundle": 0}, "--num-cpus-per-bundle"),
        ({"ray_env": {"BAD KEY": "1"}}, "--ray-env"),
    ],
)
def test_inconsistent_flags_are_value_errors_naming_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        PlacementConfig(**kwargs)


def test_decoupled_engine_size_is_not_bound_to_actor_node_size():
    cfg = PlacementConfig(actor_num_gpus_per_node=1, rollout_num_gpus=4, rollout_num_gpus_per_engine=4, colocate=False)
    assert cfg.num_gpus == 5


def test_parse_ray_env():
    env = parse_ray_env(["TORCHINDUCTOR_FORCE_DISABLE_CACHES=1", "NCCL_DEBUG=", "OPTS=a=b"])
    assert env == {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "NCCL_DEBUG": "", "OPTS": "a=b"}
    with pytest.raises(ValueError, match=r"--ray-env expects KEY=VALUE.*got 'NOEQUALS'"):
        parse_ray_env(["NOEQUALS"])
    with pytest.raises(ValueError, match="--ray-env expects"):
        parse_ray_env(["1X=2"])
    with pytest.raises(ValueError, match="sets A twice"):
        parse_ray_env(["A=1", "A=2"])


def test_plan_maps_actor_and_engines_to_bundle_positions():
    co = ResourcePlan.from_config(
        PlacementConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2, colocate=True)
    )
    assert co.num_bundles == 4 and co.actor_positions == [0, 1, 2, 3]
    assert co.engine_positions == [[0, 1], [2, 3]]
    assert co.actor_num_gpus + co.engine_num_gpus <= 1
    assert co.actor_num_cpus + co.engine_num_cpus <= co.bundle["CPU"]
    de = ResourcePlan.from_config(
        PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4, rollout_num_gpus_per_engine=2, colocate=False)
    )
    assert de.num_bundles == 6 and de.actor_positions == [0, 1]
    assert de.engine_positions == [[2, 3], [4, 5]]


def _node(i, gpus, free=None, cpus=2.0):
    return NodeResources(
        node_id=f"{i:08x}" * 7,
        node_ip=f"10.0.0.{i}",
        is_head=i == 1,
        gpus_total=gpus,
        gpus_available=gpus if free is None else free,
        cpus_total=cpus,
        cpus_available=cpus,
    )


def test_check_resources_passes_when_it_fits():
    nodes = [_node(1, 8), _node(2, 8)]
    check_resources(
        PlacementConfig(actor_num_nodes=2, actor_num_gpus_per_node=8, rollout_num_gpus=16, colocate=True), nodes
    )
    check_resources(PlacementConfig(actor_num_gpus_per_node=8, rollout_num_gpus=8, colocate=False), nodes)


def test_shortage_message_names_needed_available_per_node_and_flags():
    cfg = PlacementConfig(actor_num_gpus_per_node=8, rollout_num_gpus=8, rollout_num_gpus_per_engine=2, colocate=False)
    with pytest.raises(ResourceShortageError) as info:
        check_resources(cfg, [_node(1, 8), _node(2, 4, free=2)])
    msg = str(info.value)
    first = msg.splitlines()[0]  # the line a user sees on the terminal: needed, available and the fix
    assert "needs 16 GPUs, the cluster has 12" in first
    assert "available: 12 GPUs (10 free now) on 2 node(s)" in first
    assert "decoupled, --no-colocate: actor 1 node(s) x 8 GPUs + rollout 4 engine(s) x 2 GPUs" in first
    assert "Fix (any one)" in first
    assert "node 10.0.0.1 00000001 (head): 8 GPUs (8 free), 2 CPUs (2 free)" in msg
    assert "node 10.0.0.2 00000002: 4 GPUs (2 free)" in msg
    assert "--rollout-num-gpus 4 (the most that fits beside the actor)" in msg
    assert "--colocate" in msg and "--actor-num-nodes" in msg and "--rollout-num-gpus-per-engine" in msg


def test_shortage_when_blocks_do_not_fit_on_single_nodes():
    # 8 GPUs in total, but no node has the 8 GPUs one actor node needs.
    with pytest.raises(ResourceShortageError, match="do not each fit on a single node"):
        check_resources(
            PlacementConfig(actor_num_gpus_per_node=8, rollout_num_gpus=8, colocate=True), [_node(1, 4), _node(2, 4)]
        )


def test_shortage_of_bundle_cpus():
    with pytest.raises(ResourceShortageError, match=r"needs 0.8 CPUs \(8 bundles x 0.1\), the cluster has 0.5"):
        check_resources(
            PlacementConfig(actor_num_gpus_per_node=8, rollout_num_gpus=8, colocate=True), [_node(1, 8, cpus=0.5)]
        )
