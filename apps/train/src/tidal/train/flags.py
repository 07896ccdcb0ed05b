"""The ``train`` flags: slime's names, grouped by the package whose config section receives them.

Every flag's default is None, so "given" and "not given" stay distinguishable: a config file and the embedded
defaults fill only what the command line left unset, and each package's config supplies its own defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

_BOOL = argparse.BooleanOptionalAction

# section -> [(flag, argparse kwargs)]. Sections: train, ckpt, placement, rollout, batching, actor.
SECTIONS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "train": [
        ("--config", {"help": "YAML or TOML file of options (flag names without dashes); flags override it"}),
        ("--hf-checkpoint", {"help": "HF model dir to train (default: build or reuse the embedded tiny model)"}),
        ("--prompt-data", {"help": "training prompts, JSONL (default: the shipped addition task)"}),
        ("--eval-prompt-data", {"help": "held-out prompts, JSONL (default: the shipped held-out addition prompts)"}),
        ("--input-key", {"help": "prompt key in each record (default: prompt)"}),
        ("--label-key", {"help": "answer key in each record (default: label)"}),
        ("--num-rollout", {"type": int, "help": "rollouts to run"}),
        ("--start-rollout-id", {"type": int, "help": "first rollout id (default: 0, or the one after --load's)"}),
        ("--eval-interval", {"type": int, "help": "evaluate every N rollouts (always before and after)"}),
        ("--num-eval-prompts", {"type": int, "help": "held-out prompts per evaluation"}),
        ("--output-dir", {"help": "run folder (default: a new runs/DATE-TIME; runs/latest links to the newest)"}),
        (
            "--overwrite-output-dir",
            {"action": "store_true", "default": None, "help": "write over an earlier run in --output-dir"},
        ),
        ("--seed", {"type": int, "help": "seed of data order and initialisation"}),
        ("--tensor-model-parallel-size", {"type": int, "help": "actor tensor-parallel size"}),
        ("--context-parallel-size", {"type": int, "help": "actor context-parallel size"}),
        ("--pipeline-model-parallel-size", {"type": int, "help": "actor pipeline stages (1F1B schedule)"}),
        ("--update-weight-buffer-size", {"type": int, "help": "bytes per weight-sync shard/bucket"}),
        ("--update-weights-interval", {"type": int, "help": "sync weights to the engines every N rollouts"}),
        ("--save-hf", {"help": "also write an HF checkpoint at every save; {rollout_id} in the path is filled in"}),
        ("--debug-rollout-only", {"action": "store_true", "default": None, "help": "generate only, no actor"}),
        ("--debug-train-only", {"action": "store_true", "default": None, "help": "train on --load-debug-rollout-data"}),
        ("--use-tensorboard", {"action": "store_true", "default": None, "help": "TensorBoard events in the run dir"}),
        ("--use-wandb", {"action": "store_true", "default": None, "help": "W&B in offline mode, in the run dir"}),
        ("--wandb-project", {"help": "W&B project name (default: tidal)"}),
        ("--use-fault-tolerance", {"action": "store_true", "default": None, "help": "restart an engine that died"}),
        ("--reward-sanity-rollouts", {"type": int, "help": "warn after N rollouts of identical rewards"}),
        (
            "--mismatch-warn-threshold",
            {"type": float, "help": "warn when mean |engine - actor log-prob| exceeds this (nats; 0.05; 0: off)"},
        ),
    ],
    "ckpt": [
        ("--load", {"help": "Megatron checkpoint dir to resume from (--load = --save resumes a run)"}),
        ("--ref-load", {"help": "Megatron checkpoint dir of the reference model (default: --hf-checkpoint)"}),
        ("--ckpt-step", {"type": int, "help": "iteration to load instead of the tracker's"}),
        ("--no-load-optim", {"action": "store_true", "default": None, "help": "do not load optimizer state"}),
        ("--no-load-rng", {"action": "store_true", "default": None, "help": "do not load RNG states"}),
        ("--save", {"help": "Megatron checkpoint dir (default: OUTPUT_DIR/ckpt)"}),
        ("--save-interval", {"type": int, "help": "save every N rollouts (always at the end)"}),
        ("--keep-last", {"type": int, "help": "keep only the newest K checkpoints"}),
        ("--async-save", {"action": "store_true", "default": None, "help": "write checkpoints in the background"}),
        ("--max-shard-bytes", {"type": int, "help": "largest safetensors shard of an HF checkpoint (default 5 GiB)"}),
    ],
    "placement": [
        (
            "--colocate",
            {"action": _BOOL, "help": "actor and rollout share GPUs (default: off, slime's; on for the embedded job)"},
        ),
        ("--actor-num-nodes", {"type": int, "help": "nodes of the actor"}),
        ("--actor-num-gpus-per-node", {"type": int, "help": "actor GPUs per node"}),
        ("--rollout-num-gpus", {"type": int, "help": "GPUs of all SGLang engines"}),
        ("--rollout-num-gpus-per-engine", {"type": int, "help": "GPUs per SGLang engine (its TP size)"}),
        ("--ray-address", {"help": "connect to this Ray cluster instead of starting a local one"}),
        (
            "--num-gpus-local",
            {"type": int, "help": "GPUs of a local Ray (default: the CUDA GPUs found; none: CPU mode, logical GPUs)"},
        ),
        ("--num-cpus-local", {"type": int, "help": "CPUs of a local Ray (default 2)"}),
        ("--num-cpus-per-bundle", {"type": float, "help": "CPU share of each GPU bundle (default 0.1)"}),
        (
            "--ray-propagate-uv-env",
            {"action": "store_true", "default": None, "help": "under uv run, let Ray `uv run` every worker"},
        ),
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
        ("--apply-chat-template", {"action": "store_true", "default": None, "help": "render prompts as chat"}),
        ("--rm-type", {"help": "built-in reward: exact_match, numeric_match or math"}),
        ("--custom-rm-path", {"help": "reward function by import path, pkg.module:fn"}),
        ("--custom-generate-function-path", {"help": "per-sample generate function, pkg.module:fn"}),
        ("--over-sampling-batch-size", {"type": int, "help": "prompts per round under dynamic sampling"}),
        ("--dynamic-sampling-filter-path", {"help": "group filter (reward_variance or pkg.module:fn)"}),
        ("--dynamic-sampling-max-rounds", {"type": int, "help": "most generation rounds to fill a batch (16)"}),
        ("--generate-max-concurrency", {"type": int, "help": "custom generate calls in flight at once (64)"}),
        ("--partial-rollout", {"action": "store_true", "default": None, "help": "resume aborted samples later"}),
        (
            "--mask-offpolicy-in-partial-rollout",
            {"action": "store_true", "default": None, "help": "no loss on tokens older weights sampled"},
        ),
        ("--save-debug-rollout-data", {"help": "folder to write every rollout's samples to (one JSONL per rollout)"}),
        ("--load-debug-rollout-data", {"help": "folder of saved rollouts to train on instead of generating"}),
        ("--sglang-host", {"help": "address the SGLang servers listen on (default 127.0.0.1)"}),
        ("--sglang-startup-timeout-s", {"type": float, "help": "longest wait for an SGLang server to be healthy"}),
        ("--rollout-external", {"action": "store_true", "default": None, "help": "use SGLang servers run elsewhere"}),
        (
            "--rollout-external-engine-addrs",
            {"nargs": "+", "metavar": "HOST:PORT", "help": "SGLang servers run elsewhere: none is launched"},
        ),
        ("--use-router", {"action": _BOOL, "help": "sglang-router in front of the engines (default: if several)"}),
        (
            "--rollout-request-timeout-s",
            {"type": float, "help": "longest wait for one answer of an engine or router (default 600; then retried)"},
        ),
        (
            "--rollout-request-retries",
            {"type": int, "help": "resends of a request after a reset, refusal, timeout or 5xx (default 5)"},
        ),
        (
            "--rollout-health-check-interval",
            {"type": float, "help": "seconds between engine heartbeats with --use-fault-tolerance (10; 0: off)"},
        ),
        (
            "--rollout-health-check-timeout",
            {"type": float, "help": "a heartbeat unanswered this long kills the engine, to be restarted (default 5)"},
        ),
        ("--sglang-router-policy", {"help": "cache_aware, round_robin, random or power_of_two"}),
    ],
    "batching": [
        ("--rollout-batch-size", {"type": int, "help": "prompts per rollout"}),
        ("--global-batch-size", {"type": int, "help": "samples per optimizer step"}),
        ("--num-steps-per-rollout", {"type": int, "help": "optimizer steps per rollout"}),
        ("--use-dynamic-batch-size", {"action": _BOOL, "help": "pack by token budget"}),
        ("--max-tokens-per-gpu", {"type": int, "help": "token budget per micro-batch (dynamic batch size)"}),
        ("--micro-batch-size", {"type": int, "help": "sequences per micro-batch (without dynamic batch size)"}),
        ("--pad-to-multiple-of", {"type": int, "help": "pad each micro-batch to a multiple of this"}),
    ],
    "actor": [
        ("--lr", {"type": float, "help": "learning rate"}),
        ("--lr-warmup-iters", {"type": int, "dest": "lr_warmup_steps", "help": "linear warm-up steps"}),
        ("--weight-decay", {"type": float, "help": "AdamW weight decay"}),
        ("--clip-grad", {"type": float, "help": "gradient-norm clip (0: off)"}),
        ("--adam-beta1", {"type": float, "help": "AdamW beta1 (default 0.9)"}),
        ("--adam-beta2", {"type": float, "help": "AdamW beta2 (default 0.98)"}),
        ("--adam-eps", {"type": float, "help": "AdamW epsilon (default 1e-8)"}),
        ("--advantage-estimator", {"help": "grpo, rloo or reinforce_plus_plus_baseline"}),
        ("--disable-grpo-std-normalization", {"action": "store_true", "default": None, "help": "no std division"}),
        ("--eps-clip", {"type": float, "help": "PPO lower clip range"}),
        ("--eps-clip-high", {"type": float, "help": "PPO upper clip range (default: --eps-clip)"}),
        ("--eps-clip-c", {"type": float, "help": "dual-clip bound for negative advantages (> 1; off by default)"}),
        ("--use-kl-loss", {"action": "store_true", "default": None, "help": "KL-to-reference as a loss term"}),
        ("--kl-loss-coef", {"type": float, "help": "weight of the KL-to-reference loss"}),
        ("--kl-loss-type", {"help": "KL estimator: k1, k2 or k3"}),
        ("--kl-coef", {"type": float, "help": "KL-to-reference penalty subtracted from the reward"}),
        ("--entropy-coef", {"type": float, "help": "entropy bonus weight"}),
        ("--calculate-per-token-loss", {"action": "store_true", "default": None, "help": "mean over all tokens"}),
        ("--use-tis", {"action": "store_true", "default": None, "help": "truncated importance sampling"}),
        ("--tis-clip", {"type": float, "help": "upper bound of the TIS weight (default 2)"}),
        (
            "--no-check-for-nan-in-loss-and-grad",
            {"action": "store_true", "default": None, "help": "do not stop on a NaN/inf loss or gradient"},
        ),
        ("--params-dtype", {"help": "float32 or bfloat16"}),
        ("--bf16", {"action": "store_true", "default": None, "help": "CUDA: bf16 autocast, fp32 weights and Adam"}),
        ("--log-probs-chunk-size", {"type": int, "help": "tokens per LM-head chunk for log-probs (default 1024)"}),
        (
            "--fp32-main-params",
            {"action": "store_true", "default": None, "help": "with bfloat16 params: fp32 main weights for Adam"},
        ),
        (
            "--optimizer-cpu-offload",
            {"action": "store_true", "default": None, "help": "Adam moments in host memory, update on the CPU"},
        ),
        (
            "--recompute-activations",
            {"action": "store_true", "default": None, "help": "recompute each layer in backward (less memory)"},
        ),
        (
            "--no-recompute-lm-head",
            {
                "action": "store_false",
                "dest": "recompute_lm_head",
                "default": None,
                "help": "keep the LM head's logits for backward (faster; ~2 bytes x tokens x vocab more memory)",
            },
        ),
    ],
}

TITLES = {
    "train": "run (apps/train)",
    "ckpt": "checkpoints (tidal-ckpt)",
    "placement": "placement (tidal-placement)",
    "rollout": "rollout (tidal-rollout); any other --sglang-<option> VALUE is passed to the SGLang server as "
    "--<option> VALUE, and --sglang-router-<option> VALUE to sglang-router",
    "batching": "batching (tidal-batching)",
    "actor": "actor (tidal-actor)",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (one line, naming the flag) instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(f"{message}; see `train --help`")


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` argument parser, grouped by the package that owns each flag; every default is None.

    Abbreviations are off: ``--sglang-<option>`` must reach SGLang as written, never as a prefix of a tidal flag.
    """
    parser = _Parser(
        prog="train",
        description="RL post-training: Megatron actor, SGLang rollouts. "
        "`train convert --help`: HF <-> Megatron checkpoint conversion.",
        allow_abbrev=False,
    )
    for section, flags in SECTIONS.items():
        group = parser.add_argument_group(TITLES[section])
        for flag, kwargs in flags:
            group.add_argument(flag, **{"default": None, **kwargs})
    return parser


def dest(flag: str, kwargs: dict[str, Any]) -> str:
    """The attribute name argparse gives ``flag``."""
    return kwargs.get("dest", flag.lstrip("-").replace("-", "_"))


def flag_kinds() -> dict[str, dict[str, Any]]:
    """``dest -> argparse kwargs`` of every flag (the config file reader needs each flag's kind)."""
    return {dest(flag, kw): {"flag": flag, **kw} for flags in SECTIONS.values() for flag, kw in flags}
