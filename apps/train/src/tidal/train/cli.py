"""``train``: parse slime-style flags into each package's config, validate everything, then run the loop.

Parsing and validation happen before Ray, SGLang or Megatron start (or are imported), so a configuration error
answers in about a second with one line per problem, naming the flag and the fix. An error later in the run
(placement, a dead engine, checkpoint IO, a bug) also ends in one line, plus the file that holds its traceback.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.placement import LocalGpus
    from tidal.train.config import JobConfig

logger = logging.getLogger("tidal.train")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: "pkg.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit|Interrupt)): (.+)$")

# The embedded default job (no --hf-checkpoint): sizes that suit the tiny addition model on a 2-core CPU.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    # RL on the fixed-width addition task: measured in bench/rl_recipe_grid.py, reproduced on the real stack
    # (bench/RESULTS.md). One optimizer step per rollout of 64 prompts x 8 samples.
    "num_rollout": 150,
    "rollout_batch_size": 64,
    "n_samples_per_prompt": 8,
    "rollout_max_response_len": 6,
    "rollout_temperature": 1.0,
    "rm_type": "numeric_match",
    "lr": 3e-4,
    "use_dynamic_batch_size": True,
    "max_tokens_per_gpu": 8192,
    "eval_interval": 10,
    "num_eval_prompts": 256,
    "colocate": True,  # one CPU box: actor and engine share the (logical) GPU
}


def parse_job(argv: list[str]) -> JobConfig:
    """Parse ``argv`` into a validated JobConfig; nothing heavy is imported and nothing starts.

    Raises:
        ValueError: naming the flag and the fix; independent problems come together, one per line
            (:class:`tidal.train.checks.ConfigErrors`).
    """
    from tidal.train.config_file import expand_config
    from tidal.train.flags import SECTIONS, build_parser, dest

    parser = build_parser()
    args, unknown = parser.parse_known_args(expand_config(argv))
    given = {k: v for k, v in vars(args).items() if v is not None}
    given.pop("config", None)
    embedded = "hf_checkpoint" not in given
    values = {**EMBEDDED_DEFAULTS, **given} if embedded else dict(given)
    if "colocate" not in values and values.get("rollout_external_engine_addrs"):
        values["colocate"] = True  # external engines take no GPU of this job: nothing to add to the actor's
    sections = {
        section: {dest(flag, kw): values[dest(flag, kw)] for flag, kw in flags if dest(flag, kw) in values}
        for section, flags in SECTIONS.items()
    }
    return _build_job(sections, unknown, parser, embedded=embedded, colocate_given=given.get("colocate"))


def _unknown_problems(unknown: list[str], known: list[str]) -> list[str]:
    """Unknown options (with the closest real one), and stray words before any ``--sglang-*`` pass-through."""
    problems = []
    for i, token in enumerate(unknown):
        if token.startswith("--sglang-") or _is_number(token):
            continue
        if token.startswith("-"):
            close = difflib.get_close_matches(token.split("=", 1)[0], known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"unknown option {token}{hint} (see `train --help`)")
        elif not any(t.startswith("--sglang-") for t in unknown[:i]):
            problems.append(f"unexpected argument {token!r}: options start with two dashes (see `train --help`)")
    return problems


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _build_job(sections: dict[str, dict[str, Any]], unknown: list[str], parser, *, embedded: bool, colocate_given):
    """Each package's config from its section, then the checks that span sections; every problem is collected."""
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.ckpt import CkptConfig
    from tidal.placement import PlacementConfig
    from tidal.rollout import RolloutConfig
    from tidal.train import checks
    from tidal.train.config import JobConfig, TrainConfig
    from tidal.train.run_folder import check_output_dir, default_output_dir

    problems = checks.Problems()
    for line in _unknown_problems(unknown, sorted(parser._option_string_actions)):
        problems.add(line)
    _pass_through(sections, unknown, problems)
    train, rollout, actor = sections["train"], sections["rollout"], sections["actor"]
    train.setdefault("output_dir", str(default_output_dir()))  # runs/DATE-TIME; runs/latest links to it
    _data_files(train, problems, embedded=embedded)
    train_cfg = problems.run(TrainConfig, **train)
    hf, hf_config = _model(train, problems, embedded=embedded)
    for flag, key in (
        ("--custom-rm-path", "custom_rm_path"),
        ("--custom-generate-function-path", "custom_generate_function_path"),
        ("--dynamic-sampling-filter-path", "dynamic_sampling_filter_path"),
    ):
        if ":" in (rollout.get(key) or ""):  # a malformed path is RolloutConfig's to report
            problems.run(checks.check_import_path, flag, rollout[key])
    if actor.pop("no_check_for_nan_in_loss_and_grad", False):
        actor["check_for_nan_in_loss_and_grad"] = False
    if not actor.get("use_kl_loss") and actor.get("kl_loss_coef"):
        logger.warning("--kl-loss-coef %s is ignored without --use-kl-loss (slime's rule)", actor["kl_loss_coef"])
        actor["kl_loss_coef"] = 0.0
    temperature = rollout.get("rollout_temperature", 1.0) or 1.0
    actor_cfg = problems.run(ActorConfig, hf_checkpoint=hf, temperature=temperature, **actor)
    batching_cfg = None
    if "rollout_batch_size" in sections["batching"]:
        n = rollout.get("n_samples_per_prompt", 1)
        batching_cfg = problems.run(BatchingConfig, n_samples_per_prompt=n, **sections["batching"])
    else:
        problems.add(
            "--rollout-batch-size is required with --hf-checkpoint: the prompts per rollout "
            "(e.g. --rollout-batch-size 32 --n-samples-per-prompt 8)"
        )
    ckpt = sections["ckpt"]
    ckpt.setdefault("save", str(Path(train["output_dir"]) / "ckpt"))
    _output_folders(train, ckpt, rollout, problems)
    resuming, overwrite = bool(ckpt.get("load")), bool(train.get("overwrite_output_dir"))
    problems.run(
        check_output_dir, Path(train["output_dir"]), Path(ckpt["save"]), resuming=resuming, overwrite=overwrite
    )
    ckpt_cfg = problems.run(CkptConfig, hf_checkpoint=hf, **sections["ckpt"])
    placement_cfg = problems.run(PlacementConfig, **sections["placement"])
    rollout_cfg = problems.run(RolloutConfig, **rollout)
    if rollout_cfg is not None and placement_cfg is not None:
        problems.run(checks.check_router, rollout_cfg, placement_cfg)
    if train_cfg is not None:
        problems.run(checks.check_pipeline, train_cfg, hf_config, hf)
        problems.run(checks.check_wandb, train_cfg)
        if rollout_cfg is not None:
            problems.run(checks.check_modes, train_cfg, rollout_cfg, colocate_given=colocate_given)
            _warn_without_fault_tolerance(rollout, train_cfg)
        if placement_cfg is not None:
            dp = problems.run(checks.check_model_parallel, train_cfg, placement_cfg)
            if dp is not None and batching_cfg is not None:
                problems.run(batching_cfg.resolve, dp_size=dp)
        if batching_cfg is not None and rollout_cfg is not None:
            problems.run(checks.check_token_budget, batching_cfg, rollout_cfg, train_cfg)
    if ckpt_cfg is not None:
        problems.run(checks.check_load, ckpt_cfg)
    problems.raise_if_any()
    return JobConfig(
        train=train_cfg, placement=placement_cfg, rollout=rollout_cfg, batching=batching_cfg, actor=actor_cfg,
        ckpt=ckpt_cfg,
    )  # fmt: skip


