"""Compare what a caller asks to load with what a checkpoint holds, on every rank, before loading.

A silent partial load is the failure this package exists to prevent, so the comparison is exhaustive:
model keys absent from the checkpoint, checkpoint keys of a requested section that no rank asks for, and global
shape differences. A different transformer layer count is named first, and the per-key differences it explains
are left out (see ``architecture``). Findings are all-gathered so every rank raises the same
``CheckpointMismatchError`` (a rank that raised alone would leave the others hanging in the load's collectives).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from tidal.ckpt.architecture import describe_layers, differing_stacks, explained_by_layers, layer_counts
from tidal.ckpt.errors import CheckpointMismatchError

logger = logging.getLogger(__name__)

_SHOWN = 5


def _sharded_items(value: Any) -> list[ShardedTensor | ShardedObject]:
    if isinstance(value, ShardedTensor | ShardedObject):
        return [value]
    if not isinstance(value, dict | list):
        return []
    items: list[ShardedTensor | ShardedObject] = []
    for leaf in nested_values(value):
        if isinstance(leaf, ShardedTensorFactory):
            items.extend(_sharded_items(leaf.build()))
        elif isinstance(leaf, ShardedTensor | ShardedObject):
            items.append(leaf)
    return items


def requested_keys(value: Any) -> set[str]:
    """Checkpoint keys (ShardedTensor keys, ShardedObject base keys) under one section of a state dict."""
    return {item.key for item in _sharded_items(value)}


def _local_findings(sharded_state_dict: dict[str, Any], ckpt_metadata: dict[str, Any]) -> dict[str, Any]:
    object_keys = {v.key for v in ckpt_metadata.values() if isinstance(v, ShardedObject)}
    absent: dict[str, set[str]] = {}
    shapes: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    objects: set[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = set()
    items = []
    for section, value in sharded_state_dict.items():
        for item in _sharded_items(value):
            items.append(item)
            if isinstance(item, ShardedObject):
                if item.unique_key in ckpt_metadata:
                    continue
                if item.key in object_keys:
                    saved = next(v.global_shape for v in ckpt_metadata.values() if v.key == item.key)
                    objects.add((section, item.key, tuple(saved), tuple(item.global_shape)))
                else:
                    absent.setdefault(section, set()).add(item.key)
            elif item.key not in ckpt_metadata:
                absent.setdefault(section, set()).add(item.key)
            elif tuple(ckpt_metadata[item.key].global_shape) != tuple(item.global_shape):
                shapes.add((item.key, tuple(ckpt_metadata[item.key].global_shape), tuple(item.global_shape)))
    requested = {section: requested_keys(value) for section, value in sharded_state_dict.items()}
    layers = layer_counts(items)
    return {"absent": absent, "shapes": shapes, "objects": objects, "requested": requested, "layers": layers}


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {"absent": {}, "shapes": set(), "objects": set(), "requested": {}, "layers": {}}
    for part in parts:
        for bucket in ("absent", "requested"):
            for section, keys in part[bucket].items():
                merged[bucket].setdefault(section, set()).update(keys)
        merged["shapes"] |= part["shapes"]
        merged["objects"] |= part["objects"]
        for stack, count in part["layers"].items():
            merged["layers"][stack] = max(merged["layers"].get(stack, 0), count)
    return merged


def _few(keys: set[str] | list[str]) -> str:
    ordered = sorted(keys)
    more = f" (+{len(ordered) - _SHOWN} more)" if len(ordered) > _SHOWN else ""
    return ", ".join(ordered[:_SHOWN]) + more


def _without_layer_differences(found: dict[str, Any], stacks: dict, unused: dict[str, set[str]]) -> int:
    """Drop findings that only restate a layer-count difference (named once, first); return how many."""
    before = sum(map(len, found["absent"].values())) + sum(map(len, unused.values()))
    before += len(found["shapes"]) + len(found["objects"])
    for bucket in (found["absent"], unused):
        for section in list(bucket):
            bucket[section] = {k for k in bucket[section] if not explained_by_layers(k, None, None, stacks)}
            if not bucket[section]:
                del bucket[section]
    found["shapes"] = {f for f in found["shapes"] if not explained_by_layers(f[0], f[1], f[2], stacks)}
    found["objects"] = {f for f in found["objects"] if not explained_by_layers(f[1], f[2], f[3], stacks)}
    after = sum(map(len, found["absent"].values())) + sum(map(len, unused.values()))
    return before - after - len(found["shapes"]) - len(found["objects"])


def _problems(found: dict[str, Any], meta: dict[str, Any] | None, *, flag: str, load_dir: str | Path) -> list[str]:
    problems = []
    sections = meta["sections"] if meta else {}
    unused = {section: set(sections.get(section, ())) - requested for section, requested in found["requested"].items()}
    stacks = differing_stacks(found["ckpt_layers"], found["layers"])
    if stacks:  # the architecture first: it explains most of what follows
        explained = _without_layer_differences(found, stacks, unused)
        problems.append(describe_layers(stacks, flag=flag, load_dir=load_dir, num_explained=explained))
    for section, keys in sorted(found["absent"].items()):
        if section == "optimizer":
            problems.append(
                f"it has no optimizer state for {len(keys)} tensor(s) ({_few(keys)}); pass --no-load-optim to "
                f"start the optimizer fresh"
            )
        elif section == "rng_state":
            problems.append("it has no RNG states; pass --no-load-rng to start with fresh RNG states")
        else:
            problems.append(f"section '{section}': {len(keys)} key(s) missing from the checkpoint: {_few(keys)}")
    for key, saved, wanted in sorted(found["shapes"]):
        problems.append(f"'{key}' has shape {saved} in the checkpoint but {wanted} in the model")
    for section, keys in sorted(unused.items()):
        if keys:
            problems.append(f"section '{section}': {len(keys)} checkpoint key(s) unused by the model: {_few(keys)}")
    for section, key, saved, wanted in sorted(found["objects"]):
        if section == "rng_state":
            problems.append(
                f"'{key}' was saved for {saved[0]} rank(s) (shape {saved}) but this run has shape {wanted}; "
                f"per-rank RNG states cannot be resharded, pass --no-load-rng"
            )
        else:
            problems.append(f"object '{key}' has shape {saved} in the checkpoint but {wanted} in the model")
    return problems


def check_request(
    sharded_state_dict: dict[str, Any],
    ckpt_metadata: dict[str, Any],
    meta: dict[str, Any] | None,
    *,
    iter_dir: Path,
    flag: str,
    load_dir: str | Path,
) -> None:
    """Raise ``CheckpointMismatchError`` on every rank unless the request matches the checkpoint exactly.

    Sections absent from ``sharded_state_dict`` are skipped on purpose (``--no-load-optim``/``--no-load-rng``).
    """
    local = _local_findings(sharded_state_dict, ckpt_metadata)
    gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    found = _merge([part for part in gathered if part is not None])
    found["ckpt_layers"] = layer_counts(ckpt_metadata.values())
    skipped = sorted(set(meta["sections"] if meta else ()) - set(found["requested"]))
    if skipped:
        logger.info("not loading section(s) %s of %s", skipped, iter_dir)
    problems = _problems(found, meta, flag=flag, load_dir=load_dir)
    if problems:
        listing = "\n  - ".join(problems)
        hint = ""
        if not all("--no-load-" in problem for problem in problems):
            hint = (
                f" Check that the model (num_hidden_layers, hidden_size, num_attention_heads in --hf-checkpoint's "
                f"config.json) matches the one the checkpoint was saved from, or point {flag} (now {load_dir}) at a "
                "matching checkpoint."
            )
        raise CheckpointMismatchError(
            f"checkpoint {iter_dir} does not match the state being loaded:\n  - {listing}\nNothing was loaded.{hint}"
        )
