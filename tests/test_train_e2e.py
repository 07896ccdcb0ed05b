"""The walking skeleton end to end: `train` for 2 rollouts on the real Ray, SGLang and Megatron-core.

One run per module (it starts an SGLang server, ~30 s on two cores); every test reads its outputs. A second, smaller
job runs beside it, started at the same moment: two jobs on one host finish on distinct ports. That companion is the
feature matrix's MoE run (tests/feature_matrix.py): the embedded Qwen3-MoE with routing replay, its engine on a GPU of
its own, a two-stage actor with a PPO critic, one step off (--max-staleness 1), partial rollouts under dynamic
sampling and delta weight syncs. The main run's server
serves the float32 embedded model in bfloat16 (--sglang-dtype), as a production engine serves next to an fp32
actor, so the engine-actor agreement metrics measure a real gap here (test_train_modes_e2e.py's runs serve fp32).
It logs to an offline W&B run (the real client; W&B's folders are the test's, its server a closed loopback port).
"""

import ctypes
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, shipped_path

EVAL_DATA, TRAIN_DATA = str(shipped_path(EVAL_FILE)), str(shipped_path(TRAIN_FILE))

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids |= {int(p) for p in (task / "children").read_text().split()}
    return kids


def _leftovers(before: set[int], grace_s: float = 30.0) -> dict[int, str]:
    """New children of this process still alive after ``grace_s``, with their command lines.

    A finished run's Ray workers notice their raylet is gone and exit within a second or two, re-parented to
    us meanwhile: polled until none is alive (no fixed sleep), so only a process that really stays is reported.
    """
    deadline = time.monotonic() + grace_s
    while True:
        alive = {pid for pid in _children(os.getpid()) - before if _alive(pid)}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = {}
    for pid in alive:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
        except OSError:
            continue  # exited while being read
    return out


def _set_child_subreaper(on: bool) -> None:
    # Orphans of the run (an SGLang server or raylet left behind) are re-parented to this process instead of
    # init, so "no process remains" can be checked by listing our own children.
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, int(on), 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def offline_wandb_env(home: Path) -> dict[str, str]:
    """This process's environment for a W&B client that reaches no network: its own folders, no key, no reports."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR")}
    env.update(
        WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"),
        WANDB_ERROR_REPORTING="false", WANDB_BASE_URL="http://127.0.0.1:9", NETRC=str(home / "netrc"),
    )  # fmt: skip
    return env


COMPANION_ARGS = [
    "--num-rollout", "2",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "6",
    "--num-eval-prompts", "4",
    # the feature matrix's MoE run: the engine's routing replayed by a two-stage actor with a PPO critic, the engine
    # on a GPU of its own, one step off, partial rollouts (6 prompts for 4 groups) filtered by dynamic sampling, and
    # delta weight syncs
    "--recipe", "embedded-moe", "--use-rollout-routing-replay",
    "--no-colocate", "--rollout-num-gpus", "1",
    "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
    "--max-staleness", "1",
    "--partial-rollout", "--over-sampling-batch-size", "6",
    "--dynamic-sampling-filter-path", "tidal_train_plugins:keep_every_second_group",  # half of the groups dropped
    "--update-weight-delta",
    "--advantage-estimator", "ppo",  # a critic, fitting the returns of:
    "--custom-rm-path", "tidal_train_plugins:reward_by_length_of_its_row",
]  # fmt: skip


def companion_data(folder: Path) -> list[str]:
    """The companion's prompts as verl stores them: a Parquet file, the prompt and answer in nested fields."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tidal.train.task_data import read_jsonl

    rows = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "reward_model": {"ground_truth": r["label"]},
         "extra_info": {"index": i, "answer": r["label"]}}
        for i, r in enumerate(read_jsonl(TRAIN_DATA)[:256])
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), folder / "addition.parquet")
    parquet = str(folder / "addition.parquet")
    return ["--prompt-data", parquet, "--eval-prompt-data", parquet, "--input-key", "prompt.0.content",
            "--label-key", "reward_model.ground_truth", "--metadata-key", "extra_info"]  # fmt: skip


