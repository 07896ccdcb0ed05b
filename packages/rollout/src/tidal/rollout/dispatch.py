"""Sending a rollout's /generate requests: one per group, bounded concurrency, progress, restart, early stop.

A group is the list of samples of one prompt. A sample whose ``finish_reason`` is "abort" is unfinished: a fresh
one (no response yet) or one cut short by an abort. :func:`run_groups` continues every unfinished sample from
``prompt + response so far`` with the length budget it has left, one HTTP request per group (per distinct
budget; or ``groups_per_request`` groups together), up to ``max_concurrency`` requests in flight, so that SGLang
batches them and the caller sees groups finish one by one. Transient HTTP failures are retried by the client
(see :meth:`SGLangClient.request`); if the engine process dies, or a request fails every retry, the requests it
dropped are sent again after a restart (``max_restarts``); a caller's ``on_group_done`` can end the rollout
early (partial rollout), which aborts the requests still running: they answer with the tokens sampled so far.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
from tidal.rollout.client import SGLangClient
from tidal.rollout.errors import EngineUnavailableError, RolloutError
from tidal.rollout.progress import GenerationProgress
from tidal.rollout.server_process import ManagedServer
from tidal.rollout.types import Sample

logger = logging.getLogger(__name__)

MAX_IDLE_INTERRUPTS = 20
"""Aborts in a row, without a new token, after which a resumed sample's request is an error, not an interruption."""


def fresh_group(
    prompt_ids: Sequence[int], n: int, *, label: Any = None, group_index: int = 0, metadata: Any = None
) -> list[Sample]:
    """``n`` unstarted samples of one prompt (empty responses, ``finish_reason`` "abort")."""
    ids = [int(t) for t in prompt_ids]
    return [
        Sample(
            prompt_ids=ids,
            response_ids=[],
            response_log_probs=[],
            finish_reason="abort",
            label=label,
            group_index=group_index,
            metadata=metadata,
        )
        for _ in range(n)
    ]


def _routed(sample: Sample, out: Mapping[str, Any]) -> Any:
    """The sample's routed experts with an output's appended: the rows of the tokens this request forwarded first.

    The request re-sent ``prompt + response so far``; SGLang answers rows for the whole sequence but its last token,
    so the rows past those the sample holds are the new ones (a resumed sample keeps the routing its earlier tokens
    were sampled with).
    """
    if "routed_experts" not in out:
        return sample.rollout_routed_experts
    routed = out["routed_experts"]
    if routed is None:
        if not out["output_ids"]:
            return sample.rollout_routed_experts
        raise RolloutError(
            "--use-rollout-routing-replay: the engine answered without routed experts; start SGLang with "
            "--enable-return-routed-experts (tidal launches its own engines so)"
        )
    held = sample.rollout_routed_experts
    return routed if held is None else np.concatenate([held, routed[len(held) :].astype(held.dtype)])


def continued(sample: Sample, out: Mapping[str, Any], decode: Callable[[list[int]], str] | None) -> Sample:
    """``sample`` with one engine output appended (its tokens recorded under the output's weight version)."""
    new_ids = out["output_ids"]
    response_ids = [*sample.response_ids, *new_ids]
    mask = sample.response_loss_mask
    versions = None
    if sample.response_ids or sample.response_weight_versions is not None:  # a resumed response may mix versions
        versions = [*sample.token_weight_versions, *[out["weight_version"]] * len(new_ids)]
    return dataclasses.replace(
        sample,
        response_ids=response_ids,
        response_log_probs=[*sample.response_log_probs, *out["output_log_probs"]],
        response_loss_mask=None if mask is None else [*mask, *[1] * len(new_ids)],
        response_weight_versions=versions,
        rollout_routed_experts=_routed(sample, out),
        weight_version=out["weight_version"],
        finish_reason=out["finish_reason"],
        response_text=decode(response_ids) if decode is not None else sample.response_text,
    )


@dataclass(frozen=True, slots=True)
class _Job:
    members: tuple[tuple[int, int], ...]  # (group, sample) of each prompt the request carries
    budget: int | None  # None: no max_new_tokens given, SGLang's default applies

    @property
    def groups(self) -> list[int]:
        return list(dict.fromkeys(g for g, _ in self.members))


