"""The Megatron actor of one rank: build from an HF checkpoint, log-probs, one RL optimizer step, export."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from megatron.core.packed_seq_params import PackedSeqParams
from tidal.actor.bridge import build_gpt_model, enable_layer_recompute, load_hf_weights, named_hf_tensors
from tidal.actor.compat import apply_cpu_compat
from tidal.actor.config import ActorConfig
from tidal.actor.distributed import all_reduce_gradients, clip_gradients
from tidal.actor.errors import ActorError
from tidal.actor.hf_config import read_hf_config, to_transformer_config
from tidal.actor.logprobs import chunked_log_probs, to_token_convention
from tidal.actor.loss import LossSettings, actor_loss
from tidal.batching import PackedBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Actor:
    """One rank's share of the policy model (TP shard, DP replica) with its optimizer.

    Call ``init_distributed`` in this process first. Every rank of the actor group must make the
    same calls in the same order (they hold collectives).

    Optimizer: ``torch.optim.AdamW`` on this rank's parameters, gradients summed over the DP group
    and clipped by the TP-global norm; the same code on CPU (gloo) and GPU (NCCL).
    """

    def __init__(self, cfg: ActorConfig) -> None:
        apply_cpu_compat()
        if not parallel_state.model_parallel_is_initialized():
            raise ActorError("Actor needs torch.distributed and Megatron parallel state: call init_distributed first")
        self.cfg = cfg
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = self.device or torch.device("cpu")
        self.spec = read_hf_config(cfg.hf_checkpoint)
        config = to_transformer_config(
            self.spec,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            params_dtype=_DTYPES[cfg.params_dtype],
            use_cpu_initialization=self.device.type == "cpu",
        )
        self.model = build_gpt_model(self.spec, config).to(self.device)
        load_hf_weights(self.model, self.spec, cfg.hf_checkpoint)
        if cfg.recompute_activations:
            enable_layer_recompute(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.loss_settings = LossSettings(
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high,
            kl_loss_coef=cfg.kl_loss_coef,
            kl_loss_type=cfg.kl_loss_type,
            entropy_coef=cfg.entropy_coef,
        )
        self.num_steps = 0
        self._autocast = cfg.bf16 and self.device.type == "cuda"
        if cfg.bf16 and not self._autocast:
            logger.warning("--bf16 has no effect on CPU: computing in %s", cfg.params_dtype)
        logger.info(
            "actor built from %s: %s, %d params on this rank, device %s",
            cfg.hf_checkpoint,
            self.spec.model_type,
            sum(p.numel() for p in self.params),
            self.device,
        )

    def _forward(self, batch: PackedBatch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of ``batch`` in tidal's convention, on the model's device."""
        tokens = batch.tokens.to(self.device)
        cu = batch.cu_seqlens.to(device=self.device, dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=int(batch.max_seqlen),
            max_seqlen_kv=int(batch.max_seqlen),
        )
        targets = torch.roll(tokens, -1)

        def head(*, hidden_states, output_layer, output_weight, **_):
            return chunked_log_probs(
                hidden_states,
                output_layer,
                output_weight,
                targets,
                chunk_size=self.cfg.log_probs_chunk_size,
                temperature=self.cfg.temperature,
                with_entropy=with_entropy,
            )

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            lp, ent = self.model(
                tokens.unsqueeze(0),
                batch.position_ids.to(self.device).unsqueeze(0),
                None,
                packed_seq_params=params,
                output_processor=head,
            )
        lp = to_token_convention(lp, cu)
        return lp, (to_token_convention(ent, cu) if ent is not None else None)

    @torch.no_grad()
    def compute_log_probs(self, batch: PackedBatch) -> torch.Tensor:
        """Log-probs of ``batch.tokens`` under the current weights.

        Returns:
            float32 ``[T]`` on CPU: position t holds log p(tokens[t] | earlier tokens of its sequence),
            0 at each sequence's first token (and meaningless on the padding tail).
        """
        self.model.eval()
        lp, _ = self._forward(batch, with_entropy=False)
        return lp.float().cpu()

    def _lr(self) -> float:
        warmup = self.cfg.lr_warmup_steps
        if warmup and self.num_steps < warmup:
            return self.cfg.lr * (self.num_steps + 1) / warmup
        return self.cfg.lr

    def _num_loss_tokens(self, micro_batches: Sequence[PackedBatch]) -> float:
        total = torch.tensor(sum(float(mb.loss_mask.sum()) for mb in micro_batches), device=self.device)
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return float(total)

    def train_step(self, micro_batches: Sequence[PackedBatch]) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (gradient accumulation), token-level loss.

        Reads token fields "old_log_probs" and "advantages" (and "ref_log_probs" when
        ``kl_loss_coef`` is non-zero). The loss is the mean over every loss token of the step, all
        micro-batches and DP ranks together. A step whose gradient norm is not finite is skipped.

        Returns:
            Metrics, identical on every rank: "train/loss", "train/pg_loss", "train/pg_clipfrac",
            "train/ppo_kl", "train/entropy", "train/kl" (with KL), "train/grad_norm", "train/lr",
            "train/num_loss_tokens", "train/skipped".
        """
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        num_loss_tokens = self._num_loss_tokens(micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, torch.Tensor] = {}
        for mb in micro_batches:
            lp, ent = self._forward(mb, with_entropy=True)
            fields = {k: v.to(self.device) for k, v in mb.token_fields.items()}
            loss, sums = actor_loss(
                lp, ent, fields, mb.loss_mask.to(self.device), self.loss_settings, num_loss_tokens=num_loss_tokens
            )
            loss.backward()
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value.float()
        all_reduce_gradients(self.params)
        grad_norm = clip_gradients(self.params, self.cfg.clip_grad)
        lr = self._lr()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("skipping optimizer step %d: gradient norm is %s", self.num_steps, grad_norm)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.num_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return self._metrics(totals, grad_norm=grad_norm, lr=lr, num_loss_tokens=num_loss_tokens, skipped=skipped)

    def _metrics(
        self, totals: dict[str, torch.Tensor], *, grad_norm: float, lr: float, num_loss_tokens: float, skipped: bool
    ) -> dict[str, float]:
        keys = sorted(totals)
        stacked = torch.stack([totals[k] for k in keys])
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
        metrics = {f"train/{k}": float(v) for k, v in zip(keys, stacked.tolist(), strict=True)}
        metrics |= {
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/num_loss_tokens": num_loss_tokens,
            "train/skipped": float(skipped),
        }
        return metrics

    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF names and tensors on CPU (TP shards gathered; every TP rank must iterate)."""
        return named_hf_tensors(self.model, self.spec)

    def _ensure_optimizer_state(self) -> None:
        """Give AdamW its zero state before the first step (same update as lazy init) so it can be checkpointed."""
        if self.optimizer.state:
            return
        for p in self.params:
            self.optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }

    def sharded_state_dict(self, *, with_optimizer: bool = True) -> dict:
        """Megatron sharded state of the model (and AdamW state) for ``tidal.ckpt.save_checkpoint``/``load_checkpoint``.

        Sections: ``"model"`` and, with ``with_optimizer``, ``"optimizer"`` (exp_avg/exp_avg_sq sharded like
        their parameters, plus the step count). Because tensors are stored by global shape, a checkpoint
        saved at one TP/DP size loads at another.
        """
        model_sd = self.model.sharded_state_dict()
        out = {"model": model_sd}
        if with_optimizer:
            self._ensure_optimizer_state()
            optim = self.optimizer.state_dict()
            id_map = get_param_id_to_sharded_param_map(model_sd, iter(self.params))
            optim_state_to_sharding_state(optim, id_map, exclude_keys=("step",))
            optim["num_steps"] = ShardedObject(
                "optimizer.num_steps", self.num_steps, (1,), (0,), replica_id=dist.get_rank()
            )
            out["optimizer"] = optim
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``tidal.ckpt.load_checkpoint`` returned for ``sharded_state_dict()`` (either section optional)."""
        if "model" in state_dict:
            self.model.load_state_dict(state_dict["model"], strict=True)
        if "optimizer" in state_dict:
            optim = dict(state_dict["optimizer"])
            self.num_steps = int(optim.pop("num_steps"))
            for param_state in optim["state"].values():
                param_state["step"] = torch.tensor(float(self.num_steps))
            self.optimizer.load_state_dict(optim)
