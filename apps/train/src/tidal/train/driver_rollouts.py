"""Rollouts the driver generates itself over HTTP: partial rollout, DAPO over-sampling, or a router in front.

The plain path (one batched request per engine, inside each engine's Ray actor) stays in ``cluster.generate``;
these strategies need to see every group as it finishes, so the driver talks to the router or the engine
directly through tidal.rollout.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class DriverRollouts:
    """Per-rollout generation through ``tidal.rollout.generate_partial_rollout`` (carry-over kept between calls)."""

    def __init__(self, job, cluster, train_data, reward_fn, *, tokenizer) -> None:
        """Decide whether this job needs the driver-side path; nothing starts here."""
        rollout = job.rollout
        self.job, self.cluster, self.data, self.reward_fn = job, cluster, train_data, reward_fn
        self.tokenizer = tokenizer
        self.driver_side = bool(cluster.engines) and (
            rollout.partial_rollout or rollout.dynamic_sampling_filter_path is not None or cluster.router is not None
        )
        self.carry: list = []
        self.group_filter = None
        if rollout.dynamic_sampling_filter_path is not None:
            from tidal.rollout import resolve_group_filter

            self.group_filter = resolve_group_filter(rollout.dynamic_sampling_filter_path)

    def carry_state(self) -> list[list[dict[str, Any]]] | None:
        """Partial rollout's unfinished groups as plain data for the checkpoint (None when nothing is carried)."""
        if not self.carry:
            return None
        from tidal.rollout import sample_records

        return [sample_records(group) for group in self.carry]

    def restore_carry(self, state: list[list[dict[str, Any]]] | None) -> None:
        """Resume with the groups ``carry_state`` saved: the next rollout continues them first, as without a stop."""
        if not state:
            return
        if not self.job.rollout.partial_rollout:
            logger.warning(
                "the checkpoint carries %d unfinished partial-rollout group(s) but --partial-rollout is off: dropped",
                len(state),
            )
            return
        from tidal.rollout import samples_from_records

        self.carry = [samples_from_records(group) for group in state]
        logger.info("resumed %d unfinished partial-rollout group(s) from the checkpoint", len(self.carry))

    def generate(self, rollout_id: int) -> tuple[list, dict[str, Any]]:
        """Scored samples of ``rollout_batch_size`` finished groups, and the strategy's metrics."""
        from tidal.rollout import RolloutError, generate_partial_rollout
        from tidal.train.cluster import driver_target

        job = self.job
        wanted = job.batching.rollout_batch_size
        size = job.rollout.over_sampling_batch_size or wanted
        prompts = self.data.batch(rollout_id, size)

        def attempt():
            return generate_partial_rollout(
                driver_target(self.cluster, job),
                [list(p.ids) for p in prompts],
                job.rollout.sampling_params(),
                num_groups=wanted,
                carry_over=self.carry if job.rollout.partial_rollout else (),
                labels=[p.label for p in prompts],
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                reward_fn=self.reward_fn,
                group_filter=self.group_filter,
                mask_offpolicy=job.rollout.mask_offpolicy_in_partial_rollout,
            )

        try:
            result = attempt()
        except RolloutError as e:
            if not job.train.use_fault_tolerance:
                raise
            # The engines live in their Ray actors: restart the dead ones there, then the router (its circuit
            # breaker keeps a restarted engine marked unhealthy), and run the rollout once more from its start.
            logger.warning("rollout %d failed (%s); restarting dead engines and retrying it", rollout_id, e)
            self._restart_dead_engines()
            result = attempt()
        self.carry = list(result.carry_over) if job.rollout.partial_rollout else []
        if len(result.samples) != wanted * job.rollout.n_samples_per_prompt:
            raise RuntimeError(
                f"rollout {rollout_id}: {len(result.samples)} samples for {wanted} groups of "
                f"{job.rollout.n_samples_per_prompt}; raise --over-sampling-batch-size or loosen the group filter"
            )
        return list(result.samples), {k: float(v) for k, v in result.metrics.items()}

    def _restart_dead_engines(self) -> None:
        import ray

        restarted = ray.get([engine.ensure_alive.remote() for engine in self.cluster.engines])
        if self.cluster.router is not None:
            self.cluster.router.restart()
        logger.info("restarted %d engine(s)%s", sum(restarted), " and the router" if self.cluster.router else "")
