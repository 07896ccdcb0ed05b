"""Sources opened as memory-mapped Arrow tables through ``datasets``, every row checked for the keys.

``datasets`` turns a JSONL, JSON or Parquet file into an Arrow file in its cache once (later runs map the cached
file), and maps a ``save_to_disk`` folder as it is. The key check runs on the Arrow columns (no Python object per
row), so it costs seconds for ten million rows; its error names the file, the row and the key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from tidal.train.data_sources import FILE_FORMATS, SourceSpec, key_parts, resolve_sources

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptTable:
    """One source's rows: its files' ``datasets.Dataset`` objects end to end, with the source's weight."""

    paths: tuple[str, ...]
    """The files (or the one ``save_to_disk`` folder), in order."""
    tables: tuple[Any, ...]
    """A ``datasets.Dataset`` per path (memory-mapped Arrow)."""
    weight: float | None
    """The source's share of a mix; None: its number of rows."""
    starts: np.ndarray
    """Index of each path's first row within the source (and the total at the end)."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    def row(self, index: int) -> dict[str, Any]:
        """Row ``index`` of the source as a Python dict (the only place a row becomes Python objects)."""
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.tables[part][index - int(self.starts[part])]


def open_sources(flag: str, specs: list[str], *, keys: dict[str, str]) -> list[PromptTable]:
    """Open every source of ``specs``; each row of each file must hold ``keys`` (flag -> key path)."""
    out = []
    for source in resolve_sources(flag, specs):
        tables = [_open(flag, path, source) for path in source.paths]
        for path, table in zip(source.paths, tables, strict=True):
            if len(table) == 0:
                raise ValueError(f"{flag} {path} holds no rows (an empty file or split); give prompts")
            check_rows(f"{flag} {path}", table.data.table, keys)
        starts = np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int64)
        out.append(PromptTable(source.paths, tuple(tables), source.weight, starts))
    import pyarrow as pa

    pa.default_memory_pool().release_unused()  # the checks' columns are gone; their pool pages go back to the OS
    return out


def _open(flag: str, path: str, source: SourceSpec):
    import datasets

    try:
        if len(source.paths) == 1 and source.paths[0] == path and not path.lower().endswith(tuple(FILE_FORMATS)):
            loaded = datasets.load_from_disk(path)
            if isinstance(loaded, datasets.DatasetDict):
                splits = sorted(loaded)
                if len(splits) != 1:
                    raise ValueError(f"{flag} {path} holds the splits {splits}; point it at {path}/SPLIT")
                loaded = loaded[splits[0]]
            return loaded
        builder = FILE_FORMATS[f".{path.rsplit('.', 1)[-1].lower()}"]
        with open(path, "rb") as f:
            if builder == "json" and not f.read(1 << 16).strip():
                raise ValueError(f"{flag} {path} holds no rows (an empty file); give prompts")
        return datasets.load_dataset(builder, data_files=[path], split="train")
    except ValueError:
        raise
    except Exception as e:  # datasets wraps Arrow's and JSON's errors in its own types
        cause = e.__cause__ or e
        raise ValueError(f"{flag} {path} cannot be read as a table: {type(cause).__name__}: {cause}"[:400]) from e


def check_rows(where: str, table, keys: dict[str, str]) -> None:
    """Every row of the Arrow ``table`` holds a non-null value at each key path; else one line naming the row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for key_flag, key in keys.items():
        parts = key_parts(key)
        column: Any = None
        for depth, part in enumerate(parts):
            so_far = ".".join(map(str, parts[: depth + 1]))
            if column is None:
                if part not in table.column_names:
                    _missing(where, key, key_flag, f"no key {part!r} (its keys: {table.column_names})")
                column = table.column(part)
                continue
            if pa.types.is_struct(column.type) and isinstance(part, str):
                names = [column.type.field(i).name for i in range(column.type.num_fields)]
                if part not in names:
                    _missing(where, key, key_flag, f"no key {so_far!r}: {'.'.join(map(str, parts[:depth]))} "
                             f"has the fields {names}")  # fmt: skip
                column = pc.struct_field(column, part)
            elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                if not isinstance(part, int):
                    _missing(where, key, key_flag, f"{'.'.join(map(str, parts[:depth]))} is a list: index it by number")
                short = pc.less_equal(pc.fill_null(pc.list_value_length(column), part + 1), part)
                bad = pc.index(short, True).as_py()
                if bad >= 0:
                    _missing(where, key, key_flag, f"row {bad}: {so_far} is past the end of its list", row=True)
                column = pc.list_element(column, part)
            else:
                _missing(where, key, key_flag, f"{'.'.join(map(str, parts[:depth]))} is {column.type}, not a record")
        bad = pc.index(pc.is_null(column), True).as_py()
        if bad >= 0:
            _missing(where, key, key_flag, f"row {bad} has no value at {key!r}", row=True)


def _missing(where: str, key: str, key_flag: str, what: str, *, row: bool = False) -> None:
    fix = "fix or drop that row" if row else f"set {key_flag} to the key path that holds it (nested: a.0.b)"
    raise ValueError(f"{where}: {what}; {key_flag} is {key!r}: {fix}")
