"""The SFT stage's options, and what ``--stage sft`` makes of the other sections (standard library only).

``train --stage sft --sft-data FILE`` trains the same Megatron actor as RL, on the negative log-likelihood of the
response (or assistant) tokens, and starts no SGLang engine. An option that only RL reads would be ignored there, so
each one given on the command line or in ``--config`` is refused in one line; a recipe's RL values are dropped
silently (they were not the user's choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STAGES = ("rl", "sft")
"""The values of --stage."""

SFT_OPTIONS: dict[str, frozenset[str]] = {
    # section -> the options the SFT stage reads (every other given option is refused with --stage sft)
    "train": frozenset({"hf_checkpoint", "input_key", "label_key", "tool_key", "output_dir", "overwrite_output_dir",
                        "seed", "save_hf"}),
    "eval": frozenset({"num_eval_prompts", "eval_interval"}),
    "rollout": frozenset({"apply_chat_template"}),
    "batching": frozenset({"global_batch_size", "use_dynamic_batch_size", "max_tokens_per_gpu", "micro_batch_size",
                           "pad_to_multiple_of"}),
    "actor": frozenset({"params_dtype", "bf16", "fp32_main_params", "optimizer_cpu_offload", "recompute_lm_head",
                        "cudnn_attention_min_tokens", "recompute_activations", "recompute_num_layers",
                        "moe_aux_loss_coeff", "moe_router_dtype", "gpu_memory_gib", "lr", "lr_warmup_steps",
                        "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "loss_type",
                        "calculate_per_token_loss", "check_for_nan_in_loss_and_grad", "log_probs_chunk_size"}),
    "ckpt": frozenset({"save", "save_interval", "keep_last", "max_shard_bytes", "async_save", "hf_checkpoint"}),
    "placement": frozenset({"actor_num_nodes", "actor_num_gpus_per_node", "ray_address", "num_gpus_local",
                            "num_cpus_local", "num_cpus_per_bundle", "placement_timeout_s", "ray_env",
                            "ray_propagate_uv_env"}),
}  # fmt: skip
"""Options of the other sections that ``--stage sft`` reads; ``parallel``, ``logging`` and ``sft`` are read whole."""
_WHOLE = ("parallel", "logging", "sft")
_OWN_LINE = {  # the RL options whose refusal says more than that they are RL's
    "load": "--load with --stage sft is not supported (an SFT run starts from --hf-checkpoint): give the --save-hf "
    "folder of the earlier SFT run as --hf-checkpoint",
    "lora_rank": "--lora-rank with --stage sft is not supported yet: drop --lora-rank (SFT trains every weight)",
    "rollout_batch_size": "--rollout-batch-size counts an RL rollout's prompts: --stage sft takes --global-batch-size "
    "(rows per optimizer step)",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SftConfig:
    """Which stage the run is, and the SFT stage's data and epochs."""

    stage: str = "rl"
    """"rl" (rollouts on SGLang engines, rewards, the policy loss) or "sft" (supervised fine-tuning of the same
    actor on --sft-data: negative log-likelihood of the response tokens, no engine; its checkpoint and --save-hf
    folder are what an RL run then takes as --load or --hf-checkpoint)."""
    sft_data: tuple[str, ...] | None = field(default=None, metadata={"metavar": "PATH[:WEIGHT]"})
    """Training rows of --stage sft, read as --prompt-data is (JSONL, JSON, Parquet, globs, datasets folders,
    weighted mixes): a row's --input-key is a list of chat messages (loss on the assistant turns only) or a prompt
    text whose response is the row's --label-key (loss on the response and EOS)."""
    sft_eval_data: tuple[str, ...] | None = field(default=None, metadata={"metavar": "PATH"})
    """Held-out rows of --stage sft (as --sft-data, without weights): their mean NLL per loss token (eval/nll) before
    training, every --eval-interval steps and at the end, on the first --num-eval-prompts rows; None: no evaluation."""
    num_epoch: int = 1
    """Passes over --sft-data of --stage sft (each in a seeded order; a last partial batch of each pass is dropped)."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"--stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        if self.num_epoch < 1:
            raise ValueError(f"--num-epoch must be >= 1, got {self.num_epoch}")
        if self.stage == "sft" and not self.sft_data:
            raise ValueError("--stage sft needs --sft-data FILE (JSONL, JSON or Parquet rows of messages or pairs)")
        if self.stage == "rl":
            given = [flag for flag, value in (("--sft-data", self.sft_data), ("--sft-eval-data", self.sft_eval_data),
                                              ("--num-epoch", self.num_epoch != 1)) if value]  # fmt: skip
            if given:
                raise ValueError(f"{given[0]} is read by --stage sft only; add --stage sft or drop it")


def prepare_sft_sections(
    sections: dict[str, dict[str, Any]], given: set[str], problems, *, flags: dict[str, str]
) -> None:
    """Refuse the given options ``--stage sft`` would ignore; set the sections to what an SFT run uses.

    ``given`` are the field names set by the command line or ``--config`` (a recipe's values are not refused);
    ``flags`` maps every option's field name to its flag. The actor trains on ``sft_loss`` with a token mean over
    every loss token of a step; a step is --global-batch-size rows (else the recipe's --rollout-batch-size), one
    sample per row, at temperature 1; the actor is placed alone.
    """

    def shown(name: str, value: Any) -> str:  # as given: a pair's off side is its --no- flag
        flag = flags.get(name, name)
        return "--no-" + flag[2:] if value is False and not flag.startswith("--no-") else flag

    ignored = [
        shown(name, values[name])
        for section, values in sections.items()
        if section not in _WHOLE
        for name in sorted(set(values) & given - set(_OWN_LINE) - SFT_OPTIONS.get(section, frozenset()))
    ]
    if ignored:  # one line for them all: they have one cause and one fix
        problems.add(
            f"--stage sft would ignore RL option{'s' if len(ignored) > 1 else ''} {', '.join(ignored)} (no engine, "
            "rollout or reward runs in it): drop them, or run --stage rl"
        )
    actor, batching = sections["actor"], sections["batching"]
    if actor.get("loss_type", "sft_loss") != "sft_loss":
        problems.add(f"--stage sft trains on --loss-type sft_loss, got --loss-type {actor['loss_type']}: drop it")
    for name in sorted(set(_OWN_LINE) & given):
        problems.add(_OWN_LINE[name])
    size = batching.get("global_batch_size") or batching.get("rollout_batch_size")  # given, else the recipe's
    for section, values in sections.items():  # the recipe's RL values go; the SFT stage's own stay
        if section not in _WHOLE:
            for name in set(values) - SFT_OPTIONS.get(section, frozenset()):
                del values[name]
    if size:
        batching.update(rollout_batch_size=size, global_batch_size=size)
    else:
        problems.add("--stage sft needs --global-batch-size N: the rows of one optimizer step (e.g. 32)")
    sections["rollout"].update(n_samples_per_prompt=1, rollout_temperature=1.0)
    actor.update(loss_type="sft_loss", calculate_per_token_loss=True, lora_rank=0)
    sections["placement"]["colocate"] = True  # the engines' share of the GPUs is the actor's: no GPU is set aside
    sections["offload"] = {"offload": False}
