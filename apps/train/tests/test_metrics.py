"""metrics.jsonl append/read/truncate (resume), TensorBoard events, the per-rollout line."""

import json
import logging
import os

import pytest
from tidal.train.metrics import MetricsLog, rollout_line


def test_resume_truncates_rollouts_that_run_again(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for i in range(4):
        log.write({"rollout": i, "rollout/reward/mean": i / 10})
    assert log.truncate(2) == 2
    assert [r["rollout"] for r in log.read()] == [0, 1]
    log.write({"rollout": 2, "rollout/reward/mean": 0.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["rollout"] for line in lines] == [0, 1, 2]
    assert log.truncate(5) == 0


def test_every_record_is_fsynced_as_it_is_written(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for i in range(3):
        log.write({"rollout": i})
        assert len(synced) == i + 1  # before write() returns: a machine crash keeps the record


def test_a_torn_last_line_is_dropped_with_a_warning_on_resume(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout": 0}\n{"rollout": 1}\n{"rollout": 2, "rollout/rew')  # killed mid-write
    log = MetricsLog(path)
    with caplog.at_level(logging.WARNING):
        assert [r["rollout"] for r in log.read()] == [0, 1]
    assert "torn last line" in caplog.text
    assert log.truncate(2) == 0  # no record dropped, but the torn line is gone from the file
    log.write({"rollout": 2})
    assert [json.loads(line)["rollout"] for line in path.read_text().splitlines()] == [0, 1, 2]


def test_a_whole_last_record_without_newline_gets_one_before_the_next_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout": 0}\n{"rollout": 1}')
    log = MetricsLog(path)
    assert log.truncate(2) == 0
    log.write({"rollout": 2})
    assert [r["rollout"] for r in log.read()] == [0, 1, 2]


def test_a_broken_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout": 0}\nnot json\n{"rollout": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON record"):
        MetricsLog(path).read()


def _read_scalars(path):
    """Parse a TFRecord event file with tensorboardX's own protobuf classes: {tag: [(step, value)]}."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    data, pos, out = path.read_bytes(), 0, {}
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = Event.FromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_events_are_written(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=True)
    log.write({"rollout": 0, "rollout/reward/mean": 0.25, "note": "text is skipped"})
    log.write({"rollout": 1, "rollout/reward/mean": 0.5})
    log.close()
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = _read_scalars(events)
    assert scalars["rollout/reward/mean"] == [(0, 0.25), (1, 0.5)]
    assert "note" not in scalars


def test_rollout_line_names_each_phase():
    line = rollout_line(
        {"rollout": 2, "rollout/reward/mean": 0.5, "train/loss": -0.01, "time/generate": 1.0, "time/train": 2.0}, 10
    )
    assert line.startswith("rollout 3/10 | reward 0.500")
    assert "gen 1.0" in line and "train 2.0" in line


def test_pass_at_k_is_the_unbiased_estimator():
    from itertools import combinations

    from tidal.train.metrics import eval_metrics, pass_at_k

    # pass@k = P(at least one right among k drawn without replacement from the n samples): count the subsets
    for n, c, k in [(4, 1, 1), (4, 1, 2), (4, 2, 3), (5, 0, 2), (5, 5, 1), (6, 2, 4)]:
        right = [1] * c + [0] * (n - c)
        subsets = list(combinations(range(n), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(right[i] for i in s) for s in subsets) / len(subsets))
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    got = eval_metrics("add", rewards)
    assert got["eval/add/mean@4"] == pytest.approx(4 / 12)
    assert got["eval/add/pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert got["eval/add/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + 0 + 1.0) / 3)
    assert got["eval/add/pass@4"] == pytest.approx(2 / 3)
    assert sorted(got) == ["eval/add/mean@4", "eval/add/pass@1", "eval/add/pass@2", "eval/add/pass@4"]


def test_eval_sets_takes_one_path_or_named_pairs():
    from tidal.train.config import eval_sets

    assert eval_sets(("/data/held_out.jsonl",)) == [("held_out", "/data/held_out.jsonl")]
    assert eval_sets("/data/x.jsonl") == [("x", "/data/x.jsonl")]
    assert eval_sets(["aime", "/a.jsonl", "gsm", "/g.jsonl"]) == [("aime", "/a.jsonl"), ("gsm", "/g.jsonl")]
    for bad in (["a", "/a.jsonl", "b"], ["a", "/a.jsonl", "a", "/b.jsonl"]):
        with pytest.raises(ValueError, match="--eval-prompt-data"):
            eval_sets(bad)


def test_keep_best_by_names_the_best_saved_iteration_and_survives_a_resume(tmp_path):
    from tidal.ckpt import best_iteration
    from tidal.train.cli import parse_job
    from tidal.train.loop import _best_so_far, _mark_best

    argv = ["--output-dir", str(tmp_path / "run"), "--keep-best-by", "eval/accuracy", "--keep-last", "1"]
    job = parse_job(argv)
    history = [{"rollout": 0, "eval/accuracy": 0.4}, {"rollout": 1}, {"rollout": 2, "eval/accuracy": 0.3}]
    best = None
    for record in history:
        best = _mark_best(job, record, best)
    assert best == 0.4 and best_iteration(job.ckpt.save) == 1  # rollout 0 is saved as iteration 1
    assert _best_so_far(job, history) == 0.4  # a resumed run starts from the recorded best
    assert _mark_best(job, {"rollout": 3, "eval/accuracy": 0.5}, best) == 0.5 and best_iteration(job.ckpt.save) == 4


def test_eval_sampling_params_follow_the_eval_flags(tmp_path):
    from tidal.train.cli import parse_job
    from tidal.train.rollout_manager import eval_sampling_params

    base = ["--output-dir", str(tmp_path / "a"), "--rollout-temperature", "0.8", "--rollout-max-response-len", "32"]
    job = parse_job(base)
    params = eval_sampling_params(job.rollout, job.eval)  # defaults: one greedy sample, the rollout's length
    assert (params["n"], params["temperature"], params["top_p"], params["max_new_tokens"]) == (1, 0.0, 1.0, 32)
    flags = ["--n-samples-per-eval-prompt", "4", "--eval-temperature", "0.6", "--eval-top-p", "0.95"]
    job = parse_job([*base[:1], str(tmp_path / "b"), *base[2:], *flags, "--eval-max-response-len", "16"])
    params = eval_sampling_params(job.rollout, job.eval)
    assert (params["n"], params["temperature"], params["top_p"], params["max_new_tokens"]) == (4, 0.6, 0.95, 16)


def test_summary_compares_each_phase_with_the_measured_floor_of_the_same_shape(tmp_path, monkeypatch):
    from tidal.train import summary as summary_mod

    key = {"model": "m", "rollout_batch_size": 4, "n_samples_per_prompt": 2, "rollout_max_response_len": 6, "cpu": 2}
    floor = {"key": key, "generate_one_request_s": 0.5, "train_step_s": 0.25, "forward_s": 0.1}
    monkeypatch.setattr(summary_mod, "STEP_FLOOR_FILE", tmp_path / "floor.json")
    (tmp_path / "floor.json").write_text(json.dumps(floor))
    history = [{"rollout": 0, "rollout/reward/mean": 0.5, "time/generate": 1.0, "time/log_probs": 0.0,
                "time/train": 0.5, "time/weight_sync": 0.1, "time/rollout": 1.5}]  # fmt: skip
    result = summary_mod.RunResult(output_dir=tmp_path, checkpoint_dir=tmp_path, weights_dir=None, history=history,
                                   job_key=key)  # fmt: skip
    summary_mod.write_summary(result)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["floor_s"]["rollout"] == 0.75
    assert written["vs_floor"] == {"generate": 2.0, "log_probs": 0.0, "train": 2.0, "rollout": 2.0}
    summary_mod.write_summary(summary_mod.RunResult(output_dir=tmp_path, checkpoint_dir=tmp_path, weights_dir=None,
                                                    history=history, job_key={**key, "cpu": 64}))  # fmt: skip
    assert "vs_floor" not in json.loads((tmp_path / "summary.json").read_text())  # another machine: no floor
