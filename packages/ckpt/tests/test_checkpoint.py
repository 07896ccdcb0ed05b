"""Megatron save/load on real gloo ranks: round trips, resharding, mismatch errors, pruning, unsafe pickles."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.dist_checkpointing.strategies import filesystem_async
from tidal.ckpt import (
    TRACKER_FILENAME,
    CheckpointError,
    TrainerState,
    load_checkpoint,
    save_checkpoint,
)
from tidal.ckpt.shims import in_process_results_queue, sync_save_shims
from tidal.ckpt.state import restore_rng_state, rng_state_sharded_object

README = Path(__file__).parents[1] / "README.md"
FULL_W = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # split on axis 0 (like a column-parallel weight)
FULL_V = torch.arange(4 * 10, dtype=torch.bfloat16).reshape(4, 10)  # split on axis 1 (like a row-parallel weight)
FULL_B = torch.linspace(-1, 1, 5)  # replicated


def _state(rank: int, world: int, *, zeros: bool = False, optim: bool = True) -> dict:
    """A TP-style sharded state dict of plain tensors: rank r holds chunk r of W (axis 0) and V (axis 1)."""

    def part(full: torch.Tensor, axis: int) -> torch.Tensor:
        chunk = full.chunk(world, dim=axis)[rank].clone()
        return torch.zeros_like(chunk) if zeros else chunk

    bias = torch.zeros_like(FULL_B) if zeros else FULL_B.clone()
    model = {
        "w": ShardedTensor.from_rank_offsets("decoder.w", part(FULL_W, 0), (0, rank, world)),
        "v": ShardedTensor.from_rank_offsets("decoder.v", part(FULL_V, 1), (1, rank, world)),
        "b": ShardedTensor.from_rank_offsets("decoder.b", bias, replica_id=rank),
    }
    state: dict = {"model": model}
    if optim:
        exp_avg = part(FULL_W * 0.5, 0)
        state["optimizer"] = {
            "exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg.decoder.w", exp_avg, (0, rank, world)),
            "lr_scheduler": {"num_steps": 7, "max_lr": 1e-6},
        }
    return state


def _full(loaded: dict) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded["model"].items()}


def _save_world(rank: int, world: int, save_dir: Path, iteration: int) -> None:
    trainer = TrainerState(rollout_id=iteration, weight_version=iteration + 1, data_epoch=2, data_offset=96)
    save_checkpoint(save_dir, iteration, _state(rank, world), common_state=trainer.to_dict())


def _load_world(rank: int, world: int, load_dir: Path) -> dict:
    loaded, common = load_checkpoint(load_dir, _state(rank, world, zeros=True))
    return {
        "model": _full(loaded),
        "exp_avg": loaded["optimizer"]["exp_avg"],
        "common": common,
        "sched": loaded["optimizer"]["lr_scheduler"],
    }


def test_round_trip_restores_values_trainer_state_and_rng(ranks, tmp_path):
    def body(rank, world, save_dir):
        random.seed(1), np.random.seed(2), torch.manual_seed(3)
        state = _state(rank, world)
        state["rng_state"] = rng_state_sharded_object()
        expected_draws = (random.random(), np.random.rand(), torch.rand(3))
        trainer = TrainerState(rollout_id=5, weight_version=6, data_epoch=1, data_offset=40, data_seed=9)
        path = save_checkpoint(save_dir, 5, state, common_state=trainer.to_dict())
        random.seed(100), np.random.seed(100), torch.manual_seed(100)  # perturb every stream
        request = _state(rank, world, zeros=True)
        request["rng_state"] = rng_state_sharded_object()
        loaded, common = load_checkpoint(save_dir, request)
        restore_rng_state(loaded["rng_state"])
        draws = (random.random(), np.random.rand(), torch.rand(3))
        return path, loaded, TrainerState.from_dict(common), expected_draws, draws

    path, loaded, trainer, expected_draws, draws = ranks(1, body, tmp_path / "ckpt")[0]
    assert path == tmp_path / "ckpt" / "iter_0000005"
    assert (tmp_path / "ckpt" / TRACKER_FILENAME).read_text() == "5\n"
    assert torch.equal(loaded["model"]["w"], FULL_W)
    assert torch.equal(loaded["model"]["v"], FULL_V) and loaded["model"]["v"].dtype == torch.bfloat16
    assert torch.equal(loaded["model"]["b"], FULL_B)
    assert torch.equal(loaded["optimizer"]["exp_avg"], FULL_W * 0.5)
    assert loaded["optimizer"]["lr_scheduler"] == {"num_steps": 7, "max_lr": 1e-6}
    assert trainer == TrainerState(rollout_id=5, weight_version=6, data_epoch=1, data_offset=40, data_seed=9)
    assert expected_draws[0] == draws[0] and expected_draws[1] == draws[1]
    assert torch.equal(expected_draws[2], draws[2])
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".")]


def test_saved_on_two_ranks_loads_on_one(ranks, tmp_path):
    ranks(2, _save_world, tmp_path / "ckpt", 3)
    (result,) = ranks(1, _load_world, tmp_path / "ckpt")
    assert torch.equal(result["model"]["w"], FULL_W)
    assert torch.equal(result["model"]["v"], FULL_V)
    assert torch.equal(result["model"]["b"], FULL_B)
    assert torch.equal(result["exp_avg"], FULL_W * 0.5)
    assert result["common"]["rollout_id"] == 3 and result["common"]["weight_version"] == 4
    assert result["sched"]["num_steps"] == 7


def test_saved_on_one_rank_loads_on_two(ranks, tmp_path):
    ranks(1, _save_world, tmp_path / "ckpt", 8)
    results = ranks(2, _load_world, tmp_path / "ckpt")
    for rank, result in enumerate(results):
        assert torch.equal(result["model"]["w"], FULL_W.chunk(2, dim=0)[rank])
        assert torch.equal(result["model"]["v"], FULL_V.chunk(2, dim=1)[rank])
        assert torch.equal(result["model"]["b"], FULL_B)
        assert result["common"]["data_offset"] == 96


def _load_expecting_error(rank, world, load_dir, request_fn):
    try:
        load_checkpoint(load_dir, request_fn(rank, world))
    except CheckpointError as e:
        return type(e).__name__, str(e)
    return None


def _save_with_rng(rank, world, save_dir):
    state = _state(rank, world)
    state["rng_state"] = rng_state_sharded_object()
    save_checkpoint(save_dir, 1, state)


def _request_with_rng(rank, world):
    state = _state(rank, world, zeros=True)
    state["rng_state"] = rng_state_sharded_object()
    return state


def test_rng_at_another_world_size_says_no_load_rng_and_model_only_load_works(ranks, tmp_path):
    ranks(2, _save_with_rng, tmp_path / "ckpt")
    (error,) = ranks(1, _load_expecting_error, tmp_path / "ckpt", _request_with_rng)
    assert error is not None and error[0] == "CheckpointMismatchError"
    assert "--no-load-rng" in error[1] and "'rng_state' was saved for 2 rank(s)" in error[1]
    assert error[1].replace(str(tmp_path / "ckpt"), "DIR") in README.read_text(), "README lists a stale message"

    def model_only(rank, world, load_dir):  # what --no-load-optim --no-load-rng asks for
        loaded, _ = load_checkpoint(load_dir, {"model": _state(rank, world, zeros=True)["model"]})
        return _full(loaded)

    (model,) = ranks(1, model_only, tmp_path / "ckpt")
    assert torch.equal(model["w"], FULL_W)


def _missing_key(rank, world):
    state = _state(rank, world, zeros=True)
    state["model"]["extra"] = ShardedTensor.from_rank_offsets("decoder.extra", torch.zeros(2), replica_id=rank)
    return state


def _wrong_shape(rank, world):
    state = _state(rank, world, zeros=True)
    state["model"]["w"] = ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(8, 7), (0, rank, world))
    return state


def _unused_key(rank, world):
    state = _state(rank, world, zeros=True)
    del state["model"]["b"]
    return state


def _no_saved_optimizer(rank, world):
    state = _state(rank, world, zeros=True)
    state["optimizer"]["exp_avg_sq"] = ShardedTensor.from_rank_offsets(
        "optimizer.exp_avg_sq.decoder.w", torch.zeros(8, 6), (0, rank, world)
    )
    return state


@pytest.fixture
def saved_ckpt(ranks, tmp_path) -> Path:
    ranks(1, _save_world, tmp_path / "ckpt", 2)
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("request_fn", "expected"),
    [
        (_missing_key, "section 'model': 1 key(s) missing from the checkpoint: decoder.extra"),
        (_wrong_shape, "'decoder.w' has shape (8, 6) in the checkpoint but (8, 7) in the model"),
        (_unused_key, "section 'model': 1 checkpoint key(s) unused by the model: decoder.b"),
        (_no_saved_optimizer, "optimizer.exp_avg_sq.decoder.w); pass --no-load-optim"),
    ],
)
def test_mismatch_is_a_clear_error_and_loads_nothing(ranks, saved_ckpt, request_fn, expected):
    (error,) = ranks(1, _load_expecting_error, saved_ckpt, request_fn)
    assert error is not None, "a mismatched checkpoint loaded without error"
    name, message = error
    assert name == "CheckpointMismatchError" and expected in message, message
    assert "Nothing was loaded." in message
    assert ("num_hidden_layers" in message) == ("--no-load-optim" not in message)  # model hint only for model problems
    if request_fn is _no_saved_optimizer:
        assert message.replace(str(saved_ckpt), "DIR") in README.read_text(), "README lists a stale message"


def test_keep_last_prunes_oldest_and_keeps_the_new_one(ranks, tmp_path):
    def body(rank, world, save_dir):
        for iteration in (10, 20, 30, 40):
            save_checkpoint(save_dir, iteration, _state(rank, world), keep_last=2)
        save_checkpoint(save_dir, 15, _state(rank, world), keep_last=2)  # an older step saved after a resume

    ranks(1, body, tmp_path / "ckpt")
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["iter_0000015", "iter_0000040", TRACKER_FILENAME]
    assert (tmp_path / "ckpt" / TRACKER_FILENAME).read_text() == "15\n"


def test_resaving_an_iteration_replaces_it(ranks, tmp_path):
    def body(rank, world, save_dir):
        save_checkpoint(save_dir, 4, _state(rank, world))
        state = _state(rank, world)
        state["model"]["w"].data.mul_(-1)
        save_checkpoint(save_dir, 4, state)
        loaded, _ = load_checkpoint(save_dir, {"model": _state(rank, world, zeros=True)["model"]})
        return loaded["model"]["w"]

    (w,) = ranks(1, body, tmp_path / "ckpt")
    assert torch.equal(w, -FULL_W)


class _Exploit:
    """Unpickling this (weights_only=False) would write a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_crafted_pickle_in_the_checkpoint_is_refused_not_executed(ranks, tmp_path):
    marker = tmp_path / "pwned"

    def craft(rank, world, save_dir):  # a checkpoint written with megatron directly, not by tidal
        iter_dir = save_dir / "iter_0000001"
        iter_dir.mkdir(parents=True)
        with sync_save_shims():
            dist_checkpointing.save({**_state(rank, world), "evil": _Exploit(str(marker))}, str(iter_dir))
        (save_dir / TRACKER_FILENAME).write_text("1")

    ranks(1, craft, tmp_path / "ckpt")
    assert not marker.exists()
    (error,) = ranks(1, _load_expecting_error, tmp_path / "ckpt", _state)
    assert error is not None and "weights_only=True" in error[1], error
    assert not marker.exists(), "loading the checkpoint ran code from its pickle"

    def raw_megatron_load(rank, world, load_dir):  # the upstream hazard the shim closes
        dist_checkpointing.load_common_state_dict(str(load_dir / "iter_0000001"))

    ranks(1, raw_megatron_load, tmp_path / "ckpt")
    assert marker.exists(), "megatron/DCP now unpickles safely by itself: weights_only_unpickling may be dropped"


