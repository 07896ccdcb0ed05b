"""Run folders: a default run gets a fresh one (runs/latest links to it); a run never writes over another's records."""

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tidal.train.cli import parse_job
from tidal.train.run_folder import check_output_dir, default_output_dir, link_latest


def _finished_run(folder: Path, *, checkpoint: bool = True) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"rollout": 0}\n')
    if checkpoint:
        (folder / "ckpt").mkdir()
        (folder / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1\n")


def test_runs_without_output_dir_each_get_a_fresh_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = parse_job([])
    assert Path(first.train.output_dir).parent == Path("runs").absolute()  # absolute: workers get it
    assert first.ckpt.save == str(Path(first.train.output_dir) / "ckpt")
    _finished_run(Path(first.train.output_dir))
    second = parse_job([])  # the same command again: no refusal, its own folder
    assert second.train.output_dir != first.train.output_dir
    assert not (Path(second.train.output_dir) / "metrics.jsonl").exists()


def test_default_folder_names_are_unique_within_a_second(tmp_path):
    now = time.time()
    names = []
    for _ in range(3):
        folder = default_output_dir(tmp_path, now=now)
        folder.mkdir()
        names.append(folder.name)
    assert names[1] == names[0] + "-2" and names[2] == names[0] + "-3"


def test_runs_latest_links_to_the_newest_run(tmp_path, caplog):
    root = tmp_path / "runs"
    for name in ("20261203-120000", "20261203-130000"):
        (root / name).mkdir(parents=True)
        link_latest(root / name, root)
        assert (root / "latest").resolve() == (root / name).resolve()
    assert (root / "latest").readlink() == Path("20261203-130000")  # relative: the folder can move
    link_latest(tmp_path / "elsewhere", root)  # a run outside runs/ leaves the link alone
    assert (root / "latest").readlink() == Path("20261203-130000")
    old = tmp_path / "old_layout"
    (old / "latest").mkdir(parents=True)  # an earlier tidal's runs/latest folder: never replaced
    (old / "new").mkdir()
    with caplog.at_level(logging.WARNING):
        link_latest(old / "new", old)
    assert (old / "latest").is_dir() and not (old / "latest").is_symlink()
    assert "is a folder of an earlier run" in caplog.text


@pytest.mark.parametrize("checkpoint", [True, False], ids=["metrics and checkpoint", "metrics only"])
def test_a_folder_holding_a_run_is_refused_in_one_line_naming_both_options(tmp_path, checkpoint):
    out = tmp_path / "run"
    _finished_run(out, checkpoint=checkpoint)
    with pytest.raises(ValueError) as refused:
        parse_job(["--output-dir", str(out)])
    message = str(refused.value)
    assert "\n" not in message
    assert f"--output-dir {out} holds an earlier run" in message
    assert f"--load {out / 'ckpt'}" in message and "--overwrite-output-dir" in message
    assert parse_job(["--output-dir", str(out), "--overwrite-output-dir"]).train.overwrite_output_dir


def test_a_checkpoint_in_save_counts_as_an_earlier_run(tmp_path):
    save = tmp_path / "shared_ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("3\n")
    with pytest.raises(ValueError, match="shared_ckpt"):
        parse_job(["--output-dir", str(tmp_path / "fresh"), "--save", str(save)])


def test_resuming_or_overwriting_is_allowed_and_an_empty_or_unfinished_folder_is_free(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    check_output_dir(out, out / "ckpt", resuming=True, overwrite=False)
    check_output_dir(out, out / "ckpt", resuming=False, overwrite=True)
    started = tmp_path / "killed_during_start_up"
    (started / "logs").mkdir(parents=True)
    (started / "config.yaml").write_text("num-rollout: 3\n")
    (started / "metrics.jsonl").write_text("")
    check_output_dir(started, started / "ckpt", resuming=False, overwrite=False)


def test_effective_config_reruns_into_a_new_folder(tmp_path):
    from tidal.train.config_file import write_effective_config

    job = parse_job(["--output-dir", str(tmp_path / "a"), "--overwrite-output-dir", "--num-rollout", "4"])
    path = write_effective_config(job, tmp_path / "a")
    text = path.read_text()
    assert "overwrite-output-dir" not in text  # one command's permission, not part of the job
    assert "\nsave:" not in text  # derived from --output-dir, so a rerun elsewhere saves elsewhere
    rerun = parse_job(["--config", str(path), "--output-dir", str(tmp_path / "b")])
    assert rerun.ckpt.save == str(tmp_path / "b" / "ckpt") and rerun.train.num_rollout == 4


def test_the_refusal_reaches_the_terminal_as_one_line_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.train.cli", "--output-dir", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "holds an earlier run" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60
    assert (out / "metrics.jsonl").read_text() == '{"rollout": 0}\n'  # nothing touched
