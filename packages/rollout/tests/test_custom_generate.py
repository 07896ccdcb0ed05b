"""Custom generate functions by import path: a two-turn tool-use task on the session's real SGLang server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tidal.rollout import RolloutError, Sample, SGLangEngine, generate_samples, load_generate_fn
from transformers import AutoTokenizer

PARAMS = {"n": 2, "max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}


def test_two_turn_task_masks_the_tool_reply_and_keeps_exact_log_probs(
    sglang_server: SGLangEngine, tiny_model_dir: Path, plugins: str
) -> None:
    from transformers import Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tool = tokenizer.encode("the answer is 4")
    prompts = [tokenizer.encode("what is two plus two ?"), tokenizer.encode("a b c")]
    generate_fn = load_generate_fn(f"{plugins}:two_turn_tool_task")
    samples = generate_samples(
        sglang_server, prompts, PARAMS, labels=["4", "x"], decode=tokenizer.decode, generate_fn=generate_fn
    )
    assert [s.group_index for s in samples] == [0, 0, 1, 1]
    assert [s.label for s in samples] == ["4", "4", "x", "x"]
    model = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for s in samples:
        # Turn 1 (4 tokens, ignore_eos), the tool's reply, turn 2 (cut to 3 by the response budget).
        assert list(s.response_loss_mask) == [1] * 4 + [0] * len(tool) + [1] * 3
        assert list(s.response_ids[4 : 4 + len(tool)]) == tool
        assert list(s.response_log_probs[4 : 4 + len(tool)]) == [0.0] * len(tool)
        assert s.loss_mask == [0] * len(s.prompt_ids) + list(s.response_loss_mask)
        assert s.response_text == tokenizer.decode(s.response_ids)
        assert s.finish_reason == "length" and s.weight_version is not None
        # Turn 2 was sampled from prompt + turn 1 + tool reply: its log-probs are those of the full context.
        tokens = torch.tensor([s.tokens])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(tokens).logits[0], dim=-1)
        start = len(s.prompt_ids)
        expected = log_probs[torch.arange(start - 1, tokens.shape[1] - 1), tokens[0, start:]]
        sampled = torch.tensor(s.response_log_probs)
        mask = torch.tensor(s.response_loss_mask, dtype=torch.bool)
        torch.testing.assert_close(sampled[mask], expected[mask], atol=2e-3, rtol=0)


def test_async_generate_function_and_default_loss_mask(sglang_server: SGLangEngine, plugins: str) -> None:
    generate_fn = load_generate_fn(f"{plugins}:async_one_turn")
    samples = generate_samples(sglang_server, [[3, 4, 5]], PARAMS, generate_fn=generate_fn, max_concurrency=1)
    assert len(samples) == 2
    for s in samples:
        assert len(s.response_ids) == 4 and s.response_loss_mask == [1] * 4
        assert s.loss_mask == [0, 0, 0, 1, 1, 1, 1]


def test_generate_function_failures_name_the_flag_and_prompt(sglang_server: SGLangEngine, plugins: str) -> None:
    fails = load_generate_fn(f"{plugins}:fails_on_boom")
    with pytest.raises(RolloutError, match=r"--custom-generate-function-path: .* failed on prompt 1: ConnectionError"):
        generate_samples(sglang_server, [[3, 4], [5, 6]], PARAMS, labels=["ok", "boom"], generate_fn=fails)
    returns_text = load_generate_fn(f"{plugins}:returns_text")
    with pytest.raises(RolloutError, match=r"returned a str, not a tidal\.rollout\.Sample"):
        generate_samples(sglang_server, [[3, 4]], PARAMS, generate_fn=returns_text)
    with pytest.raises(ValueError, match="--custom-generate-function-path 'no_such_mod_xyz:f': cannot import"):
        load_generate_fn("no_such_mod_xyz:f")


def test_sample_loss_mask_defaults_and_validation() -> None:
    plain = Sample(prompt_ids=[1, 2], response_ids=[3, 4], response_log_probs=[-1.0, -2.0], finish_reason="stop")
    assert plain.loss_mask == [0, 0, 1, 1]
    masked = Sample(
        prompt_ids=[1], response_ids=[3, 4, 5], response_log_probs=[-1.0, 0.0, -1.0], finish_reason="stop",
        response_loss_mask=[1, 0, 1],
    )  # fmt: skip
    assert masked.loss_mask == [0, 1, 0, 1]
    with pytest.raises(ValueError, match=r"response_loss_mask must hold one 0 or 1 per response token \(2\), got 1"):
        Sample(prompt_ids=[1], response_ids=[3, 4], response_log_probs=[-1.0, -1.0], finish_reason="stop",
               response_loss_mask=[1])  # fmt: skip
