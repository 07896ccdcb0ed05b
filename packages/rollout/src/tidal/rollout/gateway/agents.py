"""Agent episodes through the gateway (``--agent-function-path``): GRPO groups of episodes, failures recorded.

An agent function is ``async def fn(base_url: str, api_key: str, row: dict) -> float``: it gets the OpenAI base
URL of its own gateway session, the job's key and one dataset row, runs any agent (the official ``openai``
client works unmodified), and returns the episode's reward. ``n_samples_per_prompt`` episodes of one row form a
group. An agent that raises, times out, returns no number or never calls the model fails its episode: it is
counted by reason in the metrics, its traceback goes to the failure log, and its whole group is dropped and
replaced by a group of another prompt, in rounds, as dynamic sampling replaces a group its filter drops. Under
``--partial-rollout`` groups outlive the rollout that started them instead (``partial_agents``).

An episode whose agent rewrote its history (a fork) gives one sample per trajectory, consecutive, each with the
episode's reward and ``Sample.episode`` its index in the group: training counts the episode as one sample.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from tidal.rollout.errors import RolloutError
from tidal.rollout.import_path import load_callable
from tidal.rollout.types import Sample

FLAG = "--agent-function-path"
logger = logging.getLogger(__name__)


class AgentFn(Protocol):
    """Runs one episode against its gateway session and returns the reward."""

    def __call__(self, base_url: str, api_key: str, row: dict[str, Any]) -> Awaitable[float]:
        """``base_url`` is the session's OpenAI base URL, ``api_key`` the job's key, ``row`` the JSONL record."""
        ...


def load_agent_fn(path: str) -> AgentFn:
    """Import an agent function given as ``pkg.module:fn`` (errors name ``--agent-function-path``)."""
    fn = load_callable(path, flag=FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{FLAG} {path!r}: must be 'async def fn(base_url, api_key, row) -> float'")
    return fn


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeResult:
    """One finished episode: its samples (one per trajectory, the final answer's last; none when it failed)."""

    samples: list[Sample]
    reward: float | None = None
    failure: str | None = None
    """``timeout``, ``no_model_call``, ``bad_reward`` or the exception's type name; None when it succeeded."""
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentRollout:
    """A rollout's groups of agent samples (``group_index`` 0..num_groups-1) and its ``rollout/agent/*`` metrics."""

    samples: list[Sample]
    metrics: dict[str, float]


class AgentRunner:
    """Runs agent episodes concurrently through a :class:`~tidal.rollout.gateway.server.Gateway`."""

    def __init__(
        self,
        gateway: Any,
        agent_fn: AgentFn,
        *,
        n_samples_per_prompt: int,
        max_concurrency: int,
        timeout_s: float,
        failure_log: str | Path | None = None,
    ) -> None:
        """``max_concurrency`` episodes at once, each cut after ``timeout_s``; tracebacks go to ``failure_log``."""
        if n_samples_per_prompt < 1 or max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(
                f"n_samples_per_prompt ({n_samples_per_prompt}) and max_concurrency ({max_concurrency}) must be "
                f">= 1 and timeout_s ({timeout_s}) > 0"
            )
        self.gateway, self.agent_fn = gateway, agent_fn
        self._loop: asyncio.Runner | None = None
        self.n, self.max_concurrency, self.timeout_s = n_samples_per_prompt, max_concurrency, timeout_s
        self.failure_log = Path(failure_log) if failure_log is not None else None

    def _log_failure(self, row: Mapping[str, Any], reason: str, detail: str) -> None:
        logger.warning("agent episode failed (%s): %s", reason, detail.strip().splitlines()[-1] if detail else "")
        if self.failure_log is None:
            return
        self.failure_log.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with self.failure_log.open("a") as f:
            f.write(f"--- {stamp} {reason} row={str(dict(row))[:300]}\n{detail.rstrip()}\n")

    async def episode(self, row: Mapping[str, Any], label: Any, limit: asyncio.Semaphore) -> EpisodeResult:
        """One episode in a new gateway session; never raises (a failure is the result's ``failure``)."""
        async with limit:
            sid = self.gateway.open_session()
            reason, detail, reward = None, "", None
            try:
                value = await asyncio.wait_for(
                    self.agent_fn(self.gateway.session_url(sid), self.gateway.api_key, dict(row)), self.timeout_s
                )
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    reason, detail = "bad_reward", f"the agent returned {value!r}, not a finite number"
                else:
                    reward = float(value)
            except TimeoutError:
                reason, detail = "timeout", f"the agent ran past --agent-timeout-s {self.timeout_s:g}"
            except Exception as e:  # the agent's own code: anything may be raised
                reason, detail = type(e).__name__, traceback.format_exc()
            finally:
                session = self.gateway.close_session(sid)
        episode = session.episode
        if reason is None and episode.last is None:
            reason, detail = "no_model_call", "the agent returned without calling the model"
        if reason is not None:
            self._log_failure(row, reason, detail)
            return EpisodeResult(samples=[], failure=reason, metrics=episode.metrics())
        samples = episode.samples(reward=reward, label=label)  # the final answer's trajectory last
        return EpisodeResult(samples=samples, reward=reward, metrics=episode.metrics())

    async def group(self, row: Mapping[str, Any], label: Any, limit: asyncio.Semaphore) -> list[EpisodeResult]:
        """``n_samples_per_prompt`` episodes of one row, each taking a slot of ``limit`` while it runs."""
        return list(await asyncio.gather(*(self.episode(row, label, limit) for _ in range(self.n))))

    def run_groups(self, rows: Sequence[Mapping[str, Any]], labels: Sequence[Any]) -> list[list[EpisodeResult]]:
        """``n_samples_per_prompt`` episodes of each row, all at once (bounded); the results group by row."""

        async def run() -> list[list[EpisodeResult]]:
            limit = asyncio.Semaphore(self.max_concurrency)
            return await asyncio.gather(
                *(self.group(row, label, limit) for row, label in zip(rows, labels, strict=True))
            )

        if self._loop is None:
            self._loop = asyncio.Runner()
        return self._loop.run(run())

    def close(self) -> None:
        """Close the event loop every rollout's episodes ran on (idempotent).

        One loop serves the runner's whole life, so an agent's clients made in one rollout and never closed (an
        ``AsyncOpenAI`` per episode, the common way) are cleaned up on a loop that is still open, not on a closed one.
        """
        if self._loop is not None:
            self._loop.close()
            self._loop = None


class GroupTally:
    """A rollout's count of the agent groups it looked at: kept, dropped (a failed episode, the filter), why."""

    def __init__(self, group_filter: Callable[[Sequence[Sample]], bool] | None = None) -> None:
        """Count groups; ``group_filter`` (dynamic sampling) sees one sample per episode, its final answer's."""
        self.group_filter = group_filter
        self.failures: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self.looked_at = self.filtered = self.kept = 0

    def add(self, group: Sequence[EpisodeResult]) -> list[Sample] | None:
        """The group's samples (``Sample.episode`` set) when it is kept; None when it is dropped."""
        self.looked_at += 1
        for result in group:
            self.totals.update({**result.metrics, "episodes": 1})
            if result.failure is not None:
                self.failures[result.failure] += 1
        if any(r.failure is not None for r in group):
            return None
        if self.group_filter is not None and not self.group_filter([r.samples[-1] for r in group]):
            self.filtered += 1
            return None
        self.kept += 1
        return [replace(s, episode=e) for e, r in enumerate(group) for s in r.samples]

    def short(self, num_groups: int, rounds: int) -> RolloutError:
        """The one-line error of a rollout still short of ``num_groups`` kept groups after ``rounds`` rounds."""
        return RolloutError(
            f"agent rollout kept {self.kept} of {num_groups} groups after {rounds} rounds ({self.looked_at} groups "
            f"run, failed episodes by reason: {dict(self.failures) or 'none'}, {self.filtered} groups dropped by the "
            "filter): see the agent failure log, raise --agent-timeout-s or --dynamic-sampling-max-rounds"
        )

    def metrics(self, *, rounds: int, surplus: int, samples: int, episodes_wanted: int) -> dict[str, float]:
        """``rollout/agent/*`` of the groups looked at; ``surplus``: kept groups beyond the batch."""
        episodes = max(self.totals["episodes"], 1)
        metrics = {
            "rollout/agent/episodes": float(self.totals["episodes"]),
            "rollout/agent/failed": float(sum(self.failures.values())),
            "rollout/agent/rounds": float(rounds),
            "rollout/agent/groups_dropped": float(self.looked_at - self.kept),
            "rollout/agent/groups_surplus": float(surplus),
            "rollout/agent/turns/mean": self.totals["turns"] / episodes,
            "rollout/agent/forks/mean": self.totals["forks"] / episodes,
            "rollout/agent/tokens/mean": self.totals["tokens"] / episodes,
            "rollout/agent/samples_per_episode": samples / max(episodes_wanted, 1),
        }
        return metrics | {f"rollout/agent/failed/{reason}": float(count) for reason, count in self.failures.items()}


def agent_rollout(
    runner: AgentRunner,
    rows_of_round: Callable[[int], Sequence[tuple[Mapping[str, Any], Any]]],
    *,
    num_groups: int,
    max_rounds: int,
    group_filter: Callable[[Sequence[Sample]], bool] | None = None,
) -> AgentRollout:
    """``num_groups`` complete groups: rounds of ``rows_of_round(r)`` (``(row, label)``; r = 1, 2, ...) until full.

    A group with a failed episode is dropped (and so is one ``group_filter`` rejects, under dynamic sampling).

    Raises:
        RolloutError: Still short after ``max_rounds`` rounds (one line: counts, failure reasons, options).
    """
    tally = GroupTally(group_filter)
    kept: list[list[Sample]] = []
    rounds = 0
    while len(kept) < num_groups:
        if rounds == max_rounds:
            raise tally.short(num_groups, rounds)
        rounds += 1
        pairs = list(rows_of_round(rounds))
        for group in runner.run_groups([row for row, _ in pairs], [label for _, label in pairs]):
            samples = tally.add(group)
            if samples is not None:
                kept.append(samples)
    samples = [replace(s, group_index=i) for i, group in enumerate(kept[:num_groups]) for s in group]
    metrics = tally.metrics(
        rounds=rounds, surplus=len(kept) - num_groups, samples=len(samples), episodes_wanted=num_groups * runner.n
    )
    return AgentRollout(samples=samples, metrics=metrics)
