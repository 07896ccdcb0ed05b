"""Rollout routing replay (R3): each token routed to the experts the rollout engine chose, and how often they differ.

The engine (SGLang with ``--enable-return-routed-experts``) reports, for every token it forwarded, the top-k expert
ids of every layer: one row ``[layers x top-k]`` per token (layer 0's ids first). :func:`routed_experts_field` turns a
sample's rows into the packed token field :data:`FIELD` (``[tokens, layers x top-k]``; -1 on the sample's last token,
which the engine never forwards and no loss depends on). In each forward, :class:`RoutingReplay` hands every MoE
router its layer's ids through megatron-core's top-k hook (``Router.router_replay.get_replay_topk``, the hook its
``router_replay.RouterReplay`` uses): with replay on, the router dispatches to those experts and weighs them with its
own probabilities of them (softmax over all experts then gathered, or softmax over the gathered logits with
``norm_topk_prob``), so the router's weights still get their gradient. Tokens without engine ids (-1: the last token,
the padding tail) are routed by the router itself. Prompt tokens are replayed too: the engine reports them and
their routing shapes every later token's hidden state through attention.

megatron's own ``RouterReplay`` is not used as is: every instance joins a process-wide list that is never cleared
(one per router of every model built), and it keeps every replayed tensor for backward until told otherwise; here
each actor holds its routers' hooks, and the ids of the micro-batch being computed stay set through its backward
(activation recompute included), the order tidal's one-stage training runs them in.

Whether replay is on or off, each forward with engine ids counts the (token, MoE layer) decisions whose top-k set the
router's own choice differs from the engine's: ``rollout/routing_mismatch_share``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from tidal.batching import PackedBatch

logger = logging.getLogger(__name__)

FIELD = "routed_experts"
"""Token field of the engine's expert ids, ``[T, layers x top-k]`` (-1: route normally)."""
FLAG = "--use-rollout-routing-replay"


def routed_experts_field(routed: np.ndarray | None, num_tokens: int, *, sample: int = 0) -> np.ndarray:
    """A sample's engine rows ``[num_tokens - 1, layers x top-k]`` as its token field ``[num_tokens, ...]`` (-1 last).

    Raises:
        ValueError: no rows (a sample generated without routed experts), or as many rows as tokens would not fit.
    """
    if routed is None:
        raise ValueError(
            f"sample {sample} carries no routed experts but {FLAG} replays them: generate with engines that return "
            "them (tidal launches its own with --enable-return-routed-experts; a custom generate function must "
            f"fill Sample.rollout_routed_experts), or drop {FLAG}"
        )
    routed = np.asarray(routed)
    if routed.ndim != 2 or routed.shape[0] != num_tokens - 1:
        raise ValueError(
            f"sample {sample}: routed experts of shape {routed.shape} for {num_tokens} tokens; {FLAG} needs one row "
            "per token but the last"
        )
    out = np.full((num_tokens, routed.shape[1]), -1, dtype=np.float32)
    out[:-1] = routed
    return out


class _RouterHook:
    """Stands in for megatron's ``RouterReplay`` on one router: the top-k of its layer, replayed or counted."""

    def __init__(self, owner: RoutingReplay, layer: int) -> None:
        self.owner, self.layer = owner, layer
        self.layer_number: int | None = None  # megatron's Router.set_layer_number writes it

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.owner.target
        if target is None:
            return probs, chosen
        if target.shape[0] != scores.shape[0] or target.shape[1] < (self.layer + 1) * topk:
            raise ValueError(
                f"{FLAG}: the micro-batch's routed experts are {tuple(target.shape)} (tokens, layers x top-k); the "
                f"router of layer {self.layer} sees {scores.shape[0]} tokens and top-{topk}: the engine served another "
                "model?"
            )
        engine = target[:, self.layer * topk : (self.layer + 1) * topk]
        known = engine[:, 0] >= 0
        differs = (torch.sort(chosen, dim=1).values != torch.sort(engine, dim=1).values).any(dim=1) & known
        self.owner.count(differs.sum(), known.sum())
        if not self.owner.replay:
            return probs, chosen
        replayed = torch.where(known.unsqueeze(1), engine, chosen)
        return scores.gather(1, replayed), replayed


class RoutingReplay:
    """The routing hooks of one model's MoE routers, the ids of the micro-batch in flight, and the mismatch count."""

    def __init__(self, model: torch.nn.Module, *, replay: bool) -> None:
        self.replay = replay
        """Route to the engine's experts (else only count where the router differs from them)."""
        self.target: torch.Tensor | None = None
        self.routers: list[TopKRouter] = []
        self._sums: torch.Tensor | None = None
        for module in model.modules():
            if isinstance(module, TopKRouter):
                hook = _RouterHook(self, module.layer_number - 1)  # the global layer: the engine's column block
                hook.layer_number = module.layer_number
                module.router_replay = hook
                self.routers.append(module)

    def set_batch(self, batch: PackedBatch, device: torch.device) -> None:
        """Take ``batch``'s engine ids for the forward (and its backward) that follows; none: route normally.

        Raises:
            ValueError: replay is on and the batch carries no routed experts.
        """
        field = batch.token_fields.get(FIELD)
        if field is None:
            if self.replay:
                raise ValueError(
                    f"{FLAG}: the micro-batch carries no routed experts (token field {FIELD!r}); pass each sample's "
                    "engine routing (train_on_rollout(routed_experts=...)) or drop the flag"
                )
            self.target = None
            return
        target = field.to(device=device, dtype=torch.long)
        target[batch.num_real_tokens :] = -1  # the alignment tail: routed normally
        self.target = target

    def count(self, mismatched: torch.Tensor, decisions: torch.Tensor) -> None:
        """Add one router's counts of a forward (tensors: no host sync in the forward)."""
        pair = torch.stack([mismatched, decisions]).to(torch.float64)
        self._sums = pair if self._sums is None else self._sums + pair

    def reset(self) -> None:
        """Forget the counts."""
        self._sums = None

    def metrics(self, device: torch.device) -> dict[str, float]:
        """``rollout/routing_mismatch_share`` of the forwards since :meth:`reset` ({} when none carried engine ids).

        Summed over the data-parallel ranks and pipeline stages (a collective on them).
        """
        sums = (self._sums if self._sums is not None else torch.zeros(2, dtype=torch.float64)).to(device)
        for size, group in (
            (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_group),
            (parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_group),
        ):
            if size > 1:
                dist.all_reduce(sums, group=group())
        self.reset()
        if float(sums[1]) == 0:
            return {}
        return {"rollout/routing_mismatch_share": float(sums[0] / sums[1])}