def _warn_without_fault_tolerance(rollout: dict[str, Any], train) -> None:
    for key in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if key in rollout and not train.use_fault_tolerance:
            logger.warning("--%s has no effect without --use-fault-tolerance", key.replace("_", "-"))


def _pass_through(sections: dict[str, dict[str, Any]], unknown: list[str], problems) -> None:
    """``--ray-env`` into a mapping, ``--sglang-*`` into SGLang's and the router's arguments, lists into tuples."""
    from tidal.placement import parse_ray_env
    from tidal.rollout import sglang_router_args, sglang_server_args

    placement, rollout = sections["placement"], sections["rollout"]
    placement["ray_env"] = problems.run(parse_ray_env, placement.pop("ray_env", [])) or {}
    rollout["sglang_server_args"] = problems.run(sglang_server_args, unknown) or ()
    rollout["sglang_router_args"] = problems.run(sglang_router_args, unknown) or ()
    if "--dtype" not in rollout["sglang_server_args"]:
        # SGLang serves a float32 checkpoint in float16 by default; rollout and training log-probs must come
        # from the same precision, so the engines run in the actor's dtype unless --sglang-dtype says otherwise.
        dtype = sections["actor"].get("params_dtype", "float32")
        rollout["sglang_server_args"] = (*rollout["sglang_server_args"], "--dtype", dtype)
    for key in ("rollout_stop_token_ids", "rollout_stop", "rollout_external_engine_addrs"):
        if key in rollout:
            rollout[key] = tuple(rollout[key])


