"""BatchingConfig: how a rollout becomes optimizer steps and micro-batches. Standard library only."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tidal.batching.arithmetic import BatchArithmetic, resolve_batch_arithmetic

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchingConfig:
    """Batch sizes and micro-batching (slime's flag names, dashed, in the messages)."""

    rollout_batch_size: int
    """Prompts per rollout."""
    n_samples_per_prompt: int = field(default=1, metadata={"flag": None})
    """Samples generated per prompt (--n-samples-per-prompt)."""
    global_batch_size: int | None = None
    """Samples per optimizer step; derived from --num-steps-per-rollout when None."""
    num_steps_per_rollout: int | None = None
    """Optimizer steps per rollout; derived, or 1, when None."""
    use_dynamic_batch_size: bool = field(default=False, metadata={"negatable": True})
    """Pack micro-batches up to --max-tokens-per-gpu tokens instead of a fixed count."""
    max_tokens_per_gpu: int | None = field(default=None, metadata={"auto": True})
    """Token budget of one micro-batch on one GPU, with dynamic batch size; `auto` (train): the budget of the fastest
    configuration the memory plan says fits the GPU."""
    log_probs_max_tokens_per_gpu: int | None = field(default=None, metadata={"auto": True})
    """Token budget of one micro-batch of the forward-only passes (old and reference log-probs, critic values) on one
    GPU, with dynamic batch size: they keep no activations for backward, so they fit more; None: they run on the
    training micro-batches (--max-tokens-per-gpu); `auto` (train): the largest the memory plan says fits."""
    micro_batch_size: int | None = None
    """Sequences per micro-batch without dynamic batch size; 1 when None."""
    pad_to_multiple_of: int = 1
    """Pad each micro-batch's token count to a multiple of this for kernel alignment."""
    context_parallel_size: int = field(default=1, metadata={"flag": None})
    """Context-parallel size of the trainer: each GPU holds 1/CP of every sequence, so a micro-batch holds
    --max-tokens-per-gpu x CP tokens of whole sequences (the app copies it from --context-parallel-size)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-tokens-per-gpu", self.max_tokens_per_gpu),
            ("--log-probs-max-tokens-per-gpu", self.log_probs_max_tokens_per_gpu),
            ("--micro-batch-size", self.micro_batch_size),
            ("--pad-to-multiple-of", self.pad_to_multiple_of),
            ("--context-parallel-size", self.context_parallel_size),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise ValueError(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu (e.g. --max-tokens-per-gpu 16384), got none"
            )
        if self.use_dynamic_batch_size and self.micro_batch_size is not None:
            logger.warning("--micro-batch-size %d has no effect with --use-dynamic-batch-size", self.micro_batch_size)
        if not self.use_dynamic_batch_size and self.max_tokens_per_gpu is not None:
            logger.warning(
                "--max-tokens-per-gpu %d has no effect without --use-dynamic-batch-size", self.max_tokens_per_gpu
            )
        if not self.use_dynamic_batch_size and self.log_probs_max_tokens_per_gpu is not None:
            logger.warning(
                "--log-probs-max-tokens-per-gpu %d has no effect without --use-dynamic-batch-size",
                self.log_probs_max_tokens_per_gpu,
            )
        # Checks everything that does not depend on the data-parallel size (raises ValueError with the fix).
        self.resolve(dp_size=1)

    @property
    def micro_batch_token_budget(self) -> int | None:
        """Tokens of whole sequences one micro-batch may hold with dynamic batch size (None without it).

        ``--max-tokens-per-gpu`` aligned down to ``--pad-to-multiple-of``, times the context-parallel size: the
        budget the micro-batch planner uses.
        """
        if not self.use_dynamic_batch_size or self.max_tokens_per_gpu is None:
            return None
        pad = self.pad_to_multiple_of
        return self.max_tokens_per_gpu // pad * pad * self.context_parallel_size

    @property
    def log_probs_token_budget(self) -> int | None:
        """The forward-only passes' own :attr:`micro_batch_token_budget` (None: they use the training micro-batches).

        ``--log-probs-max-tokens-per-gpu`` with dynamic batch size, aligned and times the context-parallel size alike.
        """
        if not self.use_dynamic_batch_size or self.log_probs_max_tokens_per_gpu is None:
            return None
        pad = self.pad_to_multiple_of
        return self.log_probs_max_tokens_per_gpu // pad * pad * self.context_parallel_size

    def resolve(self, *, dp_size: int) -> BatchArithmetic:
        """Resolve global batch size and steps per rollout for ``dp_size`` data-parallel ranks.

        Raises:
            ValueError: naming the flags and the fix when the numbers are inconsistent or do not divide.
        """
        return resolve_batch_arithmetic(
            rollout_batch_size=self.rollout_batch_size,
            n_samples_per_prompt=self.n_samples_per_prompt,
            global_batch_size=self.global_batch_size,
            num_steps_per_rollout=self.num_steps_per_rollout,
            dp_size=dp_size,
        )
