"""TP=2 and DP=2 over gloo with real processes, against TP=1 in this process and against transformers."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, world, tp, hf_dir, port):
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.pt"
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, str(WORKER), str(rank), str(world), str(port), str(tp), str(hf_dir), str(out)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        outs.append(out)
    for (proc, log), rank in zip(procs, range(world), strict=True):
        try:
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise
        log.close()
        tail = (tmp_path / f"rank{rank}.log").read_text()[-3000:]
        assert rc == 0, f"rank {rank} exited {rc}:\n{tail}"
    return [torch.load(o, weights_only=False) for o in outs]


@pytest.fixture(scope="module")
def single(dist_env):
    """``fn(hf_dir)``: the same worker run in this process (world size 1, TP=1), cached per model."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import tp_worker
    finally:
        sys.path.pop(0)
    from megatron.core import parallel_state

    cache = {}

    def run(hf_dir):
        if hf_dir not in cache:
            cache[hf_dir] = tp_worker.run(0, 1, 0, 1, str(hf_dir))  # process group already up: port unused
            assert parallel_state.get_tensor_model_parallel_world_size() == 1
        return cache[hf_dir]

    return run


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize(
    ("world", "tp", "model"), [(2, 2, "qwen2_tied_dir"), (2, 1, "qwen2_dir")], ids=["tp2-tied", "dp2"]
)
def test_multi_process_matches_single(tmp_path, request, hf_reference, single, world, tp, model):
    hf_dir = request.getfixturevalue(model)
    single = single(hf_dir)
    results = launch(tmp_path, world, tp, hf_dir, _free_port())
    seqs = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]
    _, ref = hf_reference(hf_dir, seqs)
    for r in results:
        assert r["export_equal"] and r["buckets_equal"]
        torch.testing.assert_close(r["log_probs"], torch.cat(ref), atol=1e-4, rtol=0)
        torch.testing.assert_close(r["log_probs"], single["log_probs"], atol=1e-5, rtol=0)
        for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/num_loss_tokens"):
            assert r["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-6), key
        # clipping (grad_norm > clip_grad) and the Adam step agree with the single-process run
        assert single["metrics"]["train/grad_norm"] > 0.5
        torch.testing.assert_close(r["log_probs_after"], single["log_probs_after"], atol=2e-4, rtol=0)
        # the engine-actor agreement covers every DP rank's tokens (sums added, the max of maxima)
        assert r["agreement"] == pytest.approx(single["agreement"])
    assert single["agreement"]["rollout/logprob_abs_diff/max"] == pytest.approx(0.9)
    assert not torch.allclose(single["log_probs_after"], single["log_probs"], atol=1e-3)
