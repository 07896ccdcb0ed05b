"""Delta weight updates: the wire format, and the loader applying deltas inside the session's real SGLang server."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tidal.rollout import SGLangEngine
from tidal.rollout.engine import DELTA_LOADER
from tidal.rollout.engine_delta import DELTA_REPORT, DELTA_ROUTE, LOADER, decode_delta, delta_checksum, encode_delta
from tidal.rollout.weight_sync import (
    destroy_weights_update_group,
    init_weights_update_group,
    update_weights_from_distributed,
    update_weights_from_tensor,
)

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _greedy(engine: SGLangEngine) -> list[list[int]]:
    return [out["output_ids"] for out in engine.generate(PROMPTS, GREEDY)]


def _apply(engine: SGLangEngine, entries: list, folder: Path, version: str | None = None) -> dict:
    """Send ``entries`` through the delta loader; the one engine process's report."""
    for old in folder.glob("*.json"):
        old.unlink()
    entries = [*entries, (f"{DELTA_REPORT}{folder}", torch.empty(0))]
    update_weights_from_tensor(engine, entries, load_format=LOADER, weight_version=version)
    (report,) = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    return report


@pytest.mark.parametrize("changed", [[0], [1, 5, 77], list(range(0, 4096, 2))])
def test_a_delta_decodes_to_the_changed_elements_by_index_or_bitmask(changed: list[int]) -> None:
    old = torch.randn(64, 64).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[changed] += 1
    key, payload, idx = encode_delta("w", new, old)
    kind = key.split("|")[1]
    assert kind == ("idx" if len(changed) < 4096 // 8 // 4 else "mask")  # whichever is smaller
    assert payload.nbytes < new.nbytes
    name, shape, got_idx, values = decode_delta(key, payload)
    assert (name, shape) == ("w", (64, 64))
    assert got_idx.tolist() == idx.tolist() == changed
    rebuilt = old.clone()
    rebuilt.view(-1)[got_idx] = values
    assert torch.equal(rebuilt, new)


def test_a_delta_as_large_as_the_tensor_is_sent_whole_and_no_change_sends_nothing() -> None:
    old = torch.zeros(8)
    assert encode_delta("w", old.clone(), old) is None
    key, payload, _ = encode_delta("w", old + 1, old)
    assert key == "w" and torch.equal(payload, old + 1)
    negative_zero = torch.full((8,), -0.0)
    assert encode_delta("w", negative_zero, old) is not None  # bits, not values: -0.0 is a change


def test_the_checksum_sees_a_value_moved_to_another_place() -> None:
    t = torch.arange(10, dtype=torch.float16)
    swapped = t.clone()
    swapped[[2, 3]] = swapped[[3, 2]]
    assert delta_checksum(t) != delta_checksum(swapped)
    assert delta_checksum(t) == delta_checksum(t.clone())


def test_sglang_still_hands_a_named_custom_loader_the_model_and_the_tensors() -> None:
    """The engine side rests on this dispatch in SGLang's weight updater; it fails when upstream changes it."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    source = textwrap.dedent(inspect.getsource(WeightUpdater.update_weights_from_tensor))
    calls = [ast.unparse(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    assert "dynamic_import(load_format)" in calls
    assert "custom_loader(self.get_model(), named_tensors)" in calls
    assert "load_format in self.custom_weight_loaders" in source
    assert DELTA_LOADER == LOADER


def test_sglang_still_loads_broadcast_tensors_with_the_models_load_weights_and_no_custom_loader() -> None:
    """``engine_delta.route_broadcast_deltas`` works around this; it fails when upstream changes it (then name the
    delta loader in the broadcast's ``load_format``, if SGLang now dispatches it, and drop the route)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    load = textwrap.dedent(inspect.getsource(WeightUpdater.load_weights_from_distributed))
    calls = [ast.unparse(n) for n in ast.walk(ast.parse(load)) if isinstance(n, ast.Call)]
    assert "self.get_model().load_weights(named_tensors)" in calls
    for fn in (
        WeightUpdater.receive_weights_from_distributed,
        SchedulerWeightUpdaterManager.update_weights_from_distributed,
    ):
        source = inspect.getsource(fn)
        assert "custom_weight_loader" not in source and "dynamic_import" not in source, fn.__qualname__


def test_a_routed_broadcast_applies_deltas_and_reports_while_a_plain_one_loads_as_before(
    sglang_server: SGLangEngine, tiny_model_dir: Path, other_model_dir: Path, tmp_path: Path, free_port
) -> None:
    original = _greedy(sglang_server)
    tiny = load_file(tiny_model_dir / "model.safetensors")
    other = load_file(other_model_dir / "model.safetensors")
    deltas = {n: encode_delta(n, other[n], tiny[n]) for n in sorted(tiny)}
    entries = [d[:2] for d in deltas.values() if d is not None]
    group_name = "tidal_test_delta"
    group = init_weights_update_group(sglang_server, master_address="127.0.0.1", master_port=free_port(),
                                      group_name=group_name, backend="gloo", timeout_s=120)  # fmt: skip
    try:
        for _ in range(2):  # installing it again changes nothing
            update_weights_from_tensor(sglang_server, [(DELTA_ROUTE, torch.empty(0))], load_format=LOADER)
        routed = [(f"{DELTA_REPORT}{tmp_path}", torch.zeros(1, dtype=torch.uint8)), *entries]
        update_weights_from_distributed(sglang_server, group, routed, group_name=group_name, weight_version="b1",
                                        timeout_s=120, bucket_bytes=2**62)  # fmt: skip
        (report,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
        assert report["sums"] == {n: str(delta_checksum(other[n])) for n, d in deltas.items() if d is not None}
        assert sglang_server.get_model_info()["weight_version"] == "b1"
        expected = _greedy(sglang_server)
        assert expected != original
        sglang_server.update_weights_from_disk(other_model_dir)
        assert _greedy(sglang_server) == expected  # the broadcast deltas gave exactly other_model_dir's weights

        for path in tmp_path.glob("*.json"):
            path.unlink()
        update_weights_from_distributed(sglang_server, group, sorted(tiny.items()), group_name=group_name,
                                        timeout_s=120)  # fmt: skip
        assert _greedy(sglang_server) == original  # a plain broadcast: whole tensors, loaded as without the route
        assert not list(tmp_path.glob("*.json"))
    finally:
        destroy_weights_update_group(sglang_server, group, group_name=group_name)
        sglang_server.update_weights_from_disk(tiny_model_dir)


def test_deltas_bring_the_real_server_to_other_weights_and_back_with_matching_checksums(
    sglang_server: SGLangEngine, tiny_model_dir: Path, other_model_dir: Path, tmp_path: Path
) -> None:
    original = _greedy(sglang_server)
    tiny = load_file(tiny_model_dir / "model.safetensors")
    other = load_file(other_model_dir / "model.safetensors")
    assert f"--custom-weight-loader {LOADER}" in " ".join(sglang_server.command())
    try:
        # every tensor's delta: dense ones go whole, the norms (ones in both) not at all
        deltas = {n: encode_delta(n, other[n], tiny[n]) for n in sorted(tiny)}
        changed = sorted(n for n, d in deltas.items() if d is not None)
        assert 0 < len(changed) < len(tiny)
        report = _apply(sglang_server, [deltas[n][:2] for n in changed], tmp_path, version="d1")
        assert report["dtype"] == "float32"
        assert report["sums"] == {n: str(delta_checksum(other[n])) for n in changed}
        assert sglang_server.get_model_info()["weight_version"] == "d1"
        expected = _greedy(sglang_server)
        assert expected != original
        sglang_server.update_weights_from_disk(other_model_dir)
        assert _greedy(sglang_server) == expected  # the deltas gave exactly other_model_dir's weights

        # a sparse delta: a few elements of q (fused into qkv_proj) and of the embedding, back to tiny's values
        name_q, name_e = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"
        sparse = {n: other[n].clone() for n in (name_q, name_e)}
        sparse[name_q].view(-1)[[0, 17, 300]] = tiny[name_q].view(-1)[[0, 17, 300]]
        sparse[name_e][3] = tiny[name_e][3]
        entries = [encode_delta(n, sparse[n], other[n])[:2] for n in sparse]
        assert all(key.startswith("tidal.delta|idx|") for key, _ in entries)
        report = _apply(sglang_server, entries, tmp_path)
        assert report["sums"] == {n: str(delta_checksum(sparse[n])) for n in sparse}
    finally:
        sglang_server.update_weights_from_disk(tiny_model_dir)
    assert _greedy(sglang_server) == original


def test_a_corrupted_delta_shows_in_the_checksum_and_a_bad_entry_does_not_stop_the_server(
    sglang_server: SGLangEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tiny = load_file(tiny_model_dir / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"  # fused into gate_up_proj
    new = tiny[name].clone()
    new.view(-1)[[5, 6]] += 1.0
    key, payload, _ = encode_delta(name, new, tiny[name])
    payload = payload.clone()
    payload[-4:] = 0  # the last value's bytes: the engine applies 0.0 instead of the value sent
    try:
        report = _apply(sglang_server, [(key, payload), ("tidal.delta|idx|1|float32|3|no.such.weight", payload)],
                        tmp_path)  # fmt: skip
        assert report["sums"][name] != str(delta_checksum(new))
        assert report["sums"]["no.such.weight"] in ("error", None)
        assert sglang_server.generate([[3, 4]], {"max_new_tokens": 2})[0]["output_ids"]  # still serving
        report = _apply(sglang_server, [(name, new)], tmp_path)  # the fallback: the tensor whole
        assert report["sums"][name] == str(delta_checksum(new))
        # a report folder that does not exist: no report, and the server still serves
        entries = [(name, new), (f"{DELTA_REPORT}{tmp_path / 'missing'}", torch.empty(0))]
        update_weights_from_tensor(sglang_server, entries, load_format=LOADER)
        assert not (tmp_path / "missing").exists()
        assert sglang_server.generate([[3, 4]], {"max_new_tokens": 2})[0]["output_ids"]
    finally:
        sglang_server.update_weights_from_disk(tiny_model_dir)