def test_save_needs_an_initialized_process_group(tmp_path):
    with pytest.raises(CheckpointError, match="init_process_group"):
        save_checkpoint(tmp_path, 1, {})


def test_common_state_must_survive_weights_only_loading(ranks, tmp_path):
    def body(rank, world, save_dir):
        with pytest.raises(ValueError, match=r"weights_only=True"):
            save_checkpoint(save_dir, 1, _state(rank, world), common_state={"x": _Exploit("/nonexistent")})
        return sorted(p.name for p in save_dir.iterdir()) if save_dir.exists() else []

    assert ranks(1, body, tmp_path / "ckpt") == [[]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU save shim only matters without CUDA")
def test_megatron_save_still_needs_the_cpu_shim(ranks, tmp_path):
    """Fails when a megatron-core upgrade no longer calls into CUDA on a CPU save: then drop sync_save_shims."""

    def body(rank, world, out):
        out.mkdir()
        try:
            with in_process_results_queue():
                dist_checkpointing.save(_state(rank, world), str(out))
        except (RuntimeError, AssertionError) as e:
            return str(e)
        return None

    (error,) = ranks(1, body, tmp_path / "raw")
    assert error is not None and ("NVIDIA" in error or "CUDA" in error), error


def test_megatron_still_spawns_a_manager_for_its_results_queue():
    """Fails when megatron-core stops spawning a Manager per process: then drop in_process_results_queue."""
    default_mode = inspect.signature(filesystem_async.get_write_results_queue).parameters["mp_mode"].default
    assert default_mode == "spawn"
    assert "Manager()" in inspect.getsource(filesystem_async.get_write_results_queue)


def _adamw_state(rank: int, world: int, *, train: bool) -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    """A TP-sharded Linear + AdamW, sharded for checkpointing the way Megatron shards a torch optimizer."""
    torch.manual_seed(0)
    full = torch.nn.Linear(6, 8)  # the same full weights on every rank; each rank keeps its row chunk
    layer = torch.nn.Linear(6, 8 // world)
    with torch.no_grad():
        layer.weight.copy_(full.weight.chunk(world, dim=0)[rank])
        layer.bias.copy_(full.bias.chunk(world, dim=0)[rank])
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, betas=(0.8, 0.9))
    if train:
        for _ in range(2):
            layer(torch.ones(3, 6)).pow(2).sum().backward()  # same input on all ranks: shards of one update
            optimizer.step()
            optimizer.zero_grad()
    else:  # a fresh optimizer must own (zero) state to be loaded into
        layer(torch.zeros(1, 6)).sum().mul(0).backward()
        optimizer.step()
    model_sd = {
        "weight": ShardedTensor.from_rank_offsets("layer.weight", layer.weight, (0, rank, world)),
        "bias": ShardedTensor.from_rank_offsets("layer.bias", layer.bias, (0, rank, world)),
    }
    optim_sd = optimizer.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, iter(layer.parameters()))
    optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))  # drops "step": kept as num_steps
    optim_sd["num_steps"] = int(optimizer.state[layer.weight]["step"])
    return {"model": model_sd, "optimizer": optim_sd}, layer, optimizer


