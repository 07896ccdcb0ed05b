"""Partial rollout: stop once the batch is full, keep the cut responses, resume them in the next rollout.

:func:`generate_partial_rollout` resumes the groups carried over from the previous call first, then
starts fresh prompts, and as soon as ``num_groups`` groups are finished (and kept, under dynamic
sampling) it aborts the requests still running (SGLang ``/abort_request``). Their samples come back with
the tokens sampled so far and are handed back as ``carry_over`` for the next call, which continues them,
possibly under newer weights: ``Sample.response_weight_versions`` records the version of every token,
and ``--mask-offpolicy-in-partial-rollout`` (:func:`mask_offpolicy_tokens`) zeroes the loss mask of the
tokens sampled by older weights.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.rollout.client import SGLangClient
from tidal.rollout.custom_generate import FLAG, GenerateFn, run_generate_fn_groups
from tidal.rollout.dispatch import fresh_group, run_groups
from tidal.rollout.errors import RolloutError
from tidal.rollout.progress import DEFAULT_LOG_EVERY_S, GenerationProgress
from tidal.rollout.rewards import RewardFn, score_samples
from tidal.rollout.types import Sample

logger = logging.getLogger(__name__)


def resume_samples(
    engine: SGLangClient,
    samples: Sequence[Sample],
    sampling_params: Mapping[str, Any],
    *,
    decode: Callable[[list[int]], str] | None = None,
) -> list[Sample]:
    """Continue every aborted sample from where it stopped; other samples pass through unchanged.

    Each aborted sample is resumed from ``prompt + response so far``, with ``max_new_tokens`` reduced by
    the tokens it already has, so that a resumed response obeys the same length limit as one generated in
    one go (with no budget left it becomes "length" without a request).

    Args:
        engine: A running engine or router (its current weights sample the new tokens).
        samples: Samples of a previous rollout; those with ``finish_reason == "abort"`` are resumed.
        sampling_params: The rollout's sampling parameters (``n`` is ignored: one continuation each).
        decode: Token ids -> text, to refresh ``response_text`` of resumed samples.

    Returns:
        The samples in the same order; resumed ones carry per-token ``response_weight_versions``.
    """
    groups = [[s] for s in samples]
    if any(s.finish_reason == "abort" for s in samples):
        run_groups(engine, groups, sampling_params, decode=decode)
    else:  # nothing to send: no engine needed
        return list(samples)
    return [
        original if original.finish_reason != "abort" else group[0]
        for original, group in zip(samples, groups, strict=True)
    ]


def mask_offpolicy_tokens(
    samples: Sequence[Sample], current_version: str | None, *, since: str | None = None
) -> list[Sample]:
    """``--mask-offpolicy-in-partial-rollout``: loss mask 0 on response tokens older weights sampled.

    Kept: the tokens of ``current_version`` and of ``since``, the version the engines had when the rollout began
    (under ``--max-staleness`` a weight update may land while a rollout generates: what it sampled before that
    update is this rollout's own, not a resumed response's). Samples whose tokens are all kept are returned as they
    are.
    """
    keep = {current_version, since}  # a token without a version (None) carries no loss either way
    out = []
    for s in samples:
        versions = s.token_weight_versions
        if all(v in keep for v in versions):
            out.append(s)
            continue
        mask = [1] * len(s.response_ids) if s.response_loss_mask is None else list(s.response_loss_mask)
        mask = [m if v in keep else 0 for m, v in zip(mask, versions, strict=True)]
        out.append(dataclasses.replace(s, response_loss_mask=mask))
    return out


class UpdateGate:
    """Weight updates announced by :meth:`begin` and :meth:`end`: a request an update cut waits here to resume.

    Shared by the thread that runs the update and those that generate (asynchronous training, ``--max-staleness``):
    a generation whose request came back aborted calls :meth:`wait_idle`, so its next tokens come from the new
    weights rather than racing the update with the old ones.
    """

    def __init__(self, *, timeout_s: float = 600.0) -> None:
        """A gate with no update running; :meth:`wait_idle` waits at most ``timeout_s`` by default."""
        self.timeout_s = timeout_s
        self._updating = 0
        self._cond = threading.Condition()

    def begin(self) -> None:
        """An update starts (every :meth:`begin` needs its :meth:`end`)."""
        with self._cond:
            self._updating += 1

    def end(self) -> None:
        """The update :meth:`begin` announced is in: requests waiting in :meth:`wait_idle` go on."""
        with self._cond:
            self._updating = max(0, self._updating - 1)
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no update runs (at most ``timeout_s``, default the gate's); False when one still runs."""
        with self._cond:
            return self._cond.wait_for(lambda: self._updating == 0, timeout=timeout_s or self.timeout_s)


