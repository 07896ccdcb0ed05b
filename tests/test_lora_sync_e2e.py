"""`train --lora-rank` end to end: each weight sync sends the adapter alone, which SGLang serves on the base.

Two runs, each launching its own SGLang server (LoRA serving is a launch flag: the session's servers have none):

- co-located (the tensor transport), a two-stage actor (--pipeline-model-parallel-size 2): four rollouts with
  --check-weight-update-equal and --use-fault-tolerance, every sample made by the test's custom generate function
  (two turns around a tool reply) and kept or dropped by a dynamic-sampling filter that keeps every second group;
  the server is SIGKILLed once rollout 1 is recorded, restarted, and given the current adapter before it serves;
- --update-weight-transport disk, on --recipe embedded-agent (every sample an agent's, every call through the agent
  gateway), decoupled (the engine on a GPU of its own) with a two-stage actor and partial rollouts: three rollouts,
  each adapter loaded from the PEFT folder the actor wrote; the engine's log-probs of the agent's samples are the
  actor's.

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
    root = tmp_path_factory.mktemp("lora_tensor")
    out = root / "run"
    args = [*COMMON, "--num-rollout", "4", "--lora-rank", str(RANK), "--lora-alpha", "16", "--lr", "2e-3",
            "--check-weight-update-equal", "--use-fault-tolerance",
            "--custom-generate-function-path", "tidal_train_plugins:two_turns_with_a_tool",
            "--dynamic-sampling-filter-path", "tidal_train_plugins:keep_every_second_group",
            "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
            "--save-debug-rollout-data", str(root / "debug")]  # fmt: skip
    killed: list[int] = []

    def after_rollout_1(run_dir: Path, log: Path) -> bool:
        if killed or len(_records(run_dir)) < 2:
            return False
        port = int(re.search(r"starting SGLang server at http://127\.0\.0\.1:(\d+)", log.read_text())[1])
        for pid in sglang_server_pids(port=port):
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # the server and its scheduler
            killed.append(pid)
        return False  # the run itself goes on

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        env.setenv("TIDAL_TEST_CALLS", str(root / "calls.txt"))
        code, log, leftovers = _train(args, out=out, kill_when=after_rollout_1)
    return out, code, log, leftovers, killed


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory):
    """Over disk, on the embedded agent recipe (its agent makes every rollout's and evaluation's samples), decoupled,
    a two-stage actor, partial rollouts (5 prompts a rollout for 4 groups: one group more carried over each time)."""
    out = tmp_path_factory.mktemp("lora_disk")
    args = ["--recipe", "embedded-agent", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--num-eval-prompts", "4", "--num-rollout", "3", "--lora-rank", str(RANK), "--lora-alpha", "16",
            "--lr", "2e-3", "--update-weight-transport", "disk", "--check-weight-update-equal",
            "--no-colocate", "--rollout-num-gpus", "1",
            "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
            "--partial-rollout", "--over-sampling-batch-size", "5", "--mask-offpolicy-in-partial-rollout"]  # fmt: skip
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


def test_every_sample_is_the_custom_functions_on_the_adapter_filtered_and_both_stages_adapters_synced(tensor_run):
    from tidal.rollout import load_rollout_data
    from tidal_train_plugins import TOOL_IDS

    out, code, log, _, _ = tensor_run
    assert code == 0, log[-6000:]
    records = _records(out)
    for r in records:
        samples = load_rollout_data(out.parent / "debug", r["rollout"])
        assert len(samples) == 4 * 4
        for s in samples:  # --custom-generate-function-path: two turns around the tool's tokens (loss mask 0)
            first = list(s.response_loss_mask).index(0)
            assert tuple(s.response_ids[first : first + len(TOOL_IDS)]) == TOOL_IDS
            assert list(s.response_loss_mask).count(0) == len(TOOL_IDS)
        # --lora-rank: the function's calls sampled base + the adapter of the last sync: the engine's log-probs of
        # its sampled tokens are the actor's (fp32 both), which a call answered by the base model is not
        assert r["rollout/logprob_abs_diff/mean"] < 1e-3 and r["rollout/logprob_abs_diff/max"] < 1e-2, r
        # --dynamic-sampling-filter-path: half of each round's groups dropped, so every batch took a second round
        assert r["rollout/dynamic_sampling/rounds"] == 2.0 and r["rollout/dynamic_sampling/groups_dropped"] >= 1, r
    for r in records[:2]:  # before the kill, the filter was asked about 8 groups a rollout: 4 kept, 4 dropped
        assert {k: v for k, v in r.items() if k.startswith("rollout/dynamic_sampling/")} == {
            "rollout/dynamic_sampling/rounds": 2.0,
            "rollout/dynamic_sampling/groups_generated": 8.0,
            "rollout/dynamic_sampling/groups_dropped": 4.0,
            "rollout/dynamic_sampling/groups_surplus": 0.0,
            "rollout/dynamic_sampling/kept_frac": 0.5,
        }
    callers = {line.split(" ", 1)[1] for line in (out.parent / "calls.txt").read_text().splitlines()}
    assert any(c.endswith("tidal/train/cli.py") for c in callers), callers  # rollouts: in the driver
    assert any("default_worker.py" in c for c in callers), callers  # evaluation: in the engine's Ray worker
    # --pipeline-model-parallel-size 2: two ranks, and each sync carried both stages' adapters (weight_sync/mb is the
    # whole adapter's, test_each_sync_sends_the_adapter_alone_and_the_engine_serves_the_actors_log_probs)
    assert sorted(p.name for p in (out / "logs").glob("actor_r*.log")) == ["actor_r0.log", "actor_r1.log"]


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
        # sampled by the adapter of the last sync, or (a group carried over by --partial-rollout) of the one before
        assert r["rollout"] - 1 <= r["rollout/weight_version"] <= r["rollout"], r
        # the agent's calls sampled base + the synced adapter: the engine's log-probs are the actor's (fp32) on the
        # tokens trained on (--mask-offpolicy-in-partial-rollout: an older adapter's tokens are not)
        assert r["rollout/agent/episodes"] == 16 and r["rollout/agent/failed"] == 0, r
        assert r["rollout/logprob_abs_diff/mean"] < 1e-3 and r["rollout/logprob_abs_diff/max"] < 1e-2, r
    # --partial-rollout: each rollout starts 5 groups and takes 4; the one left runs on and the next takes it first
    assert [r["rollout/partial/resumed_groups"] for r in records] == [0.0, 1.0, 2.0]
    assert [r["rollout/partial/carried_over_groups"] for r in records] == [1.0, 2.0, 3.0]
    assert sum(r["rollout/agent/carried_groups_taken"] for r in records) >= 1
    # --no-colocate: the engine on its own GPU kept its memory: no hand-off between it and the actor
    events = {json.loads(line)["event"] for line in (out / "handoff.jsonl").read_text().splitlines()}
    assert not events & {"engines.release", "actor.offload"}, events
    # --pipeline-model-parallel-size 2: two ranks; the PEFT folder (its size below) holds both stages' adapters
    assert sorted(p.name for p in (out / "logs").glob("actor_r*.log")) == ["actor_r0.log", "actor_r1.log"]
    # the held-out evaluation after the last rollout ran the agent's episodes on base + the last adapter
    assert "eval/accuracy" not in records[0] and 0.0 <= records[-1]["eval/accuracy"] <= 1.0
    # adapter_model.safetensors: the fp32 adapter and a small header
    assert 0 < records[-1]["weight_sync/mb"] * 2**20 - _adapter_bytes(embedded_model_path(spec=CHAT_SPEC)) < 64 * 1024
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["lora_v000003"]
    config = json.loads((out / "weights" / "lora_v000003" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, 16.0)
