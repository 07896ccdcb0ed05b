"""Partial rollout on the session's real SGLang server: abort in-flight requests, resume under new weights."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tidal.rollout import Sample, SGLangEngine, generate_samples, resume_samples

MAX_NEW = 200


def _generate_in_background(engine: SGLangEngine, prompts: list[list[int]], params: dict) -> tuple:
    box: dict = {}

    def run() -> None:
        try:
            box["samples"] = generate_samples(engine, prompts, params)
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_aborted_samples_resume_with_per_token_weight_versions(
    sglang_server: SGLangEngine, tiny_model_dir: Path
) -> None:
    from transformers import Qwen2ForCausalLM

    prompts = [[3, 4, 5], [6, 7]]
    params = {"n": 2, "max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="old")
    # SGLang's test hook: every forward step sleeps, so the 200-token requests are still running when aborted.
    sglang_server.call("/slow_down", {"forward_sleep_time": 0.05})
    try:
        thread, box = _generate_in_background(sglang_server, prompts, params)
        thread.join(timeout=3.0)
        assert thread.is_alive(), "generation finished before the abort; the slow-down did not take"
        sglang_server.abort()
        thread.join(timeout=60.0)
        assert not thread.is_alive() and "error" not in box
    finally:
        sglang_server.call("/slow_down", {"forward_sleep_time": None})
    aborted: list[Sample] = box["samples"]
    assert [s.finish_reason for s in aborted] == ["abort"] * 4
    assert all(len(s.response_ids) < MAX_NEW for s in aborted)
    assert any(len(s.response_ids) > 0 for s in aborted)  # cut mid-response, not in the queue
    assert {s.weight_version for s in aborted} == {"old"}

    # Same weights, new version: the resumed tokens must be sampled from the full context so far.
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="new")
    done = [Sample(prompt_ids=[8], response_ids=[9], response_log_probs=[-1.0], finish_reason="stop")]
    resumed = resume_samples(sglang_server, [*aborted, *done], params)
    assert resumed[-1] is done[0]  # finished samples pass through
    model = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for before, after in zip(aborted, resumed, strict=False):
        k = len(before.response_ids)
        assert after.finish_reason == "length" and len(after.response_ids) == MAX_NEW
        assert list(after.response_ids[:k]) == list(before.response_ids)
        assert list(after.response_log_probs[:k]) == list(before.response_log_probs)
        assert after.token_weight_versions == ["old"] * k + ["new"] * (MAX_NEW - k)
        assert after.weight_version == "new" and after.group_index == before.group_index
        tokens = torch.tensor([after.tokens])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(tokens).logits[0], dim=-1)
        start = len(after.prompt_ids)
        expected = log_probs[torch.arange(start - 1, tokens.shape[1] - 1), tokens[0, start:]]
        torch.testing.assert_close(torch.tensor(after.response_log_probs), expected, atol=2e-3, rtol=0)


def test_resume_keeps_the_length_limit_and_validates_versions() -> None:
    full = Sample(prompt_ids=[1], response_ids=[2, 3], response_log_probs=[-1.0, -1.0], finish_reason="abort")
    # No budget left: marked as truncated without any request (no engine needed).
    (out,) = resume_samples(None, [full], {"max_new_tokens": 2})  # type: ignore[arg-type]
    assert out.finish_reason == "length" and out.truncated
    with pytest.raises(ValueError, match="response_weight_versions has 1 entries for 2 response tokens"):
        Sample(prompt_ids=[1], response_ids=[2, 3], response_log_probs=[-1.0, -1.0], finish_reason="stop",
               response_weight_versions=["v1"])  # fmt: skip