class InterruptibleUpdates(UpdateGate):
    """Weight updates that do not wait for the requests in flight: they are aborted, and resumed under the new weights.

    One per engine, shared by the threads that generate on it and the one that loads its weights (asynchronous
    training, ``--max-staleness``). :meth:`update` aborts the engine's requests, then loads; :meth:`generate` runs a
    generation and continues every sample an update cut, once that update is done, so the samples it returns are
    finished and record per token which weights sampled it (``Sample.response_weight_versions``).
    """

    def __init__(self, engine: SGLangClient, *, timeout_s: float = 600.0) -> None:
        """Interrupt ``engine``'s requests on update; a generation waits at most ``timeout_s`` for an update."""
        super().__init__(timeout_s=timeout_s)
        self.engine = engine
        self.interrupted_samples = 0
        """Samples cut by an update and resumed, so far."""

    def update(self, load: Callable[[], None]) -> None:
        """Abort the requests in flight, then ``load()`` the new weights (e.g. ``engine.update_weights_from_disk``)."""
        self.begin()
        try:
            load()
        finally:
            self.end()

    def begin(self) -> None:
        """An update starts elsewhere (e.g. a broadcast from the trainer): abort the requests in flight; they wait.

        Every :meth:`begin` needs its :meth:`end`; the cut samples resume after the last one.
        """
        super().begin()  # before the abort: a generation that sees its samples cut waits for this update
        try:
            self.engine.abort()
        except BaseException:
            self.end()
            raise

    def generate(
        self,
        generate: Callable[[], list[Sample]],
        sampling_params: Mapping[str, Any],
        *,
        decode: Callable[[list[int]], str] | None = None,
    ) -> list[Sample]:
        """``generate()``'s samples, those an update aborted resumed after it, under its weights.

        Raises:
            RolloutError: An update did not finish within ``timeout_s``.
        """
        samples = generate()
        while any(s.finish_reason == "abort" for s in samples):
            if not self.wait_idle():
                raise RolloutError(
                    f"{self.engine.url}: a weight update did not finish in {self.timeout_s:.0f} s while "
                    f"{sum(s.finish_reason == 'abort' for s in samples)} interrupted sample(s) waited to resume"
                )
            self.interrupted_samples += sum(s.finish_reason == "abort" for s in samples)
            samples = resume_samples(self.engine, samples, sampling_params, decode=decode)
        return samples


@dataclass(frozen=True, kw_only=True, slots=True)
class PartialRolloutResult:
    """One rollout's finished groups, and what the next rollout must resume."""

    samples: list[Sample]
    """The finished groups, prompt-major, ``group_index`` 0, 1, ... in the order they finished."""
    carry_over: list[list[Sample]]
    """Groups cut short by the abort or never started, and finished ones beyond ``num_groups``: pass them
    as ``carry_over`` to the next call (they are resumed before any new prompt)."""
    num_groups: int
    """Finished groups in ``samples`` (fewer than asked when the prompts ran out)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``rollout/partial/*``: resumed, carried over, dropped groups; off-policy token fraction."""


def offpolicy_token_frac(samples: Sequence[Sample], current: str | None, *, since: str | None = None) -> float:
    """The share of the loss tokens (loss mask 1) of ``samples`` that weights older than the rollout's sampled.

    The rollout's weights are ``current`` and ``since`` (the version when it began; see :func:`mask_offpolicy_tokens`).
    """
    keep = {current, since}
    tokens = [v for s in samples for v, m in zip(s.token_weight_versions, s.loss_mask[len(s.prompt_ids) :], strict=True)
              if m]  # fmt: skip
    return sum(v not in keep for v in tokens) / len(tokens) if tokens else 0.0