@pytest.fixture(scope="module")
def _jobs(tmp_path_factory):
    """The main run and, started at the same moment beside it, a second job: two `train` jobs on one host.

    Each is its own OS process with its own Ray and SGLang. Their port allocators (one per job,
    tidal.placement.ports) test ports free and reserve them, and each reserved port holds a host-wide lock file
    until the job ends, so neither job can be handed a port the other tested free but has not bound yet: the SGLang
    servers' HTTP and NCCL ports and the actor's rendezvous port.
    """
    from tidal.train.embedded_model import MOE_SPEC, ensure_embedded_model

    ensure_embedded_model()  # built once here, not twice at once by the two jobs
    ensure_embedded_model(spec=MOE_SPEC)  # the companion's, built before the two start at the same moment
    out = tmp_path_factory.mktemp("run")
    companion = tmp_path_factory.mktemp("companion")
    data = companion_data(companion)  # the companion reads a Parquet file with nested keys
    args = [
        "--num-rollout", "2",
        "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "6",
        "--num-eval-prompts", "8",
        "--eval-prompt-data", "add", EVAL_DATA, "seen", TRAIN_DATA,  # two named sets, 2 samples each
        "--n-samples-per-eval-prompt", "2", "--eval-temperature", "1.0", "--keep-best-by", "eval/add/pass@2",
        "--lr", "1e-4",
        "--entropy-coef", "1e-3",  # a gradient even if every group's rewards tie
        "--save-debug-rollout-data", str(out / "debug"),
        "--sglang-dtype=bfloat16",  # the actor computes in float32: a measurable engine-actor gap
        "--check-weight-update-equal",  # co-located: the tensor transport and the memory hand-off, by default
        "--use-wandb", "--wandb-mode", "offline", "--wandb-group", "e2e",
        "--output-dir", str(out),
    ]  # fmt: skip
    from tidal.train.cli import parse_job

    job = parse_job(args)  # before the run: afterwards the folder holds a run, which a new parse refuses
    before = _children(os.getpid())
    _set_child_subreaper(True)
    try:
        with (companion / "output.log").open("w") as log:
            plugins = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
            second = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tidal.train.cli",
                    *COMPANION_ARGS,
                    *data,
                    "--output-dir",
                    str(companion / "run"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONPATH": plugins},  # tidal_train_plugins, for --custom-rm-path
            )
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "tidal.train.cli", *args],
                    capture_output=True,
                    text=True,
                    timeout=1500,
                    env=offline_wandb_env(out.parent / "wandb_home"),
                )
                second_code = second.wait(timeout=600)
            finally:
                if second.poll() is None:
                    os.killpg(second.pid, 9)
                    second.wait(timeout=60)
        leftovers = _leftovers(before)
    finally:
        _set_child_subreaper(False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    main = (job, summary, records, leftovers, proc.stdout + proc.stderr)
    second_output = (companion / "output.log").read_text()
    jobs = [(0, proc.stdout + proc.stderr, out), (second_code, second_output, companion / "run")]
    return main, jobs


@pytest.fixture(scope="module")
def run(_jobs):
    """The main run: ``(job config, summary, records, leftover processes, its terminal output)``."""
    return _jobs[0]


@pytest.fixture(scope="module")
def two_jobs(_jobs):
    """``[(returncode, output, run folder)]`` of both jobs, and the processes either left behind."""
    return _jobs[1], _jobs[0][3]


def test_one_record_per_rollout_with_finite_loss(run):
    _, _, records, _, _ = run
    assert [r["rollout"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/loss"])
        assert math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0
        assert 0.0 <= r["rollout/reward/mean"] <= 1.0
        assert r["rollout/response_len/mean"] > 0
        assert r["rollout/http_retries"] >= 0  # counted by every client of the run (a reset is retried, not fatal)


def test_samples_carry_the_engine_log_probs(run):
    from tidal.rollout import load_rollout_data

    _, summary, _, _, _ = run
    samples = load_rollout_data(Path(summary["metrics"]).parent / "debug", 1)
    assert len(samples) == 4 * 4
    for s in samples:
        assert len(s.response_log_probs) == len(s.response_ids) > 0
        assert all(lp <= 0.0 for lp in s.response_log_probs)
        assert s.reward in (0.0, 1.0)


AGREEMENT = ("rollout/logprob_abs_diff/mean", "rollout/logprob_abs_diff/max", "rollout/engine_actor_kl")


def test_actor_and_engine_agree_on_log_probs_up_to_bf16_serving(run):
    # The engine's sampled log-probs and the actor's recomputed ones come from two implementations of the same
    # weights: a wrong weight mapping or a missed reload shows here as a large gap. Served in bf16 against the
    # fp32 actor, the gap is real (~0.005 nats on this model; fp32 serving stays below 1e-3, test_train_modes_e2e)
    # but far below anything a mapping error gives.
    job, _, records, _, output = run
    assert job.rollout.sglang_server_args[-2:] == ("--dtype", "bfloat16")  # given as --sglang-dtype=bfloat16
    for r in records:
        assert all(math.isfinite(r[k]) and r[k] >= 0.0 for k in AGREEMENT), r
        mean = r["rollout/logprob_abs_diff/mean"]
        assert 1e-3 < mean < 0.05, mean
        assert mean <= r["rollout/logprob_abs_diff/max"] < 1.0
        assert 0.0 < r["rollout/engine_actor_kl"] < 0.01
    assert "--mismatch-warn-threshold" not in output  # below the default threshold: no warning


def test_weights_went_in_memory_and_the_engine_serves_them(run):
    # Co-located (the embedded recipe): tensors by default, no checkpoint on disk; each sync checked against the
    # actor on a fixed probe (--check-weight-update-equal), which a missed or garbled update fails by far.
    _, summary, records, _, _ = run
    assert summary["weights_dir"] is None and not (Path(summary["metrics"]).parent / "weights").exists()
    for r in records:
        assert r["weight_sync/transport"] == "tensor"
        assert r["weight_sync/mb"] > 0.5 and r["weight_sync/mb_per_s"] > 0 and r["time/weight_sync"] > 0
        assert r["weight_sync/probe_logprob_abs_diff/mean"] < 0.05  # bf16 serving against the fp32 actor
    # The second rollout's samples were generated by the weights synced after the first.
    assert records[1]["rollout/weight_version"] == 1.0


def test_colocated_hand_off_runs_in_order_every_rollout(run):
    # --offload is on with --colocate: on CPU the calls are the same as on a GPU (SGLang's real release/resume;
    # the actor's moves are no-ops there), in slime's order.
    _, summary, _, _, _ = run
    lines = [json.loads(line) for line in (Path(summary["metrics"]).parent / "handoff.jsonl").read_text().splitlines()]
    per_rollout = {r: [e["event"] for e in lines if e["rollout"] == r] for r in (0, 1)}
    for events in per_rollout.values():
        assert events == [
            "engines.generate", "engines.release", "actor.onload", "actor.train", "engines.resume.weights",
            "sync.tensor", "engines.resume.kv_cache", "sync.check", "actor.offload",
        ], events  # fmt: skip


def test_checkpoint_has_tracker(run):
    _, summary, records, _, _ = run
    ckpt = Path(summary["checkpoint_dir"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ckpt / "iter_0000002").is_dir()
    assert (ckpt / "best_checkpointed_iteration.txt").read_text() == "2\n"  # --keep-best-by: the one saved, evaluated
    log = (Path(summary["metrics"]).parent / "logs" / "train.log").read_text()
    best = f"best eval/add/pass@2 so far: {records[-1]['eval/add/pass@2']:.4f} (checkpoint iteration 2)"
    assert best in log  # the metric --keep-best-by names, read from the record of the rollout saved


def test_accuracy_is_reported_before_and_after(run):
    _, summary, records, _, output = run
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert records[-1]["eval/accuracy"] == summary["eval_after"] == records[-1]["eval/add/mean@2"]
    for name in ("add", "seen"):  # mean@k and unbiased pass@k of each named set
        mean, pass1, pass2 = (records[-1][f"eval/{name}/{m}"] for m in ("mean@2", "pass@1", "pass@2"))
        assert 0.0 <= mean <= 1.0 and pass1 <= pass2 <= 1.0
    assert "rollout 2/2 | reward" in output
    png = Path(summary["curves"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[20:24], "big") > 600  # two panels: rewards, then the engine-actor agreement


def test_the_offline_wandb_run_holds_each_rollouts_record_and_summary_says_where(run):
    _, summary, records, _, output = run
    where = summary["wandb"]
    out = Path(summary["metrics"]).parent
    assert (where["mode"], where["group"], where["url"]) == ("offline", "e2e", None)
    assert Path(where["dir"]).parent == out / "wandb"
    assert f"W&B run (offline) in {where['dir']}" in output
    inspect = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", where["dir"]]
    logged = [json.loads(line) for line in subprocess.run(inspect, capture_output=True, text=True).stdout.splitlines()]
    history = {h["step"]["num"]: h["item"] for h in (r["history"] for r in logged if r["type"] == "history")}
    assert sorted(history) == [0, 1]
    for record in records:
        for key in ("rollout/reward/mean", "train/loss", "time/rollout"):
            assert history[record["rollout"]][key] == pytest.approx(record[key], rel=1e-12), key
    assert "eval/accuracy" in history[1]


def test_no_child_process_remains(run):
    _, summary, _, leftovers, _ = run
    assert summary["engine_pids"]
    assert not [pid for pid in summary["engine_pids"] if _alive(pid)]
    assert not leftovers, leftovers


def test_the_run_folder_holds_the_memory_plan_of_its_model(run):
    from tidal.actor import ModelShape
    from tidal.ckpt import read_hf_config_json

    job, summary, _, _, _ = run
    plan = json.loads((Path(summary["metrics"]).parent / "memory_plan.json").read_text())
    shape = ModelShape.from_hf_config(read_hf_config_json(job.actor.hf_checkpoint))
    width = 2 if job.actor.params_dtype == "bfloat16" else 4
    params = plan["rows_gib"][f"parameters ({job.actor.params_dtype})"]
    assert abs(params - shape.num_params() * width / 2**30) < 0.001
    assert abs(plan["train_peak_gib"] - sum(plan["rows_gib"].values())) < 0.01
    assert plan["inputs"]["recompute_activations"] == job.actor.recompute_activations


def test_terminal_gets_one_plain_line_per_rollout_and_no_warning(run):
    # Redirected (captured here), the run writes plain lines: a start-up block (run folder, model, memory plan,
    # W&B run, Ray, what is placed, weight sync, engines ready), the accuracy before RL, one line per rollout, the
    # summary.
    # Per-call worker lines and third-party notices are in the run folder's logs, not here.
    _, summary, _, _, output = run
    lines = output.splitlines()
    assert "\x1b" not in output and "\r" not in output, output[:2000]
    assert not [line for line in lines if "WARNING" in line or "Warning" in line], output
    assert len([line for line in lines if " | reward " in line]) == 2, output
    assert len(lines) <= 8 + 1 + 2 + 1, output
    assert all(line.startswith("[tidal train] ") for line in lines), output
    logs = Path(summary["metrics"]).parent / "logs"
    engine_log = next(logs.glob("engine_*.log")).read_text()
    actor_log = (logs / "actor_r0.log").read_text()
    assert "generate: 16/16 samples" in engine_log and "generate: " not in output
    assert "weight update from tensors" in actor_log and "weight update" not in output
    assert "saved checkpoint" in actor_log and "saved checkpoint" not in output
    # Notices nobody can act on are said once, at INFO, in the file of the process that met them.
    for notice in ("GPTModel IS DEPRECATED", "No CUDA runtime is found"):
        said = [line for line in actor_log.splitlines() if notice in line]
        assert len(said) == 1 and " INFO tidal.notices: " in said[0], said
    assert "rollout 2/2 | reward" in (logs / "train.log").read_text()


def test_both_jobs_finish(two_jobs):
    results, _ = two_jobs
    for code, output, run in results:
        assert code == 0, output[-6000:]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["rollout"] for r in records] == [0, 1]


def test_their_servers_ran_on_distinct_ports(two_jobs):
    results, _ = two_jobs
    ports = []
    for _, _, run in results:
        log = "".join(f.read_text() for f in (run / "logs").glob("engine_*.log"))
        started = re.findall(r"starting SGLang server at http://[\d.]+:(\d+):.* --nccl-port (\d+)", log)
        assert len(started) == 1, log[-3000:]  # one server each, started once: no port had to be retried
        ports.append({int(p) for p in started[0]})
    assert not ports[0] & ports[1], ports


def test_each_job_read_the_hf_weights_once(two_jobs):
    from safetensors.torch import load_file
    from tidal.train.embedded_model import MOE_SPEC, embedded_model_path

    results, _ = two_jobs
    for (_, _, run), model in zip(results, (embedded_model_path(), embedded_model_path(spec=MOE_SPEC)), strict=True):
        tensors = load_file(model / "model.safetensors").values()
        total = sum(t.numel() * t.element_size() for t in tensors)
        log = (run / "logs" / "actor_r0.log").read_text()
        assert re.findall(r"actor weights: .*this rank read (\d+) bytes of HF weights", log) == [str(total)]


def test_the_companion_replays_the_moe_routing_one_step_off_with_filtered_partial_rollouts_and_deltas(two_jobs):
    results, _ = two_jobs
    code, output, run = results[1]
    assert code == 0, output[-6000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # --use-rollout-routing-replay: the actor dispatched every token to the experts its engine reported, and counts
    # where its own router would have chosen otherwise: never on rollout 0 (the same fp32 weights on both sides); on
    # rollout 1, sampled by the weights of one step before, on some near-ties (0.049 seen)
    mismatch = [r["rollout/routing_mismatch_share"] for r in records]
    assert mismatch[0] < 0.01 and 0.0 <= mismatch[1] < 0.5, mismatch
    assert all(r["weight_sync/transport"] == "nccl" for r in records)  # --no-colocate: by broadcast
    # --max-staleness 1: rollout 1 was generated by the initial weights while rollout 0 trained
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0]
    assert [r["rollout/weight_version"] for r in records] == [0.0, 0.0]
    # --partial-rollout: the groups neither taken nor dropped are carried over, and taken first by the next rollout
    assert records[0]["rollout/partial/resumed_groups"] == 0.0 and records[0]["rollout/partial/carried_over_groups"] > 0
    assert records[1]["rollout/partial/resumed_groups"] == records[0]["rollout/partial/carried_over_groups"]
    # --dynamic-sampling-filter-path keeps every second group: rollout 0's 6 prompts keep 3 of the 4 groups it needs,
    # so it takes a second round; the dropped groups are not carried over
    assert records[0]["rollout/dynamic_sampling/rounds"] == 2.0
    for r in records:
        assert r["rollout/dynamic_sampling/groups_dropped"] >= 1 and r["rollout/dynamic_sampling/kept_frac"] < 1.0, r
        assert r["rollout/partial/groups_dropped"] == r["rollout/dynamic_sampling/groups_dropped"]
    # --update-weight-delta: the first sync whole, the second only the changed elements; --pipeline-model-parallel-size
    # 2: each stage's first rank sent its own stage's delta
    assert [r["weight_sync/delta_full"] for r in records] == [1.0, 0.0]
    assert 0.0 < records[1]["weight_sync/delta_changed_share"] <= 1.0
    for stage in ("pp0", "pp1"):
        assert [r[f"weight_sync/{stage}/delta_full"] for r in records] == [1.0, 0.0]
        assert all(r[f"weight_sync/{stage}/mb"] > 0 for r in records)
    # a Parquet file with nested keys: every sample, carried over or not, held its row's --metadata-key value
    assert all(r["rollout/reward_errors"] == 0.0 for r in records) and records[0]["rollout/reward/mean"] > 0.0
    # --advantage-estimator ppo: the critic trained beside the actor on returns above 0 (--custom-rm-path)
    for r in records:
        assert r["train/critic_only"] == 0.0 and r["critic/returns_mean"] > 0.0
        assert r["critic/value_loss"] > 0.0 and r["critic/grad_norm"] > 0.0
    # the held-out set is the Parquet file too: its samples got their rows' metadata (else the reward raises: 0)
    assert "eval/accuracy" not in records[0] and 0.0 < records[-1]["eval/accuracy"] <= 1.0
