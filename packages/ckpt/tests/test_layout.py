"""resolve_checkpoint: every directory that cannot be loaded exactly is a distinct error naming the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tidal.ckpt import (
    TRACKER_FILENAME,
    CheckpointNotFoundError,
    IterationNotFoundError,
    NotAMegatronCheckpointError,
    TrackerFileMissingError,
    best_iteration,
    mark_best_iteration,
    resolve_checkpoint,
)


def _iteration(root: Path, iteration: int, *, complete: bool = True) -> Path:
    """An iteration directory as megatron leaves it; metadata.json is its last write."""
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"\0")
    if complete:
        (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return path


def test_tracker_names_the_iteration(tmp_path):
    _iteration(tmp_path, 50)
    latest = _iteration(tmp_path, 100)
    (tmp_path / TRACKER_FILENAME).write_text("100\n")
    assert resolve_checkpoint(tmp_path) == (100, latest)


def test_ckpt_step_overrides_the_tracker(tmp_path):
    older = _iteration(tmp_path, 50)
    _iteration(tmp_path, 100)
    (tmp_path / TRACKER_FILENAME).write_text("100")
    assert resolve_checkpoint(tmp_path, ckpt_step=50) == (50, older)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointNotFoundError) as e:
        resolve_checkpoint(tmp_path / "nope", flag="--ref-load")
    assert str(e.value).startswith(f"--ref-load {tmp_path / 'nope'} does not exist.")
    assert "--hf-checkpoint" in str(e.value)


def test_empty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match=r"holds no checkpoint .*it contains: notes.txt"):
        resolve_checkpoint(tmp_path)


def test_iterations_without_tracker_name_the_ckpt_step_to_pass(tmp_path):
    _iteration(tmp_path, 50)
    _iteration(tmp_path, 100)
    with pytest.raises(TrackerFileMissingError) as e:
        resolve_checkpoint(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} holds iter_0000050 and iter_0000100 but no latest_checkpointed_iteration.txt; "
        f"pass --ckpt-step 100 to load the newest (or another listed step)."
    )


def test_tracker_naming_a_missing_iteration(tmp_path):
    _iteration(tmp_path, 50)
    (tmp_path / TRACKER_FILENAME).write_text("100")
    with pytest.raises(IterationNotFoundError) as e:
        resolve_checkpoint(tmp_path)
    assert f"names iteration 100 but {tmp_path}/iter_0000100 does not exist" in str(e.value)
    assert str(e.value).endswith("Pass --ckpt-step 50 to load the newest complete one.")


def test_tracker_naming_an_incomplete_iteration(tmp_path):
    _iteration(tmp_path, 50)
    _iteration(tmp_path, 100, complete=False)
    (tmp_path / TRACKER_FILENAME).write_text("100")
    with pytest.raises(IterationNotFoundError, match=r"is incomplete \(no metadata.json"):
        resolve_checkpoint(tmp_path)


def test_ckpt_step_naming_a_missing_iteration(tmp_path):
    _iteration(tmp_path, 50)
    _iteration(tmp_path, 100)
    with pytest.raises(IterationNotFoundError, match=r"^--ckpt-step 70 but .*holds iter_0000050 and iter_0000100"):
        resolve_checkpoint(tmp_path, ckpt_step=70)


def test_garbled_tracker(tmp_path):
    _iteration(tmp_path, 7)
    (tmp_path / TRACKER_FILENAME).write_text("latest\n")
    with pytest.raises(IterationNotFoundError, match=r"holds 'latest', expected an iteration number.*--ckpt-step 7"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_checkpoint_passed_as_load_dir(tmp_path, sharded):
    (tmp_path / "config.json").write_text("{}")
    names = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] if sharded else ["model.safetensors"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(NotAMegatronCheckpointError) as e:
        resolve_checkpoint(tmp_path, flag="--ref-load")
    message = str(e.value)
    assert message.startswith(f"--ref-load {tmp_path} is a Hugging Face checkpoint (config.json + {len(names)} ")
    assert f"Pass it as --hf-checkpoint {tmp_path} instead" in message


def test_single_iteration_directory_passed_as_load_dir(tmp_path):
    iter_dir = _iteration(tmp_path, 100)
    with pytest.raises(NotAMegatronCheckpointError, match=re.escape(f"--load {tmp_path} --ckpt-step 100")):
        resolve_checkpoint(iter_dir)


def test_file_passed_as_load_dir(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        resolve_checkpoint(tmp_path / "f")


def test_hidden_leftovers_of_a_crashed_save_are_not_iterations(tmp_path):
    (tmp_path / ".iter_0000200.tmp").mkdir()
    _iteration(tmp_path, 100)
    with pytest.raises(TrackerFileMissingError, match="holds iter_0000100 but"):
        resolve_checkpoint(tmp_path)


README = Path(__file__).parents[1] / "README.md"


def _missing(root: Path) -> Path:
    return root / "run1"


def _no_tracker(root: Path) -> Path:
    _iteration(root, 50)
    _iteration(root, 100)
    return root


def _tracker_names_missing(root: Path) -> Path:
    _iteration(root, 50)
    (root / TRACKER_FILENAME).write_text("100\n")
    return root


def _hf_checkpoint(root: Path) -> Path:
    (root / "config.json").write_text("{}")
    (root / "model.safetensors").write_bytes(b"")
    return root


def _ckpt_step_missing(root: Path) -> Path:
    _iteration(root, 50)
    _iteration(root, 100)
    (root / TRACKER_FILENAME).write_text("100\n")
    return root


def _empty(root: Path) -> Path:
    (root / "notes.txt").write_text("")
    return root


def _incomplete(root: Path) -> Path:
    _iteration(root, 50)
    _iteration(root, 100, complete=False)
    (root / TRACKER_FILENAME).write_text("100\n")
    return root


def _single_iteration(root: Path) -> Path:
    return _iteration(root, 100)


@pytest.mark.parametrize(
    ("make", "ckpt_step", "error"),
    [
        (_missing, None, CheckpointNotFoundError),
        (_no_tracker, None, TrackerFileMissingError),
        (_tracker_names_missing, None, IterationNotFoundError),
        (_hf_checkpoint, None, NotAMegatronCheckpointError),
        (_ckpt_step_missing, 70, IterationNotFoundError),
        (_empty, None, CheckpointNotFoundError),
        (_incomplete, None, IterationNotFoundError),
        (_single_iteration, None, NotAMegatronCheckpointError),
    ],
)
def test_readme_lists_each_bad_directory_message_verbatim(tmp_path, make, ckpt_step, error):
    load_dir = make(tmp_path)
    with pytest.raises(error) as e:
        resolve_checkpoint(load_dir, ckpt_step=ckpt_step)
    message = str(e.value).replace(str(tmp_path), "DIR")
    assert message in README.read_text(), f"README lacks (or has a stale copy of):\n{message}"


def test_keep_last_never_deletes_the_best_iteration(tmp_path):
    from tidal.ckpt import best_iteration, mark_best_iteration
    from tidal.ckpt.checkpoint import _prune
    from tidal.ckpt.layout import BEST_FILENAME, COMPLETE_MARKER, TRACKER_FILENAME, iteration_dir_name, list_iterations

    for i in range(1, 6):
        (tmp_path / iteration_dir_name(i)).mkdir()
        (tmp_path / iteration_dir_name(i) / COMPLETE_MARKER).write_text("")
    (tmp_path / TRACKER_FILENAME).write_text("5\n")
    assert best_iteration(tmp_path) is None
    mark_best_iteration(tmp_path, 2)
    assert (tmp_path / BEST_FILENAME).read_text() == "2\n" and best_iteration(tmp_path) == 2
    _prune(tmp_path, keep=2, current=5)
    assert list_iterations(tmp_path) == [2, 4, 5]  # the newest two, and the best
    mark_best_iteration(tmp_path, 5)
    _prune(tmp_path, keep=2, current=5)
    assert list_iterations(tmp_path) == [4, 5]  # the former best is an old iteration like any other


def test_step_zero_is_an_iteration_like_any_other(tmp_path):
    first = _iteration(tmp_path, 0)
    _iteration(tmp_path, 5)
    (tmp_path / TRACKER_FILENAME).write_text("5\n")
    assert resolve_checkpoint(tmp_path, ckpt_step=0) == (0, first)  # --ckpt-step 0 is a choice, not "unset"
    (tmp_path / TRACKER_FILENAME).write_text("0\n")
    assert resolve_checkpoint(tmp_path) == (0, first)
    assert best_iteration(tmp_path) is None
    mark_best_iteration(tmp_path, 0)
    assert best_iteration(tmp_path) == 0


@pytest.mark.parametrize("text", ["", "\n", "-1", "1.5", "1e3", "0x10", "iter_0000007", "7 8", "²"])
def test_garbled_tracker_contents_are_refused_with_the_newest_step_to_pass(tmp_path, text):
    _iteration(tmp_path, 3)
    _iteration(tmp_path, 7)
    (tmp_path / TRACKER_FILENAME).write_text(text)
    with pytest.raises(IterationNotFoundError) as e:
        resolve_checkpoint(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / TRACKER_FILENAME} holds {text.strip()!r}, expected an iteration number; {tmp_path} holds "
        f"iter_0000003 and iter_0000007. Pass --ckpt-step 7 to choose one."
    )


def test_garbled_tracker_beside_no_complete_iteration(tmp_path):
    _iteration(tmp_path, 7, complete=False)
    (tmp_path / TRACKER_FILENAME).write_text("latest")
    with pytest.raises(IterationNotFoundError, match=r"holds no complete iteration\. Pass --ckpt-step N to choose"):
        resolve_checkpoint(tmp_path)


def test_a_tracker_with_spaces_and_leading_zeros_names_its_iteration(tmp_path):
    latest = _iteration(tmp_path, 12)
    (tmp_path / TRACKER_FILENAME).write_text("  0012 \n")
    assert resolve_checkpoint(tmp_path) == (12, latest)


def test_a_garbled_best_marker_names_no_best_iteration(tmp_path):
    from tidal.ckpt.layout import BEST_FILENAME

    (tmp_path / BEST_FILENAME).write_text("best\n")
    assert best_iteration(tmp_path) is None
    assert best_iteration(tmp_path / "missing") is None


@pytest.mark.parametrize(("count", "listed"), [
    (1, "iter_0000001"),
    (2, "iter_0000001 and iter_0000002"),
    (6, "iter_0000001, iter_0000002, iter_0000003, iter_0000004, iter_0000005 and iter_0000006"),
    (7, "iter_0000001, iter_0000002, ..., iter_0000005, iter_0000006 and iter_0000007"),
])  # fmt: skip
def test_the_missing_tracker_error_lists_the_iterations_it_saw(tmp_path, count, listed):
    for i in range(1, count + 1):
        _iteration(tmp_path, i)
    with pytest.raises(TrackerFileMissingError) as e:
        resolve_checkpoint(tmp_path)
    assert str(e.value).startswith(f"{tmp_path} holds {listed} but no ")


@pytest.mark.parametrize(("names", "seen"), [
    ([], "nothing"),
    ([f"f{i}" for i in range(8)], "f0, f1, f2, f3, f4, f5, f6, f7"),
    ([f"f{i}" for i in range(9)], "f0, f1, f2, f3, f4, f5, f6, f7, ..."),
])  # fmt: skip
def test_a_directory_without_checkpoints_lists_what_it_holds(tmp_path, names, seen):
    load_dir = tmp_path / "ckpt"
    load_dir.mkdir()
    for name in names:
        (load_dir / name).write_text("")
    with pytest.raises(CheckpointNotFoundError) as e:
        resolve_checkpoint(load_dir)
    assert f"holds no checkpoint (no {TRACKER_FILENAME}, no complete iter_XXXXXXX/; it contains: {seen}). " in str(
        e.value
    )


def test_a_tracker_beside_no_complete_iteration_gives_no_step_to_pass(tmp_path):
    _iteration(tmp_path, 4, complete=False)
    (tmp_path / TRACKER_FILENAME).write_text("4\n")
    with pytest.raises(IterationNotFoundError) as e:
        resolve_checkpoint(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / TRACKER_FILENAME} names iteration 4 but {tmp_path / 'iter_0000004'} is incomplete (no "
        f"metadata.json: its save did not finish); {tmp_path} holds no complete iteration."
    )


def test_only_a_complete_iteration_named_directory_is_taken_for_a_single_iteration(tmp_path):
    incomplete = _iteration(tmp_path, 9, complete=False)
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):
        resolve_checkpoint(incomplete)
    other = tmp_path / "ckpt"
    other.mkdir()
    (other / "metadata.json").write_text("{}")  # complete-looking, but not named iter_XXXXXXX
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint"):
        resolve_checkpoint(other)


def test_a_resolved_checkpoint_is_logged_with_its_flag_and_directory(tmp_path, caplog):
    latest = _iteration(tmp_path, 3)
    (tmp_path / TRACKER_FILENAME).write_text("3\n")
    with caplog.at_level("INFO", logger="tidal.ckpt.layout"):
        resolve_checkpoint(tmp_path, flag="--ref-load")
    assert caplog.messages == [f"resolved --ref-load {tmp_path} to iteration 3 ({latest})"]


def test_the_best_iteration_marker_creates_its_directory(tmp_path):
    save_dir = tmp_path / "runs" / "a" / "ckpt"
    mark_best_iteration(save_dir, 7)
    assert best_iteration(save_dir) == 7
