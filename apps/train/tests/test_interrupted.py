"""The command an interrupted run prints: the same job, resumed from --save into the same run folder."""

import shlex

from tidal.train.cli import parse_job
from tidal.train.interrupted import resume_command


def _checkpoint(save, iteration: int) -> None:
    (save / f"iter_{iteration:07d}").mkdir(parents=True)
    (save / f"iter_{iteration:07d}" / "metadata.json").write_text("{}")
    (save / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_the_resume_command_keeps_the_job_and_replaces_the_per_run_flags(tmp_path):
    save, out = tmp_path / "ckpt", tmp_path / "run"
    _checkpoint(save, 3)
    argv = ["--num-rollout", "9", "--load=old", "--start-rollout-id", "2", "--overwrite-output-dir",
            "--output-dir", str(out), "--save", str(save), "--lr", "1e-5"]  # fmt: skip
    line = resume_command(argv, parse_job(argv[:2] + argv[5:]))
    assert line.startswith(f"rollouts 0-2 are checkpointed in {save}; go on at rollout 3 with: uv run train ")
    resumed = shlex.split(line.split(" with: ", 1)[1])[3:]
    assert resumed == ["--num-rollout", "9", "--save", str(save), "--lr", "1e-5",
                       "--load", str(save), "--output-dir", str(out)]  # fmt: skip
    job = parse_job(resumed)
    assert (job.ckpt.load, job.train.output_dir, job.train.num_rollout) == (str(save), str(out), 9)


def test_without_a_checkpoint_it_says_what_the_same_command_does(tmp_path):
    argv = ["--output-dir", str(tmp_path / "run")]
    assert resume_command(argv, parse_job(argv)) == "no checkpoint was written: the same command starts the run over"
    old = tmp_path / "old"
    _checkpoint(old, 2)  # resumed from another folder, interrupted before a rollout of its own finished
    argv += ["--load", str(old)]
    line = resume_command(argv, parse_job(argv))
    assert line == f"no new checkpoint was written: the same command goes on from --load {old}"
