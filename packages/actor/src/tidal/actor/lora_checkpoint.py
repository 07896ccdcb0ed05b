"""Before a run loads a Megatron checkpoint: do its LoRA adapters (or their absence) fit ``--lora-rank``?

A LoRA actor's checkpoint holds the adapters alone (``lora.<HF/PEFT name>``, see ``lora.LoRA.sharded_state_dict``);
a full fine-tuning checkpoint holds the model. Read from the checkpoint's metadata (no tensor is loaded), so a
mismatch is one line before anything starts rather than a shape error of the load itself.
"""

from __future__ import annotations

from pathlib import Path


def adapter_rank(load_dir: str | Path, *, ckpt_step: int | None = None, flag: str = "--load") -> int:
    """The rank of the LoRA adapters in a Megatron checkpoint; 0 when it holds none (a full model)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from tidal.ckpt import resolve_checkpoint

    _, iter_dir = resolve_checkpoint(load_dir, ckpt_step=ckpt_step, flag=flag)
    for key, value in load_sharded_metadata(str(iter_dir)).items():
        if key.startswith("lora.") and key.endswith(".lora_A.weight"):
            return int(value.global_shape[0])
    return 0


def check_adapter_checkpoint(
    load_dir: str | Path, *, lora_rank: int, ckpt_step: int | None = None, flag: str = "--load"
) -> None:
    """Raise ValueError (one line) unless the checkpoint's adapter rank is ``lora_rank`` (0: no adapters)."""
    saved = adapter_rank(load_dir, ckpt_step=ckpt_step, flag=flag)
    if saved == lora_rank:
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
