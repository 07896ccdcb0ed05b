"""Routed experts on samples (--use-rollout-routing-replay): decoding SGLang's answer, concatenation across resumed
pieces, the debug files and checkpoint records, and asking for them. The real server's answers: tests/
test_routing_replay.py."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest
from tidal.rollout import (
    RolloutConfig,
    Sample,
    SGLangEngine,
    load_rollout_data,
    sample_records,
    samples_from_records,
    save_rollout_data,
)
from tidal.rollout.client import parse_output
from tidal.rollout.dispatch import continued, fresh_group
from tidal.rollout.errors import RolloutError

WIDTH = 6  # 3 layers x top-2


def _answer(prompt_len: int, out_ids: list[int], rows: np.ndarray | None, reason: str = "length") -> dict:
    meta = {
        "output_token_logprobs": [[-0.5, t, None] for t in out_ids],
        "finish_reason": {"type": reason},
        "weight_version": "1",
        "prompt_tokens": prompt_len,
    }
    if rows is not None:
        meta["routed_experts"] = base64.b64encode(rows.astype(np.int32).tobytes()).decode()
    return {"output_ids": out_ids, "meta_info": meta}


def _rows(n: int, start: int = 0) -> np.ndarray:
    return (np.arange(n * WIDTH).reshape(n, WIDTH) + start) % 8


def test_parse_output_decodes_one_row_per_forwarded_token() -> None:
    out = parse_output(_answer(4, [9, 10, 11], _rows(6)), routed_experts=True)
    assert out["routed_experts"].shape == (6, WIDTH) and out["routed_experts"].dtype == np.int16
    assert np.array_equal(out["routed_experts"], _rows(6))
    assert "routed_experts" not in parse_output(_answer(4, [9, 10, 11], _rows(6)))  # not asked: not kept
    assert parse_output(_answer(4, [9], None), routed_experts=True)["routed_experts"] is None
    with pytest.raises(RolloutError, match="routed-expert ids for 6 forwarded tokens"):
        parse_output(_answer(4, [9, 10, 11], np.zeros((5, 4))), routed_experts=True)  # 20 ids: not rows x width


def test_a_resumed_sample_keeps_its_rows_and_appends_the_new_tokens() -> None:
    (sample,) = fresh_group([1, 2, 3, 4], 1)
    first = parse_output(_answer(4, [5, 6], _rows(5), reason="abort"), routed_experts=True)
    sample = continued(sample, first, None)
    assert np.array_equal(sample.rollout_routed_experts, _rows(5))  # tokens 0..4 (the last, 6, not forwarded yet)
    # the resumed request re-sends 1 2 3 4 5 6 (new weights may route its prefix otherwise: those rows are dropped)
    second = parse_output(_answer(6, [7, 8, 9], _rows(8, start=3)), routed_experts=True)
    sample = continued(sample, second, None)
    assert sample.response_ids == [5, 6, 7, 8, 9] and sample.rollout_routed_experts.shape == (8, WIDTH)
    assert np.array_equal(sample.rollout_routed_experts[:5], _rows(5))
    assert np.array_equal(sample.rollout_routed_experts[5:], _rows(8, start=3)[5:])
    # an abort before any token keeps what there is; tokens without rows are an error naming the server flag
    assert continued(sample, {**second, "output_ids": [], "output_log_probs": [], "routed_experts": None}, None)
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        continued(sample, {**second, "routed_experts": None}, None)
    with pytest.raises(ValueError, match=r"must be \[tokens - 1, layers x top-k\]"):
        dataclasses.replace(sample, rollout_routed_experts=_rows(9))


def test_debug_files_and_checkpoint_records_keep_the_rows(tmp_path) -> None:
    routed = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], response_log_probs=[-1.0] * 3, finish_reason="stop",
                    rollout_routed_experts=_rows(4).astype(np.int16))  # fmt: skip
    plain = dataclasses.replace(routed, rollout_routed_experts=None)
    save_rollout_data(tmp_path, 3, [routed, plain])
    for back in (load_rollout_data(tmp_path, 3), samples_from_records(sample_records([routed, plain]))):
        assert back == [routed, plain]
        assert back[0].rollout_routed_experts.dtype == np.int16
        assert np.array_equal(back[0].rollout_routed_experts, routed.rollout_routed_experts)
        assert back[1].rollout_routed_experts is None
    assert len((tmp_path / "rollout_000003.jsonl").read_text()) < 1000  # base64 bytes, not nested lists


def test_the_rollout_asks_for_them_only_when_told(tmp_path) -> None:
    on, off = RolloutConfig(return_routed_experts=True), RolloutConfig()
    assert (
        on.sampling_params()["return_routed_experts"] is True and "return_routed_experts" not in off.sampling_params()
    )
    flag = "--enable-return-routed-experts"
    assert flag in SGLangEngine.from_config(on, "m", port=1, log_dir=tmp_path).command()
    assert flag not in SGLangEngine.from_config(off, "m", port=1, log_dir=tmp_path).command()
    given = dataclasses.replace(on, sglang_server_args=(flag,))
    assert SGLangEngine.from_config(given, "m", port=1, log_dir=tmp_path).command().count(flag) == 1