def _jobs(groups: Sequence[Sequence[Sample]], g: int, limit: int | None) -> list[_Job]:
    """Requests that continue group ``g``'s unfinished samples (one per remaining budget); marks spent ones."""
    by_budget: dict[int | None, list[int]] = {}
    for k, sample in enumerate(groups[g]):
        if sample.finish_reason == "abort":
            by_budget.setdefault(None if limit is None else limit - len(sample.response_ids), []).append(k)
    jobs = []
    for budget, members in by_budget.items():
        if budget is not None and budget <= 0:  # nothing left to generate: it ends as a length-truncated response
            for k in members:
                groups[g][k] = dataclasses.replace(groups[g][k], finish_reason="length")  # type: ignore[index]
        else:
            jobs.append(_Job(tuple((g, k) for k in members), budget))
    return jobs


def _merged(jobs: list[_Job], groups_per_request: int) -> list[_Job]:
    """Jobs of up to ``groups_per_request`` groups with the same budget merged into one request each."""
    if groups_per_request <= 1:
        return jobs
    by_budget: dict[int | None, list[_Job]] = {}
    for job in jobs:
        by_budget.setdefault(job.budget, []).append(job)
    merged = []
    for budget, same in by_budget.items():
        for i in range(0, len(same), groups_per_request):
            merged.append(_Job(tuple(m for job in same[i : i + groups_per_request] for m in job.members), budget))
    return merged


class _Dispatcher:
    def __init__(
        self,
        target: SGLangClient,
        groups: list[list[Sample]],
        params: Mapping[str, Any],
        *,
        decode: Callable[[list[int]], str] | None,
        progress: GenerationProgress | None,
    ) -> None:
        self.target = target
        self.groups = groups
        self.params = {k: v for k, v in params.items() if k != "n"}
        limit = self.params.get("max_new_tokens")
        self.limit = None if limit is None else int(limit)
        self.decode = decode
        self.progress = progress
        self.open_jobs = [0] * len(groups)
        self.restarts_left = self.max_restarts = 1
        self.idle_aborts: dict[tuple[int, int], int] = {}

    def request(self, job: _Job) -> list[dict[str, Any]]:
        input_ids = [[*self.groups[g][k].prompt_ids, *self.groups[g][k].response_ids] for g, k in job.members]
        params = self.params if job.budget is None else {**self.params, "max_new_tokens": job.budget}
        return self.target.generate(input_ids, params)

    def apply(self, job: _Job, outputs: list[dict[str, Any]], *, resend: bool = False) -> tuple[list[int], list[_Job]]:
        """Record a request's outputs; the groups that finished with it, and the requests that go out again.

        With ``resend``, a sample an abort cut although nobody here asked for it is continued: its group stays open.

        Raises:
            RolloutError: A sample was aborted :data:`MAX_IDLE_INTERRUPTS` times in a row without a new token.
        """
        for (g, k), out in zip(job.members, outputs, strict=True):
            self.groups[g][k] = continued(self.groups[g][k], out, self.decode)
        if self.progress is not None:
            self.progress.update(sum(out["finish_reason"] != "abort" for out in outputs))
        again = self._resent(job, outputs) if resend else []
        done = []
        for g in job.groups:
            self.open_jobs[g] -= 1
            if self.open_jobs[g] == 0 and all(s.finish_reason != "abort" for s in self.groups[g]):
                done.append(g)
        return done, again

    def _resent(self, job: _Job, outputs: list[dict[str, Any]]) -> list[_Job]:
        cut: dict[tuple[int, int | None], list[int]] = {}  # (group, budget left) -> samples
        for (g, k), out in zip(job.members, outputs, strict=True):
            if out["finish_reason"] != "abort":
                continue
            idle = self.idle_aborts.get((g, k), 0) + 1 if not out["output_ids"] else 0
            if idle >= MAX_IDLE_INTERRUPTS:
                raise RolloutError(
                    f"{self.target.describe()}: a request was aborted {idle} times in a row before it produced a "
                    "token: something aborts every request (another client calling /abort_request?)"
                )
            self.idle_aborts[(g, k)] = idle
            left = None if self.limit is None else self.limit - len(self.groups[g][k].response_ids)
            if left is not None and left <= 0:  # cut at its last token: it is a length-truncated response
                self.groups[g][k] = dataclasses.replace(self.groups[g][k], finish_reason="length")
                continue
            cut.setdefault((g, left), []).append(k)
        jobs = [_Job(tuple((g, k) for k in ks), budget) for (g, budget), ks in cut.items()]
        for resent in jobs:
            self.open_jobs[resent.members[0][0]] += 1
        if jobs:
            logger.info("%d sample(s) cut by an abort (a weight update): sent again", sum(len(j.members) for j in jobs))
        return jobs

    def recover(self, error: EngineUnavailableError) -> None:
        """A request failed every retry, or the engine process died: restart it (so no sample is lost), or give up.

        Transient failures never get here (the client retries them); this is the escalation. A target this
        process did not launch (a URL, an external server) cannot be restarted: one-line RolloutError.
        """
        server = self.target
        if not isinstance(server, ManagedServer):
            raise RolloutError(f"{server.describe()} stopped answering during generation: {error}") from error
        state = "died" if not server.is_running() else "is running but stopped answering"
        if self.restarts_left <= 0:
            hint = " (--use-fault-tolerance restarts it)" if self.max_restarts == 0 else ""
            raise server.dead_error(f"{state} during generation ({error}){hint}") from error
        logger.warning("%s %s mid-rollout (%s); restarting it and resending its requests", server.url, state, error)
        self.restarts_left -= 1
        try:
            server.restart()
        except RolloutError as e:
            raise server.dead_error(f"{state} during generation and did not restart: {e}") from e


