"""From token-id prompts to Samples: batched generation, stop-token checks, rollout metrics."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tidal.rollout.client import SGLangClient
from tidal.rollout.custom_generate import GenerateFn, run_generate_fn
from tidal.rollout.dispatch import fresh_group, run_groups
from tidal.rollout.progress import DEFAULT_LOG_EVERY_S, GenerationProgress
from tidal.rollout.router import RolloutRouter
from tidal.rollout.types import Sample, episode_ids

logger = logging.getLogger(__name__)

DEFAULT_NUM_REQUESTS = 4
"""Batched ``/generate`` requests a plain rollout's prompts are split over (:func:`generate_samples`)."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def model_stop_token_ids(model_path: str | Path) -> set[int]:
    """EOS token ids an HF checkpoint directory declares (generation_config.json, then config.json)."""
    found: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(Path(model_path) / name).get("eos_token_id")
        if isinstance(eos, int):
            found.add(eos)
        elif isinstance(eos, list):
            found.update(int(t) for t in eos)
    return found


def check_stop_tokens(
    model_path: str | Path,
    stop_token_ids: Sequence[int] = (),
    *,
    stop_strings: Sequence[str] = (),
    vocab_size: int | None = None,
) -> set[int]:
    """Fail before any rollout when generation could only end by length.

    A stop id is one the model can emit: below ``vocab_size`` (the tokenizer's, ``len(tokenizer)``) and below the
    ``vocab_size`` of config.json. An EOS id outside that range never ends a response: with another stop id or a
    stop string left that is a warning (responses end on those), with none it is an error.

    Returns:
        Every token id that ends a response: the model's EOS ids plus ``stop_token_ids``, those it can emit.

    Raises:
        ValueError: No stop id the model can emit and no ``stop_strings``: every response would run to
            --rollout-max-response-len.
    """
    declared = model_stop_token_ids(model_path) | {int(t) for t in stop_token_ids}
    limits = [v for v in (vocab_size, _read_json(Path(model_path) / "config.json").get("vocab_size")) if v]
    limit = min(limits) if limits else None
    stops = {t for t in declared if limit is None or 0 <= t < limit}
    unreachable = sorted(declared - stops)
    if not stops and not stop_strings:
        if unreachable:
            raise ValueError(
                f"the model at {model_path} ends responses only with token id(s) {unreachable}, which its "
                f"{limit}-token vocabulary cannot produce: every response would run to --rollout-max-response-len; "
                "set --rollout-stop-token-ids (or --rollout-stop STRING), or fix eos_token_id"
            )
        raise ValueError(
            f"the model at {model_path} declares no eos_token_id (generation_config.json, config.json) and "
            "--rollout-stop-token-ids is empty, so every response would run to --rollout-max-response-len; "
            "set --rollout-stop-token-ids (or --rollout-stop) or add eos_token_id to generation_config.json"
        )
    if unreachable:
        ends = [*(str(t) for t in sorted(stops)), *(repr(s) for s in stop_strings)]
        logger.warning(
            "stop token id(s) %s of %s lie outside its %d-token vocabulary and never end a response; responses end "
            "on %s or at --rollout-max-response-len",
            unreachable,
            model_path,
            limit,
            ", ".join(ends),
        )
    return stops


