"""LoRA adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``), and merged back.

The folder is what ``peft``'s ``save_pretrained`` writes for a causal LM: tensor names carry PEFT's
``base_model.model.`` prefix before the HF name (``...layers.0.self_attn.q_proj.lora_A.weight``, A ``[r, in]``,
B ``[out, r]``), the config names the rank, alpha, dropout and HF target modules. peft, transformers and an SGLang
server's own LoRA loader read it (the train app's disk weight sync hands it to the engines);
:func:`merged_hf_tensors` folds it into a base checkpoint (``train convert``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a causal LM's own parameter names."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_adapter_config(settings, base_model: str) -> dict:
    """PEFT's ``LoraConfig`` of ``settings`` (``lora.LoRASettings``), for the base model at ``base_model``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": list(settings.modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def gather_adapter_tensors(lora) -> dict[str, torch.Tensor]:
    """Every stage's adapters as full fp32 CPU tensors by HF name, on global rank 0 ({} elsewhere).

    Collective over the default process group (every rank of the actor must call it): each rank's TP group gathers
    its stage's split tensors, then rank 0 collects one copy per stage (what a DP replica holds is the same).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    tensors = lora.adapter_tensors()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensors
    lead = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(tensors if lead else {}, gathered, dst=0)
    return {n: t for part in gathered or [] for n, t in part.items()}


def write_peft_adapter(out_dir: str | Path, tensors: Mapping[str, torch.Tensor], config: dict) -> Path:
    """Write the folder atomically (replaced only once complete); ``tensors`` by HF name, stored as given."""
    from safetensors.torch import save_file
    from tidal.ckpt import fresh_tmp_dir, publish_dir

    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_tmp_dir(out)
    save_file({PEFT_PREFIX + n: t.contiguous() for n, t in sorted(tensors.items())}, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    publish_dir(tmp, out)
    return out


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors by HF name)`` of a PEFT LoRA folder; a folder that is not one is one clear error."""
    from safetensors.torch import load_file

    folder = Path(adapter_dir)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{folder} is not a PEFT LoRA adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA" or not config.get("r") or "lora_alpha" not in config:
        raise ValueError(f"{config_path}: not a LoRA adapter config (peft_type LORA with r and lora_alpha)")
    if config.get("use_dora") or config.get("use_rslora") or config.get("fan_in_fan_out"):
        raise ValueError(f"{config_path}: DoRA, rsLoRA and fan_in_fan_out adapters are not supported")
    tensors = {n.removeprefix(PEFT_PREFIX): t for n, t in load_file(str(weights_path)).items()}
    return config, tensors


def check_adapter_fits(shapes: Mapping[str, tuple[int, ...]], reader, source: str) -> dict[str, dict[str, str]]:
    """Each adapter pair adapts a weight the base has, of a shape it fits; ``{weight: {"A": name, "B": name}}``.

    ``shapes``: the adapter's tensor shapes by HF name (``...q_proj.lora_A.weight``); ``reader``: the base
    (``names()``, ``shape(name)``, as ``tidal.ckpt.HFCheckpointReader``); ``source`` begins each message. An adapter
    trained on a base of another shape or family (a weight the base lacks, a pair that does not fit) is one error
    naming both, and the fix.
    """
    pairs: dict[str, dict[str, str]] = {}
    for name in shapes:
        which = next((w for w in ("A", "B") if name.endswith(f".lora_{w}.weight")), None)
        if which is None:
            raise ValueError(f"{source}: tensor {PEFT_PREFIX}{name} is neither a lora_A nor a lora_B weight")
        pairs.setdefault(name.removesuffix(f".lora_{which}.weight") + ".weight", {})[which] = name
    base = set(reader.names())
    fix = "give the base it was trained on as --hf-checkpoint"
    for weight, ab in sorted(pairs.items()):
        if weight not in base:
            raise ValueError(
                f"{source} adapts {weight}, which the base checkpoint does not have (an adapter of another model "
                f"family or size): {fix}"
            )
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{source} has lora_{''.join(ab)} for {weight} but not its pair")
        a, b, shape = shapes[ab["A"]], shapes[ab["B"]], tuple(reader.shape(weight))
        if len(shape) != 2 or a[1] != shape[1] or b[0] != shape[0] or a[0] != b[1]:
            raise ValueError(
                f"{source} does not fit {weight} {shape}: lora_A {tuple(a)}, lora_B {tuple(b)} (an adapter trained "
                f"on a base of another shape or family): {fix}"
            )
    return pairs


def merged_hf_tensors(reader, adapter_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The base checkpoint's tensors with the adapter folded in: W + alpha/r * B @ A, in fp32, stored as W's dtype.

    ``reader``: the base (``tidal.ckpt.HFCheckpointReader``: ``names()``, ``shape(name)``, ``get(name)``). Checked
    before the first tensor is read (:func:`check_adapter_fits`): an adapter of a base of another shape or family is
    one error.
    """
    config, tensors = read_peft_adapter(adapter_dir)
    scale = float(config["lora_alpha"]) / int(config["r"])
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    pairs = check_adapter_fits(shapes, reader, f"the adapter in {adapter_dir}")
    names = list(reader.names())

    def merged() -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            w, ab = reader.get(name), pairs.get(name)
            if ab is not None:
                a, b = tensors[ab["A"]].float(), tensors[ab["B"]].float()
                w = (w.float() + scale * (b @ a)).to(w.dtype)
            yield name, w

    return merged()
