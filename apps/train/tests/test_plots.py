"""curves.png: the reward panel always, the engine-actor agreement panel once a record carries it."""

import struct

from tidal.train.plots import write_curves


def _size(png) -> tuple[int, int]:
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_agreement_panel_is_added_below_the_rewards(tmp_path):
    history = [
        {
            "rollout": i,
            "rollout/reward/mean": 0.1 * i,
            "rollout/logprob_abs_diff/mean": 0.01,
            "rollout/logprob_abs_diff/max": 0.3,
            "rollout/engine_actor_kl": 0.0,  # exact agreement: drawn at the log scale's floor, not dropped
        }
        for i in range(3)
    ]
    with_panel = write_curves(tmp_path / "a.png", history, eval_before=0.2, mismatch_threshold=0.05)
    rewards_only = write_curves(tmp_path / "b.png", [{"rollout": 0, "rollout/reward/mean": 0.5}], eval_before=0.2)
    (width_a, height_a), (width_b, height_b) = _size(with_panel), _size(rewards_only)
    assert width_a == width_b and height_a > 1.5 * height_b
    assert not list(tmp_path.glob("*.tmp.png"))


def test_each_eval_set_gets_its_curves(tmp_path):
    from tidal.train.plots import _eval_keys

    history = [
        {"rollout": i, "rollout/reward/mean": 0.1 * i, "eval/accuracy": 0.3, "eval/add/mean@4": 0.3,
         "eval/add/pass@1": 0.3, "eval/add/pass@4": 0.6, "eval/mul/mean@4": 0.1, "eval/mul/pass@4": 0.2}
        for i in range(2)
    ]  # fmt: skip
    assert _eval_keys(history) == ["eval/add/mean@4", "eval/add/pass@4", "eval/mul/mean@4", "eval/mul/pass@4"]
    assert _size(write_curves(tmp_path / "c.png", history, eval_before=0.2))[0] > 0


def test_a_distillation_run_gets_a_teacher_kl_panel(tmp_path):
    history = [{"rollout": i, "rollout/reward/mean": 0.0, "distill/teacher_kl/mean": 0.5 / (i + 1),
                "distill/teacher_kl/p10": 0.0, "distill/teacher_kl/p90": 1.0 / (i + 1)} for i in range(3)]  # fmt: skip
    with_panel = write_curves(tmp_path / "a.png", history)
    rewards_only = write_curves(tmp_path / "b.png", [{"rollout": 0, "rollout/reward/mean": 0.5}])
    assert _size(with_panel)[1] > 1.5 * _size(rewards_only)[1]
