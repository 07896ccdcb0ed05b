"""One rollout's training on one rank: plan micro-batches, old log-probs, advantages, optimizer steps.

The order matters: every old log-prob of the rollout is computed before its first optimizer step, so the PPO
ratio of every step compares against the weights that existed when the rollout was scored. With ONE optimizer
step per rollout (and no reference model, no token-level estimator, one pipeline stage) that separate pass is
skipped: the step's own forward runs on those same weights, and its detached log-probs are the old ones, the same
numbers (slime computes them again; the pass is a sizeable share of a short rollout).

The forward-only passes (old and reference log-probs, critic values) keep no activations for backward, so with
--log-probs-max-tokens-per-gpu they run on micro-batches of their own, packed under that larger budget (slime's flag),
and their per-sample values are packed into the training micro-batches as token fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch
from tidal.actor.advantages import (
    TOKEN_LEVEL_ESTIMATORS,
    explained_variance,
    explained_variance_sums,
    gae_advantages,
    token_advantages,
    whiten,
    whiten_sums,
)
from tidal.actor.agreement import agreement_metrics, agreement_sums, all_reduce_sums, combine_sums
from tidal.actor.routing_replay import FIELD, routed_experts_field
from tidal.actor.sample_weights import episode_index, sample_weights
from tidal.batching import (
    BatchingConfig,
    PackedBatch,
    pack_micro_batches,
    plan_from_config,
    plan_stats,
    unpack_micro_batches,
)

logger = logging.getLogger(__name__)


def _plan_steps(
    batching: BatchingConfig, lengths: list[int], *, dp_size: int, episode: torch.Tensor | None = None
) -> tuple[list[tuple[list[int], object]], list[int]]:
    """Each optimizer step's sample indices and micro-batch plan, and the padding samples they use.

    A step holds the samples of ``--global-batch-size`` episodes. When an episode gave several samples the count
    may not split over the data-parallel ranks: the step is padded with copies of its shortest sample that the loss
    ignores (loss mask 0), indexed from ``len(lengths)`` on; ``pads[j]`` is the sample padding ``len(lengths) + j``
    copies.
    """
    arith = batching.resolve(dp_size=dp_size)
    if episode is None:
        episode = torch.arange(len(lengths))
    episodes = int(episode[-1]) + 1 if episode.numel() else 0
    if arith.rollout_size != episodes:
        what = "samples" if episodes == len(lengths) else f"episodes ({len(lengths)} samples)"
        raise ValueError(
            f"the rollout holds {episodes} {what} but --rollout-batch-size x --n-samples-per-prompt is "
            f"{arith.rollout_size}; every prompt must contribute exactly --n-samples-per-prompt samples"
        )
    starts = torch.searchsorted(episode, torch.arange(episodes + 1)).tolist()
    steps, pads = [], []
    for episodes_of_step in arith.step_slices():
        indices = list(range(starts[episodes_of_step.start], starts[episodes_of_step.stop]))
        shortest = min(indices, key=lambda i: lengths[i])
        for _ in range(-len(indices) % dp_size):
            indices.append(len(lengths) + len(pads))
            pads.append(shortest)
        step_lengths = [lengths[i] if i < len(lengths) else lengths[pads[i - len(lengths)]] for i in indices]
        plan = plan_from_config(batching, step_lengths, dp_size=dp_size)
        steps.append((indices, plan))
    return steps, pads


def _padded(values: Sequence, pads: list[int], fill=None) -> list:
    """``values`` and, for each padding sample, its source's value (or ``fill`` of the source's length)."""
    extra = [values[i] if fill is None else [fill] * len(values[i]) for i in pads]
    return [*values, *extra]


def train_on_rollout(
    actor,
    batching: BatchingConfig,
    *,
    tokens: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    rewards: Sequence[float],
    group_size: int,
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    normalize_std: bool | None = None,
    rank: int = 0,
    dp_size: int = 1,
    reference=None,
    critic=None,
    rollout_id: int = 0,
    reuse_step_log_probs: bool = True,
    routed_experts: Sequence | None = None,
    episode_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """Train ``actor`` (a :class:`tidal.actor.Actor`) on one rollout; every DP rank calls it with the same rollout.

    Args:
        actor: this rank's actor.
        batching: batch arithmetic and micro-batching settings.
        tokens: prompt + response token ids of every sample (groups of ``group_size`` consecutive samples).
        loss_masks: 0 on prompt tokens, 1 on response tokens.
        rewards: scalar reward per sample.
        group_size: samples per prompt (GRPO group).
        rollout_log_probs: the engine's per-token log-probs (tidal's convention); measured against the actor's
            old log-probs (:mod:`tidal.actor.agreement`), as a check that both compute the same policy.
        normalize_std: divide GRPO advantages by the group's reward std; None: the actor's config decides
            (``--disable-grpo-std-normalization``). The estimator and loss aggregation also come from it.
        rank: data-parallel rank of this process.
        dp_size: data-parallel size.
        reference: a :class:`tidal.actor.ReferenceModel`; when given, every micro-batch gets its
            "ref_log_probs" (for ``--kl-loss-coef``), computed before any step with the reference on the device once.
        critic: a :class:`tidal.actor.critic.Critic` (``--advantage-estimator ppo``): its values before any step
            give GAE advantages (whitened over the rollout) and returns; it then takes the rollout's steps on the
            value loss, before the actor takes its own.
        rollout_id: the rollout's index; the actor does not train while it is below ``--num-critic-only-steps``.
        reuse_step_log_probs: take the old log-probs from the training forward when that is exact (one optimizer
            step, no reference, no critic, a sample-level estimator, one pipeline stage); False: always a separate
            pass.
        routed_experts: per sample, the engine's expert ids of each token but the last (``[tokens - 1, layers x
            top-k]``, ``Sample.rollout_routed_experts``): every pass routes the tokens to them under
            ``--use-rollout-routing-replay``, and "rollout/routing_mismatch_share" says how often the actor's router
            chose otherwise in the pass that computed the old log-probs (replay on or off).
        episode_ids: each sample's agent episode (consecutive samples of one episode share it; see
            :func:`tidal.actor.sample_weights.sample_weights`): groups and optimizer steps count episodes, and a
            step whose samples do not split over the ranks is padded with samples the loss ignores. None: every
            sample is an episode.

    Returns:
        Mean of the steps' train metrics, batching statistics (the first step's plan, and
        "batching/logprob_num_micro_batches": micro-batches of one forward-only pass on a rank, 0 when none ran),
        timings ("time/log_probs", "time/train") and,
        with ``rollout_log_probs``, the engine-actor agreement over the whole rollout (every DP rank's tokens):
        "rollout/logprob_abs_diff/mean", "rollout/logprob_abs_diff/max", "rollout/engine_actor_kl". With a critic
        also its steps' mean "critic/value_loss", "critic/clipfrac", "critic/values_mean", "critic/grad_norm", ...,
        "critic/explained_variance" of its values before the steps (absent when the returns do not vary),
        "critic/returns_mean" and "train/critic_only".
    """
    cfg = actor.cfg
    weights = sample_weights(
        cfg,
        loss_masks=loss_masks,
        rewards=rewards,
        group_size=group_size,
        normalize_std=normalize_std,
        episode_ids=episode_ids,
    )
    episode = episode_index(episode_ids, len(tokens))
    steps, pads = _plan_steps(batching, [len(t) for t in tokens], dp_size=dp_size, episode=episode)
    token_fields = dict(weights.token_fields)
    if cfg.kl_coef > 0 and reference is None:
        raise ValueError("--kl-coef needs a reference model: pass reference=ReferenceModel(...)")
    if (cfg.advantage_estimator == "ppo") != (critic is not None):
        raise ValueError("--advantage-estimator ppo and a critic go together: pass critic=Critic(cfg) with ppo only")
    if rollout_log_probs is not None:
        token_fields["rollout_log_probs"] = [list(map(float, lp)) for lp in rollout_log_probs]
    inputs = _routing_fields(cfg, routed_experts, tokens)
    token_fields |= inputs
    if pads:  # padding samples: their sources' tokens and fields, loss mask 0
        tokens, loss_masks = _padded(tokens, pads), _padded(loss_masks, pads, fill=0)
        token_fields = {k: _padded(v, pads) for k, v in token_fields.items()}
        inputs = {k: token_fields[k] for k in inputs}
    replay = actor.routing_replay if inputs else None  # counts from here on
    if replay is not None:
        replay.reset()

    # Every forward-only pass (old and reference log-probs, critic values) runs before any update: on micro-batches of
    # its own under --log-probs-max-tokens-per-gpu, else on this rank's training micro-batches of every step.
    start = time.monotonic()
    reuse = reuse_step_log_probs and len(steps) == 1 and reference is None and critic is None
    reuse = reuse and actor.stage.size == 1
    reuse = reuse and cfg.advantage_estimator not in TOKEN_LEVEL_ESTIMATORS
    # sft_loss reads no old log-probs: they are computed only to measure the engine's against them
    old_needed = cfg.loss_type != "sft_loss" or rollout_log_probs is not None
    passes = _forward_passes(actor, reference, critic, old_log_probs=not reuse and old_needed)
    own = bool(passes) and batching.log_probs_token_budget is not None
    if own:
        fields, num_forward = _forward_only_fields(
            passes, batching, steps, tokens, rank=rank, dp_size=dp_size, inputs=inputs
        )
        token_fields |= fields
    packed: list[list[PackedBatch]] = []
    for indices, plan in steps:
        packed.append(
            pack_micro_batches(
                plan,
                rank,
                [tokens[i] for i in indices],
                loss_masks=[loss_masks[i] for i in indices],
                token_fields={k: [v[i] for i in indices] for k, v in token_fields.items()},
                pad_to_multiple_of=batching.pad_to_multiple_of,
            )
        )
    if not own:
        num_forward = sum(plan.num_micro_batches for _, plan in steps) if passes else 0
        for field, compute, held in passes:
            with held():
                packed = [[_with_field(mb, field, compute(mb)) for mb in step] for step in packed]
    packed = _shaped_advantages(packed, cfg, device=actor.device)
    metrics: dict[str, float] = {"batching/logprob_num_micro_batches": float(num_forward)}
    if critic is not None:
        packed, gae_metrics = _gae(packed, cfg, device=actor.device)
        metrics |= gae_metrics
    log_probs_time = time.monotonic() - start
    metrics |= _mismatch(replay, actor, now=not reuse)  # the old log-probs' pass ran (the reference's: its own)

    packed = _train_steps(actor, critic, packed, metrics, rollout_id=rollout_id, reuse=reuse)
    metrics |= _mismatch(replay, actor, now=reuse)  # the old log-probs came from the step's own forward
    metrics["time/log_probs"] = log_probs_time
    if cfg.overlong_buffer_len:
        metrics["train/overlong_penalty/mean"] = float(weights.penalty.mean())
    if rollout_log_probs is not None:
        metrics |= _agreement(packed, device=actor.device)
    metrics |= plan_stats(steps[0][1], pad_to_multiple_of=batching.pad_to_multiple_of)
    return metrics


def _routing_fields(cfg, routed_experts: Sequence | None, tokens: Sequence[Sequence[int]]) -> dict[str, list]:
    """The token field of the engine's routed experts, when given; {} without them (an error under replay)."""
    if routed_experts is None and not cfg.use_rollout_routing_replay:
        return {}
    if routed_experts is None:
        routed_experts = [None] * len(tokens)
    if len(routed_experts) != len(tokens):
        raise ValueError(f"routed_experts has {len(routed_experts)} entries for {len(tokens)} samples")
    if not cfg.use_rollout_routing_replay and any(r is None for r in routed_experts):
        return {}  # only measured when every sample has them
    return {
        FIELD: [
            routed_experts_field(r, len(t), sample=i)
            for i, (r, t) in enumerate(zip(routed_experts, tokens, strict=True))
        ]
    }


def _mismatch(replay, actor, *, now: bool) -> dict[str, float]:
    return replay.metrics(actor.device) if replay is not None and now else {}


def _forward_passes(actor, reference, critic, *, old_log_probs: bool) -> list[tuple[str, Callable, Callable]]:
    """``(token field, compute, context holding its model on the device)`` of each forward-only pass, in order."""
    passes: list[tuple[str, Callable, Callable]] = []
    if old_log_probs:
        passes.append(("old_log_probs", actor.compute_log_probs, contextlib.nullcontext))
    if reference is not None:  # on the device once for the whole pass, not once per micro-batch
        passes.append(("ref_log_probs", reference.compute_log_probs, reference.loaded))
    if critic is not None:
        passes.append(("old_values", critic.compute_values, contextlib.nullcontext))
    return passes


def _forward_only_fields(
    passes: list[tuple[str, Callable, Callable]],
    batching: BatchingConfig,
    steps: list,
    tokens: Sequence[Sequence[int]],
    *,
    rank: int,
    dp_size: int,
    inputs: dict[str, list] | None = None,
) -> tuple[dict[str, list[torch.Tensor | None]], int]:
    """The forward-only passes on micro-batches of their own, packed under --log-probs-max-tokens-per-gpu.

    Each rank computes the samples it trains on, every step's at once (all of them before the first update), so no
    value crosses ranks; every rank plans every rank's pass (lengths only) to report the same count.

    ``inputs`` are token fields the passes read (the engine's routed experts), one entry per sample of the rollout.

    Returns:
        Per token field, one tensor per sample of the rollout (None for the other ranks' samples), and the most
        forward micro-batches any rank ran per pass.
    """
    counts = []
    for r in range(dp_size):
        samples = [indices[i] for indices, plan in steps for mb in plan.micro_batches(r) for i in mb.tolist()]
        plan = plan_from_config(batching, [len(tokens[i]) for i in samples], dp_size=1, forward_only=True)
        counts.append(plan.num_micro_batches)
        if r == rank:
            mine, own_plan = samples, plan
    batches = pack_micro_batches(
        own_plan,
        0,
        [tokens[i] for i in mine],
        token_fields={k: [v[i] for i in mine] for k, v in (inputs or {}).items()},
        pad_to_multiple_of=batching.pad_to_multiple_of,
    )
    fields: dict[str, list[torch.Tensor | None]] = {}
    for field, compute, held in passes:
        with held():
            values = unpack_micro_batches([compute(mb) for mb in batches], batches, num_samples=len(mine))
        fields[field] = [None] * len(tokens)
        for i, v in zip(mine, values, strict=True):
            fields[field][i] = v
    return fields, max(counts)


def _train_steps(actor, critic, packed: list[list[PackedBatch]], metrics: dict[str, float], *, rollout_id: int,
                 reuse: bool) -> list[list[PackedBatch]]:  # fmt: skip
    """The critic's steps (PPO), then the actor's (unless critic-only); ``packed`` with the old log-probs it used."""
    cfg = actor.cfg
    if critic is not None:
        start = time.monotonic()
        metrics |= _mean([critic.train_step(step) for step in packed])
        metrics["time/critic_train"] = time.monotonic() - start
        metrics["train/critic_only"] = float(rollout_id < cfg.num_critic_only_steps)
    start = time.monotonic()
    if critic is None or rollout_id >= cfg.num_critic_only_steps:
        metrics |= _mean([actor.train_step(step) for step in packed])
        metrics["train/num_steps"] = float(len(packed))
        if reuse:  # the step's forward computed them (before its update): the rollout's old log-probs
            packed = [
                [_with_field(mb, "old_log_probs", lp) for mb, lp in zip(packed[0], actor.step_log_probs, strict=True)]
            ]
    metrics["time/train"] = time.monotonic() - start
    return packed


def _mean(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the rollout's steps; a running total (``*/skipped_steps``) its value after the last."""
    return {
        key: per_step[-1][key] if key.endswith("/skipped_steps") else sum(m[key] for m in per_step) / len(per_step)
        for key in per_step[0]
    }


def _gae(packed: list[list[PackedBatch]], cfg, *, device) -> tuple[list[list[PackedBatch]], dict[str, float]]:
    """PPO: GAE advantages (whitened over the rollout) and returns of micro-batches holding the critic's values.

    Every micro-batch carries the token field "old_values"; the metrics are the critic's explained variance of the
    returns and their mean over the rollout's action tokens.
    """
    with_values = packed
    raw, sums, ev_sums = [], torch.zeros(3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for mb in (mb for step in with_values for mb in step):
        fields = mb.token_fields
        kl = fields["old_log_probs"] - fields["ref_log_probs"] if "ref_log_probs" in fields else None
        adv, returns = gae_advantages(
            fields["advantages"], kl, fields["old_values"], mb.loss_mask, mb.cu_seqlens,
            kl_coef=cfg.kl_coef, gamma=cfg.gamma, lambd=cfg.lambd,
        )  # fmt: skip
        raw.append((adv, returns))
        sums += whiten_sums(adv, mb.loss_mask)
        ev_sums += explained_variance_sums(fields["old_values"], returns, mb.loss_mask)
    totals = _dp_sum(torch.cat([sums, ev_sums]), device=device)
    sums, ev_sums = totals[:3], totals[3:]
    it = iter(raw)
    out = []
    for step in with_values:
        out.append([])
        for mb in step:
            adv, returns = next(it)
            mb = _with_field(mb, "returns", returns)
            out[-1].append(_with_field(mb, "advantages", whiten(adv, mb.loss_mask, sums)))
    metrics = {"critic/returns_mean": float(ev_sums[1]) / max(float(ev_sums[0]), 1.0)}
    ev = explained_variance(ev_sums)
    if math.isfinite(ev):  # undefined when every return is the same
        metrics["critic/explained_variance"] = ev
    return out, metrics


def _token_level(packed: list[list[PackedBatch]], cfg, *, device) -> list[list[PackedBatch]]:
    """REINFORCE++ (baseline): per-token advantages with the KL in the reward, whitened over the whole rollout."""
    raw = []
    for step in packed:
        for mb in step:
            fields = mb.token_fields
            kl = fields["old_log_probs"] - fields["ref_log_probs"] if "ref_log_probs" in fields else None
            raw.append(
                token_advantages(
                    fields["advantages"],
                    kl,
                    mb.loss_mask,
                    mb.cu_seqlens,
                    estimator=cfg.advantage_estimator,
                    kl_coef=cfg.kl_coef,
                    gamma=cfg.gamma,
                )
            )
    flat = [mb for step in packed for mb in step]
    sums = sum((whiten_sums(adv, mb.loss_mask) for adv, mb in zip(raw, flat, strict=True)), torch.zeros(3))
    sums = _dp_sum(sums, device=device)
    it = iter(raw)
    return [[_with_field(mb, "advantages", whiten(next(it), mb.loss_mask, sums)) for mb in step] for step in packed]


def _dp_sum(sums: torch.Tensor, *, device) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return sums
    total = sums.to(device, copy=True)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total.cpu()


def _shaped_advantages(packed: list[list[PackedBatch]], cfg, *, device) -> list[list[PackedBatch]]:
    """The micro-batches' advantages as ``cfg`` shapes them per token before PPO's GAE, if any.

    A per-sample estimator's advantage minus --kl-coef x (log pi_old - log pi_ref) on each action token; REINFORCE++
    (and its baseline variant): per-token returns with that KL in the rewards, whitened over the rollout.
    """
    if cfg.kl_coef > 0 and cfg.advantage_estimator not in (*TOKEN_LEVEL_ESTIMATORS, "ppo"):
        # --kl-coef: KL to the reference as a per-token penalty on the advantage
        packed = [[_kl_shaped(mb, cfg.kl_coef) for mb in step] for step in packed]
    if cfg.advantage_estimator in TOKEN_LEVEL_ESTIMATORS:
        packed = _token_level(packed, cfg, device=device)
    return packed


def _kl_shaped(mb: PackedBatch, kl_coef: float) -> PackedBatch:
    fields = mb.token_fields
    kl = (fields["old_log_probs"] - fields["ref_log_probs"]) * mb.loss_mask
    return _with_field(mb, "advantages", fields["advantages"] - kl_coef * kl)


def _with_field(mb: PackedBatch, name: str, values: torch.Tensor) -> PackedBatch:
    return dataclasses.replace(mb, token_fields={**mb.token_fields, name: values})


def _agreement(packed: list[list[PackedBatch]], *, device) -> dict[str, float]:
    parts = [
        agreement_sums(mb.token_fields["old_log_probs"], mb.token_fields["rollout_log_probs"], mb.loss_mask)
        for step in packed
        for mb in step
    ]
    return agreement_metrics(all_reduce_sums(combine_sums(parts), device=device))
