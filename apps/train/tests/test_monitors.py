"""Flat-reward and chat-template warnings, with a real tokenizer and real rollout Samples."""

import logging

from tidal.rollout import Sample
from tidal.train.embedded_model import build_tokenizer
from tidal.train.monitors import RewardSanity, check_engine_agreement, check_prompt_chat_template


def _samples(rewards):
    return [
        Sample(
            prompt_ids=[1, 2],
            response_ids=[3, 4],
            response_log_probs=[-0.1, -0.2],
            finish_reason="stop",
            reward=r,
            label="7",
            response_text="12",
        )
        for r in rewards
    ]


def test_identical_rewards_warn_once_after_patience_with_an_example(caplog):
    sanity = RewardSanity(3)
    with caplog.at_level(logging.WARNING):
        assert not sanity.observe(_samples([0.0, 0.0]))
        assert not sanity.observe(_samples([0.0, 0.0]))
        assert sanity.observe(_samples([0.0, 0.0]))
        assert not sanity.observe(_samples([0.0, 0.0]))  # once per streak
    assert "for 3 rollouts in a row" in caplog.text
    assert "label '7'" in caplog.text
    assert not sanity.observe(_samples([0.0, 1.0]))  # a varied rollout resets the streak
    assert sanity.streak == 0


def test_reward_sanity_can_be_disabled():
    sanity = RewardSanity(0)
    assert not any(sanity.observe(_samples([1.0])) for _ in range(5))


def _agreement(mean):
    return {
        "rollout": 4,
        "rollout/logprob_abs_diff/mean": mean,
        "rollout/logprob_abs_diff/max": 1.25,
        "rollout/engine_actor_kl": 0.03,
    }


def test_engine_actor_gap_above_the_threshold_warns_with_the_figures_and_the_flags(caplog):
    with caplog.at_level(logging.WARNING):
        message = check_engine_agreement(_agreement(0.2), 0.05)
    assert message is not None and caplog.text.count("rollout 4:") == 1
    assert "0.2000 nats on average (max 1.250, KL(engine || actor) 3.00e-02)" in message
    assert "--mismatch-warn-threshold 0.05" in message and "--sglang-dtype" in message
    assert check_engine_agreement(_agreement(float("nan")), 0.05) is not None  # NaN is no agreement


def test_engine_actor_gap_below_the_threshold_disabled_or_absent_is_silent(caplog):
    with caplog.at_level(logging.WARNING):
        assert check_engine_agreement(_agreement(0.05), 0.05) is None
        assert check_engine_agreement(_agreement(0.2), 0.0) is None  # 0 disables
        assert check_engine_agreement({"rollout": 0}, 0.05) is None  # no actor or no engine: nothing measured
        stale = {**_agreement(0.2), "rollout/staleness_max": 1.0}  # --max-staleness: sampled by older weights
        assert check_engine_agreement(stale, 0.05) is None
    assert not caplog.text


def test_the_recorder_warns_above_the_mismatch_warn_threshold_it_is_given(tmp_path, caplog):
    """--mismatch-warn-threshold 0.3 reaches the recorder: a 0.2 gap passes (the default 0.05 would warn), 0.4 warns."""
    import time
    from types import SimpleNamespace

    from tidal.train.cli import parse_job
    from tidal.train.cluster import rollout_manager_of
    from tidal.train.metrics import MetricsLog
    from tidal.train.recorder import RolloutRecorder
    from tidal.train.summary import RunResult

    job = parse_job(["--mismatch-warn-threshold", "0.3", "--output-dir", str(tmp_path / "run")])
    rollouts = rollout_manager_of(job, SimpleNamespace(tokenizer=None), tmp_path)  # no engine started: no retries
    result = RunResult(output_dir=tmp_path, checkpoint_dir=tmp_path, weights_dir=None)
    with MetricsLog(tmp_path / "metrics.jsonl") as log, caplog.at_level(logging.WARNING):
        recorder = RolloutRecorder(job, tmp_path, log, result, rollouts, start=0)
        for rollout_id, gap in enumerate([0.2, 0.4]):
            metrics = {k: v for k, v in _agreement(gap).items() if k != "rollout"}  # the actor's figures
            recorder.record(rollout_id, _samples([0.0, 1.0]), metrics, {}, time.monotonic())
    assert caplog.text.count("above --mismatch-warn-threshold 0.3:") == 1
    assert "rollout 1: " in caplog.text and "rollout 0: " not in caplog.text
    assert [r["rollout/logprob_abs_diff/mean"] for r in result.history] == [0.2, 0.4]


def _tokenizer(template=None):
    tok = build_tokenizer(["1+2=3"])
    if template:
        tok.chat_template = template
    return tok


QWEN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}{% endfor %}"


def test_prompts_rendered_with_another_template_warn_with_both_examples():
    data = ["1+2=", "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"]
    message = check_prompt_chat_template(data, _tokenizer(LLAMA), apply_chat_template=False)
    assert message is not None
    assert "<|im_start|>" in message and "<|start_header_id|>" in message


def test_prompts_rendered_with_the_tokenizers_own_template_are_fine():
    data = ["<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"]
    assert check_prompt_chat_template(data, _tokenizer(QWEN), apply_chat_template=False) is None


def test_templated_prompts_with_apply_chat_template_warn_about_double_wrapping():
    data = ["<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"]
    message = check_prompt_chat_template(data, _tokenizer(QWEN), apply_chat_template=True)
    assert message is not None and "second time" in message


def test_raw_prompts_never_warn():
    assert check_prompt_chat_template(["1+2=", "hello"], _tokenizer(), apply_chat_template=False) is None


def test_the_recorder_warns_after_reward_sanity_rollouts_identical_rewards(tmp_path, caplog):
    """--reward-sanity-rollouts is the recorder's patience: 2 warns at the second tied rollout, 0 never."""
    from tidal.train.cli import parse_job
    from tidal.train.recorder import RolloutRecorder

    def recorder(patience: str) -> RolloutRecorder:
        job = parse_job(["--reward-sanity-rollouts", patience, "--output-dir", str(tmp_path / patience)])
        return RolloutRecorder(job, tmp_path, log=None, result=None, rollouts=None, start=0)

    with caplog.at_level(logging.WARNING):
        two, off = recorder("2"), recorder("0")
        for seen in range(1, 4):
            two.samples(_samples([0.0, 0.0]))
            off.samples(_samples([0.0, 0.0]))
            assert ("for 2 rollouts in a row" in caplog.text) is (seen >= 2)
    assert caplog.text.count("rollouts in a row") == 1
