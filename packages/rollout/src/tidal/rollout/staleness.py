"""How old the weights that sampled each token are, measured against the trainer's, and the loss mask of the too-old.

An engine reports the weight version it served as a string (``"3"``; None or anything else for the initial weights,
version 0). Asynchronous training (a bound on staleness) keeps samples whose tokens are at most that many versions
older than the trainer's weights; older tokens are masked out of the loss while their sample stays for its group.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def version_number(value: str | None) -> float:
    """The engine's weight version as a number (0 for the initial weights)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def mask_stale_tokens(samples: list, oldest: int) -> tuple[list, int]:
    """Loss mask 0 on response tokens sampled by weights older than version ``oldest``; and how many were masked."""
    out, masked = [], 0
    for s in samples:
        versions = [version_number(v) for v in s.token_weight_versions]
        if all(v >= oldest for v in versions):
            out.append(s)
            continue
        mask = [1] * len(s.response_ids) if s.response_loss_mask is None else list(s.response_loss_mask)
        masked += sum(m for m, v in zip(mask, versions, strict=True) if v < oldest)
        mask = [m if v >= oldest else 0 for m, v in zip(mask, versions, strict=True)]
        out.append(dataclasses.replace(s, response_loss_mask=mask))
    return out, masked


def staleness_metrics(samples: list, version: int) -> dict[str, Any]:
    """``rollout/staleness_max``, ``_mean`` (``version`` minus each loss token's weight version), mixed samples.

    A sample is mixed when its loss tokens came from more than one version (a generation resumed after an update).
    """
    stale, mixed = [], 0
    for s in samples:
        mask = s.response_loss_mask or [1] * len(s.response_ids)
        versions = [version_number(v) for v in s.token_weight_versions]
        used = [v for m, v in zip(mask, versions, strict=True) if m]  # not an agent turn's template tokens (None)
        stale += [version - v for v in used]
        mixed += len(set(used)) > 1
    metrics = {"rollout/mixed_version_samples": float(mixed)}
    if not stale:
        return metrics | {"rollout/staleness_max": 0.0, "rollout/staleness_mean": 0.0}
    return metrics | {"rollout/staleness_max": float(max(stale)), "rollout/staleness_mean": sum(stale) / len(stale)}
