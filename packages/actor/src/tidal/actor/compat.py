"""Compatibility layer that lets megatron-core 0.19 build and train a GPTModel without a GPU.

Every patch tidal applies to third-party code lives in this module, and each one was shown
necessary by switching it off (see ``tests/test_compat.py``, which fails when an upgrade makes a
patch wrong or unnecessary):

1. ``flash_mla`` (always, even with CUDA): sglang installs a ``flash_mla`` wheel whose import raises
   ``OSError`` (not ``ImportError``) when libcuda is absent; Megatron only catches ``ImportError``.
   Putting ``None`` into ``sys.modules`` turns every ``import flash_mla`` into an ``ImportError``.
2. RNG tracker on the CPU generator: ``torch.cuda.get_rng_state``/``torch.cuda.manual_seed`` and
   Megatron's ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read and write the CPU generator.
   Without the ``manual_seed`` patch every tracker state is identical (CUDA seeding is queued
   lazily and never runs), so TP init/dropout streams would silently coincide.
3. ``torch.cuda.current_device`` returns ``"cpu"`` (RotaryEmbedding moves its tensors there).
4. ``get_default_causal_mask`` builds its mask on ``"cuda"``; it is replaced in both
   ``megatron.core.transformer.utils`` and ``megatron.core.fusions.fused_softmax`` (imported by name).

5. THD RoPE in one pass (always, even with CUDA): megatron's unfused ``_apply_rotary_pos_emb_thd``
   loops over the packed sequences in Python (``.tolist()`` host sync, ~10 small kernels per
   sequence, per layer, for q and k). The replacement gathers each token's frequencies by its
   position inside its sequence (computed on the device from ``cu_seqlens``) and rotates all tokens
   at once: the same arithmetic, one pass, no host sync. The rotation is ``fused.rope_with_table`` on fp32 cos/sin
   tables built once per forward (the running layer's ``fused.RopeTables``, shared by its model), in fp32 and
   rounded once (megatron rounds the table and each op to the input's dtype: in bf16 1.6x the rounding floor); in a
   layer with ``fused_kernels`` on CUDA through ``torch.compile`` (one kernel instead of ~8). The running layer is
   ``fused.RUNNING_ATTENTION``, set by ``fused.PackedSelfAttention`` around megatron's forward. The layers of a
   cp = 1 model take ``fused.PackedSelfAttention``'s q/k/v path instead; this patch serves the models that path does
   not cover (q/k norm, output gate, YaRN); context parallelism (cp > 1) keeps megatron's original.
6. ``flashinfer`` hidden on machines without an NVIDIA driver (in the package ``__init__``, before megatron's
   first import): megatron-core imports it at import time (~8 s per process) for MoE and inference kernels
   tidal-actor never calls, always under ``except ImportError``; ``None`` in ``sys.modules`` skips it.
7. Megatron's 1F1B pipeline schedule (``forward_backward_pipelining_without_interleaving``, the one tidal's
   pipeline parallelism drives) allocates ``torch.zeros([], dtype=torch.int, device="cuda")``; it is wrapped to
   run under a ``TorchFunctionMode`` that turns a ``device="cuda"`` argument into the CPU.
8. ``torch.cuda.synchronize`` is a no-op (CPU work is synchronous) inside megatron's ``P2PCommunicator``
   methods that call it unconditionally: after exchanging tensor shapes (``_communicate_shapes``, which
   ``variable_seq_lengths`` needs) and after every batched send/receive (``_communicate``, ``batch_p2p_sync``, the
   default). Both are wrapped; ``torch.cuda.synchronize`` itself is left alone everywhere else.

9. Megatron's gradient-accumulation fusion (``TransformerConfig.gradient_accumulation_fusion``), which the actor
   turns on for bf16 parameters with fp32 main copies on CUDA: each linear layer's weight gradient is accumulated by
   the GEMM itself into the fp32 main gradient (``weight.main_grad``, set by ``main_params.MainParams``), with no
   bf16 gradient and no separate add in between. Megatron takes that GEMM from APEX's ``fused_weight_gradient_mlp_cuda``
   and refuses the option without APEX; ``WgradAccum`` is the same two functions in torch (``addmm`` with
   ``out_dtype=float32``: cuBLAS with beta = 1 into the main gradient), installed with megatron's availability flag by
   ``apply_wgrad_accumulation_fusion``, called by the actor before it builds such a model.

10. Megatron's all-to-all MoE token dispatcher (``MoEAlltoAllTokenDispatcher``, the one tidal's MoE layers use:
   it takes a different token count on every rank) creates a CUDA stream in its constructor and copies its split
   sizes to the host on that stream (``_maybe_dtoh_and_synchronize``). On the CPU the stream is a placeholder and the
   copy is the same conversion without streams (the split sizes as numpy arrays, as the CUDA path leaves them).

Patches 2–4, 7, 8 and 10 are applied only when ``torch.cuda.is_available()`` is false; patch 9 only when the actor
asks.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

# "module.attr" -> the function a patch replaced: the record of what this process patched (the patches change
# third-party modules, so they are process-wide by nature), and the originals tests call to show a patch is needed.
ORIGINALS: dict[str, Callable[..., Any]] = {}


def _replace(module: Any, attr: str, new: Callable[..., Any]) -> None:
    """Put ``new`` in place of ``module.attr`` unless a patch already replaced it (applying twice changes nothing)."""
    key = f"{module.__name__}.{attr}"
    if key not in ORIGINALS:
        ORIGINALS[key] = getattr(module, attr)
        setattr(module, attr, new)


def apply_flash_mla_guard() -> None:
    """Make ``import flash_mla`` raise ImportError instead of OSError (patch 1; safe everywhere)."""
    sys.modules.setdefault("flash_mla", None)


def _cpu_get_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    del device, graph_safe
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    del device, graph_safe
    torch.set_rng_state(new_state)


def _cpu_cuda_get_rng_state(device: object = "cuda") -> torch.Tensor:
    del device
    return torch.get_rng_state()


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _cpu_current_device() -> str:
    return "cpu"


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    _replace(torch.cuda, "get_rng_state", _cpu_cuda_get_rng_state)
    _replace(torch.cuda, "manual_seed", _cpu_manual_seed)
    _replace(mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state)
    _replace(mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state)


def _patch_current_device() -> None:
    _replace(torch.cuda, "current_device", _cpu_current_device)


def _patch_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    _replace(transformer_utils, "get_default_causal_mask", _cpu_default_causal_mask)
    _replace(fused_softmax, "get_default_causal_mask", _cpu_default_causal_mask)


def _packed_rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *args: Any, **kwargs: Any):
    """Patch 5: ``_apply_rotary_pos_emb_thd`` for cp = 1 in one pass (positions restart per sequence)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = ORIGINALS["megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd"]
    cp_group = kwargs.get("cp_group")
    if cp_group is None or cp_group.size() != 1 or args or kwargs.get("multi_latent_attention") is not None:
        return original(t, cu_seqlens, freqs, *args, **kwargs)
    from tidal.actor.fused import RUNNING_ATTENTION, packed_rope_table, positions, rope_with_table

    plain = not kwargs.get("rotary_interleaved") and not kwargs.get("mla_rotary_interleaved")
    if plain and kwargs.get("mscale", 1.0) == 1.0 and freqs.size(-1) == t.size(-1):
        # fp32 table (once per forward: the layer's model shares it) and arithmetic, rounded once; compiled into one
        # kernel on CUDA in a layer with fused kernels
        layer = RUNNING_ATTENTION.get()
        tables = layer.rope_tables.get if layer is not None and layer.rope_tables is not None else packed_rope_table
        fn = _compiled_rope() if layer is not None and layer.fused_kernels and t.is_cuda else rope_with_table
        return fn(t, *tables(freqs, cu_seqlens, t.size(0)))
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[positions(cu_seqlens, t.size(0), t.device)],
        rotary_interleaved=kwargs.get("rotary_interleaved", False),
        mla_rotary_interleaved=kwargs.get("mla_rotary_interleaved", False),
        mscale=kwargs.get("mscale", 1.0),
    ).squeeze(1)


