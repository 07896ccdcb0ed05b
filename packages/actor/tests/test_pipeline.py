"""PP=2 over gloo with two real processes against one process on the same data, and PP's input checks.

One spawn of two processes (pp_worker.py) runs every part: an untied model (log-probs, HF export and buckets, two
clipped train steps, the weights after them, a checkpoint), a tied-embedding model (one step), and a checkpoint
saved by one process loaded at PP=2; the single-process reference runs the same code in this process, and loads
the PP=2 checkpoint at PP=1.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("pp_worker.py")
KEYS = ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/num_loss_tokens", "train/skipped")


def _import(name: str):
    sys.path.insert(0, str(WORKER.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _import_worker():
    return _import("pp_worker")


def spawn(tmp: Path, world: int, args: list[str]) -> list[dict]:
    return _import("test_context_parallel").spawn(tmp, WORKER, world, args)


@pytest.fixture(scope="module")
def single(dist_env, qwen2_dir, qwen2_tied_dir, tmp_path_factory):
    """The worker's parts in this process (world size 1, PP=1); the untied run saves a checkpoint."""
    worker = _import_worker()
    ckpt = tmp_path_factory.mktemp("pp1_ckpt")
    return {
        "pp": worker.pp_part(0, 1, 0, str(qwen2_dir), ckpt_out=str(ckpt)),  # process group already up: port unused
        "tied": worker.pp_part(0, 1, 0, str(qwen2_tied_dir), steps=1),
        "ckpt": ckpt,
    }


@pytest.fixture(scope="module")
def two_ranks(single, qwen2_dir, qwen2_tied_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp2")
    args = [str(qwen2_dir), str(qwen2_tied_dir), str(single["ckpt"]), str(tmp / "ckpt")]
    return {"ranks": spawn(tmp, 2, args), "ckpt": tmp / "ckpt"}


def assert_matches(result: dict, ref: dict) -> None:
    torch.testing.assert_close(result["log_probs"], ref["log_probs"], atol=1e-5, rtol=0)
    assert result["export_equal"] and result["buckets_equal"]
    assert result["export_names"] == ref["export_names"]  # the whole model, in HF order, on every rank
    assert len(result["metrics"]) == len(ref["metrics"])
    for metrics, expected in zip(result["metrics"], ref["metrics"], strict=True):
        for key in KEYS:
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert set(result["weights"]) == set(ref["weights"])
    for name, tensor in result["weights"].items():
        torch.testing.assert_close(tensor, ref["weights"][name], atol=2e-6, rtol=0, msg=name)
    torch.testing.assert_close(result["log_probs_after"], ref["log_probs_after"], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("part", ["pp", "tied"])
def test_pp2_matches_single_process(two_ranks, single, part):
    """Both stages return the single process's log-probs, metrics, whole-model export and updated weights."""
    ref = single[part]
    assert all(m["train/grad_norm"] > 0.5 for m in ref["metrics"])  # clipping was active
    assert not torch.allclose(ref["log_probs_after"], ref["log_probs"], atol=1e-3)
    for result in (r[part] for r in two_ranks["ranks"]):
        assert_matches(result, ref)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("part", ["pp", "tied"])
def test_pp2_stage_only_export_is_each_stages_own_share(two_ranks, single, part):
    """hf_tensor_buckets(stage_only=True): each stage yields its own tensors alone; in stage order, the whole model."""
    names = single[part]["export_names"]
    assert single[part]["stage_names"] == names and single[part]["stage_equal"]
    first, last = (r[part] for r in two_ranks["ranks"])
    assert first["stage_equal"] and last["stage_equal"]
    assert first["stage_names"] + last["stage_names"] == names
    assert first["stage_names"][0] == "model.embed_tokens.weight"  # the tied embedding too: from the first stage
    assert all(n.startswith("model.layers.0.") for n in first["stage_names"][1:])  # layer 0 of 2 on stage 0
    assert last["stage_names"][0].startswith("model.layers.1.") and "model.norm.weight" in last["stage_names"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_pp2_tied_copies_stay_equal(two_ranks):
    """The last stage's copy of the tied embedding took the same update as the first stage's embedding."""
    first, last = (r["tied"]["tied_weight"] for r in two_ranks["ranks"])
    assert torch.equal(first, last)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_checkpoints_load_across_pipeline_sizes(two_ranks, single, qwen2_dir):
    """Saved at PP=1, loaded at PP=2 (in the workers); saved at PP=2, loaded at PP=1 (here): the same weights."""
    worker = _import_worker()
    for result in (r["load"] for r in two_ranks["ranks"]):
        assert result["num_steps"] == 2
        assert set(result["weights"]) == set(single["pp"]["weights"])
        for name, tensor in result["weights"].items():
            assert torch.equal(tensor, single["pp"]["weights"][name]), name
    loaded = worker.load_part(0, 1, 0, str(qwen2_dir), str(two_ranks["ckpt"]))
    assert loaded["num_steps"] == 2
    pp2_weights = two_ranks["ranks"][0]["pp"]["weights"]
    for name, tensor in loaded["weights"].items():
        assert torch.equal(tensor, pp2_weights[name]), name


def test_pipeline_input_checks(qwen2_dir):
    """Refused before any process group exists: PP < 1, PP with CP; layers that do not split over the stages."""
    import torch.distributed as dist
    from tidal.actor import init_distributed, read_hf_config
    from tidal.actor.hf_config import to_transformer_config

    was_initialized = dist.is_initialized()
    cases = [
        ({"pipeline_model_parallel_size": 0}, "--pipeline-model-parallel-size must be >= 1, got 0"),
        (
            {"pipeline_model_parallel_size": 2, "context_parallel_size": 2},
            "--pipeline-model-parallel-size 2 with --context-parallel-size 2 is not supported",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            init_distributed(rank=0, world_size=4, master_addr="127.0.0.1", master_port=0, **kwargs)
    assert dist.is_initialized() == was_initialized
    with pytest.raises(ValueError, match="num_hidden_layers=2 is not divisible by --pipeline-model-parallel-size 3"):
        to_transformer_config(read_hf_config(qwen2_dir), pipeline_model_parallel_size=3)
