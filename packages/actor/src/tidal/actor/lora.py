"""LoRA adapters on the Megatron actor's linear layers, the base weights frozen.

Every targeted HF module of a decoder layer (``lora_targets.HF_MODULES``) gets a pair A ``[r, in]``, B ``[out, r]``
and adds ``(alpha / r) * B @ A @ dropout(x)`` to its layer's output. The adapters sit on Megatron's layers as a
child module ``lora`` and a forward hook, so the base parameters keep their names (loading, export and checkpoints
of the base are unchanged). Megatron's fused layers hold several HF modules: ``linear_qkv`` (q/k/v, its rows
interleaved per query group, see ``bridge``) and ``linear_fc1`` (gate/up stacked per TP rank) carry one pair per HF
module, each delta placed into the fused output where that module's rows are, so q, k and v are targeted and
exported separately under the names PEFT uses.

Tensor parallelism:

* column-parallel layers (q/k/v, gate/up): A replicated, B split on its output rows like the layer; the rank-r
  activation ``A x`` goes through ``copy_to_tensor_model_parallel_region`` (all-reduce in backward), so A's
  gradient and the input's gradient are whole on every TP rank.
* row-parallel layers (o, down): A split on its input columns like the layer, ``A_r x_r`` summed over TP
  (``reduce_from_tensor_model_parallel_region``), B replicated.

Pipeline stages hold their own layers' adapters. The full tensors (``adapter_tensors``) are initialised from a
generator seeded by each tensor's HF name, so every TP/PP layout starts from the same adapters: A as PEFT's
(Kaiming-uniform), B zero, so the model at step 0 is the base model. The base is frozen (``requires_grad`` False:
megatron's linear layers then take their frozen-weight path, and the actor's optimizer, gradient reduction and fp32
main copies see the adapters alone). ``adapters_disabled`` switches them off (the KL reference: :class:`BaseReference`).
``MergedParams`` gives ``W + scale * B @ A`` for the export of full HF weights (weight sync, ``--save-hf``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from tidal.actor.hf_config import HFModelSpec
from tidal.actor.lora_targets import HF_MODULES, HF_PARENT, MEGATRON_LAYERS, resolve_target_modules
from tidal.actor.pipeline import PipelineStage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoRASettings:
    """Rank, scale and targets of the adapters (from ``ActorConfig``'s ``lora_*`` fields)."""

    rank: int
    alpha: float
    dropout: float
    modules: tuple[str, ...]
    """HF module names (``lora_targets.HF_MODULES`` order)."""
    seed: int = 0
    """Added to each tensor's name hash: the initial A matrices."""

    @property
    def scale(self) -> float:
        """Alpha / rank."""
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, cfg) -> LoRASettings:
        """The settings of an ``ActorConfig`` with ``lora_rank`` > 0."""
        modules = resolve_target_modules(cfg.lora_target_modules)
        return cls(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, modules=modules, seed=cfg.seed)


class LoRAAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer: an (A, B) pair per HF module it holds.

    Args:
        kind: "column" (q/k/v, gate/up: the layer's output rows split over TP) or "row" (o, down: input split).
        layout: every HF module the layer holds, in its order: ``(name, full output rows, targeted)``; an
            untargeted module of a fused layer adds zeros.
        in_features: the layer's full input size.
        out_features: the layer's full output size (row layers).
        hf_prefix: HF name of the layer's parent module (``model.layers.3.self_attn.``).
        groups: with q/k/v, the query groups (KV heads) on this TP rank; the fused rows interleave per group.
    """

    def __init__(
        self,
        kind: str,
        layout: list[tuple[str, int, bool]],
        *,
        in_features: int,
        out_features: int,
        hf_prefix: str,
        settings: LoRASettings,
        dtype: torch.dtype,
        device: torch.device,
        groups: int = 0,
    ) -> None:
        super().__init__()
        self.kind, self.layout, self.groups, self.settings = kind, layout, groups, settings
        self.enabled = True
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else torch.nn.Identity()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        r = settings.rank
        for name, rows, targeted in layout:
            if not targeted:
                continue
            out = rows if kind == "column" else out_features
            for which, shape, split in (("A", (r, in_features), 1 if kind == "row" else None),
                                        ("B", (out, r), 0 if kind == "column" else None)):  # fmt: skip
                full = torch.zeros(shape, dtype=torch.float32)
                hf_name = f"{hf_prefix}{name}.lora_{which}.weight"
                if which == "A":
                    gen = torch.Generator().manual_seed(settings.seed + zlib.crc32(hf_name.encode()))
                    torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
                local = full if split is None else full.chunk(self.tp_size, dim=split)[self.tp_rank]
                param = torch.nn.Parameter(local.to(device=device, dtype=dtype).contiguous())
                param.lora_hf_name, param.lora_full_shape, param.lora_split_dim = hf_name, shape, split
                set_tensor_model_parallel_attributes(param, split is not None, 0 if split is None else split, 1)
                getattr(self, which)[name] = param

    @property
    def targets(self) -> list[str]:
        """The HF modules with adapters here."""
        return [name for name, _, targeted in self.layout if targeted]

    def hook(self, _module, args, kwargs, output):
        """Forward hook of the base layer: its ``(output, bias)`` with the adapters' delta added to the output."""
        if not self.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta(x).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B @ A @ dropout(x)`` on this rank's share of the layer's output (fused rows in place)."""
        x = self.dropout(x)
        names = self.targets
        if self.kind == "row":
            h = torch.nn.functional.linear(x, self.A[names[0]])
            if self.tp_size > 1:
                h = reduce_from_tensor_model_parallel_region(h)
            return torch.nn.functional.linear(h * self.settings.scale, self.B[names[0]])
        a = self.A[names[0]] if len(names) == 1 else torch.cat([self.A[n] for n in names])
        h = torch.nn.functional.linear(x, a) * self.settings.scale
        if self.tp_size > 1:
            h = copy_to_tensor_model_parallel_region(h)
        parts = dict(zip(names, h.split(self.settings.rank, dim=-1), strict=True))
        return self._fuse({n: torch.nn.functional.linear(parts[n], self.B[n]) for n in names}, x.shape[:-1])

    def _fuse(self, parts: dict[str, torch.Tensor], lead: torch.Size) -> torch.Tensor:
        """This rank's rows of every module of a column layer, in the fused layer's order (zeros where untargeted).

        ``parts`` hold ``[..., rows]`` (activations) or, with ``lead`` empty and a trailing input dim, weights.
        """
        pieces = []
        for name, rows, _ in self.layout:
            local = rows // self.tp_size
            piece = parts.get(name)
            if piece is None:
                ref = next(iter(parts.values()))
                piece = ref.new_zeros(*ref.shape[: len(lead)], local, *ref.shape[len(lead) + 1 :])
            pieces.append(piece)
        if not self.groups:  # gate/up: stacked
            return torch.cat(pieces, dim=len(lead))
        # q/k/v: per query group, [q heads of the group, k, v]
        grouped = [p.reshape(*lead, self.groups, -1, *p.shape[len(lead) + 1 :]) for p in pieces]
        fused = torch.cat(grouped, dim=len(lead) + 1)
        return fused.reshape(*lead, -1, *fused.shape[len(lead) + 2 :])

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` as this rank's shard of the layer's weight (fp32)."""
        names = self.targets
        if self.kind == "row":
            return self.settings.scale * (self.B[names[0]].float() @ self.A[names[0]].float())
        parts = {n: self.settings.scale * (self.B[n].float() @ self.A[n].float()) for n in names}
        return self._fuse(parts, torch.Size())


def apply_lora(model: torch.nn.Module, spec: HFModelSpec, stage: PipelineStage, settings: LoRASettings) -> LoRA:
    """Freeze ``model`` and put adapters on its targeted linear layers (this stage's layers).

    Raises:
        ValueError: a targeted module is in no layer of this model (the message names the modules there are).
    """
    for p in model.parameters():
        p.requires_grad_(False)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    d, h = spec.head_dim, spec.hidden_size
    q, kv, ffn = spec.num_attention_heads * d, spec.num_key_value_heads * d, spec.ffn_hidden_size
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": ffn, "up_proj": ffn, "down_proj": h}
    inputs = {"o_proj": q, "down_proj": ffn}
    some = next(model.parameters())
    adapters: dict[str, LoRAAdapter] = {}
    present: set[str] = set()
    for local_index, layer in enumerate(model.decoder.layers):
        index = stage.layer_offset + local_index
        for layer_name, modules in MEGATRON_LAYERS.items():
            try:
                linear = layer.get_submodule(layer_name)
            except AttributeError:
                continue
            present.update(modules)
            targeted = [m for m in modules if m in settings.modules]
            if not targeted:
                continue
            kind = "row" if layer_name.endswith(("linear_proj", "linear_fc2")) else "column"
            layout = [(m, rows[m], m in targeted) for m in modules]
            adapter = LoRAAdapter(
                kind,
                layout,
                in_features=inputs.get(modules[0], h),
                out_features=h,
                hf_prefix=f"model.layers.{index}.{HF_PARENT[modules[0]]}.",
                settings=settings,
                dtype=some.dtype,
                device=some.device,
                groups=spec.num_key_value_heads // tp if modules[0] == "q_proj" else 0,
            )
            linear.add_module("lora", adapter)
            linear.register_forward_hook(adapter.hook, with_kwargs=True)
            adapters[f"decoder.layers.{local_index}.{layer_name}.weight"] = adapter
    missing = [m for m in settings.modules if m not in present]
    if missing:
        there = [m for m in HF_MODULES if m in present]
        raise ValueError(
            f"--lora-target-modules: {', '.join(missing)} is in no layer of this {spec.model_type} model; its linear "
            f"modules are {', '.join(there) or 'none'}"
        )
    lora = LoRA(model, adapters, settings)
    logger.info(
        "LoRA rank %d (alpha %g) on %s: %d adapter parameters on this rank, %d frozen base parameters",
        settings.rank, settings.alpha, ",".join(settings.modules), lora.num_adapter_params(),
        sum(p.numel() for p in model.parameters() if not p.requires_grad),
    )  # fmt: skip
    return lora


class LoRA:
    """The adapters of one rank's model: ``weight name in the stage's module -> LoRAAdapter``."""

    def __init__(self, model: torch.nn.Module, adapters: dict[str, LoRAAdapter], settings: LoRASettings) -> None:
        self.model, self.adapters, self.settings = model, adapters, settings

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every adapter parameter of this rank."""
        for adapter in self.adapters.values():
            yield from adapter.parameters()

    def num_adapter_params(self) -> int:
        """Adapter elements on this rank."""
        return sum(p.numel() for p in self.parameters())

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: every adapter switched off inside the block."""
        before = [a.enabled for a in self.adapters.values()]
        for a in self.adapters.values():
            a.enabled = False
        try:
            yield
        finally:
            for a, on in zip(self.adapters.values(), before, strict=True):
                a.enabled = on

    def merged(self, params: dict[str, torch.Tensor]) -> MergedParams:
        """``params`` (the stage's base parameters by name) with each adapted weight read as W + scale * B @ A."""
        return MergedParams(params, self.adapters)

    @torch.no_grad()
    def adapter_tensors(self, *, grads: bool = False) -> dict[str, torch.Tensor]:
        """This stage's adapters (``grads``: their gradients) as full tensors on CPU, by HF/PEFT name.

        Collective over the TP group (split tensors are all-gathered): every TP rank must call it.
        """
        group = parallel_state.get_tensor_model_parallel_group()
        out = {}
        for p in self.parameters():
            t = (p.grad if grads else p).detach()
            if t is None:
                raise ValueError(f"{p.lora_hf_name} has no gradient")
            if p.lora_split_dim is not None and dist.is_initialized() and group.size() > 1:
                parts = [torch.empty_like(t) for _ in range(group.size())]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, dim=p.lora_split_dim)
            out[p.lora_hf_name] = t.float().cpu()
        return out

    def sharded_state_dict(self, prefix: str = "") -> dict:
        """The adapters as Megatron sharded tensors, keyed ``{prefix}lora.<HF/PEFT name>``.

        Global shapes: any TP/PP layout loads them. The frozen base is not in it (it comes from --hf-checkpoint).
        """
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        for p in self.parameters():
            key = f"{prefix}lora.{p.lora_hf_name}"
            if p.lora_split_dim is None:
                out[key] = make_sharded_tensor_for_checkpoint(p, key)
            else:
                out[key] = make_tp_sharded_tensor_for_checkpoint(p, key, tp_axis=p.lora_split_dim)
        return out

    @torch.no_grad()
    def load_sharded(self, state: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Copy what ``load_checkpoint`` returned for :meth:`sharded_state_dict` into the adapters."""
        for p in self.parameters():
            p.copy_(state[f"{prefix}lora.{p.lora_hf_name}"])

    @torch.no_grad()
    def load_adapter_tensors(self, tensors: Mapping[str, torch.Tensor], *, source: str = "the adapter") -> None:
        """Set this stage's adapters from full tensors by HF/PEFT name (each rank copies its shard).

        Raises:
            ValueError: a tensor is missing, or its rank or shape differs from this model's adapters (one line).
        """
        for p in self.parameters():
            t = tensors.get(p.lora_hf_name)
            if t is None:
                raise ValueError(f"{source} has no tensor {p.lora_hf_name} (--lora-target-modules differ?)")
            if tuple(t.shape) != p.lora_full_shape:
                rank_dim = 0 if ".lora_A." in p.lora_hf_name else 1
                if t.dim() == 2 and t.shape[rank_dim] != p.lora_full_shape[rank_dim]:
                    raise ValueError(
                        f"{source} has rank {t.shape[rank_dim]} ({p.lora_hf_name}), and --lora-rank is "
                        f"{self.settings.rank}: pass --lora-rank {t.shape[rank_dim]}"
                    )
                raise ValueError(
                    f"{source}: {p.lora_hf_name} has shape {tuple(t.shape)}, this model's is {p.lora_full_shape} "
                    "(an adapter of another model)"
                )
            if p.lora_split_dim is not None:
                t = t.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=p.lora_split_dim)[
                    parallel_state.get_tensor_model_parallel_rank()
                ]
            p.copy_(t)


class MergedParams(Mapping):
    """A stage's parameters by name, each adapted weight computed as ``W + scale * B @ A`` when looked up."""

    def __init__(self, params: dict[str, torch.Tensor], adapters: dict[str, LoRAAdapter]) -> None:
        self._params, self._adapters = params, adapters

    def __getitem__(self, name: str) -> torch.Tensor:
        base = self._params[name]
        adapter = self._adapters.get(name)
        if adapter is None:
            return base
        with torch.no_grad():
            return (base.float() + adapter.delta_weight()).to(base.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class BaseReference:
    """The KL reference of a LoRA actor: the same model with its adapters off (no second copy of the weights).

    Called as :class:`tidal.actor.ReferenceModel` is (``compute_log_probs``, ``loaded``).
    """

    def __init__(self, actor) -> None:
        if actor.lora is None:
            raise ValueError("BaseReference needs an actor with LoRA adapters (--lora-rank > 0)")
        self._actor = actor

    def loaded(self) -> contextlib.AbstractContextManager:
        """Nothing to move: the base weights are the actor's."""
        return contextlib.nullcontext(self)

    def compute_log_probs(self, batch) -> torch.Tensor:
        """Log-probs of ``batch`` under the base model: float32 ``[T]`` on CPU, as ``Actor.compute_log_probs``."""
        with self._actor.lora.disabled():
            return self._actor.compute_log_probs(batch)
