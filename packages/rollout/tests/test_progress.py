"""GenerationProgress: periodic log lines with rate and ETA, a bar on request."""

from __future__ import annotations

import logging

import pytest
from tidal.rollout.progress import GenerationProgress


def test_progress_logs_done_total_rate_and_eta(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tidal.rollout.progress")
    with GenerationProgress(8, desc="generate", log_every_s=0.0, bar=False) as progress:
        progress.update(2)
        progress.update(4)
    lines = [r.getMessage() for r in caplog.records if r.name == "tidal.rollout.progress"]
    assert len(lines) == 3  # one per update (log_every_s=0), one at the end
    assert lines[0].startswith("generate: 2/8 samples (25%), ") and "samples/s, ETA " in lines[0]
    assert lines[1].startswith("generate: 6/8 samples (75%)")
    assert lines[2].startswith("generate: 6/8 samples (75%)") and lines[2].endswith(" s)")
    assert progress.done == 6 and progress.rate > 0


def test_progress_logs_only_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tidal.rollout.progress")
    progress = GenerationProgress(100, log_every_s=3600.0, bar=False)
    for _ in range(10):
        progress.update(1)
    assert not caplog.records  # not yet due
    progress.close()
    assert [r.getMessage()[:24] for r in caplog.records] == ["generate: 10/100 samples"]


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    with GenerationProgress(4, desc="rollout", log_every_s=3600.0, bar=True) as progress:
        progress.update(4)
    err = capsys.readouterr().err
    assert "rollout:" in err and "/4 [" in err and "sample/s" in err  # tqdm redraws at most every 0.1 s