def test_torch_adamw_sharded_like_megatron_saved_on_two_ranks_resumes_on_one(ranks, tmp_path):
    def save(rank, world, save_dir):
        state, layer, optimizer = _adamw_state(rank, world, train=True)
        save_checkpoint(save_dir, 2, state)
        return layer.weight.detach(), optimizer.state[layer.weight]["exp_avg_sq"]

    def load(rank, world, load_dir):
        request, layer, optimizer = _adamw_state(rank, world, train=False)
        loaded, _ = load_checkpoint(load_dir, request)
        layer.load_state_dict({"weight": loaded["model"]["weight"], "bias": loaded["model"]["bias"]})
        optim = dict(loaded["optimizer"])
        num_steps = optim.pop("num_steps")
        for param_state in optim["state"].values():
            param_state["step"] = torch.tensor(float(num_steps))
        optimizer.load_state_dict(optim)
        return layer.weight.detach(), optimizer.state[layer.weight], optimizer.param_groups[0]["betas"]

    shards = ranks(2, save, tmp_path / "ckpt")
    (weight, adam, betas) = ranks(1, load, tmp_path / "ckpt")[0]
    assert torch.equal(weight, torch.cat([w for w, _ in shards]))
    assert torch.equal(adam["exp_avg_sq"], torch.cat([v for _, v in shards]))
    assert float(adam["step"]) == 2.0 and tuple(betas) == (0.8, 0.9)
