"""Custom generate functions by import path (``--custom-generate-function-path``): multi-turn and tool use.

A generate function makes ONE sample: it may call the engine several times (one call per turn), insert
tokens of its own between turns (a tool's answer) and return a :class:`Sample` whose
``response_loss_mask`` is 0 on the inserted tokens. :class:`MultiTurn` does that bookkeeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, Protocol

from tidal.rollout.client import SGLangClient
from tidal.rollout.errors import RolloutError
from tidal.rollout.import_path import load_callable
from tidal.rollout.progress import GenerationProgress
from tidal.rollout.types import Sample

FLAG = "--custom-generate-function-path"


class GenerateFn(Protocol):
    """Makes one sample for one prompt; sync, or async (then awaited in its worker thread)."""

    def __call__(
        self, engine: SGLangClient, prompt_ids: list[int], sampling_params: dict[str, Any], *, label: Any
    ) -> Sample | Awaitable[Sample]:
        """Generate one response to ``prompt_ids`` (``sampling_params`` has no ``n``: one sample per call)."""
        ...


def load_generate_fn(path: str) -> GenerateFn:
    """Import a generate function given as ``pkg.module:fn`` (errors name ``--custom-generate-function-path``)."""
    return load_callable(path, flag=FLAG)


class MultiTurn:
    """Builds one multi-turn sample: generated turns (trained on) and inserted tokens (masked out).

    Example::

        turn = MultiTurn(prompt_ids, max_response_len=params["max_new_tokens"])
        first = turn.generate(engine, params)
        turn.append(tool_result_ids)          # loss mask 0, log-prob 0.0
        turn.generate(engine, params)
        return turn.sample(label=label)
    """

    def __init__(self, prompt_ids: Sequence[int], *, max_response_len: int | None = None) -> None:
        """Start from ``prompt_ids``; ``max_response_len`` bounds all turns and inserted tokens together."""
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_response_len = max_response_len
        self.response_ids: list[int] = []
        self.log_probs: list[float] = []
        self.loss_mask: list[int] = []
        self.finish_reason = "length"
        self.weight_version: str | None = None

    @property
    def remaining(self) -> int | None:
        """Response tokens still allowed, None when unbounded."""
        return None if self.max_response_len is None else max(0, self.max_response_len - len(self.response_ids))

    def generate(self, engine: SGLangClient, sampling_params: Mapping[str, Any]) -> dict[str, Any]:
        """Generate the next turn from the prompt and everything so far; its tokens get loss mask 1.

        Returns:
            The engine's output for this turn (see :meth:`SGLangClient.generate`); when no budget is left
            nothing is generated and ``finish_reason`` is "length".
        """
        params = {k: v for k, v in sampling_params.items() if k != "n"}
        if self.remaining is not None:
            if self.remaining == 0:
                self.finish_reason = "length"
                return {"output_ids": [], "output_log_probs": [], "finish_reason": "length"}
            params["max_new_tokens"] = min(int(params.get("max_new_tokens", self.remaining)), self.remaining)
        (out,) = engine.generate([self.prompt_ids + self.response_ids], params)
        self.response_ids += out["output_ids"]
        self.log_probs += out["output_log_probs"]
        self.loss_mask += [1] * len(out["output_ids"])
        self.finish_reason = out["finish_reason"]
        self.weight_version = out["weight_version"]
        return out

    def append(self, token_ids: Sequence[int]) -> None:
        """Insert tokens the policy did not sample (a tool's answer): loss mask 0 and log-prob 0.0."""
        ids = [int(t) for t in token_ids]
        if self.remaining is not None:
            ids = ids[: self.remaining]
        self.response_ids += ids
        self.log_probs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    def sample(self, *, label: Any = None, response_text: str = "") -> Sample:
        """The finished sample (``group_index`` is set by the caller of the generate function)."""
        return Sample(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            response_log_probs=self.log_probs,
            response_loss_mask=self.loss_mask,
            finish_reason=self.finish_reason,
            label=label,
            weight_version=self.weight_version,
            response_text=response_text,
        )


def _call_one(fn: GenerateFn, engine: SGLangClient, prompt: list[int], params: dict[str, Any], label: Any) -> Sample:
    result = fn(engine, prompt, dict(params), label=label)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    if not isinstance(result, Sample):
        raise RolloutError(f"{FLAG}: {fn!r} returned a {type(result).__name__}, not a tidal.rollout.Sample")
    return result


async def _awaited(result: Awaitable[Sample]) -> Sample:
    return await result


def _count(progress: GenerationProgress, future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        progress.update(1)


def run_generate_fn(
    fn: GenerateFn,
    engine: SGLangClient,
    prompts: Sequence[Sequence[int]],
    sampling_params: Mapping[str, Any],
    *,
    labels: Sequence[Any] | None = None,
    max_concurrency: int = 64,
    progress: GenerationProgress | None = None,
) -> list[Sample]:
    """Call ``fn`` ``n`` times per prompt, at most ``max_concurrency`` calls at once (SGLang batches them).

    Returns:
        ``len(prompts) * n`` Samples, prompt-major, with ``group_index`` the prompt's index and its label.

    Raises:
        RolloutError: A call failed or returned something other than a Sample (the first such, by prompt).
    """
    groups = run_generate_fn_groups(
        fn, engine, prompts, sampling_params, labels=labels, max_concurrency=max_concurrency, progress=progress
    )
    return [sample for g in range(len(prompts)) for sample in groups[g]]


def run_generate_fn_groups(
    fn: GenerateFn,
    engine: SGLangClient,
    prompts: Sequence[Sequence[int]],
    sampling_params: Mapping[str, Any],
    *,
    labels: Sequence[Any] | None = None,
    max_concurrency: int = 64,
    progress: GenerationProgress | None = None,
    on_group_done: Callable[[int, list[Sample]], bool] | None = None,
) -> dict[int, list[Sample]]:
    """Call ``fn`` ``n`` times per prompt; each group is handed to ``on_group_done`` as its last call returns.

    ``on_group_done(g, samples)`` returning True stops the generation: calls not yet started are cancelled, those
    running finish (a custom function's sample cannot be cut and resumed), and only the groups finished so far are
    returned. Groups are started in prompt order, at most ``max_concurrency`` calls at once.

    Returns:
        The finished groups by prompt index, each with ``group_index`` the prompt's index and its label.

    Raises:
        RolloutError: A call failed or returned something other than a Sample (the first such, by prompt).
    """
    params = dict(sampling_params)
    n = int(params.pop("n", 1))
    jobs = [group for group in range(len(prompts)) for _ in range(n)]
    if not jobs:
        return {}
    label_of = (lambda g: None) if labels is None else (lambda g: labels[g])
    done: dict[int, list[Sample]] = {}
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(jobs)), thread_name_prefix="generate") as pool:
        futures = [pool.submit(_call_one, fn, engine, list(prompts[g]), params, label_of(g)) for g in jobs]
        if progress is not None:
            for future in futures:
                future.add_done_callback(functools.partial(_count, progress))
        stopped = False
        for first in range(0, len(jobs), n):  # group by group, in prompt order
            group = jobs[first]
            try:
                samples = [future.result() for future in futures[first : first + n]]
            except CancelledError:
                continue
            except RolloutError:
                raise
            except Exception as e:
                raise RolloutError(f"{FLAG}: {fn!r} failed on prompt {group}: {e!r}") from e
            if stopped:
                continue  # finished after the stop: not handed over
            done[group] = [dataclasses.replace(s, group_index=group, label=label_of(group)) for s in samples]
            if on_group_done is not None and on_group_done(group, done[group]):
                stopped = True
                for future in futures:
                    future.cancel()  # not started yet: never sent
    return done
