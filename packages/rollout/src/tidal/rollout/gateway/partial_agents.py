"""Partial rollout of agent groups (``--partial-rollout`` with ``--agent-function-path``): groups outlive a rollout.

An agent's episode is the user's coroutine: it cannot be cut and resumed token by token from outside. So a group
still running when a rollout's batch is full keeps running in the background, in an event loop of its own
(:class:`AgentGroupPool`), through training and weight syncs, and the next rollout takes the groups that finished
first (in the order they finished), before any group of its own prompts; finished groups beyond a batch wait for
the next rollout the same way. A carried group's calls made after a weight sync sample with the new weights, and
each token records its version (``Sample.response_weight_versions``): ``--mask-offpolicy-in-partial-rollout``
masks the tokens older weights sampled, and the staleness metrics count them, as for a resumed plain response.

The pool's state is plain data (:meth:`AgentGroupPool.state`, what a checkpoint holds): each finished group's
episodes (samples, reward, failure) and the row of each group still running or waiting for a slot. A restored pool
(:meth:`AgentGroupPool.restore`) takes the finished groups as they were and runs the others again from the start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tidal.rollout.debug_data import sample_records, samples_from_records
from tidal.rollout.errors import RolloutError
from tidal.rollout.gateway.agents import AgentRollout, AgentRunner, EpisodeResult, GroupTally
from tidal.rollout.partial_rollout import mask_offpolicy_tokens, offpolicy_token_frac
from tidal.rollout.types import Sample

logger = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0


@dataclass(kw_only=True, slots=True)
class AgentGroup:
    """One row's group of episodes in the pool."""

    row: dict[str, Any]
    """The dataset row every episode of the group receives."""
    label: Any
    """The row's reference answer (each sample's ``label``)."""
    started_in: int
    """The rollout whose prompts (or replacement rounds) the row came from."""
    results: list[EpisodeResult] | None = None
    """Its episodes once all finished; None while any runs (or waits for a slot)."""

    def record(self) -> dict[str, Any]:
        """The group as plain JSON data (a running group: its row only)."""
        out: dict[str, Any] = {"row": self.row, "label": self.label, "started_in": self.started_in}
        if self.results is not None:
            out["episodes"] = [
                {"samples": sample_records(r.samples), "reward": r.reward, "failure": r.failure,
                 "metrics": dict(r.metrics)}
                for r in self.results
            ]  # fmt: skip
        return out


def _episode(record: Mapping[str, Any]) -> EpisodeResult:
    return EpisodeResult(
        samples=samples_from_records(record["samples"]),
        reward=record["reward"],
        failure=record["failure"],
        metrics=dict(record["metrics"]),
    )


