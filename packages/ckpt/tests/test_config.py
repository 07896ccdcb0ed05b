from __future__ import annotations

import pytest
from tidal.ckpt import CkptConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"load": "d", "ckpt_step": -1}, "--ckpt-step must be >= 0, got -1"),
        ({"keep_last": 0}, "--keep-last must be >= 1, got 0"),
        ({"save": "d", "save_interval": 0}, "--save-interval must be >= 1, got 0"),
        ({"max_shard_bytes": 0}, "--max-shard-bytes must be >= 1, got 0"),
        ({"ckpt_step": 5}, "--ckpt-step 5 has no effect without --load"),
        ({"save_interval": 5}, "--save-interval 5 needs --save"),
    ],
)
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CkptConfig(**kwargs)


def test_defaults_are_valid_and_frozen():
    cfg = CkptConfig(load="ckpt", ckpt_step=3)
    with pytest.raises(AttributeError):
        cfg.load = "other"  # type: ignore[misc]


def test_async_save_without_save_dir_warns(caplog):
    with caplog.at_level("WARNING", logger="tidal.ckpt.config"):
        CkptConfig(async_save=True)
    assert "--async-save has no effect without --save" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tidal.ckpt.config"):
        assert CkptConfig(save="d", async_save=True, keep_last=2).async_save
    assert not caplog.text
