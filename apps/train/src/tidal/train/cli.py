"""``train``: parse slime-style flags into each package's config, validate everything, then run the loop.

Parsing and validation happen before Ray, SGLang or Megatron start, so a configuration error answers in seconds
with one line naming the flag.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("tidal.train")

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
}


def parse_job(argv: list[str]):
    """Parse ``argv`` into a validated JobConfig (ValueError names the flag on bad input)."""
    from tidal.train.config import JobConfig, TrainConfig
    from tidal.train.config_file import expand_config
    from tidal.train.flags import SECTIONS, build_parser, dest

    args, unknown = build_parser().parse_known_args(expand_config(argv))
    values = {k: v for k, v in vars(args).items() if v is not None}
    values.pop("config", None)
    embedded = "hf_checkpoint" not in values
    if embedded:
        values = {**EMBEDDED_DEFAULTS, **values}
    sections = {
        section: {dest(flag, kw): values[dest(flag, kw)] for flag, kw in flags if dest(flag, kw) in values}
        for section, flags in SECTIONS.items()
    }
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.ckpt import CkptConfig
    from tidal.placement import PlacementConfig, parse_ray_env
    from tidal.rollout import RolloutConfig, sglang_router_args, sglang_server_args
    from tidal.train.embedded_model import embedded_model_path
    from tidal.train.run_folder import check_output_dir, default_output_dir
    from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, shipped_path

    bad = [a for a in unknown if a.startswith("-") and not a.startswith("--sglang-")]
    if bad:
        raise ValueError(f"unknown option {bad[0]}; see `train --help`")
    placement = sections["placement"]
    placement["ray_env"] = parse_ray_env(placement.pop("ray_env", []))
    rollout = sections["rollout"]
    rollout["sglang_server_args"] = sglang_server_args(unknown)
    rollout["sglang_router_args"] = sglang_router_args(unknown)
    if "--dtype" not in rollout["sglang_server_args"]:
        # SGLang serves a float32 checkpoint in float16 by default; rollout and training log-probs must come
        # from the same precision, so the engines run in the actor's dtype unless --sglang-dtype says otherwise.
        dtype = sections["actor"].get("params_dtype", "float32")
        rollout["sglang_server_args"] = (*rollout["sglang_server_args"], "--dtype", dtype)
    for key in ("rollout_stop_token_ids", "rollout_stop", "rollout_external_engine_addrs"):
        if key in rollout:
            rollout[key] = tuple(rollout[key])
    train = sections["train"]
    train.setdefault("output_dir", str(default_output_dir()))
    if embedded:
        train.setdefault("prompt_data", str(shipped_path(TRAIN_FILE)))
        train.setdefault("eval_prompt_data", str(shipped_path(EVAL_FILE)))
    if "prompt_data" not in train:
        raise ValueError("--prompt-data is required with --hf-checkpoint (a JSONL file of prompts and labels)")
    train.setdefault("eval_prompt_data", train["prompt_data"])
    for key in ("prompt_data", "eval_prompt_data"):
        if not Path(train[key]).is_file():
            raise ValueError(f"--{key.replace('_', '-')} {train[key]} is not a file")
    train_cfg = TrainConfig(**train)
    hf = train_cfg.hf_checkpoint or str(embedded_model_path())
    actor = sections["actor"]
    if actor.pop("no_check_for_nan_in_loss_and_grad", False):
        actor["check_for_nan_in_loss_and_grad"] = False
    if not actor.get("use_kl_loss") and actor.get("kl_loss_coef"):
        logger.warning("--kl-loss-coef %s is ignored without --use-kl-loss (slime's rule)", actor["kl_loss_coef"])
        actor["kl_loss_coef"] = 0.0
    if not embedded and not (Path(hf) / "config.json").is_file():
        raise ValueError(f"--hf-checkpoint {hf} has no config.json; point it at a Hugging Face model directory")
    ckpt = sections["ckpt"]
    ckpt.setdefault("save", str(Path(train_cfg.output_dir) / "ckpt"))
    check_output_dir(
        Path(train_cfg.output_dir),
        Path(ckpt["save"]),
        resuming=bool(ckpt.get("load")),
        overwrite=train_cfg.overwrite_output_dir,
    )
    _check_cross_section(train_cfg, rollout, placement, ckpt, hf)
    return JobConfig(
        train=train_cfg,
        placement=PlacementConfig(**placement),
        rollout=RolloutConfig(**rollout),
        batching=BatchingConfig(n_samples_per_prompt=rollout.get("n_samples_per_prompt", 1), **sections["batching"]),
        actor=ActorConfig(hf_checkpoint=hf, temperature=rollout.get("rollout_temperature", 1.0) or 1.0, **actor),
        ckpt=CkptConfig(hf_checkpoint=hf, **sections["ckpt"]),
    )


def _check_cross_section(train, rollout: dict, placement: dict, ckpt: dict, hf: str) -> None:
    """Checks that span packages; each package's own config checks the rest when it is built."""
    if train.debug_train_only and not rollout.get("load_debug_rollout_data"):
        raise ValueError(
            "--debug-train-only trains on saved rollouts: give --load-debug-rollout-data DIR "
            "(written by an earlier run with --save-debug-rollout-data DIR)"
        )
    if rollout.get("load_debug_rollout_data") and not Path(rollout["load_debug_rollout_data"]).is_dir():
        raise ValueError(f"--load-debug-rollout-data {rollout['load_debug_rollout_data']} is not a directory")
    if train.debug_rollout_only and rollout.get("load_debug_rollout_data"):
        raise ValueError("--debug-rollout-only generates rollouts; it cannot also --load-debug-rollout-data")
    if rollout.get("rollout_external_engine_addrs"):
        clash = [
            flag
            for flag, given in (
                ("--debug-train-only", train.debug_train_only),
                ("--load-debug-rollout-data", rollout.get("load_debug_rollout_data")),
                ("--use-fault-tolerance", train.use_fault_tolerance),  # tidal cannot restart a server it does not own
                ("--no-colocate", placement.get("colocate") is False),  # no GPU is reserved for external engines
            )
            if given
        ]
        if clash:
            raise ValueError(
                f"--rollout-external-engine-addrs (SGLang servers run elsewhere) cannot be combined with {clash[0]}: "
                "drop one of them"
            )
    gpus = placement.get("actor_num_nodes", 1) * placement.get("actor_num_gpus_per_node", 1)
    pp = train.pipeline_model_parallel_size
    model_parallel = train.tensor_model_parallel_size * train.context_parallel_size * pp
    if gpus % model_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {train.tensor_model_parallel_size} x --context-parallel-size "
            f"{train.context_parallel_size} x --pipeline-model-parallel-size {pp} = {model_parallel} does not divide "
            f"the {gpus} actor GPU(s) (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    if pp > 1:
        from tidal.actor.distributed import check_pipeline_model_parallel_size

        check_pipeline_model_parallel_size(pp, context_parallel_size=train.context_parallel_size)
        config = Path(hf) / "config.json"  # the embedded model may not be built yet: the actor checks it then
        layers = json.loads(config.read_text()).get("num_hidden_layers", 0) if config.is_file() else 0
        if layers % pp:
            raise ValueError(
                f"--pipeline-model-parallel-size {pp} does not divide the model's {layers} layers "
                f"(num_hidden_layers in {Path(hf) / 'config.json'}); pick a divisor of {layers}"
            )
    if ckpt.get("load"):
        from tidal.ckpt import CheckpointError, resolve_checkpoint

        try:  # each kind of bad directory has its own message naming what was found and what to pass
            resolve_checkpoint(ckpt["load"], ckpt_step=ckpt.get("ckpt_step"))
        except CheckpointError as e:
            raise ValueError(str(e) if "--load" in str(e) else f"--load {ckpt['load']}: {e}") from e
    if train.use_wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ValueError("--use-wandb needs the wandb package: `uv pip install wandb` (it runs offline)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``uv run train``; returns the process exit code."""
    from tidal.train.workers import setup_logging

    setup_logging("train")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        from tidal.train.convert import convert_main

        return convert_main(argv[1:])
    try:
        job = parse_job(argv)
    except ValueError as e:
        print(f"train: error: {e}", file=sys.stderr)  # noqa: T201 - the one line a user error prints
        return 2
    from tidal.train.loop import run
    from tidal.train.run_folder import link_latest
    from tidal.train.watchdog import follow_launcher, start_watchdog, stop_on_sigterm

    stop_on_sigterm()  # SIGTERM stops every process as Ctrl-C does
    follow_launcher()  # `uv run train` stops when uv is killed
    start_watchdog()  # and whatever kills this process, nothing it started outlives it
    start = time.monotonic()
    if job.train.hf_checkpoint is None:
        from tidal.train.embedded_model import ensure_embedded_model

        ensure_embedded_model()
    from tidal.train.config_file import write_effective_config

    write_effective_config(job, job.train.output_dir)
    link_latest(Path(job.train.output_dir))
    try:
        result = run(job)
    except KeyboardInterrupt as e:
        logger.error("interrupted (%s): every SGLang, Ray and Megatron process was stopped", str(e) or "Ctrl-C")
        return 130
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


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
