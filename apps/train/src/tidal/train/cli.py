"""``train``: parse slime-style flags into each package's config, validate everything, then run the loop.

Parsing and validation happen before Ray, SGLang or Megatron start, so a configuration error answers in seconds
with one line naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("tidal.train")

# The embedded default job (no --hf-checkpoint): sizes that suit the tiny addition model on a 2-core CPU.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    "num_rollout": 3,
    "rollout_batch_size": 16,
    "n_samples_per_prompt": 8,
    "rollout_max_response_len": 8,
    "rollout_temperature": 1.0,
    "rm_type": "numeric_match",
    "lr": 2e-5,
    "use_dynamic_batch_size": True,
    "max_tokens_per_gpu": 2048,
}

# flag dest -> (section, field). Sections: train, placement, rollout, batching, actor.
_SECTIONS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "train": [
        ("--hf-checkpoint", {"help": "HF model dir to train (default: build or reuse the embedded tiny model)"}),
        ("--prompt-data", {"help": "training prompts, JSONL (default: the shipped addition task)"}),
        ("--eval-prompt-data", {"help": "held-out prompts, JSONL (default: the shipped held-out addition prompts)"}),
        ("--input-key", {"help": "prompt key in each record (default: prompt)"}),
        ("--label-key", {"help": "answer key in each record (default: label)"}),
        ("--num-rollout", {"type": int, "help": "rollouts to run"}),
        ("--eval-interval", {"type": int, "help": "evaluate every N rollouts (always before and after)"}),
        ("--num-eval-prompts", {"type": int, "help": "held-out prompts per evaluation"}),
        ("--save", {"help": "Megatron checkpoint dir (default: OUTPUT_DIR/ckpt)"}),
        ("--save-interval", {"type": int, "help": "save every N rollouts (always at the end)"}),
        ("--output-dir", {"help": "run folder (default: runs/latest)"}),
        ("--seed", {"type": int, "help": "seed of data order and initialisation"}),
    ],
    "placement": [
        ("--colocate", {"action": argparse.BooleanOptionalAction, "help": "actor and rollout share GPUs"}),
        ("--actor-num-nodes", {"type": int, "help": "nodes of the actor"}),
        ("--actor-num-gpus-per-node", {"type": int, "help": "actor GPUs per node"}),
        ("--rollout-num-gpus", {"type": int, "help": "GPUs of all SGLang engines"}),
        ("--rollout-num-gpus-per-engine", {"type": int, "help": "GPUs per SGLang engine (its TP size)"}),
        ("--ray-address", {"help": "connect to this Ray cluster instead of starting a local one"}),
        ("--num-gpus-local", {"type": int, "help": "logical GPUs of a local Ray (default: what the job needs)"}),
        ("--placement-timeout", {"type": float, "dest": "placement_timeout_s", "help": "seconds to wait for GPUs"}),
        ("--ray-env", {"action": "append", "metavar": "KEY=VALUE", "help": "env var for every Ray worker"}),
    ],
    "rollout": [
        ("--n-samples-per-prompt", {"type": int, "help": "responses per prompt (one GRPO group)"}),
        ("--rollout-max-response-len", {"type": int, "help": "most new tokens per response"}),
        ("--rollout-temperature", {"type": float, "help": "sampling temperature"}),
        ("--rollout-top-p", {"type": float, "help": "nucleus sampling mass"}),
        ("--rollout-top-k", {"type": int, "help": "top-k sampling (-1: all)"}),
        ("--rollout-stop-token-ids", {"type": int, "nargs": "+", "help": "extra token ids that end a response"}),
        ("--rollout-stop", {"nargs": "+", "help": "strings that end a response"}),
        ("--save-debug-rollout-data", {"help": "folder to write every rollout's samples to (one JSONL per rollout)"}),
        ("--rm-type", {"help": "built-in reward: exact_match, numeric_match or math"}),
        ("--custom-rm-path", {"help": "reward function by import path, pkg.module:fn"}),
        ("--sglang-host", {"help": "address the SGLang servers listen on (default 127.0.0.1)"}),
    ],
    "batching": [
        ("--rollout-batch-size", {"type": int, "help": "prompts per rollout"}),
        ("--global-batch-size", {"type": int, "help": "samples per optimizer step"}),
        ("--num-steps-per-rollout", {"type": int, "help": "optimizer steps per rollout"}),
        ("--use-dynamic-batch-size", {"action": argparse.BooleanOptionalAction, "help": "pack by token budget"}),
        ("--max-tokens-per-gpu", {"type": int, "help": "token budget per micro-batch (dynamic batch size)"}),
        ("--micro-batch-size", {"type": int, "help": "sequences per micro-batch (without dynamic batch size)"}),
        ("--pad-to-multiple-of", {"type": int, "help": "pad each micro-batch to a multiple of this"}),
    ],
    "actor": [
        ("--lr", {"type": float, "help": "learning rate"}),
        ("--lr-warmup-iters", {"type": int, "dest": "lr_warmup_steps", "help": "linear warm-up steps"}),
        ("--weight-decay", {"type": float, "help": "AdamW weight decay"}),
        ("--clip-grad", {"type": float, "help": "gradient-norm clip (0: off)"}),
        ("--eps-clip", {"type": float, "help": "PPO lower clip range"}),
        ("--eps-clip-high", {"type": float, "help": "PPO upper clip range (default: --eps-clip)"}),
        ("--kl-loss-coef", {"type": float, "help": "weight of the KL-to-reference loss"}),
        ("--kl-loss-type", {"help": "KL estimator: k1, k2 or k3"}),
        ("--entropy-coef", {"type": float, "help": "entropy bonus weight"}),
        ("--params-dtype", {"help": "float32 or bfloat16"}),
    ],
}
_TITLES = {
    "train": "run (apps/train)",
    "placement": "placement (tidal-placement)",
    "rollout": "rollout (tidal-rollout); any --sglang-<option> VALUE is passed to the SGLang server",
    "batching": "batching (tidal-batching)",
    "actor": "actor (tidal-actor)",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` argument parser, grouped by the package that owns each flag; every default is None."""
    parser = argparse.ArgumentParser(
        prog="train",
        description="RL post-training: Megatron actor, SGLang rollouts. "
        "`train convert --help`: HF <-> Megatron checkpoint conversion.",
    )
    for section, flags in _SECTIONS.items():
        group = parser.add_argument_group(_TITLES[section])
        for flag, kwargs in flags:
            group.add_argument(flag, default=None, **kwargs)
    return parser


