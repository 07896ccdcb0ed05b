"""HF safetensors IO: write -> read round trips (single file and sharded), configs copied, atomic replace."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import save_file
from tidal.ckpt import HFCheckpointError, save_hf_checkpoint
from tidal.ckpt.hf import iter_hf_tensors

TENSORS = {
    "model.embed_tokens.weight": torch.randn(32, 16),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16).to(torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": torch.randn(16, 48).t(),  # non-contiguous
    "model.norm.weight": torch.ones(16, dtype=torch.float16),
    "model.layers.0.self_attn.q_proj.bias": torch.arange(16, dtype=torch.int64),
}


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = {
        "config.json": '{"model_type": "qwen2"}',
        "generation_config.json": "{}",
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "README.md": "not copied",
    }
    for name, text in files.items():
        (src / name).write_text(text)
    return src


def _assert_same(read: dict[str, torch.Tensor]) -> None:
    assert sorted(read) == sorted(TENSORS)
    for name, tensor in TENSORS.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name


def test_single_file_round_trip_copies_configs(tmp_path, source):
    out = save_hf_checkpoint(tmp_path / "hf", TENSORS.items(), source_dir=source)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    _assert_same(dict(iter_hf_tensors(out)))


def test_sharded_round_trip_with_index(tmp_path):
    out = save_hf_checkpoint(tmp_path / "hf", iter(TENSORS.items()), max_shard_bytes=1100)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(TENSORS) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum((out / s).stat().st_size for s in shards)
    read = dict(iter_hf_tensors(out))
    assert set(read) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert torch.equal(read[name], tensor)


def test_reading_streams_one_tensor_at_a_time(tmp_path):
    save_hf_checkpoint(tmp_path / "hf", TENSORS.items(), max_shard_bytes=1100)
    stream = iter_hf_tensors(tmp_path / "hf")
    assert isinstance(stream, types.GeneratorType)
    name, tensor = next(stream)
    assert name in TENSORS and torch.equal(tensor, TENSORS[name])


def test_tensors_sharing_storage_are_written(tmp_path):
    embed = torch.randn(8, 4)
    out = save_hf_checkpoint(tmp_path / "hf", [("embed", embed), ("lm_head", embed), ("half", embed[:4])])
    read = dict(iter_hf_tensors(out))
    assert torch.equal(read["lm_head"], embed) and torch.equal(read["half"], embed[:4])


def test_overwrite_is_atomic_and_leaves_no_temp(tmp_path):
    save_hf_checkpoint(tmp_path / "hf", [("a", torch.zeros(2))])

    def failing():
        yield "a", torch.ones(2)
        raise RuntimeError("export died")

    with pytest.raises(RuntimeError, match="export died"):
        save_hf_checkpoint(tmp_path / "hf", failing())
    assert torch.equal(dict(iter_hf_tensors(tmp_path / "hf"))["a"], torch.zeros(2))  # the old one is intact
    save_hf_checkpoint(tmp_path / "hf", [("b", torch.ones(3))], max_shard_bytes=4)
    assert list(dict(iter_hf_tensors(tmp_path / "hf"))) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_duplicate_name_and_empty_stream_are_refused(tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        save_hf_checkpoint(tmp_path / "hf", [("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="no tensors"):
        save_hf_checkpoint(tmp_path / "hf", [])
    with pytest.raises(ValueError, match=r"has no config\.json"):
        save_hf_checkpoint(tmp_path / "hf", [("a", torch.zeros(1))], source_dir=tmp_path)
    assert not (tmp_path / "hf").exists()


def test_index_naming_a_missing_shard(tmp_path):
    out = save_hf_checkpoint(tmp_path / "hf", TENSORS.items(), max_shard_bytes=1100)
    (out / "model-00002-of-00004.safetensors").unlink(missing_ok=False)
    with pytest.raises(HFCheckpointError, match=r"names shard\(s\) missing .*model-00002-of-00004"):
        list(iter_hf_tensors(out))


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match=r"maps \['b'\] to model-00001-of-00001.safetensors"):
        list(iter_hf_tensors(tmp_path))


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFCheckpointError, match=r"holds no \*.safetensors files .*pytorch_model.bin"):
        list(iter_hf_tensors(tmp_path))
