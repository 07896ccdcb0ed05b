"""Before a run loads a Megatron checkpoint: do its LoRA adapters (or their absence) fit ``--lora-rank`` and the base?

A LoRA actor's checkpoint holds the adapters alone (``lora.<HF/PEFT name>``, see ``lora.LoRA.sharded_state_dict``);
a full fine-tuning checkpoint holds the model. Read from the checkpoint's metadata (no tensor is loaded), so a
mismatch is one line before anything starts rather than a shape error of the load itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path


def adapter_shapes(load_dir: str | Path, *, ckpt_step: int | None = None, flag: str = "--load") -> dict[str, tuple]:
    """The global shape of each LoRA adapter tensor in a Megatron checkpoint, by HF name ({} for a full model)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from tidal.ckpt import resolve_checkpoint

    _, iter_dir = resolve_checkpoint(load_dir, ckpt_step=ckpt_step, flag=flag)
    return {
        key.removeprefix("lora."): tuple(value.global_shape)
        for key, value in load_sharded_metadata(str(iter_dir)).items()
        if key.startswith("lora.") and key.endswith((".lora_A.weight", ".lora_B.weight"))
    }


def _rank(shapes: dict[str, tuple]) -> int:
    return next((int(s[0]) for n, s in shapes.items() if n.endswith(".lora_A.weight")), 0)


def check_adapter_checkpoint(
    load_dir: str | Path,
    *,
    lora_rank: int,
    ckpt_step: int | None = None,
    flag: str = "--load",
    hf_checkpoint: str | Path | None = None,
    target_modules: Iterable[str] = ("all-linear",),
) -> None:
    """Raise ValueError (one line) unless the checkpoint's adapter rank is ``lora_rank`` (0: no adapters).

    With ``hf_checkpoint`` (the base the adapters go on), also unless the adapters are the ones a LoRA actor on that
    base with ``target_modules`` (``--lora-target-modules``) has: each fits a weight of the base
    (``lora_peft.check_adapter_fits``: adapters of a base of another shape or family are refused), and every weight
    of the base the targets select has one.
    """
    shapes = adapter_shapes(load_dir, ckpt_step=ckpt_step, flag=flag)
    saved = _rank(shapes)
    if saved == lora_rank:
        if saved and hf_checkpoint is not None:
            from tidal.actor.lora_peft import check_adapter_fits
            from tidal.ckpt import HFCheckpointReader

            reader = HFCheckpointReader(hf_checkpoint)
            pairs = check_adapter_fits(shapes, reader, f"{flag} {load_dir}: the adapter")
            _check_targets(pairs, reader.names(), tuple(target_modules), f"{flag} {load_dir}")
        return
    if not saved:
        raise ValueError(
            f"{flag} {load_dir} holds a full fine-tuning checkpoint, not LoRA adapters, and --lora-rank is "
            f"{lora_rank}: drop --lora-rank, or point {flag} at a LoRA run's checkpoint"
        )
    if not lora_rank:
        raise ValueError(f"{flag} {load_dir} holds LoRA adapters of rank {saved}: pass --lora-rank {saved}")
    raise ValueError(
        f"{flag} {load_dir} holds LoRA adapters of rank {saved}, and --lora-rank is {lora_rank}: "
        f"pass --lora-rank {saved}"
    )


def _check_targets(adapted: Iterable[str], base_names: Iterable[str], targets: tuple[str, ...], source: str) -> None:
    """The weights the checkpoint adapts are those ``targets`` select in the base (a decoder layer's HF modules)."""
    from tidal.actor.lora_targets import HF_PARENT, resolve_target_modules

    modules = resolve_target_modules(targets)
    layer_weight = re.compile(r"\.layers\.\d+\.(\w+)\.(\w+)\.weight$")
    wanted = set()
    for name in base_names:
        m = layer_weight.search(name)
        if m and m[2] in modules and HF_PARENT[m[2]] == m[1]:
            wanted.add(name)
    missing, extra = sorted(wanted - set(adapted)), sorted(set(adapted) - wanted)
    given = " ".join(targets)
    if missing:
        raise ValueError(
            f"{source} holds no adapter for {missing[0]} ({len(missing)} of the {len(wanted)} weights "
            f"--lora-target-modules {given} selects in --hf-checkpoint): give the --lora-target-modules and the "
            "--hf-checkpoint the run was trained with"
        )
    if extra:
        raise ValueError(
            f"{source} holds adapters for {len(extra)} weights that --lora-target-modules {given} does not select "
            f"({extra[0]}, ...): give the --lora-target-modules the run was trained with"
        )