def run_groups(
    target: SGLangClient,
    groups: list[list[Sample]],
    sampling_params: Mapping[str, Any],
    *,
    max_concurrency: int = 64,
    decode: Callable[[list[int]], str] | None = None,
    progress: GenerationProgress | None = None,
    on_group_done: Callable[[int], bool] | None = None,
    max_restarts: int = 1,
    groups_per_request: int = 1,
    resume_interrupted: bool = False,
) -> bool:
    """Continue every unfinished sample of ``groups`` in place, until all finish or ``on_group_done`` says stop.

    Args:
        target: An engine or router this process launched (restarted if it dies), or any SGLang endpoint.
        groups: Samples per prompt; unfinished ones (``finish_reason == "abort"``) are continued in place.
        sampling_params: SGLang sampling parameters; ``max_new_tokens`` bounds each whole response.
        max_concurrency: Most HTTP requests in flight.
        decode: Token ids -> text for ``response_text``.
        progress: Counts finished samples.
        on_group_done: Called with a group's index when its last sample finishes; True ends the rollout:
            nothing more is sent, the target aborts what still runs, and those samples keep their partial
            responses (``finish_reason`` "abort").
        max_restarts: Restarts of a dead (or unanswering) engine or router allowed in this call before giving up.
        groups_per_request: Groups (of one length budget) sent together in one request: fewer, larger requests
            when nothing needs to see groups finish one by one (each request has a fixed cost on the server;
            bench/RESULTS.md compares the counts).
        resume_interrupted: A sample that comes back aborted although this call did not stop (another caller
            aborted the engine's requests: an interruptible weight update of asynchronous training) is sent again
            at once from where it stopped; SGLang serves it once the update is in, so its later tokens come from
            the new weights (per-token versions say which). Off: it is returned unfinished.

    Returns:
        Whether ``on_group_done`` stopped the rollout early.

    Raises:
        RolloutError: A request failed every retry and no restart is left (one line naming the engine and its
            log file), or (``resume_interrupted``) a sample was aborted :data:`MAX_IDLE_INTERRUPTS` times in a row
            without a new token.
    """
    run = _Dispatcher(target, groups, sampling_params, decode=decode, progress=progress)
    run.restarts_left = run.max_restarts = max_restarts
    jobs = _merged([job for g in range(len(groups)) for job in _jobs(groups, g, run.limit)], groups_per_request)
    for job in jobs:
        for g in job.groups:
            run.open_jobs[g] += 1
    queue: deque[_Job] = deque(jobs)
    stopped = False
    failed: list[_Job] = []
    lost: EngineUnavailableError | None = None
    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(queue))), thread_name_prefix="rollout") as pool:
        inflight: dict[Future, _Job] = {}
        while queue or inflight or lost is not None:
            while queue and not stopped and lost is None and len(inflight) < max_concurrency:
                job = queue.popleft()
                inflight[pool.submit(run.request, job)] = job
            if not inflight:
                if lost is not None:  # every request the dead engine held has come back failed
                    run.recover(lost)
                    queue.extendleft(reversed(failed))
                    failed, lost = [], None
                    continue
                break  # stopped: the jobs still queued stay unfinished
            done, _ = wait(inflight, return_when=FIRST_COMPLETED)
            for future in done:
                job = inflight.pop(future)
                try:
                    outputs = future.result()
                except EngineUnavailableError as e:
                    failed.append(job)
                    lost = e
                    continue
                done, again = run.apply(job, outputs, resend=resume_interrupted and not stopped)
                queue.extend(again)
                for g in done:
                    if on_group_done is not None and not stopped and on_group_done(g):
                        stopped = True
                        target.abort()  # running requests answer now, with what they have
    return stopped
