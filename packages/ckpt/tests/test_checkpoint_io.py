"""CheckpointIO: built from CkptConfig, saves with the rank's RNG state, loads what the flags ask for."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from megatron.core.dist_checkpointing import ShardedTensor
from tidal.ckpt import CheckpointIO, CkptConfig


def _state(value: float, *, optim: bool) -> dict:
    state: dict = {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.full((3,), value), replica_id=0)}}
    if optim:
        state["optimizer"] = {"m": ShardedTensor.from_rank_offsets("m", torch.full((3,), value), replica_id=0)}
    return state


def test_from_config_reads_every_checkpoint_flag():
    cfg = CkptConfig(
        save="s", load="l", ckpt_step=3, keep_last=2, async_save=True, no_load_optim=True, no_load_rng=True,
        max_shard_bytes=7,
    )  # fmt: skip
    io = CheckpointIO.from_config(cfg)
    assert io == CheckpointIO(
        save_dir="s", load_dir="l", ckpt_step=3, keep_last=2, async_save=True, load_optimizer=False, load_rng=False,
        max_shard_bytes=7,
    )  # fmt: skip


def _round_trip(rank: int, world: int, save_dir: str, skip: bool) -> tuple[list[float], list[float], bool, dict]:
    flags = {"no_load_optim": skip, "no_load_rng": skip}
    io = CheckpointIO.from_config(CkptConfig(save=save_dir, load=save_dir, **flags))
    random.seed(5)
    io.save(4, _state(2.0, optim=True), common_state={"rollout_id": 3})
    expected = random.random()  # the next draw after the saved state
    random.seed(99)
    # as the trainer asks: the optimizer section only when the flags load it
    loaded, common = io.load(_state(0.0, optim=io.load_optimizer))
    optimizer = loaded["optimizer"]["m"].tolist() if "optimizer" in loaded else []
    return loaded["model"]["w"].tolist(), optimizer, random.random() == expected, common


@pytest.mark.parametrize("skip", [False, True])
def test_save_then_load_restores_the_model_and_the_rng_unless_told_not_to(ranks, tmp_path: Path, skip: bool):
    """--no-load-optim leaves the saved optimizer state out of the load, --no-load-rng the RNG states."""
    [(weights, optimizer, rng_restored, common)] = ranks(1, _round_trip, str(tmp_path / "ckpt"), skip)
    assert weights == [2.0, 2.0, 2.0]
    assert optimizer == ([] if skip else [2.0, 2.0, 2.0])
    assert rng_restored is not skip
    assert common == {"rollout_id": 3}


def test_save_and_load_without_a_directory_name_the_flag():
    with pytest.raises(ValueError, match="--save"):
        CheckpointIO().save(1, {}, common_state={})
    with pytest.raises(ValueError, match="--load"):
        CheckpointIO().load({})