def _data_files(train: dict[str, Any], problems, *, embedded: bool) -> None:
    """Fill in the shipped data for the embedded job; check each prompt file's first record."""
    from tidal.train import checks
    from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, shipped_path

    if embedded:
        train.setdefault("prompt_data", str(shipped_path(TRAIN_FILE)))
        train.setdefault("eval_prompt_data", str(shipped_path(EVAL_FILE)))
    if "prompt_data" not in train:
        problems.add("--prompt-data is required with --hf-checkpoint: a JSONL file of prompts and labels")
        return
    train.setdefault("eval_prompt_data", train["prompt_data"])
    keys = {"input_key": train.get("input_key") or "prompt", "label_key": train.get("label_key") or "label"}
    for key in ("prompt_data", "eval_prompt_data"):
        problems.run(checks.check_prompt_file, f"--{key.replace('_', '-')}", train[key], **keys)


def _model(train: dict[str, Any], problems, *, embedded: bool) -> tuple[str, dict[str, Any] | None]:
    """The model folder and its config.json (None when the embedded model is not built yet)."""
    from tidal.train import checks
    from tidal.train.embedded_model import embedded_model_path

    if not embedded:
        return train["hf_checkpoint"], problems.run(checks.check_hf_checkpoint, train["hf_checkpoint"])
    hf = str(embedded_model_path())
    config = Path(hf) / "config.json"  # built on first use: its layers are checked against the pipeline then
    return hf, json.loads(config.read_text()) if config.is_file() else None


def _output_folders(train: dict[str, Any], ckpt: dict[str, Any], rollout: dict[str, Any], problems) -> None:
    """Every folder the run writes is a folder (or can be created as one)."""
    from tidal.train import checks

    save_hf = (train.get("save_hf") or "").replace("{rollout_id}", "0")
    for flag, path in (
        ("--output-dir", train.get("output_dir") or "runs/latest"),
        ("--save", ckpt["save"]),
        ("--save-debug-rollout-data", rollout.get("save_debug_rollout_data")),
        ("--save-hf", save_hf),
    ):
        if path:
            problems.run(checks.check_writable_dir, flag, path)


def check_local_gpus(job: JobConfig, *, detected_gpus: int | None = None) -> LocalGpus | None:
    """What a local Ray will declare for ``job``, checked against the job (None with ``--ray-address``).

    ``detected_gpus`` stands in for the machine (tests); by default the CUDA GPUs are detected without torch.

    Raises:
        ResourceShortageError: the job needs more GPUs than this machine has (one line: needed vs available).
        ValueError: ``--num-gpus-local`` asks for more GPUs than the machine has.
    """
    if job.placement.ray_address:
        return None  # a cluster's GPUs are known once connected: create_placement checks them then
    from tidal.placement import detect_gpus, plan_local_gpus

    return plan_local_gpus(job.placement, detect_gpus() if detected_gpus is None else detected_gpus)


