"""Hugging Face checkpoints: stream tensors out of (sharded) safetensors, write them back atomically.

Reading (:class:`HFCheckpointReader`, the one reader of HF weights) memory-maps a shard with ``safe_open`` and
copies one tensor out at a time, so peak memory is one tensor, not the model, and counts the bytes it copied.
Writing accumulates tensors up to ``max_shard_bytes``, writes each shard as it fills, and publishes the whole
directory (weights, index, config and tokenizer files) with one rename.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tidal.ckpt import atomic
from tidal.ckpt.config import DEFAULT_MAX_SHARD_BYTES
from tidal.ckpt.errors import HFCheckpointError

logger = logging.getLogger(__name__)

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""Non-weight files copied from ``source_dir`` when present (config.json is required)."""


def _shard_files(hf_dir: Path) -> dict[str, list[str] | None]:
    """Shard file -> the tensor names the index assigns it (None: every tensor in the file)."""
    index = hf_dir / INDEX_FILENAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index} is not a safetensors index (no 'weight_map'): {e}") from e
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)  # type: ignore[union-attr]
        missing = sorted(f for f in files if not (hf_dir / f).is_file())
        if missing:
            raise HFCheckpointError(f"{index} names shard(s) missing from {hf_dir}: {missing}")
        return files
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if not shards:
        found = ", ".join(sorted(p.name for p in hf_dir.iterdir())[:8]) or "nothing"
        raise HFCheckpointError(
            f"--hf-checkpoint {hf_dir} holds no *.safetensors files (found: {found}); point --hf-checkpoint at a "
            f"Hugging Face model directory (config.json + *.safetensors)"
        )
    return dict.fromkeys(shards)


class HFCheckpointReader:
    """Random access by name to the tensors of an HF safetensors checkpoint; the one place tidal opens them to read.

    Opening reads only the shards' headers (names, shapes, dtypes); :meth:`get` memory-maps one shard and copies one
    tensor out. :attr:`bytes_read` counts the tensor bytes copied out so far, so a caller can report (and a test can
    check) how much of the checkpoint this process read.

    Args:
        hf_dir: directory with ``model.safetensors`` or shards plus ``model.safetensors.index.json``.

    Raises:
        HFCheckpointError: the directory is missing, holds no safetensors, or its index names a missing shard or
            a tensor its shard does not contain, or a tensor appears in two shards.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.hf_dir = Path(hf_dir)
        if not self.hf_dir.is_dir():
            raise HFCheckpointError(f"--hf-checkpoint {self.hf_dir} is not a directory")
        self.bytes_read = 0
        """Bytes of tensor data :meth:`get` copied out of the checkpoint since this reader was made."""
        self._file: dict[str, str] = {}  # tensor name -> shard file, in the shards' order
        self._shape: dict[str, tuple[int, ...]] = {}
        for file, names in _shard_files(self.hf_dir).items():
            with safe_open(self.hf_dir / file, framework="pt", device="cpu") as shard:
                present = set(shard.keys())
                wanted = sorted(present) if names is None else names
                absent = sorted(set(wanted) - present)
                if absent:
                    raise HFCheckpointError(
                        f"{self.hf_dir / INDEX_FILENAME} maps {absent[:5]} to {file}, which lacks them"
                    )
                for name in wanted:
                    if name in self._file:
                        raise HFCheckpointError(f"tensor {name!r} appears in more than one shard of {self.hf_dir}")
                    self._file[name] = file
                    self._shape[name] = tuple(shard.get_slice(name).get_shape())

    def names(self) -> list[str]:
        """Every tensor name, shard by shard in file order."""
        return list(self._file)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape ``name`` has in its shard's header (nothing of the data is read)."""
        return self._shape[name]

    def get(self, name: str) -> torch.Tensor:
        """Copy one tensor out of its shard (on CPU); adds its size to :attr:`bytes_read`."""
        with safe_open(self.hf_dir / self._file[name], framework="pt", device="cpu") as shard:
            tensor = shard.get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def iter_hf_tensors(hf_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight of an HF checkpoint, one tensor at a time, shard by shard.

    Args:
        hf_dir: directory with ``model.safetensors`` or shards plus ``model.safetensors.index.json``.

    Raises:
        HFCheckpointError: see :class:`HFCheckpointReader`.
    """
    reader = HFCheckpointReader(hf_dir)
    for name in reader.names():
        yield name, reader.get(name)


def _write_shards(tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal current, size
        if current:
            save_file(current, tmp / f"shard-{len(shards):05d}.tmp", metadata={"format": "pt"})
            shards.append(list(current))
            current, size = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor name {name!r} given twice to save_hf_checkpoint")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        # clone(): safetensors refuses views sharing storage (e.g. tied embeddings) and non-contiguous tensors.
        current[name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
    flush()
    return shards


def _name_shards(tmp: Path, shards: list[list[str]]) -> dict[str, str]:
    if len(shards) == 1:
        (tmp / "shard-00000.tmp").rename(tmp / SINGLE_FILENAME)
        return dict.fromkeys(shards[0], SINGLE_FILENAME)
    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (tmp / f"shard-{i:05d}.tmp").rename(tmp / final)
        weight_map.update(dict.fromkeys(names, final))
    return weight_map


def save_hf_checkpoint(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    source_dir: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write an HF checkpoint atomically: safetensors (sharded with an index past ``max_shard_bytes``) + configs.

    Args:
        out_dir: the directory to create or replace (replaced only once the new one is complete).
        tensors: ``(hf_name, tensor)`` pairs, consumed as a stream.
        source_dir: HF directory whose config.json, generation_config.json and tokenizer files are copied.
        max_shard_bytes: largest shard; a single tensor larger than this gets a shard of its own.

    Returns:
        ``out_dir`` as a Path.
    """
    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes must be >= 1, got {max_shard_bytes}")
    out_dir = Path(out_dir).absolute()
    source = Path(source_dir) if source_dir is not None else None
    if source is not None and not (source / "config.json").is_file():
        raise ValueError(f"source_dir {source} has no config.json; pass the --hf-checkpoint the model came from")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = atomic.fresh_tmp_dir(out_dir)
    try:
        shards = _write_shards(tmp, tensors, max_shard_bytes)
        if not shards:
            raise ValueError("save_hf_checkpoint got no tensors")
        weight_map = _name_shards(tmp, shards)
        if len(shards) > 1:
            total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILENAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if source is not None:
            for name in COPIED_FILES:
                if (source / name).is_file():
                    shutil.copy2(source / name, tmp / name)
        atomic.publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved HF checkpoint %s (%d tensors, %d shard(s))", out_dir, len(weight_map), len(shards))
    return out_dir