def generate_partial_rollout(
    target: SGLangClient,
    prompts: Sequence[Sequence[int]],
    sampling_params: Mapping[str, Any],
    *,
    num_groups: int,
    carry_over: Sequence[Sequence[Sample]] = (),
    labels: Sequence[Any] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    reward_fn: RewardFn | None = None,
    group_filter: Callable[[list[Sample]], bool] | None = None,
    mask_offpolicy: bool = False,
    max_concurrency: int = 64,
    progress_every_s: float = DEFAULT_LOG_EVERY_S,
    resume_interrupted: bool = False,
    generate_fn: GenerateFn | None = None,
    max_rounds: int = 1,
    more_prompts: Callable[[int], Sequence[tuple[Sequence[int], Any]]] | None = None,
    metadata: Sequence[Any] | None = None,
) -> PartialRolloutResult:
    """Generate until ``num_groups`` groups are finished, abort the rest and hand it over (``--partial-rollout``).

    Under dynamic sampling (``group_filter``) the first round is ``carry_over`` and ``prompts``; while fewer than
    ``num_groups`` groups are kept once every group of a round is done, another round starts on
    ``more_prompts(round)`` (round 2, 3, ...), at most ``max_rounds`` rounds in all.

    Args:
        target: An engine or a :class:`~tidal.rollout.router.RolloutRouter` (its ``abort`` reaches every engine).
        prompts: Token ids of this rollout's new prompts (over-sample: unused ones are carried over).
        sampling_params: SGLang sampling parameters with ``n`` samples per prompt.
        num_groups: Finished groups wanted (the rollout batch size).
        carry_over: ``carry_over`` of the previous call; resumed first.
        labels: Reference answer per new prompt.
        decode: Token ids -> text for ``response_text``.
        reward_fn: Scores each group as it finishes (needed by ``group_filter``).
        group_filter: Dynamic sampling: a finished group counts only if this returns True; dropped
            groups are discarded and counted.
        mask_offpolicy: Zero the loss mask of tokens that older weights sampled (see :func:`mask_offpolicy_tokens`):
            older than the target's ``weight_version`` at this call's start and at its end.
        max_concurrency: Most requests (or ``generate_fn`` calls) in flight.
        progress_every_s: Seconds between progress log lines.
        resume_interrupted: Samples that an interruptible weight update (not this call's own abort) cut are sent
            again at once and finish under the new weights (see :func:`~tidal.rollout.dispatch.run_groups`).
        generate_fn: A custom generate function (``--custom-generate-function-path``) makes each sample, one call
            per sample; once the batch is full the calls not started are cancelled and those running finish (a
            custom sample is not cut): groups not finished are carried over unstarted.
        max_rounds: Most rounds under ``group_filter`` (``--dynamic-sampling-max-rounds``).
        more_prompts: ``(token ids, label)`` or ``(token ids, label, metadata)`` of the prompts of round ``r`` >= 2
            (``--over-sampling-batch-size`` of them); None: one round.
        metadata: ``Sample.metadata`` per new prompt (the row's ``--metadata-key`` value) for the reward.

    Returns:
        The finished groups, the groups to carry over, ``rollout/partial/*`` metrics and, under ``group_filter``,
        ``rollout/dynamic_sampling/{rounds,groups_generated,groups_dropped,groups_surplus,kept_frac}``.

    Raises:
        RolloutError: Under ``group_filter``, fewer than ``num_groups`` groups kept after ``max_rounds`` rounds (or
            when ``more_prompts`` ran out): one line with the counts and the options to change.
    """
    if labels is not None and len(labels) != len(prompts):
        raise ValueError(f"got {len(labels)} labels for {len(prompts)} prompts")
    if group_filter is not None and reward_fn is None:
        raise ValueError("group_filter needs reward_fn: groups are filtered on their rewards")
    _check_resumable(carry_over, generate_fn)
    began = target.get_model_info().get("weight_version")  # a weight update may land while this rollout runs
    n = int(sampling_params.get("n", 1))
    groups = [list(group) for group in carry_over]
    groups += [
        fresh_group(
            ids, n, label=None if labels is None else labels[i], metadata=None if metadata is None else metadata[i]
        )
        for i, ids in enumerate(prompts)
    ]
    kept: list[int] = []
    dropped: set[int] = set()

    def finished(g: int) -> bool:  # a group's last sample is done: score, filter, count; True when full
        if reward_fn is not None:
            groups[g] = score_samples(groups[g], reward_fn)
        if group_filter is not None and not group_filter(groups[g]):
            dropped.add(g)
        else:
            kept.append(g)
        return len(kept) >= num_groups

    done_before = {g for g, group in enumerate(groups) if all(s.finish_reason != "abort" for s in group)}
    full = any(finished(g) for g in sorted(done_before))  # surplus groups of the previous call count first
    to_run = [] if full else [g for g in range(len(groups)) if g not in done_before]

    def run_round(to_run: list[int]) -> bool:  # True when the batch filled up (the rest was stopped)
        unfinished = sum(s.finish_reason == "abort" for g in to_run for s in groups[g])
        with GenerationProgress(unfinished, desc="partial rollout", log_every_s=progress_every_s) as progress:
            if not to_run:
                return False
            if generate_fn is not None:
                return _run_generate_fn(generate_fn, target, groups, to_run, sampling_params, finished, decode,
                                        max_concurrency=max_concurrency, progress=progress)  # fmt: skip
            return run_groups(
                target,
                [groups[g] for g in to_run],
                sampling_params,
                max_concurrency=max_concurrency,
                decode=decode,
                progress=progress,
                on_group_done=lambda i: finished(to_run[i]),
                resume_interrupted=resume_interrupted,
            )

    full = full or run_round(to_run)
    rounds = 1
    while not full and group_filter is not None and more_prompts is not None and rounds < max_rounds:
        batch = list(more_prompts(rounds + 1))
        if not batch:
            break
        rounds += 1
        logger.info("dynamic sampling: %d/%d groups kept after round %d; round %d", len(kept), num_groups,
                    rounds - 1, rounds)  # fmt: skip
        start = len(groups)
        groups += [fresh_group(p[0], n, label=p[1], metadata=p[2] if len(p) > 2 else None) for p in batch]
        full = run_round(list(range(start, len(groups))))
    if group_filter is not None and len(kept) < num_groups:
        raise _short_batch(len(kept), num_groups, len(dropped), rounds, ran_out=rounds < max_rounds)
    taken = kept[:num_groups]
    samples = [dataclasses.replace(s, group_index=i) for i, g in enumerate(taken) for s in groups[g]]
    rest = [groups[g] for g in range(len(groups)) if g not in set(taken) and g not in dropped]
    metrics = {
        "rollout/partial/resumed_groups": float(len(carry_over)),
        "rollout/partial/carried_over_groups": float(len(rest)),
        "rollout/partial/aborted_samples": float(sum(s.finish_reason == "abort" for group in rest for s in group)),
        "rollout/partial/groups_dropped": float(len(dropped)),
    }
    if group_filter is not None:
        metrics |= _dynamic_sampling_metrics(rounds, kept=len(kept), dropped=len(dropped), taken=len(taken))
    if samples:
        current = target.get_model_info().get("weight_version")
        metrics["rollout/partial/offpolicy_token_frac"] = offpolicy_token_frac(samples, current, since=began)
        if mask_offpolicy:
            samples = mask_offpolicy_tokens(samples, current, since=began)
    logger.info(
        "partial rollout: %d/%d groups finished, %d carried over, %d dropped",
        len(taken),
        num_groups,
        len(rest),
        len(dropped),
    )
    return PartialRolloutResult(samples=samples, carry_over=rest, num_groups=len(taken), metrics=metrics)


