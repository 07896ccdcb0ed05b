"""config.json is parsed once per process while it is unchanged; a rewritten file is read again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tidal.ckpt import read_hf_config_json
from tidal.ckpt.hf_config_file import _parsed


def _reads() -> int:
    return _parsed.cache_info().misses  # every miss is one read of a file


def test_config_json_is_read_once_until_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 2, "rope_scaling": {"factor": 4.0}}')
    before = _reads()
    first = read_hf_config_json(tmp_path)
    assert (
        read_hf_config_json(str(tmp_path)) == read_hf_config_json(tmp_path / ".") == first
    )  # one path, three spellings
    assert _reads() == before + 1
    first["rope_scaling"]["factor"] = 8.0  # each caller gets its own copy
    assert read_hf_config_json(tmp_path)["rope_scaling"] == {"factor": 4.0}
    mtime = path.stat().st_mtime_ns
    path.write_text('{"num_hidden_layers": 4, "rope_scaling": {"factor": 4.0}}')
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # a new mtime even on a coarse clock
    assert read_hf_config_json(tmp_path)["num_hidden_layers"] == 4
    assert _reads() == before + 2


def test_missing_or_broken_config_json_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_hf_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError):
        read_hf_config_json(tmp_path)
