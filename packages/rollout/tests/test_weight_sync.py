"""Weight updates from in-memory tensors on the session's real SGLang server."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tidal.rollout import RolloutError, SGLangEngine
from tidal.rollout.weight_sync import (
    _serialize,
    destroy_weights_update_group,
    init_weights_update_group,
    update_weights_from_distributed,
    update_weights_from_tensor,
)

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _greedy(engine: SGLangEngine) -> list[list[int]]:
    return [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def greedy_reference(_sglang_engine: SGLangEngine, tiny_model_dir: Path, other_model_dir: Path):
    """Greedy outputs under the served weights and under other_model_dir's (loaded from disk, then undone)."""
    engine = _sglang_engine
    original = _greedy(engine)
    engine.update_weights_from_disk(other_model_dir)
    expected = _greedy(engine)
    engine.update_weights_from_disk(tiny_model_dir)
    assert _greedy(engine) == original
    assert expected != original
    return original, expected


def test_update_weights_from_tensor_in_buckets_matches_loading_from_disk(
    sglang_server: SGLangEngine, greedy_reference, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    """In two parts (as two pipeline stages send them): the first without version or flush, the second sets it."""
    original, expected = greedy_reference
    tensors = load_file(other_model_dir / "model.safetensors")
    names = sorted(tensors)
    halves = [[(n, tensors[n]) for n in names[: len(names) // 2]], [(n, tensors[n]) for n in names[len(names) // 2 :]]]
    try:
        first = update_weights_from_tensor(sglang_server, halves[0], bucket_bytes=64 * 1024, flush_cache=False)
        assert sglang_server.get_model_info()["weight_version"] != "t1"  # part of the weights: not the new version
        second = update_weights_from_tensor(sglang_server, halves[1], bucket_bytes=64 * 1024, weight_version="t1")
        assert first["weight_sync/num_buckets"] > 1  # the small bucket size split the model
        assert (first["weight_sync/num_tensors"], second["weight_sync/num_tensors"]) == tuple(map(len, halves))
        mb = first["weight_sync/mb"] + second["weight_sync/mb"]
        assert mb == pytest.approx(sum(t.nbytes for t in tensors.values()) / 2**20)
        assert _greedy(sglang_server) == expected
        assert sglang_server.get_model_info()["weight_version"] == "t1"
    finally:
        sglang_server.update_weights_from_disk(tiny_model_dir)
    assert _greedy(sglang_server) == original


def test_update_weights_by_broadcast_over_gloo_matches_loading_from_disk(
    sglang_server: SGLangEngine, greedy_reference, tiny_model_dir: Path, other_model_dir: Path, free_port
) -> None:
    """Two groups at once on one server (as two pipeline stages use): each sends its half, the second the version."""
    original, expected = greedy_reference
    tensors = load_file(other_model_dir / "model.safetensors")
    names = sorted(tensors)
    halves = [[(n, tensors[n]) for n in names[: len(names) // 2]], [(n, tensors[n]) for n in names[len(names) // 2 :]]]
    address = {"master_address": "127.0.0.1", "backend": "gloo", "timeout_s": 120}
    groups = [
        init_weights_update_group(sglang_server, master_port=free_port(), group_name=f"tidal_test_pp{i}", **address)
        for i in range(2)
    ]
    try:
        first = update_weights_from_distributed(
            sglang_server, groups[0], halves[0], group_name="tidal_test_pp0", bucket_bytes=64 * 1024, timeout_s=120,
            flush_cache=False,
        )  # fmt: skip
        assert sglang_server.get_model_info()["weight_version"] != "d1"  # part of the weights: not the new version
        second = update_weights_from_distributed(
            sglang_server, groups[1], halves[1], group_name="tidal_test_pp1", bucket_bytes=64 * 1024,
            weight_version="d1", timeout_s=120,
        )  # fmt: skip
        assert first["weight_sync/num_buckets"] > 1
        assert (first["weight_sync/num_tensors"], second["weight_sync/num_tensors"]) == tuple(map(len, halves))
        assert _greedy(sglang_server) == expected
        assert sglang_server.get_model_info()["weight_version"] == "d1"
    finally:
        for i, group in enumerate(groups):
            destroy_weights_update_group(sglang_server, group, group_name=f"tidal_test_pp{i}")
        sglang_server.update_weights_from_disk(tiny_model_dir)
    assert _greedy(sglang_server) == original


def test_tensor_update_outside_a_session_is_refused_with_the_server_message(
    sglang_server: SGLangEngine, tiny_model_dir: Path
) -> None:
    # The session endpoints are what update_weights_from_tensor adds; without them SGLang 0.5.23 says no.
    # (A tensor of the wrong shape is not tested: it raises inside SGLang's scheduler and kills the server.)
    name, tensor = next(iter(load_file(tiny_model_dir / "model.safetensors").items()))
    payload = {"serialized_named_tensors": [_serialize([(name, tensor)])]}
    with pytest.raises(RolloutError, match="between begin_weight_update"):
        sglang_server.call("/update_weights_from_tensor", payload)
    assert sglang_server.generate([[3, 4]], {"max_new_tokens": 2})[0]["output_ids"]  # still serving


def test_a_session_left_open_by_a_killed_trainer_is_closed_by_the_next_update(
    sglang_server: SGLangEngine, greedy_reference, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    # A trainer SIGKILLed mid-sync never sends /end_weight_update; the next run's update must still go in.
    original, expected = greedy_reference
    sglang_server.call("/begin_weight_update", {})
    tensors = load_file(other_model_dir / "model.safetensors")
    try:
        update_weights_from_tensor(sglang_server, sorted(tensors.items()), weight_version="t2")
        assert _greedy(sglang_server) == expected
        assert sglang_server.get_model_info()["weight_version"] == "t2"
    finally:
        with contextlib.suppress(RolloutError):  # without the fix the session is still open: leave the server usable
            sglang_server.call("/end_weight_update", {})
        sglang_server.update_weights_from_disk(tiny_model_dir)
    assert _greedy(sglang_server) == original
