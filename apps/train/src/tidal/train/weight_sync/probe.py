"""--check-weight-update-equal's measure: the engines' and the actor's log-probs of the same probe tokens."""

from __future__ import annotations

import math


def probe_gap(engine_samples: list[list[tuple[list[int], list[float]]]], actor_log_probs: list[list[float]]) -> dict:
    """Metrics of engine vs actor log-probs on the probe: mean and max |gap| over every engine's sampled tokens.

    ``engine_samples[e][i]`` is engine ``e``'s ``(prompt + response tokens, response log-probs)`` of probe prompt
    ``i``; ``actor_log_probs`` holds the actor's log-probs of the same token lists, engine-major, in tidal's
    convention (position t scores token t).
    """
    gaps: list[float] = []
    flat = [sample for samples in engine_samples for sample in samples]
    for (tokens, engine_lp), actor_lp in zip(flat, actor_log_probs, strict=True):
        response = actor_lp[len(tokens) - len(engine_lp) :]
        gaps += [abs(a - e) for a, e in zip(response, engine_lp, strict=True)]
    if not gaps or not all(math.isfinite(g) for g in gaps):
        return {"weight_sync/probe_logprob_abs_diff/mean": math.inf, "weight_sync/probe_logprob_abs_diff/max": math.inf}
    return {
        "weight_sync/probe_logprob_abs_diff/mean": sum(gaps) / len(gaps),
        "weight_sync/probe_logprob_abs_diff/max": max(gaps),
    }
