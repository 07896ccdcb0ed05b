"""Rollouts handed to the trainer, generated ahead of it by weights at most ``--max-staleness`` versions old.

With ``--max-staleness 0`` a rollout is generated when the loop asks for it: the synchronous loop. With K >= 1 a
producer thread generates rollout ``j`` as soon as the engines serve weights of version ``>= j - K`` (the trainer
holds version ``j`` when it trains on rollout ``j``), so rollout ``k + 1`` is generated while the actor trains on
rollout ``k`` (K = 1, slime's one-step-off loop) and, for K > 1, the engines keep a buffer of up to K rollouts
filled. A weight update does not wait for the requests in flight: the engines abort them, load, and resume them
under the new weights (``tidal.rollout.InterruptibleUpdates``, in the engine workers; on the driver-side path and
for external servers the update waits for them instead). Every token records the version that sampled it, so a
sample's staleness at training time is at most K; ``rollout/mixed_version_samples`` counts the resumed ones.

Samples continued from an older rollout (``--partial-rollout`` carry-over) can hold tokens older than that: with
K >= 1 such tokens are masked out of the loss (their sample stays, for its group's advantage) and counted in
``rollout/stale_tokens_masked``; nothing is dropped. Per rollout the buffer reports ``rollout/staleness_max`` and
``rollout/staleness_mean`` (in weight versions, over the tokens the loss uses), ``time/trainer_wait`` (the trainer
waited for this rollout) and ``time/engine_wait`` (the engines waited, between the previous rollout's generation
and this one's: for weights under K >= 1; for training, weight sync and evaluation under K = 0).

A checkpoint waits for a rollout being generated to finish, then saves the buffered rollouts with the carry-over
(``checkpoint_state``), so that a resumed run trains on exactly them (``restore``).
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0


class RolloutBuffer:
    """The rollouts the loop trains on, from the rollout manager; a context manager that stops its producer."""

    def __init__(self, rollouts, *, max_staleness: int, num_rollout: int) -> None:
        """Buffer ``rollouts.generate``'s results (the rollout manager's) for rollouts ``0 .. num_rollout - 1``.

        No thread starts before :meth:`take`. ``max_staleness`` is the job's ``AsyncPlan.max_staleness``.
        """
        self.rollouts = rollouts
        self.max_staleness = max_staleness
        self.num_rollout = num_rollout
        self._ready: dict[int, tuple[list, dict[str, float]]] = {}
        self._cond = threading.Condition()
        self._generating = threading.Lock()  # held while a rollout is generated: a checkpoint waits for it
        self._version = 0  # the newest weight version the engines serve (as the trainer last reported it)
        self._producing: int | None = None  # the rollout the producer generates or waits to generate
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop = False
        self._last_end: float | None = None

    def __enter__(self) -> RolloutBuffer:
        """The buffer itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the producer (a generation in flight ends with the engines, which the cluster stops next)."""
        self.close()

    def close(self) -> None:
        """Stop the producer thread; it is waited for briefly."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                logger.info("the rollout producer is still generating; it ends with the engines")

    def take(self, rollout_id: int, version: int) -> tuple[list, dict[str, float]]:
        """Rollout ``rollout_id``'s samples, for an actor at weight ``version``, and its ``time/*``, staleness metrics.

        Raises:
            Exception: whatever the producer's generation raised (the same exception).
        """
        tick = time.monotonic()
        if self.max_staleness == 0:
            samples, metrics = self._ready.pop(rollout_id, None) or self._generate(rollout_id)
        else:
            samples, metrics = self._wait_for(rollout_id, version)
        metrics = {**metrics, "time/trainer_wait": time.monotonic() - tick}
        if self.max_staleness > 0:
            from tidal.rollout import mask_stale_tokens

            samples, masked = mask_stale_tokens(samples, version - self.max_staleness)
            metrics["rollout/stale_tokens_masked"] = float(masked)
        from tidal.rollout import staleness_metrics

        return samples, metrics | staleness_metrics(samples, version)

    def checkpoint_state(self, timeout: float | None = None) -> tuple[list | None, list | None] | None:
        """``(carry-over, buffered rollouts)`` as plain data, taken together once no rollout is being generated.

        None when a rollout is still being generated after ``timeout`` seconds (None: wait as long as it takes).
        """
        if not self._generating.acquire(timeout=-1 if timeout is None else timeout):
            return None
        try:
            return self._checkpoint_state()
        finally:
            self._generating.release()

    def _checkpoint_state(self) -> tuple[list | None, list | None]:
        from tidal.rollout import sample_records

        with self._cond:
            buffered = [
                {"rollout_id": j, "samples": sample_records(samples), "metrics": metrics}
                for j, (samples, metrics) in sorted(self._ready.items())
            ]
            if buffered:
                logger.info("the checkpoint holds %d buffered rollout(s): %s", len(buffered), sorted(self._ready))
            return self.rollouts.carry_state(), buffered or None

    def restore(self, buffered: list | None, start: int) -> None:
        """Take back the rollouts :meth:`checkpoint_state` saved; those before ``start`` are not trained on (logged)."""
        from tidal.rollout import samples_from_records

        for entry in buffered or []:
            self._ready[int(entry["rollout_id"])] = (samples_from_records(entry["samples"]), dict(entry["metrics"]))
        early = sorted(j for j in self._ready if j < start)
        for j in early:
            del self._ready[j]
        if early:
            logger.warning(
                "--start-rollout-id %d: the checkpoint's buffered rollouts %s are not trained on", start, early
            )
        if self._ready:
            logger.info("resumed %d buffered rollout(s) from the checkpoint: %s", len(self._ready), sorted(self._ready))

    def _generate(self, rollout_id: int) -> tuple[list, dict[str, float]]:
        start = time.monotonic()
        samples, times = self.rollouts.generate(rollout_id)
        times["time/engine_wait"] = 0.0 if self._last_end is None else start - self._last_end
        self._last_end = time.monotonic()
        return samples, times

    def _wait_for(self, rollout_id: int, version: int) -> tuple[list, dict[str, float]]:
        with self._cond:
            self._version = version
            self._cond.notify_all()
            if self._thread is None:
                first = max([rollout_id - 1, *self._ready]) + 1
                self._thread = threading.Thread(
                    target=self._produce, args=(first,), name="rollout-producer", daemon=True
                )
                self._thread.start()
            waited = time.monotonic()
            while rollout_id not in self._ready:
                if self._error is not None:
                    raise self._error
                if not self._cond.wait(timeout=WAIT_LOG_EVERY_S):
                    logger.info(
                        "waiting %.0f s for rollout %d: the engines generate rollout %s",
                        time.monotonic() - waited,
                        rollout_id,
                        self._producing,
                    )
            return self._ready.pop(rollout_id)

    def _produce(self, first: int) -> None:
        try:
            for j in range(first, self.num_rollout):
                with self._cond:
                    self._producing = j
                    while not self._stop and self._version < j - self.max_staleness:
                        self._cond.wait(timeout=WAIT_LOG_EVERY_S)  # the trainer's next take() reports the new version
                    if self._stop:
                        return
                with self._generating:
                    result = self._generate(j)
                with self._cond:
                    self._ready[j] = result
                    self._cond.notify_all()
        except BaseException as e:  # the trainer re-raises it on its next take()
            with self._cond:
                self._error = e
                self._cond.notify_all()
