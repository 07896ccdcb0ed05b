import logging
import os
import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table
from tidal.placement import PlacementConfig, PlacementError, ResourceShortageError, create_placement, groups
from tidal.placement.groups import wait_for_placement_group
from tidal.placement.lifecycle import read_cluster

from .conftest import GPUS_PER_NODE, TEST_ENV


@ray.remote
class Worker:
    def where(self):
        keys = ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *TEST_ENV)
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            **{k: os.environ.get(k) for k in keys},
        }


def _node_of(placement, bundle_index):
    return placement.bundle(bundle_index).node_id


def _assert_ordered(placement):
    keys = [(b.node_ip, b.node_id, b.gpu_id) for b in placement.bundles]
    assert keys == sorted(keys)
    assert len({(b.node_id, b.gpu_id) for b in placement.bundles}) == len(placement.bundles)
    for node in {b.node_id for b in placement.bundles}:
        gpus = [b.gpu_id for b in placement.bundles if b.node_id == node]
        assert gpus == sorted(gpus)


def test_cluster_view(ray_cluster):
    nodes = read_cluster()
    assert len(nodes) == 2 and sum(n.is_head for n in nodes) == 1
    assert all(n.gpus_total == GPUS_PER_NODE for n in nodes)


def test_shortage_error_is_fast_and_creates_nothing(ray_cluster):
    before = len(placement_group_table())
    cfg = PlacementConfig(
        actor_num_gpus_per_node=4,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=2,
        colocate=False,
        placement_timeout_s=600,
    )
    start = time.monotonic()
    with pytest.raises(ResourceShortageError) as info:
        create_placement(cfg)
    elapsed = time.monotonic() - start
    print(f"\nshortage error after {elapsed:.2f} s:\n{info.value}")
    assert elapsed < 5
    msg = str(info.value)
    assert "needs 12 GPUs, the cluster has 8" in msg
    assert msg.count(": 4 GPUs (4 free), 2 CPUs") == 2 and "(head)" in msg
    assert "--rollout-num-gpus 4" in msg and "--colocate" in msg
    assert len(placement_group_table()) == before


def test_colocated_one_node(ray_cluster, placements):
    cfg = PlacementConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2, colocate=True)
    p = create_placement(cfg, name="co-1")
    placements.append(p)
    _assert_ordered(p)
    assert len(p.bundles) == 4 and len({b.node_id for b in p.bundles}) == 1
    assert [p.bundle(i).gpu_id for i in p.actor_bundles] == [0, 1, 2, 3]
    assert p.engine_bundles == [p.actor_bundles[0:2], p.actor_bundles[2:4]]
    assert p.engine_visible_devices(1) == "2,3"
    # Co-located: the actor rank and the engine share bundle 2 with fractional GPUs, both see its GPU.
    rdzv = p.rendezvous()
    actor = Worker.options(**p.actor_options(2, rdzv)).remote()
    engine = Worker.options(**p.engine_options(1)).remote()
    a, e = ray.get([actor.where.remote(), engine.where.remote()], timeout=120)
    expected = p.rank_env(2, rdzv)
    assert a["gpu_ids"] == e["gpu_ids"] == [p.bundle(p.actor_bundles[2]).gpu_id]
    assert a["CUDA_VISIBLE_DEVICES"] == expected["CUDA_VISIBLE_DEVICES"] == "2"
    assert (a["RANK"], a["WORLD_SIZE"], a["LOCAL_RANK"]) == ("2", "4", "2")
    assert (a["MASTER_ADDR"], a["MASTER_PORT"]) == (rdzv.master_addr, str(rdzv.master_port))
    assert a["node_id"] == e["node_id"] == _node_of(p, p.actor_bundles[2])
    assert a["TIDAL_PLACEMENT_TEST"] == e["TIDAL_PLACEMENT_TEST"] == "from-ray-env"
    assert e["RANK"] is None


def test_colocated_two_nodes(ray_cluster, placements):
    cfg = PlacementConfig(
        actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=8, rollout_num_gpus_per_engine=4, colocate=True
    )
    p = create_placement(cfg, name="co-2")
    placements.append(p)
    _assert_ordered(p)
    nodes = [_node_of(p, i) for i in p.actor_bundles]
    assert len(set(nodes)) == 2 and nodes[:4] == [nodes[0]] * 4 and nodes[4:] == [nodes[4]] * 4
    assert [p.bundle(i).gpu_id for i in p.actor_bundles] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert p.engine_bundles == [p.actor_bundles[:4], p.actor_bundles[4:]]
    rdzv = p.rendezvous()
    env5 = p.rank_env(5, rdzv)
    assert (env5["RANK"], env5["LOCAL_RANK"], env5["NODE_RANK"], env5["LOCAL_WORLD_SIZE"]) == ("5", "1", "1", "4")
    assert env5["MASTER_ADDR"] == p.bundle(p.actor_bundles[0]).node_ip


def test_decoupled_one_node(ray_cluster, placements):
    cfg = PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, rollout_num_gpus_per_engine=2, colocate=False)
    p = create_placement(cfg, name="de-1")
    placements.append(p)
    _assert_ordered(p)
    assert len({b.node_id for b in p.bundles}) == 1
    assert [p.bundle(i).gpu_id for i in p.actor_bundles] == [0, 1]
    assert [p.bundle(i).gpu_id for i in p.engine_bundles[0]] == [2, 3]
    assert p.plan.actor_num_gpus == p.plan.engine_num_gpus == 1.0


def test_decoupled_two_nodes(ray_cluster, placements):
    cfg = PlacementConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2, colocate=False)
    p = create_placement(cfg, name="de-2")
    placements.append(p)
    _assert_ordered(p)
    actor_nodes = {_node_of(p, i) for i in p.actor_bundles}
    engine_nodes = [{_node_of(p, i) for i in bundles} for bundles in p.engine_bundles]
    assert len(actor_nodes) == 1 and all(len(n) == 1 for n in engine_nodes)
    assert not actor_nodes & set().union(*engine_nodes)
    assert not set(p.actor_bundles) & {i for b in p.engine_bundles for i in b}
    assert [p.engine_visible_devices(e) for e in range(2)] == ["0,1", "2,3"]
    ports = [p.engine_ports(e) for e in range(2)]
    assert all(pt.host == p.engine_node_ip(e) for e, pt in enumerate(ports))
    assert len({n for pt in ports for n in (pt.http_port, pt.nccl_port, pt.dist_init_port)}) == 6


def test_wait_times_out_with_pending_resources_and_removes_group(ray_cluster, monkeypatch, caplog):
    monkeypatch.setattr(groups, "PROGRESS_EVERY_S", 0.2)  # the real interval is 30 s
    pg = placement_group([{"GPU": 1, "CPU": 0.1}, {"GPU": 1, "tidal_missing_resource": 1}], name="never")
    start = time.monotonic()
    with (
        caplog.at_level(logging.INFO, logger=groups.__name__),
        pytest.raises(PlacementError, match=r"timed out after 1 s .*0/2 bundles placed.*tidal_missing_resource"),
    ):
        wait_for_placement_group(pg, timeout_s=1)
    assert time.monotonic() - start < 10
    progress = [r.getMessage() for r in caplog.records if "waiting for the placement group" in r.getMessage()]
    assert len(progress) >= 3 and "0/2 bundles placed, state PENDING" in progress[0]
    assert placement_group_table(pg)["state"] == "REMOVED"
