"""``train``: parse slime-style flags into each package's config, validate everything, then run the loop.

Parsing and validation happen before Ray, SGLang or Megatron start (or are imported), so a configuration error
answers in about a second with one line per problem, naming the flag and the fix. An error later in the run
(placement, a dead engine, checkpoint IO, a bug) also ends in one line, plus the file that holds its traceback.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.ckpt import read_hf_config_json

if TYPE_CHECKING:
    from tidal.placement import LocalGpus
    from tidal.train.config import JobConfig

logger = logging.getLogger("tidal.train")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: "pkg.module.SomeError: message".
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception|Exit|Interrupt)): (.+)$")


def parse_job(argv: list[str]) -> JobConfig:
    """Parse ``argv`` into a validated JobConfig; nothing heavy is imported and nothing starts.

    One pipeline: the values of a recipe (``--recipe``, else :func:`tidal.train.recipes.recipe_for`), then of the
    ``--config`` file, then of the flags, merged as values; each lands in the section of the package that owns it;
    then the rules and checks of :func:`_build_job`.

    Raises:
        ValueError: naming the flag and the fix; independent problems come together, one per line
            (:class:`tidal.train.checks.ConfigErrors`).
    """
    from tidal.train import checks, option_mutant
    from tidal.train.config_file import config_values, read_config_file
    from tidal.train.flags import SECTIONS, build_parser, options
    from tidal.train.recipes import DEFAULT_RECIPE, recipe_for, recipe_options

    parser = build_parser(("embedded", recipe_options("embedded")))  # --help shows the embedded recipe's values
    args, unknown = parser.parse_known_args(option_mutant.neutralize_argv(argv))  # argv unless a mutant is set
    given = {k: v for k, v in vars(args).items() if v is not None}
    path = given.pop("config", None)
    given.pop("list_recipes", None)
    if path is not None:  # the file's values under the flags'; its SGLang pass-through before theirs
        from_file, passthrough = config_values(read_config_file(path), source=path)
        given, unknown = {**from_file, **given}, [*passthrough, *unknown]
    problems = checks.Problems()
    # A missing --recipe is reported with the other problems, which are checked against the default recipe.
    recipe = problems.run(recipe_for, given.pop("recipe", None), given) or DEFAULT_RECIPE
    values = option_mutant.neutralize_values({**recipe_options(recipe), **given})  # as merged, unless a mutant
    if values.get("environment"):  # an environment is an agent that brings its own prompt data
        from tidal.train.environments import environment_values

        values = problems.run(environment_values, values["environment"], given, values) or values
    if values.get("agent_function_path") and "rm_type" in given:  # a recipe's --rm-type is its plain runs'
        problems.add(
            "--agent-function-path scores each episode with the reward its agent returns, so --rm-type would be "
            "ignored: drop --rm-type (score inside the agent)"
        )
    if values.get("rollout_external_engine_addrs"):
        # Servers run elsewhere: this job places no engine (an explicit --rollout-num-gpus N > 0 is refused).
        values.setdefault("rollout_num_gpus", 0)
    sections: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for option in options():
        if option.name in values:
            sections[option.section][option.name] = values[option.name]
    if values.get("stage") == "sft":  # only what the SFT stage reads: the RL options given are refused
        from tidal.train.sft_config import prepare_sft_sections

        prepare_sft_sections(sections, set(given), problems, flags={o.name: o.flag for o in options()})
    with option_mutant.parsing_job():
        return _build_job(sections, unknown, parser, problems)


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


def _without_wandb_key(unknown: list[str], problems) -> list[str]:
    """``unknown`` less slime's ``--wandb-key`` and its value, refused in one line that does not repeat the key."""
    kept, skip = [], False
    for i, token in enumerate(unknown):
        if skip:
            skip = False
        elif token.split("=", 1)[0] == "--wandb-key":
            problems.add(
                "--wandb-key is not taken (a key on the command line shows in the process list and would be saved "
                "in config.yaml): set WANDB_API_KEY or run `wandb login`"
            )
            skip = token == "--wandb-key" and i + 1 < len(unknown) and not unknown[i + 1].startswith("-")
        else:
            kept.append(token)
    return kept


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _build_job(sections: dict[str, dict[str, Any]], unknown: list[str], parser, problems) -> JobConfig:
    """Each package's config from its section, then the checks that span sections; every problem joins ``problems``."""
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.ckpt import CkptConfig
    from tidal.placement import PlacementConfig
    from tidal.rollout import RolloutConfig
    from tidal.train import checks
    from tidal.train.auto_memory import resolve_auto, take_auto
    from tidal.train.config import APP_SECTIONS, JobConfig, TrainConfig
    from tidal.train.flags import SECTIONS
    from tidal.train.run_folder import default_output_dir
    from tidal.train.shared import propagate_shared

    unknown = _without_wandb_key(unknown, problems)
    for line in _unknown_problems(unknown, sorted(parser._option_string_actions)):
        problems.add(line)
    _pass_through(sections, unknown, problems)
    auto = take_auto(sections, problems)
    train, rollout, actor, ckpt = sections["train"], sections["rollout"], sections["actor"], sections["ckpt"]
    train.setdefault("output_dir", str(default_output_dir()))  # runs/DATE-TIME; runs/latest links to it
    ckpt.setdefault("save", str(Path(train["output_dir"]) / "ckpt"))
    # Absolute: workers on other nodes (and other working directories) get these paths, not the driver's cwd.
    paths = (("train", "output_dir"), ("ckpt", "save"), ("ckpt", "load"), ("ckpt", "ref_load"), ("ckpt", "critic_load"))
    for section, key in paths:
        if sections[section].get(key):
            sections[section][key] = str(Path(sections[section][key]).absolute())
    if sections["sft"].get("stage") == "sft":
        from tidal.train.sft_data import check_sft_data

        check_sft_data(train, sections["sft"], problems)
    else:
        checks.check_data_files(train, sections["eval"], problems)
    hf, hf_config = _model(train, problems)
    propagate_shared(sections, {("train", "hf_checkpoint"): hf})
    checks.check_import_paths(rollout, problems, actor)
    checks.check_code_sandbox(rollout, problems)
    if not actor.get("use_kl_loss") and actor.get("kl_loss_coef"):
        logger.warning("--kl-loss-coef %s is ignored without --use-kl-loss (slime's rule)", actor["kl_loss_coef"])
        actor["kl_loss_coef"] = 0.0
    _warn_without_effect(actor)
    if "rollout_batch_size" not in sections["batching"]:  # required: BatchingConfig has no default for it
        problems.add(
            "--rollout-batch-size is required (the base recipe has none): the prompts per rollout "
            "(e.g. --rollout-batch-size 32 --n-samples-per-prompt 8)"
        )
    checks.check_output_folders(train, ckpt, rollout, problems)
    batching = sections["batching"]
    job = {  # in the order their problems are listed
        "train": problems.run(TrainConfig, **train),
        **{name: problems.run(SECTIONS[name], **sections[name]) for name in APP_SECTIONS},
        "actor": problems.run(ActorConfig, **actor),
        "batching": problems.run(BatchingConfig, **batching) if "rollout_batch_size" in batching else None,
        "ckpt": problems.run(CkptConfig, **ckpt),
        "placement": problems.run(PlacementConfig, **sections["placement"]),
        "rollout": problems.run(RolloutConfig, **rollout),
    }
    choice = None
    if auto and None not in job.values():
        resolved = problems.run(resolve_auto, auto, job, hf_config)
        # unresolved, the budgets hold placeholders that no later check should read
        job, choice = resolved or ({**job, "batching": None}, None)
    rl_sections = {name: section for name, section in job.items() if name != "sft"}  # the SFT stage's are its own
    checks.check_job(problems, **rl_sections, hf=hf, hf_config=hf_config, given=sections)
    problems.raise_if_any()
    return JobConfig(**job, memory_choice=choice)