def check_chat_template(tokenizer: str | Path | Any) -> str:
    """Fail before any rollout when ``--apply-chat-template`` cannot work with this tokenizer.

    Args:
        tokenizer: A transformers tokenizer, or the checkpoint directory to load one from.

    Returns:
        The rendering of a one-message user conversation with the generation prompt.

    Raises:
        ValueError: The tokenizer has no chat template, the template fails to render, or its rendering
            drops the message.
    """
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer  # deferred: only this check needs it

        source = str(tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        source = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    fix = "pass prompts already formatted (drop --apply-chat-template) or use a checkpoint that ships a chat template"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--apply-chat-template is set but the tokenizer of {source} has no chat template; {fix}")
    probe = "tidal chat template probe"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": probe}], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # a Jinja error or a template that rejects the conversation
        raise ValueError(f"--apply-chat-template: the chat template of {source} fails to render: {e!r}; {fix}") from e
    if not isinstance(rendered, str) or probe not in rendered:
        raise ValueError(
            f"--apply-chat-template: the chat template of {source} renders a user message without its text "
            f"(got {rendered!r}); {fix}"
        )
    return rendered


def as_client(target: SGLangClient | str) -> SGLangClient:
    """An engine or router as given, or a client for a URL (e.g. a router started elsewhere)."""
    return SGLangClient(target) if isinstance(target, str) else target


def generate_samples(
    engine: SGLangClient | str,
    prompts: Sequence[Sequence[int]],
    sampling_params: Mapping[str, Any],
    *,
    labels: Sequence[Any] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    generate_fn: GenerateFn | None = None,
    max_concurrency: int = 64,
    progress_every_s: float = DEFAULT_LOG_EVERY_S,
    max_restarts: int = 1,
    num_requests: int = DEFAULT_NUM_REQUESTS,
) -> list[Sample]:
    """Generate ``n`` responses per prompt and wrap them as unscored Samples.

    The prompts' ``n`` samples go in ``num_requests`` batched ``/generate`` requests (each prompt's samples in one
    of them), ``max_concurrency`` requests in flight (SGLang batches them). Progress (samples done, samples/s, ETA)
    is logged every ``progress_every_s`` and drawn as a bar when stderr is a terminal. If ``engine`` is an
    :class:`SGLangEngine` whose process dies mid-rollout, it is restarted once and the requests it lost are sent
    again, so no sample is dropped. With ``generate_fn`` (``--custom-generate-function-path``, e.g. a multi-turn
    rollout) each sample is made by one call of it instead, ``max_concurrency`` calls at a time.

    Args:
        engine: A running engine, a :class:`~tidal.rollout.router.RolloutRouter` in front of several, or
            the URL of either.
        prompts: Token ids of each prompt.
        sampling_params: As for :meth:`SGLangClient.generate` (``n`` samples per prompt).
        labels: Reference answer per prompt, copied to each of its samples.
        decode: Token ids -> text for ``Sample.response_text`` (e.g. a tokenizer's decode); the ids
            stay what the engine sampled either way; fills a custom sample's empty ``response_text``.
        generate_fn: Makes one sample per call (see :class:`tidal.rollout.custom_generate.GenerateFn`).
        max_concurrency: Most requests (or ``generate_fn`` calls) in flight at once.
        progress_every_s: Seconds between progress log lines.
        max_restarts: Restarts of a dead engine allowed before RolloutError.
        num_requests: Requests the prompts are split over (at most one per prompt). A few large requests cost less
            than one per prompt (each request has a fixed cost on the server; bench/RESULTS.md compares the
            counts); a few keep the progress line moving. Through a
            :class:`~tidal.rollout.router.RolloutRouter`, always one per prompt (the router places each one).

    Returns:
        ``len(prompts) * n`` Samples, prompt-major; ``group_index`` is the prompt's index.

    Raises:
        RolloutError: A request failed, or the engine died again after its restart (with its log tail).
    """
    if labels is not None and len(labels) != len(prompts):
        raise ValueError(f"got {len(labels)} labels for {len(prompts)} prompts")
    target = as_client(engine)
    n = int(sampling_params.get("n", 1))
    with GenerationProgress(len(prompts) * n, log_every_s=progress_every_s) as progress:
        if generate_fn is not None:
            samples = run_generate_fn(
                generate_fn,
                target,
                prompts,
                sampling_params,
                labels=labels,
                max_concurrency=max_concurrency,
                progress=progress,
            )
            if decode is None:
                return samples
            return [
                s if s.response_text else dataclasses.replace(s, response_text=decode(list(s.response_ids)))
                for s in samples
            ]
        groups = [
            fresh_group(ids, n, label=None if labels is None else labels[g], group_index=g)
            for g, ids in enumerate(prompts)
        ]
        run_groups(
            target,
            groups,
            sampling_params,
            max_concurrency=max_concurrency,
            decode=decode,
            progress=progress,
            max_restarts=max_restarts,
            # through a router: one request per prompt, so that it places each prompt on an engine
            groups_per_request=1 if isinstance(target, RolloutRouter) else -(-len(groups) // max(1, num_requests)),
        )
    return [sample for group in groups for sample in group]


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Per-rollout metrics with slash keys: response length, truncated fraction, rewards, reward errors.

    Each figure the reward reported (``Sample.reward_metrics``) is summed over the samples as well. The reward
    mean and std count each agent episode once (its trajectories share its reward).
    """
    if not samples:
        return {}
    lengths = [len(s.response_ids) for s in samples]
    metrics = {
        "rollout/num_samples": float(len(samples)),
        "rollout/response_len/mean": statistics.fmean(lengths),
        "rollout/response_len/max": float(max(lengths)),
        "rollout/truncated_frac": sum(s.truncated for s in samples) / len(samples),
        "rollout/aborted_frac": sum(s.finish_reason == "abort" for s in samples) / len(samples),
    }
    ids = episode_ids(samples)
    if ids is not None:  # an agent episode's trajectories share its reward: count it once
        last = [s for i, s in enumerate(samples) if i + 1 == len(samples) or ids[i + 1] != ids[i]]
        metrics["rollout/num_episodes"] = float(len(last))
    rewards = [s.reward for s in (samples if ids is None else last) if s.reward is not None]
    if rewards:
        metrics["rollout/reward/mean"] = statistics.fmean(rewards)
        metrics["rollout/reward/std"] = statistics.pstdev(rewards)
        metrics["rollout/reward_errors"] = float(sum(s.reward_error is not None for s in samples))
        kinds = collections.Counter(_error_kind(s.reward_error) for s in samples if s.reward_error is not None)
        metrics.update({f"rollout/reward_errors/{kind}": float(count) for kind, count in sorted(kinds.items())})
    for s in samples:  # the reward's own figures (--rm-type code: sandbox seconds, why programs scored 0)
        for key, value in (s.reward_metrics or {}).items():
            metrics[f"rollout/{key}"] = metrics.get(f"rollout/{key}", 0.0) + value
    return metrics


def _error_kind(error: str) -> str:
    """The exception class of a ``reward_error`` (``MathTimeout('...')`` -> ``MathTimeout``), else ``not_a_number``."""
    match = re.match(r"(\w+)\(", error)
    return match.group(1) if match else "not_a_number"


def filter_uniform_groups(samples: Sequence[Sample]) -> tuple[list[Sample], int]:
    """DAPO dynamic filtering: drop every group whose rewards are all equal (no learning signal under GRPO).

    Returns:
        The kept samples (order preserved) and the number of groups dropped.

    Raises:
        ValueError: A sample has not been scored.
    """
    rewards: dict[int, set[float]] = {}
    for s in samples:
        if s.reward is None:
            raise ValueError(f"filter_uniform_groups needs scored samples; group {s.group_index} has one unscored")
        rewards.setdefault(s.group_index, set()).add(s.reward)
    uniform = {group for group, values in rewards.items() if len(values) == 1}
    return [s for s in samples if s.group_index not in uniform], len(uniform)
