"""Prompt sources as people store them: JSONL, JSON, Parquet, ``datasets`` folders, globs, weighted mixes.

A ``--prompt-data`` value is one or more sources, each ``PATH[:WEIGHT]``; ``PATH`` is a file, a glob of files of one
format, or a folder written by ``datasets``' ``save_to_disk`` (one split). Files are read through the ``datasets``
library into Arrow tables that are memory-mapped: a row becomes a Python object only when a batch asks for it.

Keys are paths into a row: ``prompt.0.content`` is field ``content`` of item 0 of list ``prompt``. Every row of every
file is checked for the keys when the data is opened (vectorized over the Arrow columns), so a missing key is one
line naming the file, the row and the key, before any process starts.
"""

from __future__ import annotations

import glob
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> the ``datasets`` builder that reads it."""
FIRST_RECORD_BYTES = 1 << 20
"""Bytes of a JSONL file read to find its first record (the start-up check)."""


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One source of ``--prompt-data``: its files (or ``datasets`` folder) and its mixing weight."""

    spec: str
    """As given (``PATH[:WEIGHT]``)."""
    paths: tuple[str, ...]
    """Files in sorted order, or one ``save_to_disk`` folder."""
    weight: float | None
    """Share of the mix (normalized over the sources); None: the source's share is its number of rows."""

    @property
    def name(self) -> str:
        """A short name: the stem of its path (a glob's stem with its wildcards)."""
        return Path(self.spec.rsplit(":", 1)[0] if self.weight is not None else self.spec).stem or "data"


def split_weight(spec: str) -> tuple[str, float | None]:
    """``PATH[:WEIGHT]`` -> ``(PATH, WEIGHT or None)``; a suffix that is no number stays part of the path."""
    path, sep, tail = spec.rpartition(":")
    if not sep:
        return spec, None
    try:
        weight = float(tail)
    except ValueError:
        return spec, None
    return path, weight


def is_disk_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def resolve_source(flag: str, spec: str) -> SourceSpec:
    """Files (or the ``datasets`` folder) of one source; an error names the flag, the path and what to give."""
    path, weight = split_weight(spec)
    if weight is not None and not weight > 0:
        raise ValueError(f"{flag} {spec}: the weight after ':' must be > 0, got {weight}")
    if any(c in path for c in "*?["):
        files = sorted(glob.glob(path, recursive=True))
        if not files:
            raise ValueError(f"{flag} {path}: the pattern matches no file; check the path")
    elif Path(path).is_dir():
        if not is_disk_dataset(Path(path)):
            raise ValueError(
                f"{flag} {path} is a folder but not one written by datasets' save_to_disk; give files, a glob "
                "such as DIR/*.parquet, or a save_to_disk folder"
            )
        return SourceSpec(spec, (path,), weight)
    elif Path(path).is_file():
        files = [path]
    else:
        raise ValueError(f"{flag} {path} is not a file, a glob or a folder; check the path")
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = sorted(suffixes - set(FILE_FORMATS))
    if unknown:
        raise ValueError(
            f"{flag} {path}: files ending {unknown} are not read; give .jsonl, .json or .parquet files, "
            "or a datasets save_to_disk folder"
        )
    if len({FILE_FORMATS[s] for s in suffixes}) > 1:
        raise ValueError(f"{flag} {path} matches files of several formats {sorted(suffixes)}; give one source each")
    return SourceSpec(spec, tuple(files), weight)


def resolve_sources(flag: str, specs: str | tuple[str, ...] | list[str]) -> list[SourceSpec]:
    """Every source of ``specs``; weights are given for all of them or for none."""
    specs = [specs] if isinstance(specs, str) else list(specs)
    if not specs:
        raise ValueError(f"{flag} needs at least one PATH[:WEIGHT]")
    sources = [resolve_source(flag, spec) for spec in specs]
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ValueError(
            f"{flag} {' '.join(specs)}: give every source a weight (PATH:WEIGHT) or none (each then counts its rows)"
        )
    return sources


def key_parts(key: str) -> list[str | int]:
    """``"prompt.0.content"`` -> ``["prompt", 0, "content"]`` (an all-digit part indexes a list)."""
    return [int(part) if part.isdigit() else part for part in key.split(".")]


def get_key(row: Any, key: str) -> Any:
    """The value at ``key`` in ``row``; raises KeyError naming the first part that is missing."""
    value = row
    for part in key_parts(key):
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError) as e:
            raise KeyError(part) from e
    return value


def first_record(path: str) -> dict[str, Any] | None:
    """The first record of a JSONL or Parquet file (cheap: a megabyte, or one row), or None for other kinds."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path).iter_batches(batch_size=1)
        batch = next(table, None)
        return batch.to_pylist()[0] if batch is not None and batch.num_rows else {}
    if suffix != ".jsonl":
        return None
    with open(path, "rb") as f:
        head = f.read(FIRST_RECORD_BYTES)
    lines = [(n, line) for n, line in enumerate(head.splitlines(), start=1) if line.strip()]
    if not lines:
        return {}
    line_no, first = lines[0]
    try:
        record = json.loads(first)
    except ValueError as e:
        raise ValueError(f"{path}: line {line_no} is not JSON ({e}); the file must be JSONL") from e
    if not isinstance(record, dict):
        raise ValueError(f"{path}: line {line_no} is a JSON {type(record).__name__}, not an object")
    return record


def check_prompt_source(flag: str, spec: str | list[str], *, keys: dict[str, str]) -> None:
    """The start-up check of one source: its files exist in a known format, and a first record holds ``keys``.

    ``keys`` maps a flag (``--input-key``) to its key path. Only the first record of the first file is read here
    (JSONL and Parquet); :func:`tidal.train.prompt_tables.open_sources` checks every row when the data is opened.
    """
    for source in resolve_sources(flag, spec):
        for path in source.paths:
            if Path(path).is_dir():
                continue
            try:
                record = first_record(path)
            except OSError as e:
                raise ValueError(f"{flag} {path} cannot be read ({e})") from e
            if record == {}:
                raise ValueError(f"{flag} {path} holds no records; give a file with one prompt per row")
            if record is not None:
                _check_keys(f"{flag} {path}: row 0", record, keys)


def _check_keys(where: str, row: dict[str, Any], keys: dict[str, str]) -> None:
    for key_flag, key in keys.items():
        try:
            get_key(row, key)
        except KeyError as e:
            raise ValueError(
                f"{where} has no key {key!r} (missing part {e.args[0]!r}; its keys: {sorted(row)}); set {key_flag} "
                "to the key path that holds it (nested: a.0.b)"
            ) from e
