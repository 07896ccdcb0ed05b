"""Batch arithmetic with slime's semantics: rollout size, global batch size, optimizer steps per rollout.

One rollout holds ``rollout_batch_size * n_samples_per_prompt`` samples. It is trained on in
``num_steps_per_rollout`` optimizer steps of ``global_batch_size`` samples each, so either of the two may be given
and the other follows; each global batch is then split evenly over the data-parallel ranks. Standard library only,
so that the command line can validate before importing torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchArithmetic:
    """Resolved batch sizes (a plan object: derived values never go back into the config)."""

    rollout_size: int
    """Samples per rollout (``rollout_batch_size * n_samples_per_prompt``)."""
    global_batch_size: int
    """Samples per optimizer step, over all data-parallel ranks."""
    num_steps_per_rollout: int
    """Optimizer steps per rollout."""
    dp_size: int
    """Data-parallel size the numbers were checked against."""
    samples_per_rank: int
    """Samples each data-parallel rank trains on per optimizer step."""

    def step_slices(self) -> list[range]:
        """Sample indices (into the rollout's sample list) of each optimizer step's global batch, in order."""
        gbs = self.global_batch_size
        return [range(k * gbs, (k + 1) * gbs) for k in range(self.num_steps_per_rollout)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def resolve_batch_arithmetic(
    *,
    rollout_batch_size: int,
    n_samples_per_prompt: int,
    global_batch_size: int | None = None,
    num_steps_per_rollout: int | None = None,
    dp_size: int = 1,
) -> BatchArithmetic:
    """Resolve and check global batch size and steps per rollout (slime semantics).

    Args:
        rollout_batch_size: prompts per rollout (``--rollout-batch-size``).
        n_samples_per_prompt: samples per prompt (``--n-samples-per-prompt``).
        global_batch_size: samples per optimizer step (``--global-batch-size``); derived when None.
        num_steps_per_rollout: optimizer steps per rollout (``--num-steps-per-rollout``); derived when None,
            and 1 when both are None.
        dp_size: data-parallel size; every global batch must split evenly over it.

    Returns:
        The resolved numbers.

    Raises:
        ValueError: naming the flags, the numbers and the fix, when the numbers are inconsistent or do not divide.
    """
    _check_positive("--rollout-batch-size", rollout_batch_size)
    _check_positive("--n-samples-per-prompt", n_samples_per_prompt)
    _check_positive("--global-batch-size", global_batch_size)
    _check_positive("--num-steps-per-rollout", num_steps_per_rollout)
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    rollout = rollout_batch_size * n_samples_per_prompt
    what = (
        f"--rollout-batch-size {rollout_batch_size} × --n-samples-per-prompt {n_samples_per_prompt} "
        f"= {rollout} samples per rollout"
    )
    if global_batch_size is None:
        steps = num_steps_per_rollout or 1
        if rollout % steps:
            raise ValueError(
                f"--num-steps-per-rollout {steps} does not divide the rollout: {what}; "
                f"use a --num-steps-per-rollout that divides {rollout} (one of {_divisors(rollout)[:12]}) "
                "or change --rollout-batch-size / --n-samples-per-prompt"
            )
        gbs = rollout // steps
    else:
        gbs = global_batch_size
        if rollout % gbs:
            raise ValueError(
                f"--global-batch-size {gbs} does not divide the rollout: {what}; use a --global-batch-size that "
                f"divides {rollout} (one of {_divisors(rollout)[:12]}), or set --num-steps-per-rollout instead"
            )
        steps = rollout // gbs
        if num_steps_per_rollout is not None and num_steps_per_rollout != steps:
            raise ValueError(
                f"--global-batch-size {gbs} and --num-steps-per-rollout {num_steps_per_rollout} disagree: {what}, "
                f"and {rollout} // {gbs} = {steps} steps; set only one of the two flags "
                f"(or --num-steps-per-rollout {steps}, or --global-batch-size {rollout // num_steps_per_rollout})"
            )
    if gbs % dp_size:
        raise ValueError(
            f"--global-batch-size {gbs} is not divisible by the data-parallel size {dp_size} ({what}, "
            f"{steps} step(s) per rollout); choose --global-batch-size / --num-steps-per-rollout so that each "
            f"step's samples split evenly over {dp_size} ranks (e.g. a multiple of {dp_size}), or change "
            "--rollout-batch-size / --n-samples-per-prompt"
        )
    return BatchArithmetic(
        rollout_size=rollout,
        global_batch_size=gbs,
        num_steps_per_rollout=steps,
        dp_size=dp_size,
        samples_per_rank=gbs // dp_size,
    )