def _check_resumable(carry_over: Sequence[Sequence[Sample]], generate_fn: GenerateFn | None) -> None:
    if generate_fn is not None and any(s.response_ids for group in carry_over for s in group):
        raise ValueError(f"{FLAG}: a custom generate function's sample cannot be resumed; carry over unstarted groups")


def _dynamic_sampling_metrics(rounds: int, *, kept: int, dropped: int, taken: int) -> dict[str, float]:
    """``rollout/dynamic_sampling/*``: rounds, groups generated (kept or dropped), dropped, kept beyond the batch."""
    return {
        "rollout/dynamic_sampling/rounds": float(rounds),
        "rollout/dynamic_sampling/groups_generated": float(kept + dropped),
        "rollout/dynamic_sampling/groups_dropped": float(dropped),
        "rollout/dynamic_sampling/groups_surplus": float(kept - taken),
        "rollout/dynamic_sampling/kept_frac": kept / (kept + dropped) if kept + dropped else 0.0,
    }


def _short_batch(kept: int, wanted: int, dropped: int, rounds: int, *, ran_out: bool) -> RolloutError:
    why = f"when the prompts ran out after {rounds} round(s)" if ran_out else f"after {rounds} round(s)"
    return RolloutError(
        f"dynamic sampling kept {kept} of {wanted} groups {why} ({kept + dropped} groups generated, {dropped} dropped "
        "by the filter); the prompts are too easy or too hard for the policy: raise --dynamic-sampling-max-rounds or "
        "--over-sampling-batch-size, or change --dynamic-sampling-filter-path"
    )


def _run_generate_fn(
    fn: GenerateFn,
    target: SGLangClient,
    groups: list[list[Sample]],
    to_run: list[int],
    sampling_params: Mapping[str, Any],
    finished: Callable[[int], bool],
    decode: Callable[[list[int]], str] | None,
    *,
    max_concurrency: int,
    progress: GenerationProgress,
) -> bool:
    """Make the samples of the groups ``to_run`` with ``fn``, handing each finished group to ``finished``.

    Returns:
        Whether ``finished`` said the batch is full (the calls not started then were cancelled).
    """
    full = False

    def done(i: int, samples: list[Sample]) -> bool:
        nonlocal full
        g = to_run[i]
        if decode is not None:
            samples = [s if s.response_text else dataclasses.replace(s, response_text=decode(list(s.response_ids)))
                       for s in samples]  # fmt: skip
        if groups[g][0].metadata is not None:  # a custom function's samples carry the row's metadata on
            samples = [dataclasses.replace(s, metadata=groups[g][0].metadata) for s in samples]
        groups[g] = samples
        full = finished(g)
        return full

    run_generate_fn_groups(
        fn,
        target,
        [groups[g][0].prompt_ids for g in to_run],
        sampling_params,
        labels=[groups[g][0].label for g in to_run],
        max_concurrency=max_concurrency,
        progress=progress,
        on_group_done=done,
    )
    return full
