"""`train` end to end in its other modes, on the real Ray, SGLang and Megatron-core.

- its driver alone killed with SIGKILL in the middle of its third rollout (its own SGLang server, Ray and the actor
  must all go within 30 s), then resumed with --load: the metrics continue without a gap or a repeat, the resumed
  rollout trains on the prompts it would have had, and the engine serves the checkpoint's weights again; its actor
  is two pipeline stages, each of whose first rank hands its own stage's tensors to the co-located engine;
- --debug-rollout-only (no actor; with --partial-rollout on the session's two servers, so the driver-side
  generation path runs through sglang-router) then --debug-train-only on its saved rollouts (no engine), its
  forward-only passes on --log-probs-max-tokens-per-gpu;
- SIGTERM (to the driver, as `kill` sends it) during the start-up of a decoupled run (actor and engine on separate
  GPUs) stops every process, exits 130 and says no checkpoint was written; Ctrl-C typed on the terminal of a run in
  rollout 1 checkpoints rollout 0 on the way out and prints the command that goes on from it, which does;
- on a pseudo-terminal (--debug-rollout-only): a live rollout line that rewrites itself, gone at the end, above
  which the start-up block and one line per rollout stay;
- --max-staleness 1: rollout k + 1 is generated while rollout k trains, staleness <= 1 in metrics.jsonl; its
  actor is two pipeline stages (--pipeline-model-parallel-size 2), each of whose first rank broadcasts its own stage's
  tensors to both engines through its own group. Its driver alone is SIGKILLed as it trains rollout 2, just after the
  checkpoint of rollout 1, which holds the buffered rollout 2; resumed with --load, it trains on exactly those
  samples (not generated again), then on a new rollout 3, without a gap or a repeat, and leaves no process.

The resumed, rollout-only, terminal and --max-staleness runs attach to the session's one SGLang server
(``external_engine``, tests/conftest.py) through --rollout-external-engine-addrs, so they pay no SGLang start-up of
their own (the rollout-only and --max-staleness runs add ``second_external_engine``, started beside it); the first
killed run launches its own, to show that a SIGKILL of the driver leaves no server behind.
"""

import contextlib
import fcntl
import json
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_e2e import _alive, _children, _leftovers, _set_child_subreaper

pytestmark = pytest.mark.slow

COMMON = [
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "6",
    "--num-eval-prompts", "8",
    "--lr", "1e-4",
]  # fmt: skip


