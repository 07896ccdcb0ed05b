"""Expert parallelism over gloo: EP=2 (two real processes, each holding half of every MoE layer's experts, tokens
exchanged all-to-all) against EP=1 in this process and against transformers."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ep_worker.py")
sys.path.insert(0, str(WORKER.parent))
try:
    import ep_worker
    from moe_models import save_tiny_moe
finally:
    sys.path.pop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("moe_ep"), seed=4, norm_topk_prob=True, mlp_only_layers=[1])


def _spawn(tmp: Path, world: int, ep: int, hf_dir: Path, pp: int = 1) -> list[dict]:
    port, procs = _free_port(), []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, str(WORKER), str(rank), str(world), str(port), str(ep), str(hf_dir)]
        cmd += [str(tmp / f"rank{rank}.pt"), str(pp)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=300)
            log.close()
            assert rc == 0, f"rank {rank} exited {rc}:\n{(tmp / f'rank{rank}.log').read_text()[-3000:]}"
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_ep2_matches_ep1_and_transformers(tmp_path, dist_env, moe_dir, hf_reference):
    single = ep_worker.run(0, 1, 0, 1, str(moe_dir))  # process group already up: port unused
    results = _spawn(tmp_path, 2, 2, moe_dir)
    _, ref = hf_reference(moe_dir, ep_worker.SEQS)
    assert single["local_experts"] == (8, 64, 64)  # 8 experts x [gate; up] (2 x 32) x hidden 64
    assert [r["local_experts"] for r in results] == [(4, 64, 64)] * 2  # half of them on each rank
    for r in (single, *results):  # the memory plan counts this rank's share of the experts
        assert r["plan_param_bytes"] == r["param_bytes"]
    assert results[0]["param_bytes"] < single["param_bytes"]
    torch.testing.assert_close(single["log_probs"], torch.cat(ref), atol=1e-5, rtol=0)
    assert (single["replay_log_probs"] - single["log_probs"]).abs().max() > 1e-3  # replayed experts: other values
    for r in results:
        assert r["export_equal"] and r["buckets_equal"]  # every expert gathered back under its HF name
        torch.testing.assert_close(r["log_probs"], single["log_probs"], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["replay_log_probs"], single["replay_log_probs"], atol=1e-6, rtol=0)
        keys = ("train/loss", "train/pg_loss", "train/grad_norm", "train/num_loss_tokens", "train/moe_expert_load_max")
        for key in keys:
            assert r["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5), key
        balance = r["metrics"]["train/moe_load_balancing_loss"]
        assert balance == pytest.approx(single["metrics"]["train/moe_load_balancing_loss"], rel=1e-5)
        # updated weights (lr * g / (|g| + 1)) equal: every gradient, experts and router included, equals EP=1's
        assert set(r["weights"]) == set(single["weights"])
        for name, tensor in r["weights"].items():
            torch.testing.assert_close(tensor, single["weights"][name], atol=1e-6, rtol=0, msg=name)
        torch.testing.assert_close(r["log_probs_after"], single["log_probs_after"], atol=1e-5, rtol=0)
    # the step moved every expert of the MoE layers (each received tokens) and the routers

    before = ep_worker.load_file(f"{moe_dir}/model.safetensors")
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.experts.7.down_proj.weight"):
        assert not torch.equal(single["weights"][name], before[name]), name
    # balance loss: >= 1 (its minimum, perfectly balanced) per MoE layer and micro-batch
    assert single["metrics"]["train/moe_load_balancing_loss"] >= 1.0
    # the EP=2 distributed checkpoint (each rank's half of the experts) loads into one process (EP=1)
    from tidal.actor import Actor, ActorConfig
    from tidal.ckpt import load_checkpoint

    actor = Actor(ActorConfig(hf_checkpoint=str(moe_dir), **ep_worker.CFG))
    state, _ = load_checkpoint(tmp_path / "ckpt", actor.sharded_state_dict())
    actor.load_state_dict(state)
    assert actor.num_steps == 1
    for name, tensor in actor.named_hf_tensors():
        assert torch.equal(tensor, results[0]["weights"][name]), name


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_pp2_moe_with_balance_loss_matches_pp1(tmp_path, dist_env):
    """Two pipeline stages of a 4-layer MoE: megatron's 1F1B schedule weighs the balance loss as one process does."""
    moe_dir = save_tiny_moe(tmp_path / "moe4", seed=6, num_hidden_layers=4, norm_topk_prob=True)
    single = ep_worker.run(0, 1, 0, 1, str(moe_dir))
    for r in _spawn(tmp_path, 2, 1, moe_dir, pp=2):
        assert r["export_equal"] and r["buckets_equal"]
        torch.testing.assert_close(r["log_probs"], single["log_probs"], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["replay_log_probs"], single["replay_log_probs"], atol=1e-6, rtol=0)
        for key in ("train/loss", "train/grad_norm", "train/moe_load_balancing_loss", "train/moe_expert_load_max"):
            assert r["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5), key
        for name, tensor in r["weights"].items():
            torch.testing.assert_close(tensor, single["weights"][name], atol=1e-6, rtol=0, msg=name)
        assert r["plan_param_bytes"] >= r["param_bytes"]  # the plan counts the larger stage