def validate(argv: list[str], *, detected_gpus: int | None = None) -> JobConfig:
    """Every check a user's input gets before anything starts: the flags and files, then this machine's GPUs."""
    job = parse_job(argv)
    check_local_gpus(job, detected_gpus=detected_gpus)  # start_ray applies the same rule, and logs CPU mode
    return job


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``uv run train``; returns the process exit code.

    A bad input prints one line per problem (exit 2); any later error prints one line and the file holding its
    traceback (exit 1); Ctrl-C stops every process and exits 130.
    """
    from tidal.train.logs import setup_logging

    setup_logging("train")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        from tidal.train.convert import convert_main

        return convert_main(argv[1:])
    from tidal.placement import PlacementError

    try:
        job = validate(argv)
    except (ValueError, PlacementError) as e:
        for line in str(e).splitlines():
            print(f"train: error: {line}", file=sys.stderr)  # noqa: T201 - the one line a user error prints
        return 2
    except Exception as e:  # a bug in the checks themselves: still one line, the traceback in a file
        return _report(e, argv, out_dir=None)
    from tidal.train.watchdog import follow_launcher, start_watchdog, stop_on_sigterm

    stop_on_sigterm()  # SIGTERM stops every process as Ctrl-C does
    follow_launcher()  # `uv run train` stops when uv is killed
    start_watchdog()  # and whatever kills this process, nothing it started outlives it
    try:
        return _run(job)
    except KeyboardInterrupt as e:
        logger.error("interrupted (%s): every SGLang, Ray and Megatron process was stopped", str(e) or "Ctrl-C")
        return 130
    except Exception as e:
        return _report(e, argv, out_dir=job.train.output_dir)


def _run(job: JobConfig) -> int:
    from tidal.train.loop import run

    start = time.monotonic()
    if job.train.hf_checkpoint is None:
        from tidal.train.embedded_model import ensure_embedded_model

        ensure_embedded_model()
    from tidal.train.config_file import write_effective_config
    from tidal.train.run_folder import link_latest

    write_effective_config(job, job.train.output_dir)
    link_latest(Path(job.train.output_dir))
    result = run(job)
    logger.info(
        "done in %.1f s (RL %.1f s): held-out accuracy %s -> %s; summary %s; curves %s; checkpoint %s",
        time.monotonic() - start,
        result.wall_s,
        _fmt(result.eval_before),
        _fmt(result.eval_after),
        result.output_dir / "summary.json",
        result.output_dir / "curves.png",
        result.checkpoint_dir,
    )
    return 0


def _cause(error: BaseException) -> BaseException:
    """The exception a Ray worker raised (Ray wraps it: ``RayTaskError.cause``), else ``error`` itself."""
    seen: set[int] = set()
    while isinstance(getattr(error, "cause", None), BaseException) and id(error) not in seen:
        seen.add(id(error))
        error = error.cause  # type: ignore[attr-defined]
    return error


def error_line(error: BaseException) -> str:
    """One line for the terminal: a tidal package's or a user's error by its message, anything else by its type.

    Ray hands back an exception raised in a worker as ``RayTaskError(cause)`` (unwrapped to the cause), or, when
    the worker died of it in ``__init__``, as an ``ActorDiedError`` holding only the remote traceback's text: then
    the traceback's last line (the exception that killed it) is the one shown.
    """
    cause = _cause(error)
    lines = [line.strip() for line in _ANSI.sub("", str(cause)).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    name = type(cause).__name__
    if type(cause).__module__.startswith("tidal.") or isinstance(cause, ValueError):
        return _clip(text) or name
    if type(cause).__module__.startswith("ray."):
        last = next((m for line in reversed(lines) if (m := _EXCEPTION_LINE.match(line))), None)
        return _clip(f"a Ray worker failed ({name}): " + (f"{last[1]}: {last[2]}" if last else text))
    return _clip(f"unexpected {name}: {text}" if text else f"unexpected {name}")


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _report(error: BaseException, argv: list[str], *, out_dir: str | None) -> int:
    """Write the traceback to ``OUT/error.log`` (or a temporary file) and print one line naming it; exit code 1."""
    text = f"train {' '.join(argv)}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n" + "".join(
        traceback.format_exception(error)
    )
    candidates = [Path(out_dir) / "error.log"] if out_dir else []
    candidates.append(Path(tempfile.gettempdir()) / f"tidal-train-error-{os.getpid()}.log")
    where = "(no log file could be written)"
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError:
            continue
        where = f"(traceback in {path.resolve()})"
        break
    print(f"train: error: {error_line(error)} {where}", file=sys.stderr)  # noqa: T201 - the one line
    return 1


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