def _dest(flag: str, kwargs: dict[str, Any]) -> str:
    return kwargs.get("dest", flag.lstrip("-").replace("-", "_"))


def parse_job(argv: list[str]):
    """Parse ``argv`` into a validated JobConfig (ValueError names the flag on bad input)."""
    from tidal.train.config import JobConfig, TrainConfig

    args, unknown = build_parser().parse_known_args(argv)
    values = {k: v for k, v in vars(args).items() if v is not None}
    embedded = "hf_checkpoint" not in values
    if embedded:
        values = {**EMBEDDED_DEFAULTS, **values}
    sections = {
        section: {_dest(flag, kw): values[_dest(flag, kw)] for flag, kw in flags if _dest(flag, kw) in values}
        for section, flags in _SECTIONS.items()
    }
    from tidal.actor import ActorConfig
    from tidal.batching import BatchingConfig
    from tidal.placement import PlacementConfig, parse_ray_env
    from tidal.rollout import RolloutConfig, sglang_server_args
    from tidal.train.embedded_model import embedded_model_path
    from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, shipped_path

    bad = [a for a in unknown if a.startswith("-") and not a.startswith("--sglang-")]
    if bad:
        raise ValueError(f"unknown option {bad[0]}; see `train --help`")
    placement = sections["placement"]
    placement["ray_env"] = parse_ray_env(placement.pop("ray_env", []))
    rollout = sections["rollout"]
    rollout["sglang_server_args"] = sglang_server_args(unknown)
    if "--dtype" not in rollout["sglang_server_args"]:
        # SGLang serves a float32 checkpoint in float16 by default; rollout and training log-probs must come
        # from the same precision, so the engines run in the actor's dtype unless --sglang-dtype says otherwise.
        dtype = sections["actor"].get("params_dtype", "float32")
        rollout["sglang_server_args"] = (*rollout["sglang_server_args"], "--dtype", dtype)
    for key in ("rollout_stop_token_ids", "rollout_stop"):
        if key in rollout:
            rollout[key] = tuple(rollout[key])
    train = sections["train"]
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
    if not embedded and not (Path(hf) / "config.json").is_file():
        raise ValueError(f"--hf-checkpoint {hf} has no config.json; point it at a Hugging Face model directory")
    return JobConfig(
        train=train_cfg,
        placement=PlacementConfig(**placement),
        rollout=RolloutConfig(**rollout),
        batching=BatchingConfig(n_samples_per_prompt=rollout.get("n_samples_per_prompt", 1), **sections["batching"]),
        actor=ActorConfig(
            hf_checkpoint=hf, temperature=rollout.get("rollout_temperature", 1.0) or 1.0, **sections["actor"]
        ),
    )


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

    start = time.monotonic()
    if job.train.hf_checkpoint is None:
        from tidal.train.embedded_model import ensure_embedded_model

        ensure_embedded_model()
    result = run(job)
    logger.info(
        "done in %.1f s: held-out accuracy %.3f -> %.3f; metrics %s; checkpoint %s; last weights %s",
        time.monotonic() - start,
        result.eval_before,
        result.eval_after,
        result.output_dir / "metrics.jsonl",
        result.checkpoint_dir,
        result.weights_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
