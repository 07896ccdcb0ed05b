"""Partial rollout on the session's real SGLang server: abort in-flight requests, resume under new weights."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from tidal.rollout import InterruptibleUpdates, Sample, SGLangEngine, generate_samples
from tidal.rollout.partial_rollout import resume_samples

MAX_NEW = 200
PROMPTS = [[3, 4, 5], [6, 7]]
PARAMS = {"n": 2, "max_new_tokens": MAX_NEW, "temperature": 1.0, "ignore_eos": True}


def test_aborted_samples_resume_with_per_token_weight_versions(
    sglang_server: SGLangEngine, tiny_model_dir: Path, slowed_generation
) -> None:
    from transformers import Qwen2ForCausalLM

    prompts, params = PROMPTS, PARAMS
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="old")
    # SGLang's test hook: every forward step sleeps, so the 200-token requests are still running when aborted.
    with slowed_generation(sglang_server, lambda: generate_samples(sglang_server, prompts, params)) as (thread, box):
        sglang_server.abort()
        thread.join(timeout=60.0)
    assert not thread.is_alive() and "error" not in box
    aborted: list[Sample] = box["result"]
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


def test_an_interruptible_update_aborts_the_generation_which_finishes_under_the_new_weights(
    sglang_server: SGLangEngine, tiny_model_dir: Path, slowed_generation
) -> None:
    prompts, params = PROMPTS, PARAMS
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="old")
    gate = InterruptibleUpdates(sglang_server, timeout_s=60)

    def load() -> None:  # the update itself: fast again, then the new version
        sglang_server.call("/slow_down", {"forward_sleep_time": None})
        sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="new")

    def generate():
        return gate.generate(lambda: generate_samples(sglang_server, prompts, params), params)

    with slowed_generation(sglang_server, generate) as (thread, box):
        tick = time.monotonic()
        gate.update(load)
        assert time.monotonic() - tick < 5  # it did not wait for the 10 s generation
        thread.join(timeout=60.0)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    samples: list[Sample] = box["result"]
    assert gate.interrupted_samples == 4
    for s in samples:  # finished, the old weights' tokens first, then the new ones'
        assert s.finish_reason == "length" and len(s.response_ids) == MAX_NEW
        versions = s.token_weight_versions
        k = versions.count("old")
        assert versions == ["old"] * k + ["new"] * (MAX_NEW - k) and k < MAX_NEW
    assert any(s.token_weight_versions[0] == "old" for s in samples)  # cut mid-response


def test_a_disk_update_while_requests_run_loads_then_flushes_once_they_are_done(
    sglang_server: SGLangEngine, tiny_model_dir: Path, slowed_generation
) -> None:
    # SGLang's own flush inside the update fails the call while requests run (the new weights already loaded):
    # the update's flush waits for idle instead, as it must after an interruptible update's abort
    def generate():
        return generate_samples(sglang_server, PROMPTS, PARAMS)

    with slowed_generation(sglang_server, generate) as (thread, box):
        sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="loaded-busy")  # 400 before
    thread.join(timeout=60.0)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert all(len(s.response_ids) == MAX_NEW for s in box["result"])
    assert sglang_server.get_model_info()["weight_version"] == "loaded-busy"


def test_the_driver_side_sends_again_what_an_update_cut(
    sglang_server: SGLangEngine, tiny_model_dir: Path, caplog, slowed_generation
):
    # The driver-side path (partial rollout, the router) under --max-staleness: the engine's own worker aborts the
    # requests when a weight update begins (InterruptibleUpdates.begin); the driver sends the cut samples again at
    # once, and SGLang serves them before or after the update: nothing is lost or cut short either way.
    from tidal.rollout import generate_partial_rollout

    prompts, params = PROMPTS, PARAMS
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="old")
    gate = InterruptibleUpdates(sglang_server, timeout_s=60)

    def generate():
        return generate_partial_rollout(sglang_server, prompts, params, num_groups=2, resume_interrupted=True)

    with (
        caplog.at_level("INFO", logger="tidal.rollout.dispatch"),
        slowed_generation(sglang_server, generate) as (thread, box),
    ):
        gate.begin()  # what the trainer's sync does first (EngineWorker.begin_update)
        try:
            sglang_server.call("/slow_down", {"forward_sleep_time": None})
            sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="new")
        finally:
            gate.end()
        thread.join(timeout=60.0)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    assert "cut by an abort (a weight update): sent again" in caplog.text
    result = box["result"]
    assert result.num_groups == 2 and not result.carry_over  # every group finished in this call
    for s in result.samples:  # whole responses; the cut ones continue their first tokens, older weights first
        assert s.finish_reason == "length" and len(s.response_ids) == MAX_NEW
        versions = s.token_weight_versions
        k = versions.count("old")
        assert versions == ["old"] * k + ["new"] * (MAX_NEW - k), versions
    assert any(s.response_weight_versions is not None for s in result.samples)  # some were resumed


def test_resume_keeps_the_length_limit_and_validates_versions() -> None:
    full = Sample(prompt_ids=[1], response_ids=[2, 3], response_log_probs=[-1.0, -1.0], finish_reason="abort")
    # No budget left: marked as truncated without any request (no engine needed).
    (out,) = resume_samples(None, [full], {"max_new_tokens": 2})  # type: ignore[arg-type]
    assert out.finish_reason == "length" and out.truncated
    with pytest.raises(ValueError, match="response_weight_versions has 1 entries for 2 response tokens"):
        Sample(prompt_ids=[1], response_ids=[2, 3], response_log_probs=[-1.0, -1.0], finish_reason="stop",
               response_weight_versions=["v1"])  # fmt: skip


def test_partial_rollout_stops_when_full_and_resumes_the_rest_next_call(sglang_server: SGLangEngine, tiny_model_dir):
    """The carried group fills the batch first; with mask_offpolicy (the train app's
    --mask-offpolicy-in-partial-rollout) its tokens sampled by older weights leave the loss, without it they stay."""
    from tidal.rollout import generate_partial_rollout
    from tidal.rollout.rewards import numeric_match

    full_len = 60
    params = {"n": 2, "max_new_tokens": full_len, "temperature": 1.0, "ignore_eos": True}
    # A group carried over from an earlier rollout, cut 2 tokens short of the limit under weights "old".
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="old")
    cut = sglang_server.generate([[3, 4, 5]], {**params, "max_new_tokens": full_len - 2})
    carried = [
        Sample(
            prompt_ids=[3, 4, 5],
            response_ids=o["output_ids"],
            response_log_probs=o["output_log_probs"],
            finish_reason="abort",
            label="1",
            weight_version="old",
        )
        for o in cut
    ]
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="new")
    sglang_server.call("/slow_down", {"forward_sleep_time": 0.05})  # fresh groups need 3 s: still running
    try:
        first = generate_partial_rollout(
            sglang_server, [[6, 7], [8, 9, 10]], params, num_groups=1, carry_over=[carried], labels=["2", "3"],
            mask_offpolicy=True, reward_fn=numeric_match, metadata=[{"row": 2}, {"row": 3}],
        )  # fmt: skip
    finally:
        sglang_server.call("/slow_down", {"forward_sleep_time": None})
    # The carried group finished first and filled the batch; the fresh groups were aborted mid-response.
    assert first.num_groups == 1 and len(first.samples) == 2
    for s in first.samples:
        assert s.group_index == 0 and s.label == "1" and s.reward is not None
        assert s.finish_reason == "length" and len(s.response_ids) == full_len
        assert s.token_weight_versions == ["old"] * (full_len - 2) + ["new"] * 2
        assert s.loss_mask == [0] * 3 + [0] * (full_len - 2) + [1] * 2  # prompt, off-policy tokens masked
    assert len(first.carry_over) == 2
    for group, label in zip(first.carry_over, ["2", "3"], strict=True):
        assert [s.finish_reason for s in group] == ["abort", "abort"] and group[0].label == label
        assert [s.metadata for s in group] == [{"row": int(label)}] * 2  # each row's --metadata-key value
        assert all(len(s.response_ids) < full_len for s in group)
    assert first.metrics["rollout/partial/resumed_groups"] == 1.0
    assert first.metrics["rollout/partial/carried_over_groups"] == 2.0
    assert first.metrics["rollout/partial/offpolicy_token_frac"] == pytest.approx((full_len - 2) / full_len)

    # Next rollout, newer weights: the aborted groups are resumed from where they stopped.
    sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="newer")
    second = generate_partial_rollout(sglang_server, [], params, num_groups=2, carry_over=first.carry_over)
    assert second.num_groups == 2 and second.carry_over == []
    assert [s.group_index for s in second.samples] == [0, 0, 1, 1]
    assert {s.label for s in second.samples} == {"2", "3"}
    assert all(s.metadata == {"row": int(s.label)} for s in second.samples)  # carried over with its samples
    by_prompt = {tuple(g[0].prompt_ids): g for g in first.carry_over}
    for i, s in enumerate(second.samples):
        before = by_prompt[tuple(s.prompt_ids)][i % 2]  # a group's samples keep their order
        k = len(before.response_ids)
        assert list(s.response_ids[:k]) == list(before.response_ids)
        assert list(s.response_log_probs[:k]) == list(before.response_log_probs)
        assert s.finish_reason == "length" and len(s.response_ids) == full_len
        assert s.token_weight_versions[k:] == ["newer"] * (full_len - k)
        assert set(s.token_weight_versions[:k]) <= {"new"}
        assert s.loss_mask[len(s.prompt_ids) :] == [1] * full_len  # not masked: mask_offpolicy is off


def test_mask_offpolicy_tokens_keeps_tool_masks() -> None:
    from tidal.rollout.partial_rollout import mask_offpolicy_tokens, offpolicy_token_frac

    s = Sample(prompt_ids=[1], response_ids=[2, 3, 4], response_log_probs=[-1.0, 0.0, -1.0], finish_reason="stop",
               response_loss_mask=[1, 0, 1], response_weight_versions=["1", "2", "2"], weight_version="2")  # fmt: skip
    (masked,) = mask_offpolicy_tokens([s], "2")
    assert masked.loss_mask == [0, 0, 0, 1]
    assert mask_offpolicy_tokens([s], "1")[0].loss_mask == [0, 1, 0, 0]
    # a weight update ("1" -> "2") landed while the rollout ran: both are its own weights, an older one is not
    assert mask_offpolicy_tokens([s], "2", since="1")[0] is s
    older = dataclasses.replace(s, response_weight_versions=["0", "1", "2"])
    assert mask_offpolicy_tokens([older], "2", since="1")[0].loss_mask == [0, 0, 0, 1]
    assert offpolicy_token_frac([older], "2", since="1") == 0.5  # "0" and "2" sampled the loss tokens
    assert offpolicy_token_frac([older], "2") == 0.5 and offpolicy_token_frac([older], "1") == 1.0
    assert offpolicy_token_frac([dataclasses.replace(older, response_loss_mask=[1, 1, 1])], "2", since="1") == 1 / 3
    fresh = Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[-1.0], finish_reason="stop")
    assert mask_offpolicy_tokens([fresh], None)[0] is fresh  # all tokens from the current (None) version


def test_an_update_gate_holds_its_waiters_until_the_last_update_ends() -> None:
    from tidal.rollout import UpdateGate

    gate = UpdateGate(timeout_s=30)
    assert gate.wait_idle()
    gate.begin()
    gate.begin()  # two updates overlap: the waiters go on after the second ends
    assert not gate.wait_idle(0.05)
    released = threading.Event()
    waiter = threading.Thread(target=lambda: gate.wait_idle() and released.set())
    waiter.start()
    gate.end()
    assert not released.wait(0.2)
    gate.end()
    waiter.join(timeout=10)
    assert released.is_set()
