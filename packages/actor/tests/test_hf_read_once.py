"""HF weights are read once per job: by rank 0, broadcast to the other ranks, copied into the reference and the
critic, and not read at all by a resume whose checkpoint overwrites them. Real Megatron ranks over gloo, TP=2 x PP=2.

Bytes are counted by ``tidal.ckpt.HFCheckpointReader``, the one place that opens safetensors files to read them
(checked here on the source).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("hf_read_worker.py")
ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, qwen2_tied_dir):
    """The four ranks' records (TP=2 x PP=2: the tied output weight on the last stage comes from the embedding)."""
    tmp = tmp_path_factory.mktemp("hf_read")
    world, tp, port = 4, 2, _free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, str(WORKER), str(rank), str(world), str(port), str(tp), str(qwen2_tied_dir)]
        log = (tmp / f"rank{rank}.log").open("w")
        procs.append((subprocess.Popen([*cmd, str(tmp / "ckpt"), str(tmp / f"rank{rank}.pt")], stdout=log,
                                       stderr=subprocess.STDOUT), log))  # fmt: skip
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=300)
            log.close()
            assert rc == 0, f"rank {rank} exited {rc}:\n{(tmp / f'rank{rank}.log').read_text()[-3000:]}"
    finally:
        for proc, _ in procs:
            proc.kill()
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
def test_rank0_alone_reads_the_checkpoint_once(ranks, qwen2_tied_dir):
    total = sum(t.numel() * t.element_size() for t in load_file(qwen2_tied_dir / "model.safetensors").values())
    assert [r["read"]["actor"] for r in ranks] == [total, 0, 0, 0]
    assert all(r["read"]["reference"] == r["read"]["critic"] == 0 for r in ranks)


@pytest.mark.slow
def test_every_rank_got_its_own_shards(ranks):
    # the TP shards of both stages, gathered back, are the checkpoint exactly; all ranks agree on the log-probs
    assert all(r["export_equal"] for r in ranks)
    for r in ranks[1:]:
        torch.testing.assert_close(r["log_probs"], ranks[0]["log_probs"], atol=0, rtol=0)


@pytest.mark.slow
def test_reference_and_critic_hold_the_actors_weights(ranks):
    assert all(r["reference_equal"] and r["critic_equal"] for r in ranks)


@pytest.mark.slow
def test_resume_reads_no_hf_weights_and_refuses_to_compute_before_its_load(ranks):
    assert all(r["resume_read"] == {"actor": 0, "critic": 0} for r in ranks)
    assert all(r["refused_before_load"] for r in ranks)
    assert all(r["resume_equal"] and r["resume_log_probs_equal"] for r in ranks)


def test_bad_checkpoint_is_one_clear_error(dist_env, qwen2_dir, tmp_path):
    from tidal.actor import Actor, ActorConfig
    from tidal.ckpt import HFCheckpointError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((qwen2_dir / "config.json").read_text())
    with pytest.raises(HFCheckpointError, match=r"holds no \*\.safetensors files"):
        Actor(ActorConfig(hf_checkpoint=str(bad)))


def test_safetensors_are_opened_only_by_the_reader():
    found = [
        path.relative_to(ROOT).as_posix()
        for src in (*ROOT.glob("packages/*/src"), *ROOT.glob("apps/*/src"))
        for path in src.rglob("*.py")
        if re.search(r"\bsafe_open\b", path.read_text(encoding="utf-8"))
    ]
    assert found == ["packages/ckpt/src/tidal/ckpt/hf.py"]
