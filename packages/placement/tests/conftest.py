import os
import subprocess
import sys
import textwrap
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from tidal.placement import PlacementConfig, shutdown_ray, start_ray

GPUS_PER_NODE = 4
TEST_ENV = {"TIDAL_PLACEMENT_TEST": "from-ray-env"}

# A user's driver: starts its own local Ray, places a co-located job, reports, then waits for Ctrl-C.
LOCAL_DRIVER = textwrap.dedent(
    """
    import json, os, signal, time
    import ray
    from tidal.placement import PlacementConfig, create_placement, start_ray

    # A shell without job control starts background commands with SIGINT ignored, and Python keeps that: this
    # driver stands for a user's terminal, where Ctrl-C interrupts.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    cfg = PlacementConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True, placement_timeout_s=120,
                          ray_env={"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    start_ray(cfg)
    placement = create_placement(cfg)
    node = ray._private.worker.global_worker.node
    print(json.dumps({"session": os.path.basename(node.get_session_dir_path()),
                      "gpus": ray.cluster_resources().get("GPU"), "bundles": placement.actor_bundles}), flush=True)
    time.sleep(600)  # until Ctrl-C
    """
)


@pytest.fixture(scope="session")
def local_ray_driver(ray_cluster, tmp_path_factory):
    """The local-Ray driver subprocess for test_lifecycle.py.

    Launched once the cluster is up (two Ray start-ups at once overran Ray's fixed 30 s raylet start-up
    limit on the loaded 2-core box) and while the placement tests run, so its ~20 s start-up overlaps them.
    """
    stderr = tmp_path_factory.mktemp("driver") / "stderr.txt"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOCAL_DRIVER], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
    proc.stderr_path = stderr
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def ray_cluster():
    """Two simulated Ray nodes (4 logical GPUs each, same IP) started once; the driver connects by address."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": GPUS_PER_NODE, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, num_gpus=GPUS_PER_NODE)
    cluster.wait_for_nodes(timeout=120)
    start_ray(PlacementConfig(ray_address=cluster.address, ray_env=TEST_ENV))
    assert ray.is_initialized()
    yield cluster
    shutdown_ray()
    cluster.shutdown()
    os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture
def placements(ray_cluster, local_ray_driver):
    """Placements a test creates are removed at its end, and their GPUs seen free again, before the next test."""
    made = []
    yield made
    for placement in made:
        placement.remove()
    total = ray.cluster_resources()["GPU"]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < total and time.monotonic() < deadline:
        time.sleep(0.1)
