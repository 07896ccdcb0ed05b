"""Which linear layers ``--lora-target-modules`` names (standard library only: the config checks it before start).

The adapters are per HF module (PEFT's names): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``. Megatron's fused layers are accepted too and stand for the HF modules they hold
(``linear_qkv``: q/k/v, ``linear_proj``: o, ``linear_fc1``: gate/up, ``linear_fc2``: down), as are the short names
``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``, and ``all-linear`` for every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable

HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every HF linear module of a decoder layer an adapter can sit on, in the order adapters are built and exported."""

MEGATRON_LAYERS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
"""Each Megatron linear layer of a decoder layer (name inside the layer) and the HF modules it holds, in its order."""

HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
HF_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}

_MEGATRON_NAMES = tuple(name.rsplit(".", 1)[1] for name in MEGATRON_LAYERS)
_ALIASES: dict[str, tuple[str, ...]] = {"all-linear": HF_MODULES}
_ALIASES |= {name.rsplit(".", 1)[1]: modules for name, modules in MEGATRON_LAYERS.items()}
_ALIASES |= {m: (m,) for m in HF_MODULES} | {m.removesuffix("_proj"): (m,) for m in HF_MODULES}


def resolve_target_modules(names: Iterable[str]) -> tuple[str, ...]:
    """The HF modules ``names`` (each may hold several, comma-separated) stand for, in :data:`HF_MODULES` order.

    Raises:
        ValueError: a name matches no linear module (the message lists the names there are), or none is given.
    """
    wanted: set[str] = set()
    for name in (n.strip() for given in names for n in given.split(",")):
        if not name:
            continue
        if name not in _ALIASES:
            raise ValueError(
                f"--lora-target-modules {name!r} matches no linear module of the model; the modules are "
                f"{', '.join(HF_MODULES)} (or Megatron's {', '.join(_MEGATRON_NAMES)}, or all-linear)"
            )
        wanted.update(_ALIASES[name])
    if not wanted:
        raise ValueError(f"--lora-target-modules names no module; give all-linear or some of {', '.join(HF_MODULES)}")
    return tuple(m for m in HF_MODULES if m in wanted)
