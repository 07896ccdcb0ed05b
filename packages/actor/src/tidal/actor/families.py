"""The model families tidal-actor builds, by HF ``model_type`` and architecture name (standard library only).

A family is an HF architecture (``config.json``'s ``model_type`` and ``architectures``) that the actor maps to
Megatron-core and back. :func:`check_family` is what every entry point asks first, before any process starts:
an unknown architecture is one line that lists the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One model family: the HF names that select it."""

    model_type: str
    """HF ``model_type`` in config.json."""
    architecture: str
    """HF class name in config.json's ``architectures``."""
    moe: bool
    """A mixture-of-experts family (routed experts in some or all layers)."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(model_type="qwen2", architecture="Qwen2ForCausalLM", moe=False),
        Family(model_type="qwen3", architecture="Qwen3ForCausalLM", moe=False),
        Family(model_type="llama", architecture="LlamaForCausalLM", moe=False),
        Family(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", moe=True),
        Family(model_type="glm4_moe", architecture="Glm4MoeForCausalLM", moe=True),
    )
}
"""Every family the actor builds, by ``model_type``."""


def known_families() -> str:
    """The known families as one line: ``qwen2 (Qwen2ForCausalLM), ...``."""
    return ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())


def family_of(cfg: dict[str, Any], *, source: str = "config.json") -> Family:
    """The family a ``config.json`` dict names (by ``model_type``, checked against ``architectures``).

    Raises:
        ValueError: one line naming ``source``, the model type (and architectures) it saw, and the known families.
    """
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    family = FAMILIES.get(model_type)
    if family is None:
        seen = f"model_type {model_type!r}" + (f" ({', '.join(map(str, architectures))})" if architectures else "")
        raise ValueError(f"{source}: {seen} is not a model family tidal trains; known: {known_families()}")
    if architectures and family.architecture not in architectures:
        raise ValueError(
            f"{source}: model_type {model_type!r} with architectures {architectures}: tidal trains "
            f"{model_type} as {family.architecture} only; known: {known_families()}"
        )
    return family
