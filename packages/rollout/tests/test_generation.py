"""generate_samples, stop-token checks and rollout metrics, on the session's real SGLang server."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tidal.rollout import Sample, SGLangEngine, score_samples
from tidal.rollout.generation import check_stop_tokens, filter_uniform_groups, generate_samples, rollout_metrics
from tidal.rollout.rewards import numeric_match
from transformers import AutoTokenizer


def test_generate_samples_groups_responses_and_keeps_sampled_ids(
    sglang_server: SGLangEngine, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tidal.rollout.progress")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer.encode("what is two plus two ?"), tokenizer.encode("the answer is")]
    params = {"n": 4, "max_new_tokens": 6, "temperature": 1.0}
    samples = generate_samples(
        sglang_server, prompts, params, labels=["4", "7"], decode=tokenizer.decode, progress_every_s=0.0
    )
    assert len(samples) == 8
    progress = [r.getMessage() for r in caplog.records if r.name == "tidal.rollout.progress"]
    assert progress[0].startswith("generate: 4/8 samples (50%)")  # one request per prompt: 4 samples each
    assert progress[-1].startswith("generate: 8/8 samples (100%)") and "samples/s" in progress[-1]
    assert [s.group_index for s in samples] == [0] * 4 + [1] * 4
    assert [s.label for s in samples] == ["4"] * 4 + ["7"] * 4
    for s in samples:
        assert list(s.prompt_ids) == prompts[s.group_index]
        assert len(s.response_log_probs) == len(s.response_ids) >= 1
        assert s.response_text == tokenizer.decode(s.response_ids)
        assert s.weight_version is not None
    caplog.clear()
    together = generate_samples(sglang_server, prompts, params, labels=["4", "7"], progress_every_s=0.0,
                                num_requests=1)  # fmt: skip
    progress = [r.getMessage() for r in caplog.records if r.name == "tidal.rollout.progress"]
    assert progress[0].startswith("generate: 8/8 samples")  # both prompts in one request
    assert [(s.group_index, s.label, list(s.prompt_ids)) for s in together] == [
        (g, label, prompts[g]) for g, label in ((0, "4"), (1, "7")) for _ in range(4)
    ]
    scored = score_samples(samples, numeric_match)
    metrics = rollout_metrics(scored)
    assert metrics["rollout/num_samples"] == 8.0
    assert 0.0 <= metrics["rollout/truncated_frac"] <= 1.0
    assert metrics["rollout/truncated_frac"] == sum(s.finish_reason == "length" for s in samples) / 8
    assert metrics["rollout/reward/mean"] == sum(s.reward for s in scored) / 8
    assert metrics["rollout/reward_errors"] == 0.0


def test_rollout_metrics_count_truncation_and_reward_errors() -> None:
    def sample(finish_reason: str, reward: float, error: str | None) -> Sample:
        return Sample(
            prompt_ids=[1],
            response_ids=[2, 3],
            response_log_probs=[-1.0, -1.0],
            finish_reason=finish_reason,
            reward=reward,
            reward_error=error,
        )

    samples = [sample("length", 1.0, None), sample("stop", 0.0, "boom"), sample("stop", 1.0, None)]
    samples.append(sample("length", 0.0, None))
    metrics = rollout_metrics(samples)
    assert metrics["rollout/truncated_frac"] == 0.5
    assert metrics["rollout/reward/mean"] == 0.5
    assert metrics["rollout/reward_errors"] == 1.0
    assert metrics["rollout/response_len/mean"] == 2.0
    assert rollout_metrics([]) == {}


def test_check_stop_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    eos = json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert check_stop_tokens(tiny_model_dir) == {eos}
    assert check_stop_tokens(tiny_model_dir, [5]) == {eos, 5}
    with pytest.raises(ValueError, match=rf"token id\(s\) \[{eos}\], which its {eos}-token vocabulary cannot produce"):
        check_stop_tokens(tiny_model_dir, vocab_size=eos)  # a tokenizer whose ids end below the EOS
    assert check_stop_tokens(tiny_model_dir, [1], vocab_size=eos) == {1}  # the EOS is left out (a warning)
    assert check_stop_tokens(tiny_model_dir, stop_strings=["\n"], vocab_size=eos) == set()
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="set --rollout-stop-token-ids"):
        check_stop_tokens(tmp_path)
    assert check_stop_tokens(tmp_path, [7]) == {7}


def test_filter_uniform_groups_drops_groups_without_signal() -> None:
    def sample(group: int, reward: float | None) -> Sample:
        return Sample(
            prompt_ids=[1],
            response_ids=[2],
            response_log_probs=[-1.0],
            finish_reason="stop",
            reward=reward,
            group_index=group,
        )

    samples = [sample(0, 1.0), sample(0, 1.0), sample(1, 0.0), sample(1, 1.0), sample(2, 0.0), sample(2, 0.0)]
    kept, dropped = filter_uniform_groups(samples)
    assert dropped == 2
    assert kept == samples[2:4]
    with pytest.raises(ValueError, match="needs scored samples"):
        filter_uniform_groups([sample(0, None)])


def test_rollout_stop_strings_end_responses_and_keep_the_tokens(
    sglang_server: SGLangEngine, tiny_model_dir: Path
) -> None:
    """--rollout-stop: a response ends at the first stop string the engine samples, which stays in it."""
    from tidal.rollout import RolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (one,) = tokenizer.convert_tokens_to_ids(["1"])  # the only token whose text contains "1"
    cfg = RolloutConfig(n_samples_per_prompt=4, rollout_max_response_len=8, rollout_stop=("1",))
    params = {**cfg.sampling_params(), "ignore_eos": True}
    assert params["stop"] == ["1"]
    # The model follows "the answer is" with "1" most of the time (p ~ 0.9).
    samples = generate_samples(sglang_server, [tokenizer.encode("the answer is")], params, decode=tokenizer.decode)
    assert any(s.finish_reason == "stop" for s in samples)
    for s in samples:
        if s.finish_reason == "stop":  # ended by the stop string, whose token stays in the response
            assert s.response_ids[-1] == one and one not in s.response_ids[:-1]
            assert s.response_text.endswith("1")
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 8 and one not in s.response_ids


def test_top_k_max_response_len_and_stop_token_ids_reach_the_engine(
    sglang_server: SGLangEngine, tiny_model_dir: Path
) -> None:
    """--rollout-top-k, --rollout-max-response-len and --rollout-stop-token-ids, as RolloutConfig sends them.

    Top-k 1 samples greedily at any temperature: the 4 samples of a prompt are the greedy response, of exactly
    --rollout-max-response-len tokens (EOS ignored); a stop token id taken from that response then ends it there.
    """
    from tidal.rollout import RolloutConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [tokenizer.encode("what is two plus two ?")]
    base = {"n_samples_per_prompt": 4, "rollout_max_response_len": 7, "rollout_temperature": 1.0}

    def sample(ignore_eos=True, **flags):
        params = {**RolloutConfig(**{**base, **flags}).sampling_params(), "ignore_eos": ignore_eos}
        return generate_samples(sglang_server, prompt, params)

    greedy = generate_samples(
        sglang_server, prompt, {"n": 1, "max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    )
    expected = list(greedy[0].response_ids)
    assert len({tuple(s.response_ids) for s in sample(n_samples_per_prompt=16)}) > 1  # without top-k: random
    top1 = sample(rollout_top_k=1)
    assert all(s.finish_reason == "length" and list(s.response_ids) == expected for s in top1)
    assert len(top1) == 4
    short = sample(rollout_top_k=1, rollout_max_response_len=3)
    assert all(s.finish_reason == "length" and list(s.response_ids) == expected[:3] for s in short)
    # SGLang's ignore_eos also ignores stop token ids: EOS counts here, but the greedy first token comes before it
    ended = sample(ignore_eos=False, rollout_top_k=1, rollout_stop_token_ids=(expected[0],))
    assert all(s.finish_reason == "stop" and list(s.response_ids) == expected[:1] for s in ended)


def test_check_chat_template(tiny_model_dir: Path) -> None:
    from tidal.rollout import check_chat_template

    with pytest.raises(ValueError, match=r"--apply-chat-template is set but the tokenizer of .* has no chat template"):
        check_chat_template(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    )
    assert check_chat_template(tokenizer) == "<user>tidal chat template probe<bot>"
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{% endfor %}"
    with pytest.raises(ValueError, match="renders a user message without its text"):
        check_chat_template(tokenizer)
    tokenizer.chat_template = "{{ raise_exception('system message required') }}"
    with pytest.raises(ValueError, match=r"fails to render: .*system message required"):
        check_chat_template(tokenizer)


def test_generate_samples_without_max_new_tokens_uses_sglang_default(sglang_server: SGLangEngine) -> None:
    samples = generate_samples(sglang_server, [[3, 4, 5]], {"n": 2, "temperature": 0.0})
    assert len(samples) == 2 and all(s.finish_reason in ("stop", "length") for s in samples)
    assert all(1 <= len(s.response_ids) <= 128 for s in samples)  # SGLang's default max_new_tokens
    assert samples[0].response_ids == samples[1].response_ids  # greedy
