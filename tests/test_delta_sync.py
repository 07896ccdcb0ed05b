"""--update-weight-delta against the session's real SGLang server: `train` runs, and the sender's functions.

The runs, over disk and over nccl (gloo on CPU) to the external engine, with two pipeline stages (each sends its own
delta) and --check-weight-update-equal: four rollouts during the third of which the server is given other weights
and another version (its initial ones, as a restarted server serves): that sync goes whole, the next one as deltas
again. The functions: the "actor" is the embedded
checkpoint's own tensors (what the server loaded), then a copy with a few elements changed, sent as on the sending
rank (one delta corrupted on purpose).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import tidal.rollout
import torch
from safetensors.torch import load_file, save_file
from tidal.rollout import SGLangClient, engine_delta
from tidal.train.embedded_model import ensure_embedded_model
from tidal.train.weight_sync import delta

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_modes_e2e import COMMON, _records, _train

pytestmark = pytest.mark.slow

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
Q, EMBED = "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"


def _greedy(client: SGLangClient) -> list[list[int]]:
    return [out["output_ids"] for out in client.generate(PROMPTS, GREEDY)]


def _changed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights with a few elements of q (fused into qkv_proj on the engine) and two embedding rows changed."""
    new = {n: t.clone() for n, t in weights.items()}
    new[Q].view(-1)[[0, 9, 513]] += 3.0
    new[EMBED][[3, 4, 5]] *= -4.0
    return new


@pytest.fixture
def engine(external_engine: str, tmp_path: Path):
    client = SGLangClient(f"http://{external_engine}", request_timeout_s=300)
    model = ensure_embedded_model()
    original = _greedy(client)
    yield client, load_file(model / "model.safetensors"), tmp_path
    client.update_weights_from_disk(model)
    assert _greedy(client) == original


@pytest.fixture
def link(engine, request):
    """A function of a folder: a sender's link to the engine over ``request.param`` (nccl: a gloo group, as on CPU)."""
    client, _, _ = engine
    transport, group = request.param, None
    if transport == "nccl":
        from tidal.rollout import init_weights_update_group

        name = "tidal_test_delta_link"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        group = init_weights_update_group([client], master_address="127.0.0.1", master_port=port,
                                          group_name=name, backend="gloo", timeout_s=120), name  # fmt: skip
    yield lambda folder: delta._Link([client], folder, disk=transport == "disk", tp_size=1, expected=1, group=group)
    if group is not None:
        from tidal.rollout import destroy_weights_update_group

        destroy_weights_update_group([client], group[0], group_name=group[1])


@pytest.mark.parametrize("link", ["tensor", "disk", "nccl"], indirect=True)
def test_a_corrupted_delta_falls_back_to_the_whole_tensor_and_the_engine_ends_with_the_actors_weights(
    engine, link, monkeypatch
) -> None:
    client, weights, tmp = engine
    new = _changed(weights)
    checkpoint = tmp / "changed"
    checkpoint.mkdir()
    save_file(new, checkpoint / "model.safetensors")
    for f in ensure_embedded_model().iterdir():
        if f.name != "model.safetensors":
            (checkpoint / f.name).symlink_to(f)
    client.update_weights_from_disk(checkpoint)
    expected = _greedy(client)  # the changed weights, loaded the normal way

    snap = delta.DeltaSnapshot(pin=False)
    first = delta._send(link(tmp / "a"), iter(weights.items()), snap, True, 1 << 20, "v1", True)
    assert snap.dtype == torch.float32 and set(snap.tensors) == set(weights)
    assert first["weight_sync/delta_full"] == 1.0 and first["weight_sync/delta_fallbacks"] == 0.0
    assert first["weight_sync/delta_changed"] == sum(t.numel() for t in weights.values())
    assert _greedy(client) != expected

    def corrupting(name, new_t, old_t):
        entry = engine_delta.encode_delta(name, new_t, old_t)
        if entry is not None and name == Q:
            key, payload, idx = entry
            payload = payload.clone()
            payload[-4:] = 0  # the last changed value arrives as 0.0
            entry = key, payload, idx
        return entry

    monkeypatch.setattr(tidal.rollout, "encode_delta", corrupting)  # the sender looks it up at each sync
    second = delta._send(link(tmp / "b"), iter(new.items()), snap, False, 1 << 20, "v2", True)
    assert second["weight_sync/delta_full"] == 0.0
    assert second["weight_sync/delta_changed"] == 3 + 3 * new[EMBED].shape[1]
    assert second["weight_sync/delta_fallbacks"] == 1.0  # q went again whole, after its checksum differed
    assert second["weight_sync/mb"] < sum(t.nbytes for t in weights.values()) / 2**20 / 10
    assert client.get_model_info()["weight_version"] == "v2"
    assert _greedy(client) == expected
    assert all(torch.equal(snap.tensors[n], new[n]) for n in new)


@pytest.mark.parametrize("transport", ["disk", "nccl"])
def test_a_server_serving_another_version_gets_the_next_sync_whole_then_deltas_again(
    tmp_path: Path, external_engine: str, transport: str
) -> None:
    """Two pipeline stages: each sends its own delta (over nccl through its own group), whole again after a reload."""
    client = SGLangClient(f"http://{external_engine}")
    client.update_weights_from_disk(ensure_embedded_model(), weight_version="0")
    args = [*COMMON, "--num-rollout", "4", "--update-weight-delta", "--update-weight-transport", transport,
            "--check-weight-update-equal", "--rollout-external-engine-addrs", external_engine,
            "--custom-generate-function-path", "tidal_train_plugins:reload_the_server_once"]  # fmt: skip
    args += ["--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    reloaded = tmp_path / "reloaded"
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
            env.setenv("TIDAL_TEST_SERVER", external_engine)
            env.setenv("TIDAL_TEST_RELOAD_AT", "2")  # while rollout 2 is generated, after the sync of version 2
            env.setenv("TIDAL_TEST_RELOADED", str(reloaded))
            code, log, leftovers = _train(args, out=tmp_path / "run")
        assert code == 0, log[-6000:]
        assert reloaded.exists()
        records = _records(tmp_path / "run")
        assert [r["weight_sync/transport"] for r in records] == [transport] * 4
        # whole: the first sync, and the one after the server reported version 0 instead of 2; deltas otherwise
        assert [r["weight_sync/delta_full"] for r in records] == [1.0, 0.0, 1.0, 0.0]
        assert f"{external_engine}: '0'; sending the weights whole" in log
        assert all(r["weight_sync/delta_fallbacks"] == 0.0 for r in records)
        assert all(r["weight_sync/probe_logprob_abs_diff/mean"] <= 0.05 for r in records)  # the actor's weights
        assert all(r["weight_sync/pp0/mb"] > 0 and r["weight_sync/pp1/mb"] > 0 for r in records)
        assert ["eval/accuracy" in r for r in records] == [False, False, False, True]  # evaluated after the last
        for r in (records[1], records[3]):
            assert 0.0 < r["weight_sync/delta_changed_share"] <= 1.0
        assert "delta snapshot of stage 1" in log
        assert not leftovers, leftovers
    finally:
        client.update_weights_from_disk(ensure_embedded_model())
