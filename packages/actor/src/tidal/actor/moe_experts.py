"""The routed experts of an MoE layer: all of a rank's SwiGLU experts as two stacked weights, one grouped GEMM each.

Megatron-core 0.19 without Transformer Engine offers ``SequentialMLP`` only (one ``MLP`` module and two GEMMs per
expert, a Python loop over the experts). :class:`GroupedExperts` keeps a rank's ``E`` local experts as
``weight1 [E, 2F, H]`` (each expert's gate rows, then its up rows) and ``weight2 [E, H, F]``, which are HF's
``gate_proj``/``up_proj``/``down_proj`` stacked, and on CUDA in bf16 runs each projection as one
``torch.nn.functional.grouped_mm`` over the tokens the dispatcher sorted by expert. Elsewhere (CPU, fp32) it runs a
loop of ``F.linear`` per expert, HF's own arithmetic. Either way the routing probability scales each expert's
SwiGLU output before the down projection (as Megatron's expert MLP does).

The weights are expert parameters (``allreduce = False``): their gradients are summed over the expert-data-parallel
group, not the data-parallel one (``distributed.all_reduce_gradients``). In a distributed checkpoint the expert axis
is sharded over the expert-parallel group.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

logger = logging.getLogger(__name__)

# torch's grouped GEMM (public as torch.nn.functional.grouped_mm in recent releases, torch._grouped_mm before)
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :class:`GroupedExperts` runs ``grouped_mm`` for weights on ``device`` in ``dtype``."""
    return device.type == "cuda" and dtype == torch.bfloat16 and _grouped_mm is not None


class GroupedExperts(MegatronModule):
    """A rank's local experts (``num_local_experts`` of the model's, expert tensor-parallel size 1)."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        *,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = dict(dtype=config.params_dtype, device=device)
        self.num_local_experts = num_local_experts
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, 2 * ffn, hidden, **kw))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn, **kw))
        for weight in (self.weight1, self.weight2):
            weight.allreduce = False  # megatron's mark of an expert parameter
            if config.perform_initialization:
                config.init_method(weight)
        self.ep_group = pg_collection.ep if pg_collection is not None else None
        self.expt_dp_group = pg_collection.expt_dp if pg_collection is not None else None

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """SwiGLU of each expert on its run of ``tokens`` (sorted by expert), scaled by ``probs``; no bias."""
        probs = probs.to(tokens.dtype).unsqueeze(-1)
        if grouped_gemm_available(tokens.device, tokens.dtype):
            offsets = tokens_per_expert.to(tokens.device, non_blocking=True).cumsum(0).to(torch.int32)
            gate_up = _grouped_mm(tokens, self.weight1.transpose(-2, -1), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            return _grouped_mm(F.silu(gate) * up * probs, self.weight2.transpose(-2, -1), offs=offsets), None
        outputs = []
        counts = tokens_per_expert.tolist()
        for e, (x, p) in enumerate(zip(tokens.split(counts), probs.split(counts), strict=True)):
            gate, up = F.linear(x, self.weight1[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up * p, self.weight2[e]))
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, tokens.shape[-1]), None

    def backward_dw(self) -> None:
        """Nothing deferred: weight gradients are computed in the ordinary backward."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The stacked weights with their expert axis sharded over the expert-parallel group."""
        out = {}
        for name, tensor in (("weight1", self.weight1), ("weight2", self.weight2)):
            out[f"{prefix}{name}"] = make_tp_sharded_tensor_for_checkpoint(
                tensor,
                f"{prefix}{name}",
                0,
                prepend_offsets=sharded_offsets,
                tp_group=self.ep_group,
                dp_cp_group=self.expt_dp_group,
            )
        for key, value in self.state_dict(prefix="", keep_vars=True).items():
            if key.endswith("_extra_state"):
                out[f"{prefix}{key}"] = make_sharded_object_for_checkpoint(value, f"{prefix}{key}", sharded_offsets)
        return out