@functools.cache
def _compiled_rope():
    from tidal.actor.fused import rope_with_table

    return torch.compile(rope_with_table, dynamic=True)


def _patch_packed_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    _replace(rope_utils, "_apply_rotary_pos_emb_thd", _packed_rope_thd)


class _CudaDeviceToCpu(TorchFunctionMode):
    """Patch 7: every torch function called with ``device="cuda"`` (or a CUDA ``torch.device``) gets the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _patch_pipeline_schedule() -> None:
    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_backward_pipelining_without_interleaving

    @functools.wraps(original)
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        with _CudaDeviceToCpu():
            return original(*args, **kwargs)

    _replace(schedules, "forward_backward_pipelining_without_interleaving", on_cpu)


def _cpu_synchronize(device: object = None) -> None:
    del device  # patch 8: CPU work is synchronous, there is nothing to wait for


def _patch_synchronize() -> None:
    """Patch 8, scoped: ``torch.cuda.synchronize`` is a no-op only while megatron's p2p methods run."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    for name in ("_communicate_shapes", "_communicate"):
        original = getattr(P2PCommunicator, name)

        @functools.wraps(original)
        def without_cuda_sync(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            synchronize = torch.cuda.synchronize
            torch.cuda.synchronize = _cpu_synchronize
            try:
                return _original(*args, **kwargs)
            finally:
                torch.cuda.synchronize = synchronize

        _replace(P2PCommunicator, name, without_cuda_sync)


def _host_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None):
    """Patch 10: the dispatcher's device-to-host step on the CPU (no streams; split sizes as numpy arrays)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _patch_moe_dispatcher() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _replace(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", _host_dtoh_and_synchronize)
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:  # the constructor creates a CUDA stream otherwise
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "host"


def apply_cpu_compat() -> bool:
    """Apply the compatibility patches this process needs; idempotent.

    Call it in every process before megatron-core builds a model. Patches 1 and 5 are always
    applied; patches 2–4, 7, 8 and 10 only when no CUDA device is available.

    Returns:
        True when the CPU patches (2–4, 7, 8, 10) are in effect, False on a CUDA machine.
    """
    apply_flash_mla_guard()
    _patch_packed_rope()
    if torch.cuda.is_available():
        return False
    patched = len(ORIGINALS)
    _patch_rng()
    _patch_current_device()
    _patch_causal_mask()
    _patch_pipeline_schedule()
    _patch_synchronize()
    _patch_moe_dispatcher()
    if len(ORIGINALS) > patched:
        logger.info(
            "applied megatron-core CPU compatibility patches (rng, current_device, causal mask, pipeline schedule, "
            "synchronize, MoE dispatcher streams)"
        )
    return True


class WgradAccum:
    """APEX's ``fused_weight_gradient_mlp_cuda`` in torch: ``main_grad += grad_output^T @ input``, in place."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        """Accumulate the weight gradient of half-precision ``[..., in]`` / ``[..., out]`` into fp32 ``[out, in]``."""
        grad_t = grad_output.reshape(-1, grad_output.size(-1)).t()
        x = total_input.reshape(-1, total_input.size(-1))
        if main_grad.is_cuda and grad_t.dtype != main_grad.dtype:
            torch.addmm(main_grad, grad_t, x, out_dtype=main_grad.dtype, out=main_grad)
        else:  # no mixed-dtype addmm on the CPU (aten::addmm.dtype_out is CUDA-only): the same sum, unfused
            main_grad.add_(grad_t.to(main_grad.dtype) @ x.to(main_grad.dtype))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32  # a half-precision main gradient: the same call


def apply_wgrad_accumulation_fusion() -> None:
    """Patch 9: let megatron's linear layers accumulate weight gradients into ``main_grad`` (idempotent)."""
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is WgradAccum:
        return
    available = layers._grad_accum_fusion_available  # False without APEX: megatron would refuse the option
    ORIGINALS["megatron.core.tensor_parallel.layers._grad_accum_fusion_available"] = lambda: available
    layers.fused_weight_gradient_mlp_cuda = WgradAccum
    layers._grad_accum_fusion_available = True
    logger.info("gradient-accumulation fusion: linear weight gradients accumulate into the fp32 main gradients")
