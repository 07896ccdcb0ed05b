"""Read a model's transformer layer counts off its checkpoint keys, to name an architecture mismatch first.

Megatron-core stacks a block's layers into one checkpoint tensor per parameter: ``decoder.layers.mlp.linear_fc1
.weight`` has global shape ``(num_layers, ...)``, and each layer's ``_extra_state`` is a ``ShardedObject`` of
global shape ``(num_layers,)``. Older layouts number the layers in the key (``decoder.layers.3.mlp...``). Either
way a checkpoint from a model with another layer count (``num_hidden_layers``) differs in dozens of keys at once,
and the first of them alphabetically (often an ``_extra_state`` object) says nothing useful; the layer counts say
it all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_INDEXED = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<index>\d+)\.")
_STACKED = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?!\d)")


def layer_stack(key: str) -> str | None:
    """The layer stack a checkpoint key belongs to (``"decoder.layers"``), or None."""
    match = _INDEXED.match(key) or _STACKED.match(key)
    return match.group("stack") if match else None


def layer_counts(items: Iterable[Any]) -> dict[str, int]:
    """Layers per stack seen in sharded items (anything with ``.key`` and ``.global_shape``)."""
    counts: dict[str, int] = {}
    for item in items:
        indexed = _INDEXED.match(item.key)
        if indexed:
            stack, count = indexed.group("stack"), int(indexed.group("index")) + 1
        else:
            stacked = _STACKED.match(item.key)
            if not stacked or not item.global_shape:
                continue
            stack, count = stacked.group("stack"), int(item.global_shape[0])
        counts[stack] = max(counts.get(stack, 0), count)
    # Optimizer state mirrors the model's keys ("optimizer.state.exp_avg.decoder.layers"): count the model's.
    return {s: n for s, n in counts.items() if not any(s != t and s.endswith(f".{t}") for t in counts)}


def differing_stacks(saved: dict[str, int], wanted: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Stacks present on both sides with different layer counts: ``{stack: (saved, wanted)}``."""
    return {s: (saved[s], wanted[s]) for s in sorted(saved.keys() & wanted.keys()) if saved[s] != wanted[s]}


def explained_by_layers(
    key: str, saved_shape: tuple[int, ...] | None, wanted_shape: tuple[int, ...] | None, stacks: dict
) -> bool:
    """Whether a key's difference is just the layer count of a differing stack (or a mirror of it)."""
    stack = layer_stack(key)
    if stack is None or not any(stack == s or stack.endswith(f".{s}") for s in stacks):
        return False
    indexed = _INDEXED.match(key)
    if indexed:  # a numbered layer beyond the smaller model
        return int(indexed.group("index")) >= min(min(pair) for pair in stacks.values())
    return saved_shape is not None and wanted_shape is not None and saved_shape[1:] == wanted_shape[1:]


def describe_layers(stacks: dict[str, tuple[int, int]], *, flag: str, load_dir: Any, num_explained: int) -> str:
    """One line naming each layer-count difference, the flag that sets it, and what to do."""
    parts = [
        f"the checkpoint has {saved} layers ({stack}.0-{saved - 1}), the model has {wanted} ({stack}.0-{wanted - 1})"
        for stack, (saved, wanted) in stacks.items()
    ]
    decoder = stacks.get("decoder.layers")
    fix = (
        f"point --hf-checkpoint at the model it was saved from (num_hidden_layers {decoder[0]} in its config.json), or "
        if decoder
        else ""
    )
    return (
        f"{'; '.join(parts)}: {flag} {load_dir} was saved from a different model; {fix}point {flag} at a "
        f"checkpoint of this model ({num_explained} checkpoint entries differ only in the layer count)"
    )