class AgentGroupPool:
    """Groups of agent episodes running in a background event loop, collected in the order they finish.

    At most the runner's ``max_concurrency`` episodes run at once over every group of the pool, the earliest
    submitted first. :meth:`close` cancels the episodes still running.
    """

    def __init__(self, runner: AgentRunner) -> None:
        """Start the pool's event loop thread; episodes run on ``runner`` (its gateway, agent and bounds)."""
        self.runner = runner
        self._cond = threading.Condition()
        self._running: list[AgentGroup] = []
        self._finished: deque[AgentGroup] = deque()
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._limit = asyncio.Semaphore(runner.max_concurrency)
        self._thread = threading.Thread(target=self._loop.run_forever, name="tidal-agent-groups", daemon=True)
        self._thread.start()

    def submit(self, row: Mapping[str, Any], label: Any, *, started_in: int) -> None:
        """Start ``row``'s group (its episodes wait for free slots behind the groups submitted before)."""
        group = AgentGroup(row=dict(row), label=label, started_in=started_in)
        with self._cond:
            self._running.append(group)
        asyncio.run_coroutine_threadsafe(self._run(group), self._loop)

    async def _run(self, group: AgentGroup) -> None:
        try:
            results = await self.runner.group(group.row, group.label, self._limit)
        except Exception as e:  # AgentRunner.episode records the agent's own errors: this is tidal's
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        with self._cond:
            group.results = results
            self._running.remove(group)
            self._finished.append(group)
            self._cond.notify_all()

    def counts(self) -> tuple[int, int]:
        """``(running, finished)``: groups running or waiting for a slot, and finished groups not taken yet."""
        with self._cond:
            return len(self._running), len(self._finished)

    def next_finished(self) -> AgentGroup | None:
        """The earliest finished group not taken yet, waiting for one while any runs; None when none is left.

        Raises:
            RolloutError: A group could not be run (not an agent's failure: those are its episodes' results).
        """
        waited = time.monotonic()
        with self._cond:
            while not self._finished and self._running and self._error is None:
                if not self._cond.wait(timeout=WAIT_LOG_EVERY_S):
                    logger.info("waiting %.0f s for agent groups: %d running, the earliest started in rollout %d",
                                time.monotonic() - waited, len(self._running), self._running[0].started_in)  # fmt: skip
            if self._error is not None:
                raise RolloutError(f"running an agent group failed: {self._error!r}") from self._error
            return self._finished.popleft() if self._finished else None

    def state(self) -> list[dict[str, Any]]:
        """Every group as plain data: the finished ones (in finish order) with their episodes, then the running."""
        with self._cond:
            return [g.record() for g in (*self._finished, *self._running)]

    def restore(self, state: Sequence[Mapping[str, Any]]) -> None:
        """Take back what :meth:`state` gave: finished groups as they were, the others started again from scratch."""
        for record in state:
            if "episodes" not in record:
                self.submit(record["row"], record["label"], started_in=int(record["started_in"]))
                continue
            results = [_episode(e) for e in record["episodes"]]
            group = AgentGroup(row=dict(record["row"]), label=record["label"], started_in=int(record["started_in"]),
                               results=results)  # fmt: skip
            with self._cond:
                self._finished.append(group)

    def close(self) -> None:
        """Cancel the episodes still running (their sessions close) and stop the event loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        with self._cond:
            if self._running:
                logger.info("%d agent group(s) still running at the end were cancelled", len(self._running))
            self._running.clear()


def partial_agent_rollout(
    pool: AgentGroupPool,
    rows_of_round: Callable[[int], Sequence[tuple[Mapping[str, Any], Any]]],
    *,
    rollout_id: int,
    num_groups: int,
    max_rounds: int,
    group_filter: Callable[[Sequence[Sample]], bool] | None = None,
    current_version: Callable[[], str | None] | None = None,
    mask_offpolicy: bool = False,
) -> AgentRollout:
    """``num_groups`` kept groups: those the pool finished first, carried ones included; the rest stays in the pool.

    Round 1 submits ``rows_of_round(1)`` behind the groups already in the pool; groups are looked at in the order
    they finish (a group with a failed episode, or one ``group_filter`` rejects, is dropped and counted) until
    ``num_groups`` are kept. When every group in the pool is done and the batch is still short, round r submits
    ``rows_of_round(r)``, up to ``max_rounds`` rounds. The groups still running then, and the finished groups not
    looked at, stay in the pool for the next rollout.

    Metrics: ``rollout/agent/*`` of the groups looked at (``groups_surplus``: finished groups left for the next
    rollout, ``groups_in_flight``: groups still running, ``carried_groups_taken``: groups of the batch that an
    earlier rollout started) and ``rollout/partial/{resumed_groups,carried_over_groups,offpolicy_token_frac}`` as
    plain partial rollout reports them. ``current_version()`` is the engines' weight version: with
    ``mask_offpolicy`` tokens sampled by weights older than its value at the start and at the end get loss mask 0.

    Raises:
        RolloutError: Still short after ``max_rounds`` rounds (one line: counts, failure reasons, options).
    """
    tally = GroupTally(group_filter)
    began = current_version() if current_version is not None else None  # an update may land while this runs
    resumed = sum(pool.counts())
    kept: list[tuple[AgentGroup, list[Sample]]] = []
    rounds = 1
    for row, label in rows_of_round(1):
        pool.submit(row, label, started_in=rollout_id)
    while len(kept) < num_groups:
        group = pool.next_finished()
        if group is None:  # every group is done and the batch is short: a round of replacement prompts
            if rounds == max_rounds:
                raise tally.short(num_groups, rounds)
            rounds += 1
            for row, label in rows_of_round(rounds):
                pool.submit(row, label, started_in=rollout_id)
            continue
        assert group.results is not None
        samples = tally.add(group.results)
        if samples is not None:
            kept.append((group, samples))
    running, finished = pool.counts()
    samples = [replace(s, group_index=i) for i, (_, group) in enumerate(kept) for s in group]
    metrics = tally.metrics(rounds=rounds, surplus=finished, samples=len(samples),
                            episodes_wanted=num_groups * pool.runner.n)  # fmt: skip
    current = current_version() if current_version is not None else None
    metrics |= {
        "rollout/agent/groups_in_flight": float(running),
        "rollout/agent/carried_groups_taken": float(sum(g.started_in != rollout_id for g, _ in kept)),
        "rollout/partial/resumed_groups": float(resumed),
        "rollout/partial/carried_over_groups": float(running + finished),
        "rollout/partial/offpolicy_token_frac": offpolicy_token_frac(samples, current, since=began),
    }
    if mask_offpolicy:
        samples = mask_offpolicy_tokens(samples, current, since=began)
    logger.info("agent partial rollout: %d/%d groups kept (%d of earlier rollouts), %d running and %d finished "
                "carried over", len(kept), num_groups, metrics["rollout/agent/carried_groups_taken"], running,
                finished)  # fmt: skip
    return AgentRollout(samples=samples, metrics=metrics)


class CallHold:
    """Engine calls a holder can stop: while held, a call waits; :meth:`hold` waits for the calls in flight.

    The gateway's engines are wrapped (:meth:`wrap`) when groups run on while the actor trains and the engines give
    it their memory (``--offload-rollout``): the calls made then wait until the engines are back.
    """

    def __init__(self, *, timeout_s: float) -> None:
        """A call waits at most ``timeout_s`` to go out, and :meth:`hold` as long for the calls in flight."""
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._held = False
        self._in_flight = 0

    def hold(self) -> None:
        """Stop new calls and wait for those in flight.

        Raises:
            RolloutError: A call still runs after ``timeout_s`` (the hold stays off).
        """
        with self._cond:
            self._held = True
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout=self.timeout_s):
                self._held = False
                self._cond.notify_all()
                raise RolloutError(f"{self._in_flight} agent call(s) still ran {self.timeout_s:.0f} s after the "
                                   "engines were to release their memory")  # fmt: skip

    def release(self) -> None:
        """Let the held calls go out."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One engine call: it waits while held (at most ``timeout_s``, then RolloutError), and counts in flight."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._held, timeout=self.timeout_s):
                raise RolloutError(f"an agent call waited {self.timeout_s:.0f} s for the engines to be back")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def wrap(self, engine: Any) -> HeldEngine:
        """``engine`` (a gateway ``Generator``) whose ``generate`` calls go through this hold."""
        return HeldEngine(engine, self)


class HeldEngine:
    """An engine client whose ``generate`` waits while its :class:`CallHold` is held; the rest passes through."""

    def __init__(self, engine: Any, hold: CallHold) -> None:
        """Wrap ``engine``; its ``url`` stays the same (the gateway pins sessions by it)."""
        self.engine, self.hold, self.url = engine, hold, engine.url

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        """The engine's ``generate``, once the hold lets it go out."""
        with self.hold.call():
            return self.engine.generate(input_ids, sampling_params)

    def generate_stream(self, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The engine's ``generate_stream``, once the hold lets it go out (held as one call until it ends)."""
        with self.hold.call():
            yield from self.engine.generate_stream(input_ids, sampling_params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
