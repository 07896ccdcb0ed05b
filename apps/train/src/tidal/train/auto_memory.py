"""``auto`` token budgets and recompute: resolved once, before anything starts, from the memory plan.

``--max-tokens-per-gpu auto``, ``--log-probs-max-tokens-per-gpu auto`` and ``--recompute-activations auto`` (the
recipes' defaults) are taken out of the parsed values before the configs are built (:func:`take_auto`), and
replaced by :func:`resolve_auto` with the configuration :func:`tidal.actor.choose_memory_config` predicts fastest
among those that fit the trainer GPU (``--gpu-memory-gib``, else this machine's). A value the user sets is kept.
With no GPU known (a CPU machine) ``auto`` means no recompute and a budget of at least the longest sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

AUTO = "auto"
BUDGETS = ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu")
PLACEHOLDER_TOKENS = 1 << 20
"""What an ``auto`` budget holds while the configs are first built (replaced before any check reads it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoRequest:
    """Which of the three the job leaves to the plan."""

    budget: bool = False
    """``--max-tokens-per-gpu auto``."""
    logprob_budget: bool = False
    """``--log-probs-max-tokens-per-gpu auto``."""
    recompute: bool = False
    """``--recompute-activations auto``."""

    def __bool__(self) -> bool:
        return self.budget or self.logprob_budget or self.recompute


def int_or_auto(text: str) -> int | str:
    """A flag's value: an integer, or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    return int(text)


int_or_auto.__name__ = "integer or auto"


def bool_or_auto(text: str) -> bool | str:
    """A switch's optional value: ``auto``, or true/false (the switch alone is true)."""
    value = text.strip().lower()
    if value == AUTO:
        return AUTO
    if value in ("true", "on", "1", "yes"):
        return True
    if value in ("false", "off", "0", "no"):
        return False
    raise ValueError(value)


bool_or_auto.__name__ = "true, false or auto"


def take_auto(sections: dict[str, dict[str, Any]], problems) -> AutoRequest:
    """Take the ``auto`` values out of ``sections`` (placeholders in their place) and say which were ``auto``."""
    batching, actor = sections["batching"], sections["actor"]
    dynamic = bool(batching.get("use_dynamic_batch_size"))
    budget = batching.get("max_tokens_per_gpu") == AUTO
    logprob = batching.get("log_probs_max_tokens_per_gpu") == AUTO
    for key in BUDGETS:
        if batching.get(key) == AUTO:  # without dynamic batch size there is no budget to choose
            batching[key] = PLACEHOLDER_TOKENS if dynamic else None
    recompute = actor.get("recompute_activations") == AUTO
    if recompute:
        actor["recompute_activations"] = False
        if actor.get("recompute_num_layers"):
            problems.add(
                f"--recompute-num-layers {actor['recompute_num_layers']} is chosen by --recompute-activations auto: "
                "drop one of them"
            )
            actor.pop("recompute_num_layers")
    return AutoRequest(budget=budget and dynamic, logprob_budget=logprob and dynamic, recompute=recompute)


def resolve_auto(request: AutoRequest, job: dict[str, Any], hf_config: dict[str, Any] | None):
    """The job's sections with the ``auto`` values chosen, and the choice (None when nothing was ``auto``).

    Raises:
        ValueError: no configuration holds the run's longest sample (one line: what would).
    """
    if not request:
        return job, None
    from tidal.actor import ModelShape, choose_memory_config
    from tidal.train.memory import engine_fraction, gpu_bytes_of, memory_inputs, plannable

    parallel, offload, actor, batching = job["parallel"], job["offload"], job["actor"], job["batching"]
    rollout, placement = job["rollout"], job["placement"]
    inputs = memory_inputs(parallel, actor, batching, rollout)
    gpu = gpu_bytes_of(actor) if plannable(hf_config) else None
    shape = ModelShape.from_hf_config(hf_config) if plannable(hf_config) else None
    longest = inputs.longest_sequence
    step = _step_tokens(batching, longest)
    choice = choose_memory_config(
        shape,
        inputs,
        gpu_bytes=gpu,
        longest_sample=longest,
        engine_fraction=engine_fraction(offload, rollout, placement) if gpu else 0.0,
        step_tokens=step,
        choose_budget=request.budget,
        choose_recompute=request.recompute,
        choose_logprob_budget=request.logprob_budget,
    )
    out = dict(job)
    if request.budget or request.logprob_budget:
        values = {}
        if request.budget:
            values["max_tokens_per_gpu"] = choice.max_tokens_per_gpu
        if request.logprob_budget:
            values["log_probs_max_tokens_per_gpu"] = choice.log_probs_max_tokens_per_gpu
        out["batching"] = replace(batching, **values)
    if request.recompute:
        out["actor"] = replace(
            actor,
            recompute_activations=choice.recompute_activations,
            recompute_num_layers=choice.recompute_num_layers,
        )
    logger.info("memory auto: %s", choice.reason)
    return out, choice


def _step_tokens(batching, longest: int) -> int:
    """An upper bound of the tokens one GPU trains per optimizer step (every sample of the step at full length)."""
    samples = batching.global_batch_size or batching.rollout_batch_size * batching.n_samples_per_prompt
    return samples * longest
