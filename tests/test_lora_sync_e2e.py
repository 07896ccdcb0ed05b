"""`train --lora-rank` end to end: each weight sync sends the adapter alone, which SGLang serves on the base.

Two runs, each launching its own SGLang server (LoRA serving is a launch flag: the session's servers have none):

- co-located (the tensor transport): four rollouts with --check-weight-update-equal and --use-fault-tolerance; the
  server is SIGKILLed once rollout 1 is recorded, restarted, and given the current adapter before it serves again;
- --update-weight-transport disk, on --recipe embedded-agent (every sample an agent's, every call through the agent
  gateway): three rollouts, each adapter loaded from the PEFT folder the actor wrote; the engine's log-probs of the
  agent's samples are the actor's.

After each training step the engine serving base + adapter gives the actor's log-probs (the probe), the version the
engines report advances with each sync, and the bytes sent are the adapter's, not the model's.
"""

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from server_procs import sglang_server_pids
from test_train_modes_e2e import COMMON, _records, _train

pytestmark = pytest.mark.slow

RANK = 8


def _adapter_bytes(model_dir: Path) -> int:
    """Bytes of a rank-RANK fp32 adapter on every linear module of every layer: r * (in + out) per module."""
    config = json.loads((model_dir / "config.json").read_text())
    h, ffn, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    q, kv = heads * d, config["num_key_value_heads"] * d
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + ffn) + (ffn + h)
    return 4 * RANK * per_layer * config["num_hidden_layers"]


@pytest.fixture(scope="module")
def tensor_run(tmp_path_factory):
    """Co-located LoRA run; its SGLang server SIGKILLed (process group) once rollout 1 is recorded."""
    out = tmp_path_factory.mktemp("lora_tensor")
    args = [*COMMON, "--num-rollout", "4", "--lora-rank", str(RANK), "--lora-alpha", "16", "--lr", "2e-3",
            "--check-weight-update-equal", "--use-fault-tolerance"]  # fmt: skip
    killed: list[int] = []

    def after_rollout_1(run_dir: Path, log: Path) -> bool:
        if killed or len(_records(run_dir)) < 2:
            return False
        port = int(re.search(r"starting SGLang server at http://127\.0\.0\.1:(\d+)", log.read_text())[1])
        for pid in sglang_server_pids(port=port):
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # the server and its scheduler
            killed.append(pid)
        return False  # the run itself goes on

    code, log, leftovers = _train(args, out=out, kill_when=after_rollout_1)
    return out, code, log, leftovers, killed


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    """Over disk, on the embedded agent recipe: its agent makes every rollout's and evaluation's samples."""
    out = tmp_path_factory.mktemp("lora_disk")
    args = ["--recipe", "embedded-agent", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--num-eval-prompts", "4", "--num-rollout", "3", "--lora-rank", str(RANK), "--lora-alpha", "16",
            "--lr", "2e-3", "--update-weight-transport", "disk", "--check-weight-update-equal"]  # fmt: skip
    code, log, leftovers = _train(args, out=out)
    return out, code, log, leftovers


def test_each_sync_sends_the_adapter_alone_and_the_engine_serves_the_actors_log_probs(tensor_run):
    from tidal.train.embedded_model import embedded_model_path

    out, code, log, leftovers, _ = tensor_run
    assert code == 0, log[-6000:]
    assert not leftovers, leftovers
    records = _records(out)
    assert [r["rollout"] for r in records] == [0, 1, 2, 3]
    adapter = _adapter_bytes(embedded_model_path())
    model = sum(f.stat().st_size for f in embedded_model_path().glob("*.safetensors"))
    for r in records:
        assert r["weight_sync/transport"] == "tensor"
        assert r["weight_sync/mb"] * 2**20 == adapter, r  # the adapter's bytes, in the actor's fp32
        assert r["weight_sync/probe_logprob_abs_diff/mean"] < 1e-4, r  # fp32 engine and actor
        assert r["rollout/weight_version"] == r["rollout"]  # each rollout was sampled by its sync's adapter
    assert adapter < model / 4
    assert "--enable-lora --max-lora-rank 8 --lora-target-modules q_proj k_proj v_proj o_proj" in log


def test_the_served_adapter_version_advances_with_each_sync(tensor_run):
    _, _, log, _, _ = tensor_run
    loaded = [int(v) for v in re.findall(r"LoRA adapter tidal-lora-v(\d+)-[0-9a-f]+ from tensors", log)]
    assert sorted(set(loaded)) == [1, 2, 3, 4], loaded
    assert loaded == sorted(loaded)  # a restarted engine gets the current one again, never an older one


def test_a_restarted_engine_gets_the_current_adapter_before_it_serves(tensor_run):
    out, _, log, _, killed = tensor_run
    assert killed, "the run's SGLang server was not found to kill"
    assert "restarting SGLang server" in log or "restarting it (--use-fault-tolerance)" in log
    events = [json.loads(line) for line in (out / "handoff.jsonl").read_text().splitlines()]
    at = [i for i, e in enumerate(events) if e["event"] == "resync.tensor" or e.get("retry")]
    assert len(at) == 1, events
    version = events[at[0]]["version"]
    assert version >= 2, events[at[0]]  # the kill came after rollout 1's sync
    check = next(e for e in events[at[0] + 1 :] if e["event"] in ("sync.check", "engines.generate"))
    assert check["event"] == "sync.check" and check["mean"] < 1e-4, check  # the restarted engine serves the adapter
    # the kill lands when the killer sees rollout 1 recorded, which on a loaded box may be as late as the last sync:
    # then the probe above is the restarted engine's only generation; otherwise it generates after its resync
    generated = [i for i, e in enumerate(events) if e["event"] == "engines.generate" and e["rollout"] >= version]
    assert not generated or at[0] < generated[-1]


def test_over_disk_each_engine_loads_the_peft_folder_and_only_the_newest_is_kept(disk_run):
    from tidal.train.embedded_model import CHAT_SPEC, embedded_model_path

    out, code, log, leftovers = disk_run
    assert code == 0, log[-6000:]
    assert not leftovers, leftovers
    records = _records(out)
    assert [r["rollout"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["weight_sync/transport"] == "disk"
        assert r["weight_sync/probe_logprob_abs_diff/mean"] < 1e-4, r
        assert r["rollout/weight_version"] == r["rollout"]
        # the agent's calls sampled base + the synced adapter: the engine's log-probs are the actor's (fp32)
        assert r["rollout/agent/episodes"] == 16 and r["rollout/agent/failed"] == 0, r
        assert r["rollout/logprob_abs_diff/mean"] < 1e-3 and r["rollout/logprob_abs_diff/max"] < 1e-2, r
    # the held-out evaluation after the last rollout ran the agent's episodes on base + the last adapter
    assert "eval/accuracy" not in records[0] and 0.0 <= records[-1]["eval/accuracy"] <= 1.0
    # adapter_model.safetensors: the fp32 adapter and a small header
    assert 0 < records[-1]["weight_sync/mb"] * 2**20 - _adapter_bytes(embedded_model_path(spec=CHAT_SPEC)) < 64 * 1024
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["lora_v000003"]
    config = json.loads((out / "weights" / "lora_v000003" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, 16.0)