def _warn_without_effect(actor: dict[str, Any]) -> None:
    """One warning per algorithm option that the chosen estimator or loss ignores."""
    estimator = actor.get("advantage_estimator", "grpo")
    if "gamma" in actor and estimator != "reinforce_plus_plus":
        logger.warning("--gamma has no effect with --advantage-estimator %s (reinforce_plus_plus only)", estimator)
    if "overlong_penalty_factor" in actor and not actor.get("overlong_buffer_len"):
        logger.warning("--overlong-penalty-factor has no effect without --overlong-buffer-len")


def _pass_through(sections: dict[str, dict[str, Any]], unknown: list[str], problems) -> None:
    """``--ray-env`` into a mapping, ``--sglang-*`` into SGLang's and the router's arguments, lists into tuples."""
    from tidal.placement import parse_ray_env
    from tidal.rollout import sglang_arg_problems, sglang_router_args, sglang_server_args, sglang_value_problems
    from tidal.train.flags import section_defaults

    placement, rollout = sections["placement"], sections["rollout"]
    placement["ray_env"] = problems.run(parse_ray_env, placement.pop("ray_env", [])) or {}
    # Mapped once, "--sglang-X=V" as "--X V": every reader below and after finds a value after its flag.
    rollout["sglang_server_args"] = problems.run(sglang_server_args, unknown) or ()
    rollout["sglang_router_args"] = problems.run(sglang_router_args, unknown) or ()
    for line in sglang_arg_problems(rollout["sglang_server_args"], rollout["sglang_router_args"]):
        problems.add(line)  # SGLang's own parsers, imported only when such flags are given
    for line in sglang_value_problems(rollout["sglang_server_args"], rollout["sglang_router_args"]):
        problems.add(line)  # the values tidal reads, the flags tidal sets
    if "--dtype" not in rollout["sglang_server_args"]:
        # SGLang serves a float32 checkpoint in float16 by default; rollout and training log-probs must come
        # from the same precision, so the engines run in the actor's dtype unless --sglang-dtype says otherwise.
        dtype = sections["actor"].get("params_dtype") or section_defaults("actor")["params_dtype"]
        rollout["sglang_server_args"] = (*rollout["sglang_server_args"], "--dtype", dtype)
    for section in sections.values():
        for key, value in section.items():
            if isinstance(value, list):  # nargs="+" options: the configs hold tuples
                section[key] = tuple(value)


