"""What each process writes to its log file and to the terminal (tidal.train.logs), one process per case."""

import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
from tidal.train.logs import TERMINAL, LogPlan, setup_logging

log_dir, verbose, marks = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
setup_logging("engine http://h:1", LogPlan(log_dir=log_dir, verbose=verbose), terminal_marks=marks)
setup_logging("engine http://h:1", LogPlan(log_dir=log_dir, verbose=verbose), terminal_marks=marks)  # idempotent
log = logging.getLogger("tidal.rollout.progress")
log.info("generate: 512/512 samples")
log.info("rollout 1/3 | reward 0.2", extra=TERMINAL)
log.warning("a real warning")
gpt = logging.getLogger("megatron.core.models.gpt.gpt_model")
gpt.warning("GPTModel IS DEPRECATED. Please use HybridModel")
gpt.warning("GPTModel IS DEPRECATED. Please use HybridModel")
gpt.warning("another megatron warning")
gpt.error("GPTModel IS DEPRECATED, as an error")
"""


def _run(tmp_path, *, verbose: bool, marks: bool) -> tuple[list[str], str]:
    args = [str(tmp_path), str(int(verbose)), str(int(marks))]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    return proc.stderr.splitlines(), (tmp_path / "engine_http_h_1.log").read_text()


@pytest.mark.parametrize(
    ("verbose", "marks", "shown"),
    [
        (False, False, ["a real warning", "another megatron warning", "as an error"]),  # a worker
        (False, True, ["rollout 1/3", "a real warning", "another megatron warning", "as an error"]),  # the driver
        (True, True, ["generate: 512", "rollout 1/3", "a real warning", "tidal.notices", "another", "as an error"]),
        (True, False, ["generate: 512", "rollout 1/3", "a real warning", "tidal.notices", "another", "as an error"]),
    ],
)
def test_the_terminal_shows_warnings_marked_lines_and_with_verbose_everything(tmp_path, verbose, marks, shown):
    terminal, file = _run(tmp_path, verbose=verbose, marks=marks)
    assert len(terminal) == len(shown), terminal
    for line, expected in zip(terminal, shown, strict=True):
        assert line.startswith("[tidal engine http://h:1] ") and expected in line, terminal
    # The file holds every line, each once, whatever the terminal shows.
    assert file.count("generate: 512/512") == file.count("rollout 1/3") == file.count("a real warning") == 1


def test_a_notice_is_said_once_at_info_with_its_meaning(tmp_path):
    terminal, file = _run(tmp_path, verbose=False, marks=True)
    assert not [line for line in terminal if "GPTModel IS DEPRECATED." in line], terminal
    notices = [line for line in file.splitlines() if "GPTModel IS DEPRECATED." in line]
    assert len(notices) == 1, file
    assert " INFO tidal.notices: megatron.core.models.gpt.gpt_model: GPTModel" in notices[0]
    assert "nothing to do" in notices[0]  # what it means
    # The same logger's other warnings, and an error matching the notice, still pass as they are.
    assert "WARNING megatron.core.models.gpt.gpt_model: another megatron warning" in file
    assert "ERROR megatron.core.models.gpt.gpt_model: GPTModel IS DEPRECATED, as an error" in file


def test_rollout_bar_draws_nothing_off_a_terminal(capsys):
    from tidal.train.terminal import RolloutBar

    with RolloutBar(3) as bar:  # pytest's captured stderr is no terminal
        for rollout in range(3):
            bar.phase(rollout, "generate")
    assert bar.live is False
    assert capsys.readouterr() == ("", "")
