"""Tearing down the process groups leaves no group object behind for a process forked afterwards.

A group object inherited through ``fork`` owns gloo threads that only the parent has; destroying it in the child
(megatron's ``initialize_model_parallel`` overwrites its globals) joins those absent threads and hangs. tidal-ckpt's
multi-rank tests fork their ranks from the pytest process after this package's tests ran there.
"""

from __future__ import annotations

import socket

import torch.distributed as dist
from tidal.actor import destroy_distributed, init_distributed
from tidal.actor.distributed import drop_leftover_groups, parallel_state  # tidal.actor first: it hides flashinfer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups_left() -> list[str]:
    return sorted(name for name, value in vars(parallel_state).items() if isinstance(value, dist.ProcessGroup))


def test_megatron_teardown_leaves_two_groups_in_its_globals():
    # What destroy_distributed works around; when an upgrade of megatron-core clears them itself, this fails and
    # drop_leftover_groups can go.
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    try:
        parallel_state.destroy_model_parallel()
        assert _groups_left() == [
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
            "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        ]
    finally:
        drop_leftover_groups()
        dist.destroy_process_group()
    assert _groups_left() == []


def test_destroy_distributed_leaves_no_group_object():
    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    assert _groups_left()  # a live parallel state holds its groups
    destroy_distributed()
    assert _groups_left() == []
    assert not dist.is_initialized()
