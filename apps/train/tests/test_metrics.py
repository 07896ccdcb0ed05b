"""metrics.jsonl append/read/truncate (resume), TensorBoard events, the per-rollout line."""

import json

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
