"""Partial rollout: resume responses that an abort cut short, recording which weights sampled each token.

When a rollout's batch is full, the requests still running are aborted (:meth:`SGLangEngine.abort`):
their samples come back with the tokens sampled so far and ``finish_reason`` "abort". The next rollout
resumes them with :func:`resume_samples`, possibly under newer weights; ``response_weight_versions``
then says which version sampled each token (e.g. to drop or reweight stale tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tidal.rollout.engine import SGLangEngine
from tidal.rollout.types import Sample


def _resumed(sample: Sample, out: Mapping[str, Any], decode: Callable[[list[int]], str] | None) -> Sample:
    new_ids = out["output_ids"]
    response_ids = [*sample.response_ids, *new_ids]
    mask = sample.response_loss_mask
    return dataclasses.replace(
        sample,
        response_ids=response_ids,
        response_log_probs=[*sample.response_log_probs, *out["output_log_probs"]],
        response_loss_mask=None if mask is None else [*mask, *[1] * len(new_ids)],
        response_weight_versions=[*sample.token_weight_versions, *[out["weight_version"]] * len(new_ids)],
        weight_version=out["weight_version"],
        finish_reason=out["finish_reason"],
        response_text=decode(response_ids) if decode is not None else sample.response_text,
    )


def resume_samples(
    engine: SGLangEngine,
    samples: Sequence[Sample],
    sampling_params: Mapping[str, Any],
    *,
    decode: Callable[[list[int]], str] | None = None,
) -> list[Sample]:
    """Continue every aborted sample from where it stopped; other samples pass through unchanged.

    Each aborted sample is resumed as one request for ``prompt + response so far``, with
    ``max_new_tokens`` reduced by the tokens it already has, so that a resumed response obeys the same
    length limit as one generated in one go. Requests with the same remaining budget share one batched call.

    Args:
        engine: A running engine (its current weights sample the new tokens).
        samples: Samples of a previous rollout; those with ``finish_reason == "abort"`` are resumed.
        sampling_params: The rollout's sampling parameters (``n`` is ignored: one continuation each).
        decode: Token ids -> text, to refresh ``response_text`` of resumed samples.

    Returns:
        The samples in the same order; resumed ones carry per-token ``response_weight_versions``.
    """
    params = {k: v for k, v in sampling_params.items() if k != "n"}
    limit = int(params.get("max_new_tokens", 1 << 30))
    by_budget: dict[int, list[int]] = {}
    for i, sample in enumerate(samples):
        if sample.finish_reason == "abort":
            by_budget.setdefault(limit - len(sample.response_ids), []).append(i)
    result = list(samples)
    for budget, indices in by_budget.items():
        if budget <= 0:
            for i in indices:
                result[i] = dataclasses.replace(samples[i], finish_reason="length")
            continue
        prompts = [[*samples[i].prompt_ids, *samples[i].response_ids] for i in indices]
        outputs = engine.generate(prompts, {**params, "max_new_tokens": budget})
        for i, out in zip(indices, outputs, strict=True):
            result[i] = _resumed(samples[i], out, decode)
    return result