def _train(args, *, out: Path, timeout=1200, kill_when=None, sig=signal.SIGKILL, group=True, poll_s=0.5):
    """Run `train`; with ``kill_when(out)`` send ``sig`` to its process group (``group``) or to the driver alone.

    ``kill_when`` is asked every ``poll_s`` seconds.

    Returns ``(returncode, output, leftover pids)``; leftovers (orphans re-parented here) are killed afterwards.
    """
    before = _children(os.getpid())
    _set_child_subreaper(True)
    log = out.parent / f"{out.name}-{len(list(out.parent.glob(out.name + '-*.log')))}.log"  # one per run
    try:
        with log.open("w") as f, _sigint_not_ignored():
            proc = subprocess.Popen(
                # --verbose: these tests read the workers' INFO lines (SGLang starts, broadcasts, resumes)
                [sys.executable, "-m", "tidal.train.cli", *args, "--verbose", "--output-dir", str(out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                if kill_when is not None and kill_when(out, log):
                    (os.killpg if group else os.kill)(proc.pid, sig)
                    kill_when = None
                time.sleep(poll_s)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(timeout=120)
        leftovers = _leftovers(before)  # after SIGKILL, Ray's own reapers get the same grace
        _kill_until_none_left(before)  # still subreaper: grandchildren of what we kill come to us too
    finally:
        _set_child_subreaper(False)
    return code, log.read_text(), leftovers


@contextlib.contextmanager
def _sigint_not_ignored():
    """A child started in this block takes SIGINT as Ctrl-C even where this pytest ignores it.

    A process ignoring SIGINT passes that on to what it starts (a shell's background job ignores it, so does a
    pytest started with ``&`` from a script); a handler of its own is not inherited, the default is.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _kill_until_none_left(before: set[int], timeout_s: float = 60.0) -> None:
    """SIGKILL every new child (and its group) until none is alive: never leave a server for the next test."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {pid for pid in _children(os.getpid()) - before if _alive(pid)}
        if not alive:
            return
        for pid in alive:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
        time.sleep(0.5)


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, external_engine):
    """A run whose driver alone is SIGKILLed during rollout 3 of 3, then the same command with --load = --save.

    The killed run launches its own SGLang server; the resumed one attaches to the shared server, which is given
    the initial weights first, so the resumed run must load the checkpoint's weights into it for its first
    rollout to be sampled by them.
    """
    from tidal.rollout import SGLangClient
    from tidal.train.embedded_model import embedded_model_path

    out = tmp_path_factory.mktemp("resume")
    args = [
        *COMMON,
        "--num-rollout", "3",
        "--save-interval", "1",
        "--save", str(out / "ckpt"),
        "--save-debug-rollout-data", str(out / "debug"),
        "--use-tensorboard",
        "--check-weight-update-equal",  # its own engine: tensors; the external one: broadcast over gloo
        "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",  # each stage sends its own share
        "--save-hf", str(out / "hf" / "{rollout_id}"),  # an HF copy beside every checkpoint
        "--eval-interval", "2",  # after rollout 1 and the last, not after rollout 0
    ]  # fmt: skip

    def mid_third_rollout(run_dir: Path, _log: Path) -> bool:
        return len(_records(run_dir)) >= 2 and (run_dir / "ckpt" / "iter_0000002" / "metadata.json").exists()

    killed_code, killed_log, killed_leftovers = _train(
        args, out=out, kill_when=mid_third_rollout, group=False, poll_s=0.1
    )  # a rollout takes under a second: a 0.5 s poll could miss it under load
    records_at_kill = _records(out)
    server = SGLangClient(f"http://{external_engine}")
    server.update_weights_from_disk(embedded_model_path(), weight_version="0")
    assert server.get_model_info()["weight_version"] == "0"
    external = ["--rollout-external-engine-addrs", external_engine]
    code, log, leftovers = _train([*args, *external, "--load", str(out / "ckpt")], out=out)
    assert code == 0, log[-6000:]
    return out, killed_code, killed_log, records_at_kill, log, leftovers, killed_leftovers


def test_checkpoints_hf_copies_and_evaluations_follow_their_options(resumed):
    """--save-interval 1: a checkpoint after every rollout (without it, only after the last); --save-hf: an HF copy
    at each save, "{rollout_id}" filled in; --eval-interval 2: held-out evaluation after rollout 1 and the last only;
    --num-eval-prompts 8: each evaluation generated 8 responses (1 per prompt); --verbose: the workers' INFO lines
    reached the terminal (test_train_e2e's run, without it, shows none)."""
    import torch
    from safetensors.torch import load_file

    out, _, killed_log, _, log, *_ = resumed
    assert sorted(p.name for p in (out / "ckpt").glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    # rollout 1's copy may be cut short by the kill, which comes once its checkpoint is complete
    first, last = (load_file(next((out / "hf" / r).glob("*.safetensors"))) for r in ("0", "2"))
    assert (out / "hf" / "2" / "config.json").exists() and first.keys() == last.keys()
    assert any(not torch.equal(first[k], last[k]) for k in first)  # trained between the two
    assert ["eval/accuracy" in r for r in _records(out)] == [False, True, True]
    engine_logs = "".join(p.read_text() for p in (out / "logs").glob("engine_*.log"))
    assert "generate: 8/8 samples" in engine_logs and "generate: 16/16 samples" in engine_logs
    assert "generate: 16/16 samples" in killed_log and "generate: 16/16 samples" in log  # --verbose


def test_killed_run_died_mid_rollout(resumed):
    _, killed_code, killed_log, records_at_kill, *_ = resumed
    assert killed_code == -signal.SIGKILL, killed_log[-3000:]
    assert [r["rollout"] for r in records_at_kill] == [0, 1]
    assert "starting SGLang" in killed_log  # it launched its own server, which had to go with it


def test_sigkill_of_the_driver_alone_leaves_no_process_within_30_s(resumed):
    # The SGLang server (in its own session), the engine worker and actor rank, raylet, GCS and Ray's agents: none
    # may outlive the driver (tidal.train.watchdog, and the servers' parent-death signal).
    *_, killed_leftovers = resumed
    assert not killed_leftovers, killed_leftovers


def test_resume_continues_metrics_without_gap_or_repeat(resumed):
    out, _, _, _, log, *_ = resumed
    assert "resumed from" in log
    assert [r["rollout"] for r in _records(out)] == [0, 1, 2]
    assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_resumed_rollout_used_the_prompts_of_an_uninterrupted_run(resumed):
    from tidal.rollout import load_rollout_data
    from tidal.train.cli import parse_job
    from tidal.train.data import PromptDataset
    from transformers import AutoTokenizer

    out, *_ = resumed
    job = parse_job(COMMON)
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    keys = {"input_key": "prompt", "label_key": "label", "seed": job.train.seed}
    data = PromptDataset(job.train.prompt_data, tokenizer, **keys)
    for rollout_id in (0, 1, 2):
        samples = load_rollout_data(out / "debug", rollout_id)
        expected = [list(p.ids) for p in data.batch(rollout_id, 4) for _ in range(4)]
        assert [list(s.prompt_ids) for s in samples] == expected, rollout_id


def test_resume_read_no_hf_weights(resumed):
    # The killed run's rank 0 read the HF weights once (rank 1 got them by broadcast); the resumed run, whose --load
    # overwrites them, read none. Both runs append to the same per-rank logs.
    from safetensors.torch import load_file
    from tidal.train.embedded_model import embedded_model_path

    out, *_ = resumed
    total = sum(t.numel() * t.element_size() for t in load_file(embedded_model_path() / "model.safetensors").values())
    read = {
        rank: re.findall(
            r"actor weights: .*this rank read (\d+) bytes", (out / "logs" / f"actor_r{rank}.log").read_text()
        )
        for rank in (0, 1)
    }
    assert read == {0: [str(total), "0"], 1: ["0", "0"]}


def test_resumed_engines_serve_the_checkpointed_weights(resumed):
    # The first rollout after resume was sampled by the weights of the checkpoint (version 2), not the HF start.
    out, *_ = resumed
    assert _records(out)[2]["rollout/weight_version"] == 2.0


def test_external_engine_got_the_weights_by_broadcast_and_serves_them(resumed):
    # An external engine is not co-located: --update-weight-transport defaults to nccl (gloo on CPU), without the
    # memory hand-off. The killed run's own engine took tensors. Each sync was checked on the probe in fp32.
    out, _, _, _, log, *_ = resumed
    records = _records(out)
    assert [r["weight_sync/transport"] for r in records] == ["tensor", "tensor", "nccl"]
    assert records[2]["weight_sync/mb_per_s"] > 0
    assert all(r["weight_sync/probe_logprob_abs_diff/mean"] < 1e-3 for r in records), records
    assert "weight sync: nccl; offload: actor off, engines off" in log
    events = [json.loads(line)["event"] for line in (out / "handoff.jsonl").read_text().splitlines()]
    assert "engines.release" not in events[-4:] and events[-2:] == ["sync.nccl", "sync.check"]


def test_each_pipeline_stage_sent_its_own_tensors_to_the_colocated_engine(resumed):
    # Co-located on CPU the tensor transport's handles are shared memory, which any process on the host may send:
    # each stage's first rank sent its own 25 tensors (no PP hop to rank 0), stage 1's last bucket the version.
    # (Only a stage's sender returns its weight_sync/pp{stage}/ keys. Its log line is no proof: Ray holds a line that
    # repeats another rank's back for a few seconds, and the SIGKILL of the driver loses it.)
    _, _, _, records_at_kill, *_ = resumed
    for r in records_at_kill:
        assert r["weight_sync/transport"] == "tensor"
        assert [r[f"weight_sync/{k}num_tensors"] for k in ("pp0/", "pp1/", "")] == [25, 25, 50]
        assert r["weight_sync/pp0/mb"] + r["weight_sync/pp1/mb"] == pytest.approx(r["weight_sync/mb"])
        assert r["weight_sync/probe_logprob_abs_diff/max"] < 1e-4  # the engine serves both stages' tensors


def test_fp32_served_engine_agrees_with_the_actor_to_rounding(resumed):
    # The shared server serves fp32 like the actor computes: only summation order differs. A bf16-served engine
    # is above 1e-3 (test_train_e2e.py), so the metric separates the two; after the resume too, where the engine
    # reloaded the checkpoint's weights.
    out, *_ = resumed
    records = _records(out)
    for r in records:
        values = [
            r[k] for k in ("rollout/logprob_abs_diff/mean", "rollout/logprob_abs_diff/max", "rollout/engine_actor_kl")
        ]
        assert all(math.isfinite(v) and v >= 0.0 for v in values), r
        assert r["rollout/logprob_abs_diff/mean"] < 1e-3, r["rollout/logprob_abs_diff/mean"]
        assert r["rollout/engine_actor_kl"] < 1e-6


def test_resumed_run_leaves_no_process_and_the_external_server_running(resumed, external_engine):
    from tidal.rollout import SGLangClient

    out, _, _, _, _, leftovers, _ = resumed
    assert not leftovers, leftovers
    assert SGLangClient(f"http://{external_engine}").health_ok()  # tidal never stops a server it did not start
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "config.yaml").exists()


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory, external_engine, second_external_engine):
    """--max-staleness 1 (TIS on by default), 4 rollouts on two servers, a checkpoint after each; killed, resumed.

    The actor runs as two pipeline stages on two (logical) GPUs, synced by broadcast (the external engines' default
    transport) with --check-weight-update-equal: about 5 s more than one rank (RL time 17 s against 13 s, seen on two
    loaded cores). Two engines (the session's two servers, without a router): each stage's group holds both, so each
    engine receives every stage's tensors.

    Its driver alone is SIGKILLed as soon as the checkpoint of rollout 1 is complete: it then trains rollout 2,
    which that checkpoint holds (generated while rollout 1 trained). A rollout takes under a second here, so the kill
    may also land in rollout 2's weight sync, leaving the shared server's weight-update session open: the next sync
    closes it (tidal.rollout.weight_sync); a kill that lands after rollout 2 finds the checkpoint of rollout 2 holding
    rollout 3, and the tests read which. The same command with --load then trains on the buffered rollout 2 and on
    rollout 3, which it generates itself, in the same output folder.
    """
    from tidal.rollout import load_rollout_data

    out = tmp_path_factory.mktemp("async")
    external = ["--rollout-external-engine-addrs", external_engine, second_external_engine, "--no-use-router"]
    pipeline = ["--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--check-weight-update-equal"]
    args = [*COMMON, *external, "--num-rollout", "4", "--max-staleness", "1", "--save-interval", "1"]
    args += [*pipeline, "--save", str(out / "ckpt"), "--save-debug-rollout-data", str(out / "debug")]

    def training_rollout_2(run_dir: Path, _log: Path) -> bool:
        tracker = run_dir / "ckpt" / "latest_checkpointed_iteration.txt"
        return tracker.exists() and tracker.read_text().strip() == "2"

    killed = _train(args, out=out, kill_when=training_rollout_2, group=False, poll_s=0.1)
    # A rollout can take 0.2 s here: a late kill finds rollout 2 trained and checkpointed, with rollout 3 buffered.
    resume_at = int((out / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    buffered = load_rollout_data(out / "debug", resume_at)  # generated, checkpointed, not trained on
    at_kill = resume_at, _records(out), buffered
    code, log, leftovers = _train([*args, "--load", str(out / "ckpt")], out=out)
    assert code == 0, log[-6000:]
    return _records(out), killed, at_kill, (out, log, leftovers)


def test_one_step_off_trains_on_samples_at_most_one_version_old(one_step_off):
    records, *_ = one_step_off
    assert [r["rollout"] for r in records] == [0, 1, 2, 3]  # rollouts 0, 1 before the kill; 2, 3 after the resume
    assert all(r["rollout/staleness_max"] <= 1 for r in records)  # --max-staleness 1, from the per-token versions
    # Rollouts 0 and 1 were sampled by the initial weights (1 while the actor trained on 0), k + 1 by those after k.
    assert [r["rollout/weight_version"] for r in records] == [0.0, 0.0, 1.0, 2.0]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert ["eval/accuracy" in r for r in records] == [False, False, False, True]  # evaluated after the last
    for r in records:
        assert r["time/trainer_wait"] >= 0 and r["time/engine_wait"] >= 0 and r["rollout/stale_tokens_masked"] == 0
        assert math.isfinite(r["train/loss"]) and "train/tis" in r  # on by default: pi_old / pi_behaviour


def test_each_pipeline_stage_broadcast_its_own_tensors_and_both_engines_serve_all(
    one_step_off, external_engine, second_external_engine
):
    # The embedded model's 4 layers of 12 HF tensors each, split 2 + 2: stage 0 adds the (tied) embedding, stage 1
    # the final norm. Each stage's first rank sent its own share alone, through its own group (no PP hop to rank 0),
    # to both engines at once.
    from tidal.rollout import SGLangClient

    records, *_, (out, log, _) = one_step_off  # the resumed run's log (the killed one's may lack Ray's last lines)
    log += "".join(f.read_text() for f in sorted((out / "logs").glob("actor_r*.log")))  # each rank's own lines
    for r in records:
        assert r["weight_sync/transport"] == "nccl"
        counts = [r[f"weight_sync/{k}num_tensors"] for k in ("pp0/", "pp1/", "")]
        assert counts == [25, 25, 50]
        assert r["weight_sync/pp0/mb"] + r["weight_sync/pp1/mb"] == pytest.approx(r["weight_sync/mb"])
        assert r["weight_sync/pp0/mb"] > r["weight_sync/pp1/mb"] > 1.0  # the embedding is stage 0's
        # Over both engines' probe tokens: an engine without one stage's tensors would be off by the training's step.
        assert r["weight_sync/probe_logprob_abs_diff/max"] < 1e-4
    senders = set(re.findall(r"\[tidal actor (r\d)\][^\n]*weight broadcast \(tidal_weights_[0-9a-f]+_(pp\d)\)", log))
    assert senders == {("r0", "pp0"), ("r1", "pp1")}
    groups = re.findall(r"weight update group '(tidal_weights_[0-9a-f]+_pp\d)': trainer \+ (\d) engine ranks", log)
    assert {(name[-3:], ranks) for name, ranks in groups} == {("pp0", "2"), ("pp1", "2")}
    servers = [SGLangClient(f"http://{addr}") for addr in (external_engine, second_external_engine)]
    versions = [s.get_model_info()["weight_version"] for s in servers]
    assert versions == [str(len(records))] * 2  # the last stage of the last sync set it on both
    prompt, greedy = [[11, 12, 13]], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    first, second = (s.generate(prompt, greedy)[0]["output_ids"] for s in servers)
    assert first == second  # the same weights
    assert "starting sglang-router" not in log  # --no-use-router: two engines and no router in front


def test_async_run_killed_after_a_checkpoint_with_a_buffered_rollout_leaves_no_process(one_step_off, external_engine):
    from tidal.rollout import SGLangClient

    _, (code, log, leftovers), (resume_at, records_at_kill, _), _ = one_step_off
    assert code == -signal.SIGKILL, log[-3000:]
    assert resume_at in (2, 3)  # killed in rollout 2 (or, late, 3), before its record
    assert [r["rollout"] for r in records_at_kill] == list(range(resume_at))
    # Each checkpoint holds the rollout generated ahead: [1] after rollout 0, [2] after rollout 1, ...
    held = re.findall(r"the checkpoint holds 1 buffered rollout\(s\): \[(\d)\]", log)
    assert held[:resume_at] == [str(k) for k in range(1, resume_at + 1)]
    assert not leftovers, leftovers  # the actor's two ranks, the engine worker, Ray: none outlives the driver
    assert SGLangClient(f"http://{external_engine}").health_ok()  # the shared server was not left mid-update


def test_resumed_async_run_trains_on_the_buffered_samples_without_gap_or_repeat(one_step_off):
    from tidal.rollout import load_rollout_data
    from tidal.train.cli import parse_job
    from tidal.train.data import PromptDataset
    from transformers import AutoTokenizer

    records, _, (k, _, buffered), (out, log, leftovers) = one_step_off
    assert f"resumed 1 buffered rollout(s) from the checkpoint: [{k}]" in log
    assert not leftovers, leftovers
    # Rollout k (2) was trained on the samples the killed run generated and checkpointed, not generated again: its
    # file under --save-debug-rollout-data is the killed run's, and its record is of exactly those samples.
    again = load_rollout_data(out / "debug", k)
    assert [(list(s.prompt_ids), list(s.response_ids)) for s in again] == [
        (list(s.prompt_ids), list(s.response_ids)) for s in buffered
    ]
    assert records[k]["rollout/num_samples"] == len(buffered) == 16
    assert records[k]["rollout/reward/mean"] == pytest.approx(sum(s.reward for s in buffered) / len(buffered))
    lengths = [len(s.response_ids) for s in buffered]
    assert records[k]["rollout/response_len/mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert {v for s in buffered for v in s.token_weight_versions} == {str(k - 1)}  # the weights after rollout k - 2
    # Each rollout used its own prompts, in order: no batch skipped or repeated across the kill.
    job = parse_job(COMMON)
    tokenizer = AutoTokenizer.from_pretrained(job.actor.hf_checkpoint)
    data = PromptDataset(job.train.prompt_data, tokenizer, input_key="prompt", label_key="label", seed=job.train.seed)
    for rollout_id in (0, 1, 2, 3):
        expected = [list(p.ids) for p in data.batch(rollout_id, 4) for _ in range(4)]
        assert [list(s.prompt_ids) for s in load_rollout_data(out / "debug", rollout_id)] == expected, rollout_id


@pytest.fixture(scope="module")
def debug_runs(tmp_path_factory, external_engine, second_external_engine, external_engine_logs, sft_run):
    """--debug-rollout-only (2 rollouts saved, partial, through sglang-router to two engines), then --debug-train-only
    on them with PPO (a critic; the first rollout trains it alone), its forward-only passes (old log-probs, values)
    packed under --log-probs-max-tokens-per-gpu; its model is the --save-hf folder of the SFT stage's run
    (``sft_run``)."""
    root = tmp_path_factory.mktemp("debug")
    data = root / "rollouts"
    engines = [external_engine, second_external_engine]
    gen = [*COMMON, "--num-rollout", "2", "--debug-rollout-only", "--save-debug-rollout-data", str(data),
           "--partial-rollout", "--over-sampling-batch-size", "6", "--sglang-router-policy", "round_robin",
           "--rollout-external-engine-addrs", external_engine, second_external_engine]  # fmt: skip
    before = [external_engine_logs[e].read_text().count("POST /generate") for e in engines]
    code, gen_log, gen_left = _train(gen, out=root / "gen")
    assert code == 0, gen_log[-6000:]
    requests = [
        external_engine_logs[e].read_text().count("POST /generate") - n for e, n in zip(engines, before, strict=True)
    ]
    trn = [*COMMON, "--num-rollout", "2", "--debug-train-only", "--load-debug-rollout-data", str(data),
           "--advantage-estimator", "ppo", "--num-critic-only-steps", "1", "--value-clip", "0.2", "--lambd", "0.95",
           "--critic-lr", "1e-3", "--log-probs-max-tokens-per-gpu", "32",
           "--recipe", "embedded", "--hf-checkpoint", str(sft_run[0] / "hf")]  # fmt: skip
    code, train_log, train_left = _train(trn, out=root / "train")  # forward passes at 32 tokens, training at 8192
    assert code == 0, train_log[-6000:]
    return root, data, gen_left | train_left, (requests, gen_log)


def test_rollout_only_generates_without_training(debug_runs):
    root, data, _, (requests, log) = debug_runs
    records = _records(root / "gen")
    assert [r["rollout"] for r in records] == [0, 1]
    assert not any("train/loss" in r for r in records)
    # two engines: the driver's requests, resumed ones included, went through sglang-router, round robin to both
    assert re.search(r"starting sglang-router at \S+: .* --worker-urls \S+ \S+ --policy round_robin", log)
    assert all(n > 0 for n in requests), requests
    # partial rollout through the driver: of --over-sampling-batch-size 6 prompts, 4 finished groups are kept and the
    # other 2 carried to rollout 1, which resumes them first beside 6 new prompts and carries 8 - 4 on
    partial = [{k.split("/")[-1]: v for k, v in r.items() if k.startswith("rollout/partial/")} for r in records]
    assert [(p["resumed_groups"], p["carried_over_groups"], p["groups_dropped"]) for p in partial] == [
        (0.0, 2.0, 0.0),
        (2.0, 4.0, 0.0),
    ], partial
    assert sorted(p.name for p in data.iterdir())[:2] and len(list(data.iterdir())) == 2
    assert not (root / "gen" / "ckpt").exists()


def test_train_only_trains_on_the_saved_rollouts_with_a_critic(debug_runs):
    from tidal.batching import plan_micro_batches
    from tidal.rollout import load_rollout_data

    root, data, leftovers, _ = debug_runs
    records = _records(root / "train")
    assert [r["rollout"] for r in records] == [0, 1]
    for r in records:
        saved = load_rollout_data(data, r["rollout"])
        assert r["rollout/reward/mean"] == pytest.approx(sum(s.reward for s in saved) / len(saved))
        assert r["critic/lr"] == 1e-3 and r["critic/grad_norm"] >= 0.0
        for key in ("critic/value_loss", "critic/clipfrac", "critic/values_mean", "critic/returns_mean"):
            assert math.isfinite(r[key]), key
        assert math.isfinite(r.get("critic/explained_variance", 0.0))  # absent when the returns did not vary
        # the old log-probs and values ran on micro-batches of their own (32 tokens), training on one (8192)
        forward = plan_micro_batches([len(s.tokens) for s in saved], dp_size=1, max_tokens_per_gpu=32)
        assert r["batching/logprob_num_micro_batches"] == forward.num_micro_batches > r["batching/num_micro_batches"]
        assert r["batching/num_micro_batches"] == 1
    # --num-critic-only-steps 1: rollout 0 trains the critic alone, rollout 1 both
    assert records[0]["train/critic_only"] == 1.0 and "train/loss" not in records[0]
    assert records[1]["train/critic_only"] == 0.0 and records[1]["train/grad_norm"] > 0.0
    assert math.isfinite(records[1]["train/loss"])
    summary = json.loads((root / "train" / "summary.json").read_text())
    assert summary["engine_pids"] == []
    assert (root / "train" / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    assert not leftovers, leftovers


def test_train_only_run_starts_from_the_sft_stages_weights(debug_runs, sft_run):
    root, *_ = debug_runs
    hf = sft_run[0] / "hf"
    actor_log = (root / "train" / "logs" / "actor_r0.log").read_text()
    assert f"actor weights: read from {hf} by rank 0" in actor_log, actor_log[-3000:]


def test_sigterm_during_start_up_stops_everything(tmp_path):
    def engine_launched(out: Path, _log: Path) -> bool:  # the server process is starting: its log file exists
        return any((out / "logs").glob("sglang_*.log"))

    decoupled = ["--no-colocate", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    code, log, leftovers = _train([*COMMON, *decoupled, "--num-rollout", "1"], out=tmp_path / "run",
                                  kill_when=engine_launched, sig=signal.SIGTERM, group=False, timeout=600)  # fmt: skip
    assert code == 130, log[-4000:]
    assert "interrupted (signal SIGTERM)" in log
    assert "no checkpoint was written: the same command starts the run over" in log
    assert not leftovers, leftovers


def _train_on_a_terminal(
    args: list[str], *, timeout_s: float = 900.0, typist=None, env: dict | None = None
) -> tuple[int, str]:
    """Run `train` with a pseudo-terminal (200 columns) as its controlling terminal, stdin, stdout and stderr;
    ``(exit code, raw output)``. ``typist(output so far)`` returns the bytes to type next (b"\x03": Ctrl-C)."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    before = _children(os.getpid())
    _set_child_subreaper(True)
    chunks: list[bytes] = []
    try:
        env = {**os.environ, "COLUMNS": "200", "LINES": "50", **(env or {})}  # pytest's children get COLUMNS=80
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.train.cli", *args],
            stdin=side, stdout=side, stderr=side, start_new_session=True, env=env,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # Ctrl-C typed there reaches its process group
        )  # fmt: skip
        os.close(side)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            typed = typist(b"".join(chunks).decode("utf-8", "replace")) if typist else b""
            if typed:
                os.write(main, typed)
            if select.select([main], [], [], 0.2 if typist else 1.0)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # EIO: every holder of the terminal's other side has closed it
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=120)
        _kill_until_none_left(before)
    finally:
        _set_child_subreaper(False)
        os.close(main)
    return code, b"".join(chunks).decode("utf-8", "replace")


_TOKEN = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\r|\n|[^\x1b\r\n]+")


def _screen(raw: str) -> list[str]:
    """The non-empty lines a terminal shows once ``raw`` is written: text, CR, LF, cursor up, erase line."""
    lines, row, at_start = [""], 0, False
    for m in _TOKEN.finditer(raw):
        token, code = m.group(0), m.group(2)
        if token == "\n":
            row += 1
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            at_start = True
        elif code == "A":
            row = max(0, row - int(m.group(1) or 1))
        elif code == "K":
            lines[row] = ""
        elif code is None:
            lines[row] = token if at_start else lines[row] + token
            at_start = False
    return [line.strip() for line in lines if line.strip()]


def test_ctrl_c_mid_run_saves_the_finished_rollout_and_prints_the_command_that_goes_on(tmp_path, external_engine):
    """Ctrl-C typed on the run's terminal while rollout 1 is generated: rollout 0 (trained, synced, not yet saved:
    the run saves at its end only) is checkpointed on the way out, and the command printed goes on from it."""
    import shlex

    from tidal.rollout import SGLangClient
    from tidal.train.embedded_model import embedded_model_path

    out, held, release = tmp_path / "run", tmp_path / "held", tmp_path / "release"
    args = [*COMMON, "--num-rollout", "2", "--rollout-external-engine-addrs", external_engine, "--output-dir", str(out),
            "--custom-generate-function-path", "tidal_train_plugins:held_at_a_version"]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
           "TIDAL_TEST_HOLD_AT": "1", "TIDAL_TEST_HELD": str(held), "TIDAL_TEST_RELEASE": str(release)}  # fmt: skip
    typed = []

    def typist(output: str) -> bytes:
        if not typed and held.exists():  # rollout 1's generation (weights of version 1) is under way
            typed.append(b"\x03")
            return b"\x03"
        if typed and "interrupted: saving" in output and not release.exists():
            release.touch()  # the driver took the Ctrl-C: let the generation's calls return
        return b""

    try:
        code, raw = _train_on_a_terminal(args, typist=typist, env=env)
        assert code == 130, raw[-6000:]
        screen = _screen(raw)
        assert [r["rollout"] for r in _records(out)] == [0]
        assert (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        (line,) = [line for line in screen if "go on at rollout 1 with: " in line]
        assert "rollout 0 is checkpointed in " in line
        command = shlex.split(line.split(" with: ", 1)[1])
        assert command[:3] == ["uv", "run", "train"]
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            resumed = _train(command[3:], out=out)  # the printed command as it is (_train adds --verbose)
    finally:
        server = SGLangClient(f"http://{external_engine}")  # back to the weights other tests start from
        server.update_weights_from_disk(embedded_model_path(), weight_version="0")
    code, log, leftovers = resumed
    assert code == 0, log[-6000:]
    assert "resumed from" in log and not leftovers, leftovers
    records = _records(out)
    assert [r["rollout"] for r in records] == [0, 1]
    assert records[1]["rollout/weight_version"] == 1.0  # the engine got the checkpoint's weights back first


def test_a_terminal_shows_a_live_rollout_line_then_one_line_per_rollout(tmp_path, external_engine):
    out = tmp_path / "tty"
    args = [*COMMON, "--num-rollout", "2", "--debug-rollout-only", "--rollout-external-engine-addrs", external_engine]
    code, raw = _train_on_a_terminal([*args, "--output-dir", str(out)])
    assert code == 0, raw[-6000:]
    assert "rollout 2/2: generate" in raw and "\x1b[2K" in raw  # the live line, redrawn with its phase
    screen = _screen(raw)
    assert not [line for line in screen if "rollout 2/2: " in line], screen  # gone once the run ends
    assert [line.split(" | ")[0][-11:] for line in screen if " | reward " in line] == ["rollout 1/2", "rollout 2/2"]
    # Run folder, model, Ray, what is placed, engines ready; accuracy before RL; 2 rollouts; the summary.
    assert len(screen) == 5 + 1 + 2 + 1, "\n".join(screen)
    assert screen[-1].startswith("[tidal train] ") and " done in " in screen[-1], screen
    assert not [line for line in screen if "WARNING" in line], screen
