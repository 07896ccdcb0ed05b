"""RoPE scaling from an HF config: "linear", "dynamic" (NTK) and "llama3", as transformers computes them.

megatron-core 0.19's ``RotaryEmbedding`` knows llama3 scaling only with fixed ``low_freq_factor=1``,
``high_freq_factor=4`` and ``original_max_position_embeddings=8192`` (only ``rope_scaling_factor`` is a
parameter), and linear scaling as ``seq_len_interpolation_factor``. Rather than depend on those
defaults, tidal computes the inverse frequencies exactly as transformers' ``modeling_rope_utils``
does for the config's own parameters and installs them in the model's ``RotaryEmbedding`` (whose
``inv_freq`` is a plain attribute, not a checkpointed buffer). All three types have attention
scaling 1, so nothing else changes.

* ``linear``: ``inv_freq / factor``.
* ``llama3``: wavelengths above ``original_max_position_embeddings / low_freq_factor`` divided by
  ``factor``, below ``... / high_freq_factor`` kept, smooth interpolation in between.
* ``dynamic``: transformers recomputes the frequencies from the longest sequence of each batch once
  it exceeds ``max_position_embeddings`` (and keeps that state across calls); up to
  ``max_position_embeddings`` it equals the default RoPE, which is what tidal supports: a longer
  packed sequence raises ``ValueError``.

Other types (``yarn``, ``longrope``, ...) are refused with a ``ValueError`` naming the ``rope_type``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """A non-default RoPE scaling read from an HF config."""

    rope_type: str
    """"linear", "dynamic" or "llama3"."""
    factor: float
    """Scaling factor (context extension ratio)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: the pre-training context length."""


def parse_rope_scaling(cfg: dict) -> RopeScaling | None:
    """The RoPE scaling of an HF ``config.json`` dict (``rope_parameters`` or the older ``rope_scaling``).

    Returns:
        None for default RoPE, else the scaling.

    Raises:
        ValueError: an unsupported ``rope_type`` (named), or a missing/invalid parameter.
    """
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by tidal.actor; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    if "factor" not in params or float(params["factor"]) <= 0:
        raise ValueError(f"rope_type {rope_type!r} needs a positive 'factor', got {params.get('factor')!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_type {rope_type!r} with partial_rotary_factor != 1 is not supported by tidal.actor")
    scaling = RopeScaling(rope_type=rope_type, factor=float(params["factor"]))
    if rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
        if missing:
            raise ValueError(f"rope_type 'llama3' needs {missing} in rope_parameters/rope_scaling")
        original = params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise ValueError(
                f"rope_type 'llama3' needs high_freq_factor > low_freq_factor, got "
                f"{scaling.high_freq_factor} <= {scaling.low_freq_factor}"
            )
    return scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 ``[head_dim / 2]`` inverse frequencies, in transformers' order of operations."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope_scaling(
    model: torch.nn.Module, *, head_dim: int, theta: float, scaling: RopeScaling | None, max_position_embeddings: int
) -> None:
    """Install the scaled inverse frequencies in ``model.rotary_pos_emb`` (a no-op for default RoPE).

    Call it right after building the model, before its first forward (Megatron caches the RoPE table
    per sequence length). For ``dynamic``, a forward pre-hook refuses sequences longer than
    ``max_position_embeddings``.
    """
    if scaling is None:
        return
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(rotary.inv_freq.device)
    if scaling.rope_type == "dynamic":

        def refuse_beyond_max(_module, args, kwargs):
            seq_len = args[0] if args else kwargs["max_seq_len"]
            if seq_len > max_position_embeddings:
                raise ValueError(
                    f"rope_type 'dynamic' is supported up to max_position_embeddings={max_position_embeddings} "
                    f"(where it equals default RoPE); got a sequence of {seq_len} tokens"
                )

        rotary.register_forward_pre_hook(refuse_beyond_max, with_kwargs=True)
    logger.info("RoPE scaling %s (factor %s) installed", scaling.rope_type, scaling.factor)