def _model(train: dict[str, Any], problems) -> tuple[str, dict[str, Any] | None]:
    """The model folder and its config.json (None when the embedded model is not built yet)."""
    from tidal.train import checks
    from tidal.train.embedded_model import embedded_model_path, embedded_spec_of

    hf = train.get("hf_checkpoint")
    spec = embedded_spec_of(hf)
    if spec is None:
        return hf, problems.run(checks.check_hf_checkpoint, hf)
    hf = str(embedded_model_path(spec=spec))
    config = Path(hf) / "config.json"  # built on first use: its layers are checked against the pipeline then
    return hf, read_hf_config_json(hf) if config.is_file() else None


def check_local_gpus(job: JobConfig, *, detected_gpus: int | None = None) -> LocalGpus | None:
    """What a local Ray will declare for ``job``, checked against the job (None with ``--ray-address``).

    ``detected_gpus`` stands in for the machine (tests); by default the CUDA GPUs are detected without torch.

    Raises:
        ResourceShortageError: the job needs more GPUs than this machine has (one line: needed vs available).
        ValueError: ``--num-gpus-local`` asks for more GPUs than the machine has.
    """
    if job.placement.cluster_address:
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
    traceback (exit 1); Ctrl-C stops every process and exits 130, having checkpointed the newest finished rollout
    and printed the command that goes on from it.
    """
    from tidal.train.logs import LogPlan, forward_ray_logs, setup_logging

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        from tidal.train.convert import convert_main

        setup_logging("convert", LogPlan(verbose=True))  # a one-shot tool: its few INFO lines are its report
        return convert_main(argv[1:])
    setup_logging("train", terminal_marks=True)
    forward_ray_logs()  # before anything imports Ray
    from tidal.train.option_mutant import neutralize_argv

    listing = neutralize_argv(argv)  # argv itself unless an option mutant drops an app option
    if "--list-recipes" in listing or _recipe_arg(listing) == "list":
        from tidal.train.recipes import describe

        sys.stdout.write(describe() + "\n")
        return 0
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
        from tidal.train.interrupted import resume_command
        from tidal.train.watchdog import STOPPED_BY

        cause = str(e) or (STOPPED_BY[-1] if STOPPED_BY else "Ctrl-C")
        logger.error("interrupted (%s): every SGLang, Ray and Megatron process was stopped", cause)
        if job.sft.stage == "sft":  # an SFT run does not resume: its last --save-hf folder is where to go on from
            logger.error("the SFT stage is not resumed: start a new one from its last --save-hf folder, if any")
        elif not job.train.debug_rollout_only:
            logger.error("%s", resume_command(argv, job))
        return 130
    except Exception as e:
        return _report(e, argv, out_dir=job.train.output_dir)


def _recipe_arg(argv: list[str]) -> str | None:
    """The value of ``--recipe`` in ``argv`` (``--recipe NAME`` or ``--recipe=NAME``), if given."""
    for i, token in enumerate(argv):
        if token == "--recipe" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--recipe="):
            return token.split("=", 1)[1]
    return None


def _run(job: JobConfig) -> int:
    from tidal.train.logs import TERMINAL, LogPlan, setup_logging
    from tidal.train.loop import run

    start = time.monotonic()
    plan = LogPlan.of_run(job.train.output_dir, job.logging.verbose)
    setup_logging("train", plan, terminal_marks=True)
    shown = "" if job.logging.verbose else "; -v shows their INFO lines here too"
    logger.info("run folder %s (each process logs in %s%s)", job.train.output_dir, plan.log_dir, shown, extra=TERMINAL)
    from tidal.train.embedded_model import embedded_spec_of, ensure_embedded_model

    spec = embedded_spec_of(job.train.hf_checkpoint)
    if spec is not None:  # an embedded model (the default, or --recipe embedded-moe's): built on first use
        ensure_embedded_model(spec=spec)
    logger.info("model %s", job.actor.hf_checkpoint, extra=TERMINAL)
    from tidal.train.config_file import write_effective_config
    from tidal.train.run_folder import link_latest

    write_effective_config(job, job.train.output_dir)
    link_latest(Path(job.train.output_dir))
    if not job.train.debug_rollout_only:
        from tidal.ckpt import read_hf_config_json
        from tidal.train.memory import write_memory_plan

        write_memory_plan(job, read_hf_config_json(job.actor.hf_checkpoint), job.train.output_dir)
    if job.sft.stage == "sft":
        from tidal.train.sft_loop import run_sft

        sft = run_sft(job)
        logger.info("done in %.1f s: %s", time.monotonic() - start, sft.describe(), extra=TERMINAL)
        return 0
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
        extra=TERMINAL,
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
