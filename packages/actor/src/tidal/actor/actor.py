"""The Megatron actor of one rank: build from an HF checkpoint, log-probs, one RL optimizer step, export."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from tidal.actor import moe_loss
from tidal.actor.attention import HostPackedSeqParams, set_cudnn_min_segment
from tidal.actor.bridge import (
    build_gpt_model,
    enable_layer_recompute,
    load_hf_weights,
    named_hf_tensors,
    router_buffers,
)
from tidal.actor.compat import apply_cpu_compat, apply_wgrad_accumulation_fusion
from tidal.actor.config import ActorConfig
from tidal.actor.context_parallel import context_parallel_size, gather_rows, shard_inputs
from tidal.actor.distributed import all_reduce_gradients, clip_gradients
from tidal.actor.errors import ActorError
from tidal.actor.hf_config import read_hf_config, to_transformer_config
from tidal.actor.hf_export import HFExporter, HFTensorBucket
from tidal.actor.logprobs import chunked_log_probs, to_token_convention
from tidal.actor.loss import LossSettings, actor_loss, load_function
from tidal.actor.main_params import MainParams
from tidal.actor.megatron_holds import release_dispatch_graphs
from tidal.actor.memory_plan import MemoryInputs, ModelShape, largest_fitting_tokens
from tidal.actor.offload import CPUOffloadAdamW, PinnedReservation, host_copy_shapes, move_tensors
from tidal.actor.oom import LOGPROB_FLAG, TRAIN_FLAG, run_reporting_oom
from tidal.actor.pipeline import (
    PipelineStage,
    all_reduce_tied_embedding_grad,
    broadcast_from_stage,
    broadcast_object_from_last_stage,
    run_schedule,
)
from tidal.actor.routing_replay import RoutingReplay
from tidal.actor.transfer import to_device, to_host_async
from tidal.batching import PackedBatch
from tidal.ckpt import read_hf_config_json

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Actor:
    """One rank's share of the policy model (TP shard, pipeline stage, DP replica) with its optimizer.

    Call ``init_distributed`` in this process first. Every rank of the actor group must make the
    same calls in the same order (they hold collectives).

    Optimizer: ``torch.optim.AdamW`` on this rank's parameters, gradients summed over the DP group
    and clipped by the norm over TP x PP; the same code on CPU (gloo) and GPU (NCCL). With pipeline
    parallelism (``pipeline``) micro-batches go through Megatron's 1F1B schedule; results are the same on every rank.
    """

    value_head = False
    """A scalar value head in place of the LM head (:class:`tidal.actor.critic.Critic`)."""
    kind = "actor"
    """The model's name in logs and offload metrics (``actor/offload_gb``)."""
    metric_prefix = "train"
    """Prefix of ``train_step``'s metrics (``train/loss``)."""
    ckpt_prefix = ""
    """Prefix of the model's keys in Megatron checkpoints (two models may share one checkpoint)."""

    def __init__(self, cfg: ActorConfig, *, weights: str | Actor = "hf") -> None:
        """Build this rank's model and optimizer (collective: every rank of the group builds it at once).

        ``weights`` says where the initial weights come from: ``"hf"`` reads ``cfg.hf_checkpoint`` (rank 0 reads,
        every rank gets its shards by broadcast: :func:`tidal.actor.bridge.load_hf_weights`); an ``Actor`` of the
        same layout built from the same checkpoint lends its current parameters (a copy in memory, nothing read;
        a critic takes all but the LM head); ``"checkpoint"`` reads nothing and leaves the parameters as Megatron
        initialised them, for a checkpoint that :meth:`load_state_dict` loads next: until it has, the model refuses
        to compute or export.
        """
        apply_cpu_compat()
        if not parallel_state.model_parallel_is_initialized():
            raise ActorError("Actor needs torch.distributed and Megatron parallel state: call init_distributed first")
        self.cfg = cfg
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = self.device or torch.device("cpu")
        self._fused = cfg.fused_kernels and self.device.type == "cuda"
        self._recompute_lm_head = cfg.recompute_lm_head
        self._exporters: dict[tuple, HFExporter] = {}
        self._pinned: PinnedReservation | None = None
        self.spec = read_hf_config(cfg.hf_checkpoint)
        self.stage = PipelineStage.current(self.spec.num_layers)
        # bf16 weights with fp32 main copies on CUDA: the weight-gradient GEMMs accumulate into the main gradients
        wgrad_fusion = self._fused and cfg.fp32_main_params
        if wgrad_fusion:
            apply_wgrad_accumulation_fusion()
        config = to_transformer_config(
            self.spec,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            params_dtype=_DTYPES[cfg.params_dtype],
            use_cpu_initialization=self.device.type == "cpu",
            fused_swiglu=self._fused,
            context_parallel_size=context_parallel_size(),
            pipeline_model_parallel_size=self.stage.size,
            gradient_accumulation_fusion=wgrad_fusion,
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_dtype=None if cfg.moe_router_dtype == "none" else cfg.moe_router_dtype,
        )
        # .to(dtype) as megatron's Float16Module does: the local spec's torch norms are created in fp32
        model = build_gpt_model(self.spec, config, self.stage, fused_kernels=self._fused, value_head=self.value_head)
        self.model = model.to(device=self.device, dtype=_DTYPES[cfg.params_dtype])
        self._expert_load = None
        self.routing_replay: RoutingReplay | None = None
        """The MoE routers' hooks: replay the engine's experts (--use-rollout-routing-replay), count mismatches."""
        if self.spec.moe is not None:
            moe_loss.prepare_model(self.model)
            release_dispatch_graphs(self.model)
            self._expert_load = moe_loss.ExpertLoad(self.model)
            self.routing_replay = RoutingReplay(self.model, replay=cfg.use_rollout_routing_replay)
        self._check_routing_replay()
        self._awaiting_checkpoint = False
        self.hf_bytes_read = self._init_weights(weights)
        """Bytes of HF weights this rank read while it was built (0 on every rank but rank 0, and without "hf")."""
        set_cudnn_min_segment(self.model, cfg.cudnn_attention_min_tokens)
        self.lora = None
        """The LoRA adapters (``tidal.actor.lora.LoRA``) with ``--lora-rank`` > 0: the base is frozen."""
        if cfg.lora_rank:
            from tidal.actor.lora import LoRASettings, apply_lora

            self.lora = apply_lora(self.model, self.spec, self.stage, LoRASettings.from_config(cfg))
        if cfg.recompute_activations:
            enable_layer_recompute(self.model, cfg.recompute_num_layers)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # with tied embeddings split over stages, the first stage's embedding and the last stage's output weight
        self._tied_index = None
        tied = self.spec.tie_word_embeddings and not self.value_head
        if tied and self.stage.size > 1 and (self.stage.first or self.stage.last) and not self.lora:
            tied = self.model.shared_embedding_or_output_weight()
            self._tied_index = next(i for i, p in enumerate(self.params) if p is tied)
        # With --fp32-main-params the optimizer owns fp32 copies of the (bf16) model parameters.
        self.main_params = MainParams(self.params) if cfg.fp32_main_params else None
        adam = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
        adam["weight_decay"] = cfg.weight_decay
        if cfg.optimizer_cpu_offload:
            self.optimizer = CPUOffloadAdamW(self._optimizer_params(), **adam)
        else:
            self.optimizer = torch.optim.AdamW(self._optimizer_params(), fused=self.device.type == "cuda", **adam)
        self.loss_settings = LossSettings.of(cfg)
        self._loss_fn = actor_loss
        if cfg.loss_type == "custom_loss":
            self._loss_fn = load_function(cfg.custom_loss_function_path, flag="--custom-loss-function-path")
        self.num_steps = 0
        self.num_skipped_steps = 0
        """Steps skipped for a non-finite gradient norm since this Actor was built (``--no-check-for-nan-...``)."""
        self.step_log_probs: list[torch.Tensor] = []
        """The log-probs the last :meth:`train_step` computed for micro-batches given without old ones."""
        self._autocast = cfg.bf16 and self.device.type == "cuda"
        if cfg.bf16 and not self._autocast:
            logger.warning("--bf16 has no effect on CPU: computing in %s", cfg.params_dtype)
        logger.info(
            "%s built from %s: %s, %d params on this rank, device %s",
            self.kind,
            cfg.hf_checkpoint,
            self.spec.model_type,
            sum(p.numel() for p in self.params),
            self.device,
        )

    def _init_weights(self, weights: str | Actor) -> int:
        """Fill the model's parameters from ``weights`` (see ``__init__``); the bytes of HF weights read here."""
        read = 0
        if isinstance(weights, Actor):
            weights.require_weights()
            _copy_parameters(self.model, weights.model, skip_head=self.value_head)
            how = f"copied from the {weights.kind} built from the same checkpoint"
        elif weights == "hf":
            hf = self.cfg.hf_checkpoint
            read = load_hf_weights(self.model, self.spec, hf, self.stage, value_head=self.value_head)
            how = f"read from {hf} by rank 0" if dist.get_rank() == 0 else f"{hf}'s, broadcast from rank 0"
        elif weights == "checkpoint" and self.cfg.lora_rank:  # a LoRA checkpoint holds the adapters alone
            return self._init_weights("hf")
        elif weights == "checkpoint":
            self._awaiting_checkpoint = True
            how = "left for the checkpoint loaded next"
        else:
            raise ValueError(f'weights must be "hf", "checkpoint" or an Actor, got {weights!r}')
        logger.info("%s weights: %s; this rank read %d bytes of HF weights", self.kind, how, read)
        return read

    def _check_routing_replay(self) -> None:
        if not self.cfg.use_rollout_routing_replay:
            return
        if self.spec.moe is None:
            raise ValueError(
                f"--use-rollout-routing-replay replays the experts of a mixture-of-experts model, but "
                f"{self.cfg.hf_checkpoint} is dense; drop the flag"
            )
        if self.stage.size > 1 and self.cfg.recompute_activations:
            raise ValueError(
                "--use-rollout-routing-replay with pipeline stages and --recompute-activations is not supported (a "
                "layer recomputed in backward would see another micro-batch's experts); drop one of them"
            )

    def require_weights(self) -> None:
        """Raise unless the model holds real weights (built with ``weights="checkpoint"``: once one is loaded)."""
        if self._awaiting_checkpoint:
            raise ActorError(
                f"the {self.kind} was built without weights for a checkpoint to load (weights='checkpoint'), and "
                "none was loaded: call load_state_dict with its 'model' section first"
            )

    def _forward(self, batch: PackedBatch, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of ``batch`` in tidal's convention, on the model's device.

        On a pipeline stage other than the last: its output hidden states (what the schedule sends on).
        """
        if self.routing_replay is not None:
            self.routing_replay.set_batch(batch, self.device)
        tokens = to_device(batch.tokens, self.device)
        cu = to_device(batch.cu_seqlens, self.device, torch.int32)
        params = HostPackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=int(batch.max_seqlen),
            max_seqlen_kv=int(batch.max_seqlen),
            host_cu_seqlens=tuple(batch.cu_seqlens.tolist()),
        )
        targets = torch.roll(tokens, -1)
        position_ids = to_device(batch.position_ids, self.device)
        # context parallelism: this rank's zigzag shard of every sequence; rows are gathered back below
        cp = shard_inputs(batch, self.device) if self.model.config.context_parallel_size > 1 else None
        if cp is not None:
            tokens, position_ids, params, targets = cp.tokens, cp.position_ids, cp.packed_seq_params, cp.targets

        head = self._head(targets, with_entropy=with_entropy)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast):
            out = self.model(
                tokens.unsqueeze(0),
                position_ids.unsqueeze(0),
                None,
                packed_seq_params=params,
                output_processor=head,
            )
        if not self.stage.last:
            return out
        lp, ent = out
        if cp is not None:
            lp = gather_rows(lp, batch, cp.shard)
            ent = gather_rows(ent, batch, cp.shard) if ent is not None else None
        lp = to_token_convention(lp, cu)
        return lp, (to_token_convention(ent, cu) if ent is not None else None)

    def _head(self, targets: torch.Tensor, *, with_entropy: bool):
        """The last stage's output processor: per-row ``(log-probs, entropy or None)`` of ``targets``."""

        def head(*, hidden_states, output_layer, output_weight, **_):
            return chunked_log_probs(
                hidden_states,
                output_layer,
                output_weight,
                targets,
                chunk_size=self.cfg.log_probs_chunk_size,
                temperature=self.cfg.temperature,
                with_entropy=with_entropy,
                entropy_grad=self.cfg.entropy_coef != 0.0,
                fused=self._fused,
                recompute=self._recompute_lm_head,
            )

        return head

    @torch.no_grad()
    def compute_log_probs(self, batch: PackedBatch) -> torch.Tensor:
        """Log-probs of ``batch.tokens`` under the current weights.

        Returns:
            float32 ``[T]`` on CPU: position t holds log p(tokens[t] | earlier tokens of its sequence),
            0 at each sequence's first token (and meaningless on the padding tail).
        """
        self.require_weights()  # before any collective: every rank refuses alike
        self.model.eval()
        if self.stage.size == 1:
            lp, _ = self._guard_oom(lambda: self._forward(batch, with_entropy=False), [batch], logprob=True)
            return lp.float().cpu()
        # the last stage computes them through the schedule, then every stage receives them
        forward = functools.partial(self._forward, with_entropy=False)
        out = self._guard_oom(
            lambda: run_schedule(self.model, [batch], forward, _keep_log_probs, forward_only=True),
            [batch],
            logprob=True,
        )
        lp = out[0] if self.stage.last else torch.empty(batch.num_tokens, dtype=torch.float32, device=self.device)
        broadcast_from_stage(lp, self.stage.size - 1)
        return lp.cpu()

    def _guard_oom(self, fn, batches: Sequence[PackedBatch], *, logprob: bool):
        """``fn()``; an out-of-memory becomes one line naming the budget the memory plan says fits."""
        longest = max(int(mb.max_seqlen) for mb in batches)

        def fitting_tokens(gpu_bytes: int) -> int:
            inputs = MemoryInputs.from_actor_config(
                self.cfg,
                train_tokens=1,
                logprob_tokens=1,
                longest_sequence=longest,
                tensor_parallel=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_parallel=self.stage.size,
                context_parallel=context_parallel_size(),
                expert_parallel=parallel_state.get_expert_model_parallel_world_size(),
            )
            shape = ModelShape.from_hf_config(read_hf_config_json(self.cfg.hf_checkpoint))
            return largest_fitting_tokens(shape, inputs, gpu_bytes=gpu_bytes, logprob=logprob)

        return run_reporting_oom(
            fn,
            what="log-prob" if logprob else "training",
            tokens=max(mb.num_tokens for mb in batches),
            device=self.device,
            flag=LOGPROB_FLAG if logprob else TRAIN_FLAG,
            fitting_tokens=fitting_tokens,
            model=self.model,
        )

    def _lr(self) -> float:
        warmup = self.cfg.lr_warmup_steps
        if warmup and self.num_steps < warmup:
            return self.cfg.lr * (self.num_steps + 1) / warmup
        return self.cfg.lr

    def _num_loss_tokens(self, micro_batches: Sequence[PackedBatch]) -> float:
        total = torch.tensor(sum(_loss_weight(mb) for mb in micro_batches), device=self.device)
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return float(total)

    def train_step(self, micro_batches: Sequence[PackedBatch]) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (gradient accumulation), token-level loss.

        Reads token fields "old_log_probs" and "advantages" (and "ref_log_probs" when
        ``kl_loss_coef`` is non-zero). The loss is the mean over every loss token of the step, all
        micro-batches and DP ranks together. A step whose gradient norm is not finite is skipped.

        A micro-batch without "old_log_probs" (one pipeline stage only) takes this forward's own log-probs,
        detached: the weights before this step, exactly what an old-log-prob pass would have computed, since no
        step ran since. They are kept in :attr:`step_log_probs` (float32, CPU, one tensor per micro-batch).

        Returns:
            Metrics, identical on every rank: "train/loss", "train/pg_loss", "train/pg_clipfrac",
            "train/ppo_kl", "train/entropy", "train/kl" (with KL), "train/grad_norm", "train/lr",
            "train/num_loss_tokens", "train/skipped" (1.0 when this step was skipped), "train/skipped_steps" (the
            running total of skipped steps).
        """
        self.require_weights()  # before any collective: every rank refuses alike
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        num_loss_tokens = self._num_loss_tokens(micro_batches)
        self._zero_grad()
        balance_loss = self._begin_balance_loss(len(micro_batches))
        totals: dict[str, torch.Tensor] = {}

        self.step_log_probs = []
        if self.stage.size > 1 and any("old_log_probs" not in mb.token_fields for mb in micro_batches):
            raise ValueError("train_step with pipeline stages needs every micro-batch's old_log_probs")

        def loss_of(mb: PackedBatch, output: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
            fields = {k: to_device(v, self.device) for k, v in mb.token_fields.items()}
            if "old_log_probs" not in fields:  # this forward runs on the weights the old log-probs mean
                fields["old_log_probs"] = output[0].detach().float()
                self.step_log_probs.append(to_host_async(fields["old_log_probs"]))  # complete after the sync below
            loss, sums = self._loss_fn(
                *output,
                fields,
                to_device(mb.loss_mask, self.device),
                self.loss_settings,
                num_loss_tokens=num_loss_tokens,
                cu_seqlens=mb.cu_seqlens,
            )
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value.float()
            return loss

        forward = functools.partial(self._forward, with_entropy=True)
        if self.stage.size == 1:
            for mb in micro_batches:
                self._guard_oom(lambda mb=mb: loss_of(mb, forward(mb)).backward(), [mb], logprob=False)
        else:  # the loss on the last stage; metrics come from there (_metrics)
            self._guard_oom(
                lambda: run_schedule(
                    self.model,
                    micro_batches,
                    forward,
                    lambda mb, out: (loss_of(mb, out), _ONE, None),
                    forward_only=False,
                ),
                micro_batches,
                logprob=False,
            )
        if self.step_log_probs and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the step_log_probs copies have landed
        params = self._optimizer_params()
        all_reduce_gradients(params)
        if self._tied_index is not None:
            all_reduce_tied_embedding_grad(params[self._tied_index].grad)
        grad_norm = clip_gradients(params, self.cfg.clip_grad)
        lr = self._lr()
        skipped = not math.isfinite(grad_norm)
        if skipped and self.cfg.check_for_nan_in_loss_and_grad:
            raise ActorError(
                f"optimizer step {self.num_steps}: the gradient norm is {grad_norm} (loss "
                f"{float(totals.get('loss', float('nan'))):.4g}); lower --lr, check the rewards, or pass "
                "--no-check-for-nan-in-loss-and-grad to skip such steps instead"
            )
        if skipped:
            self.num_skipped_steps += 1
            logger.warning(
                "skipping optimizer step %d: gradient norm is %s (%d step(s) skipped so far)",
                self.num_steps,
                grad_norm,
                self.num_skipped_steps,
            )
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            if self.main_params:
                self.main_params.copy_to_model()
            self.num_steps += 1
        if not self.main_params:  # main gradients stay allocated (zeroed at the next step)
            self.optimizer.zero_grad(set_to_none=True)
        metrics = self._metrics(totals, grad_norm=grad_norm, lr=lr, num_loss_tokens=num_loss_tokens, skipped=skipped)
        return metrics | self._balance_loss_metrics(balance_loss, len(micro_batches))

    def _begin_balance_loss(self, num_micro_batches: int) -> bool:
        """Whether this step has an MoE load-balancing loss; if so, each micro-batch's weighs 1 / (the step's)."""
        if self._expert_load is not None:
            self._expert_load.reset()
        if self.spec.moe is None or self.cfg.moe_aux_loss_coeff == 0:
            return False
        moe_loss.begin_step(self.model, num_micro_batches * parallel_state.get_data_parallel_world_size(), self.device)
        return True

    def _balance_loss_metrics(self, on: bool, num_micro_batches: int) -> dict[str, float]:
        if self._expert_load is None:
            return {}
        load = {f"{self.metric_prefix}/moe_expert_load_max": self._expert_load.metric(self.device)}
        if not on:
            return load
        value = moe_loss.step_metric(
            num_moe_layers=self.spec.moe.num_moe_layers,
            num_micro_batches=num_micro_batches,
            recomputed=self._recomputed_layers(),
            device=self.device,
        )
        return load | {f"{self.metric_prefix}/moe_load_balancing_loss": value}

    def _recomputed_layers(self) -> list[int]:
        """Global indices of this stage's layers whose forward runs again in backward (--recompute-activations)."""
        if not self.cfg.recompute_activations:
            return []
        local = self.spec.num_layers // self.stage.size
        count = self.cfg.recompute_num_layers or local
        return [self.stage.layer_offset + i for i in range(min(count, local))]

    def _optimizer_params(self) -> list[torch.nn.Parameter]:
        return self.main_params.main if self.main_params else self.params

    def _zero_grad(self) -> None:
        if self.main_params:
            self.main_params.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _metrics(
        self, totals: dict[str, torch.Tensor], *, grad_norm: float, lr: float, num_loss_tokens: float, skipped: bool
    ) -> dict[str, float]:
        metrics = {}
        if self.stage.last:  # the only stage that computed the loss
            keys = sorted(totals)
            stacked = torch.stack([totals[k] for k in keys])
            if parallel_state.get_data_parallel_world_size() > 1:
                dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
            metrics = {f"{self.metric_prefix}/{k}": float(v) for k, v in zip(keys, stacked.tolist(), strict=True)}
        if self.stage.size > 1:
            metrics = broadcast_object_from_last_stage(metrics)
        extra = {"grad_norm": grad_norm, "lr": lr, "num_loss_tokens": num_loss_tokens, "skipped": float(skipped),
                 "skipped_steps": float(self.num_skipped_steps)}  # fmt: skip
        metrics |= {f"{self.metric_prefix}/{k}": v for k, v in extra.items()}
        return metrics

    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF names and tensors on CPU (TP shards gathered, pipeline stages broadcast; every rank must iterate).

        The checkpoint path: tensors as the optimizer holds them (with ``fp32_main_params``, the fp32 main copies).
        """
        self.require_weights()
        params = None
        if self.lora:  # the merged weights; with --fp32-main-params from the model's adapters
            return named_hf_tensors(self.model, self.spec, params=self._merged(), stage=self.stage)
        if self.main_params:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            params = dict(zip(names, self.main_params.main, strict=True))
        return named_hf_tensors(self.model, self.spec, params=params, stage=self.stage)

    def hf_tensor_buckets(
        self,
        *,
        dtype: torch.dtype = torch.bfloat16,
        bucket_bytes: int = 512 * 2**20,
        reuse_buffers: bool = False,
        stage_only: bool = False,
    ) -> Iterator[HFTensorBucket]:
        """The weight-sync path: HF tensors cast to ``dtype`` on this rank's device, packed into flat buckets.

        Each ``HFTensorBucket`` holds at most ``bucket_bytes`` (a larger single tensor gets its own); iterating
        one yields ``(hf_name, tensor)`` views into its ``flat`` buffer. TP shards are gathered and pipeline stages
        broadcast (every rank must iterate). Equal to ``named_hf_tensors()`` cast to ``dtype`` (the
        score-correction biases of a ``glm4_moe`` kept float32, in a last bucket). With
        ``reuse_buffers`` the buffers are kept and refilled by the next call (consume a bucket before asking for
        the next export). With ``stage_only`` only this pipeline stage's HF tensors (in HF order; the tied
        embedding from the first stage), with no broadcast between stages: only this rank's TP group iterates.
        """
        self.require_weights()
        key = (dtype, bucket_bytes, reuse_buffers, stage_only)
        if key not in self._exporters:
            params = (
                dict(self.model.named_parameters()) | router_buffers(self.model) if not self.lora else self._merged()
            )
            self._exporters[key] = HFExporter(
                params, self.spec, dtype=dtype, bucket_bytes=bucket_bytes, reuse_buffers=reuse_buffers,
                stage=self.stage, stage_only=stage_only, fixed_sources=not self.lora,
            )  # fmt: skip
        return self._exporters[key].buckets()

    def _merged(self):
        """With LoRA: the stage's parameters, each adapted weight read as W + scale * B @ A (computed on lookup)."""
        return self.lora.merged(dict(self.model.named_parameters()))

    def offload(self) -> dict[str, float]:
        """Move parameters, gradients and optimizer state to host memory (co-located: the engines need the GPU).

        The weight-sync buffers are dropped. On a CPU actor nothing moves (the call is the same). Every tensor comes
        back with :meth:`onload`; nothing may run on the model in between.

        Returns:
            ``actor/offload_gb`` (moved), ``actor/offload_s`` and, on CUDA, ``actor/gpu_allocated_gb`` after it.
        """
        self._exporters.clear()
        return self._move(torch.device("cpu"), "offload")

    def reserve_offload_memory(self) -> None:
        """Pin, in a background thread, the host memory :meth:`offload` will copy into (CUDA only; else nothing).

        Call it while the engines start: the first offload otherwise pins it itself (22.3 s for a 1.5B actor on an
        H200 host). Sizes are those of every tensor :meth:`offload` moves, AdamW's moments included (created now,
        as zeros, exactly as the first step would). :meth:`offload` waits for the thread.
        """
        if self.device.type != "cuda" or self._pinned is not None:
            return
        self._ensure_optimizer_state()
        self._pinned = PinnedReservation(host_copy_shapes(self._offloadable()))
        logger.info("pinning %.1f GiB of host memory for offload in the background", self._pinned.bytes / 2**30)

    def onload(self) -> dict[str, float]:
        """Bring back what :meth:`offload` moved; ``actor/onload_gb``, ``actor/onload_s`` (and GPU memory on CUDA)."""
        return self._move(self.device, "onload")

    def _offloadable(self) -> Iterator[torch.Tensor]:
        for p in self.model.parameters():  # the frozen base of LoRA too
            yield p
            if p.grad is not None:
                yield p.grad
        if self.main_params:
            for main in self.main_params.main:
                yield main
                if main.grad is not None:
                    yield main.grad
        if not isinstance(self.optimizer, CPUOffloadAdamW):  # its moments already live in host memory
            for state in self.optimizer.state.values():
                yield from (v for k, v in state.items() if torch.is_tensor(v) and k != "step")

    def _move(self, device: torch.device, what: str) -> dict[str, float]:
        if self._pinned is not None:
            self._pinned.wait()
        tick = time.perf_counter()
        moved = move_tensors(self._offloadable(), device)
        metrics = {f"{self.kind}/{what}_gb": moved / 2**30, f"{self.kind}/{what}_s": time.perf_counter() - tick}
        if self.device.type == "cuda":
            metrics[f"{self.kind}/gpu_allocated_gb"] = torch.cuda.memory_allocated(self.device) / 2**30
        return metrics

    def _ensure_optimizer_state(self) -> None:
        """Give AdamW its zero state before the first step (same update as lazy init) so it can be checkpointed."""
        if self.optimizer.state:
            return
        if isinstance(self.optimizer, CPUOffloadAdamW):
            self.optimizer.init_state()
            return
        for group in self.optimizer.param_groups:
            # as torch's AdamW initialises it: a fused (CUDA) or capturable update needs its step on the device
            on_device = group.get("fused") or group.get("capturable")
            for p in group["params"]:
                self.optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def sharded_state_dict(self, *, with_optimizer: bool = True) -> dict:
        """Megatron sharded state of the model (and AdamW state) for ``tidal.ckpt.save_checkpoint``/``load_checkpoint``.

        Sections: ``"model"`` and, with ``with_optimizer``, ``"optimizer"`` (exp_avg/exp_avg_sq sharded like
        their parameters, plus the step count). Because tensors are stored by global shape, a checkpoint
        saved at one TP/DP size loads at another.
        """
        if self.lora:  # the adapters alone: the frozen base comes from --hf-checkpoint
            model_sd = self.lora.sharded_state_dict(prefix=self.ckpt_prefix)
        else:
            model_sd = self.model.sharded_state_dict(prefix=self.ckpt_prefix)
        out = {"model": model_sd}
        if with_optimizer:
            self._ensure_optimizer_state()
            optim = self.optimizer.state_dict()
            if self.main_params:  # fp32 main weights travel with the optimizer state, sharded like the model's
                for i, main in enumerate(self.main_params.main):  # a new dict: state_dict() shares the live ones
                    optim["state"][i] = {**optim["state"][i], "main_param": main.detach()}
            id_map = get_param_id_to_sharded_param_map(model_sd, iter(self.params))
            optim_state_to_sharding_state(optim, id_map, exclude_keys=("step",))
            optim["num_steps"] = ShardedObject(
                f"{self.ckpt_prefix}optimizer.num_steps", self.num_steps, (1,), (0,), replica_id=dist.get_rank()
            )
            out["optimizer"] = optim
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what ``tidal.ckpt.load_checkpoint`` returned for ``sharded_state_dict()`` (either section optional)."""
        optim, mains = None, {}
        if "optimizer" in state_dict:
            optim = dict(state_dict["optimizer"])
            # copies: the loaded main weights may share storage with this actor's (dist_checkpointing loads in place)
            optim["state"] = {i: dict(param_state) for i, param_state in optim["state"].items()}
            mains = {i: st.pop("main_param").clone() for i, st in optim["state"].items() if "main_param" in st}
        if "model" in state_dict:
            model = state_dict["model"]
            if self.lora:
                self.lora.load_sharded(model, prefix=self.ckpt_prefix)
            else:  # the keys carry the prefix they were saved under
                self.model.load_state_dict({k.removeprefix(self.ckpt_prefix): v for k, v in model.items()}, strict=True)
            self._awaiting_checkpoint = False
            if self.main_params:
                self.main_params.copy_from_model()
        if optim is not None:
            self.num_steps = int(optim.pop("num_steps"))
            for param_state in optim["state"].values():
                param_state["step"] = torch.tensor(float(self.num_steps))
            self.optimizer.load_state_dict(optim)
            if self.main_params and mains:
                with torch.no_grad():
                    for i, main in mains.items():
                        self.main_params.main[i].copy_(main)
                self.main_params.copy_to_model()


@torch.no_grad()
def _copy_parameters(dst: torch.nn.Module, src: torch.nn.Module, *, skip_head: bool) -> None:
    """Copy every parameter of ``dst`` from ``src``'s of the same name (a model of the same layout and rank).

    ``skip_head``: ``dst`` is a critic, whose value head (``output_layer.*``) keeps its own initial weights.
    """
    source = dict(src.named_parameters())
    for name, param in dst.named_parameters():
        if skip_head and name.startswith("output_layer."):
            continue
        other = source.get(name)
        if other is None or other.shape != param.shape:
            found = "none" if other is None else tuple(other.shape)
            raise ActorError(f"cannot copy {name} {tuple(param.shape)} from a model of another layout (it has {found})")
        param.copy_(other)


_ONE = torch.ones((), dtype=torch.int)  # the "token count" handed to Megatron's schedule (it does not rescale)


def _keep_log_probs(_mb: PackedBatch, output: tuple[torch.Tensor, torch.Tensor | None]) -> tuple:
    """The schedule's loss function in the log-prob pass: no loss, keep the log-probs."""
    return torch.zeros(()), _ONE, output[0].float().contiguous()


def _loss_weight(mb: PackedBatch) -> float:
    """Sum of a micro-batch's loss-token weights: its loss tokens, or with "loss_weights" their weighted sum."""
    mask = mb.loss_mask.float()
    if "loss_weights" in mb.token_fields:
        mask = mask * mb.token_fields["loss_weights"]
    return float(mask.sum())
