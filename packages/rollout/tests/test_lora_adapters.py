"""LoRA adapters loaded at run time into a real SGLang server (--enable-lora) and named by every /generate.

One server with LoRA serving is started for this module (the session's server has none, and LoRA is a launch
flag); what it serves is compared with transformers on the same base with the adapter merged in.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tidal.rollout import (
    RolloutError,
    ServedAdapters,
    SGLangEngine,
    adapter_name,
    load_adapter_from_tensors,
    lora_server_args,
)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real SGLang server on tiny_model_dir that takes adapters of rank <= RANK on every linear module."""
    engine = SGLangEngine(
        tiny_model_dir,
        port=_free_port(),
        log_dir=tmp_path_factory.mktemp("sglang_lora_logs"),
        extra_server_args=["--dtype", "float32", *lora_server_args(RANK, MODULES)],
        startup_timeout_s=600,
    )
    engine.start()
    yield engine
    engine.shutdown()


def _adapter(tiny_model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """Random A and B (B not zero: the adapter changes the model) for every module of both layers, by HF name."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    h, ffn = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h)}
    shapes |= {"gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (rows, cols) in shapes.items():
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            stem = f"model.layers.{layer}.{parent}.{module}"
            out[f"{stem}.lora_A.weight"] = torch.randn(RANK, cols, generator=gen) * 0.3
            out[f"{stem}.lora_B.weight"] = torch.randn(rows, RANK, generator=gen) * 0.3
    return out


def _peft_config() -> dict:
    return {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES), "bias": "none"}


def _merged_log_probs(tiny_model_dir: Path, adapter: dict[str, torch.Tensor] | None, tokens: list[int]) -> list[float]:
    """transformers' log-probs of ``tokens[1:]`` on the base with ``adapter`` merged in (W + alpha/r * B @ A)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, a in (adapter or {}).items():
            if name.endswith(".lora_A.weight"):
                stem = name.removesuffix(".lora_A.weight")
                params[f"{stem}.weight"] += ALPHA / RANK * adapter[f"{stem}.lora_B.weight"] @ a
        logits = model(torch.tensor([tokens])).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [lps[t - 1, tokens[t]].item() for t in range(1, len(tokens))]


def _check_served(engine: SGLangEngine, tiny_model_dir: Path, adapter: dict[str, torch.Tensor] | None) -> None:
    """Every prompt's sampled tokens have, on the engine, transformers' log-probs under base (+ adapter merged)."""
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        expected = _merged_log_probs(tiny_model_dir, adapter, prompt + out["output_ids"])[len(prompt) - 1 :]
        assert out["output_log_probs"] == pytest.approx(expected, abs=2e-3)


def test_an_adapter_from_tensors_is_served_as_base_plus_adapter_under_its_version(lora_server, tiny_model_dir):
    adapter = _adapter(tiny_model_dir, seed=1)
    name = adapter_name(1, "t")
    metrics = load_adapter_from_tensors(lora_server, sorted(adapter.items()), name=name, config=_peft_config())
    assert metrics["weight_sync/mb"] == pytest.approx(sum(t.nbytes for t in adapter.values()) / 2**20)
    assert metrics["weight_sync/num_tensors"] == len(adapter)
    served = ServedAdapters(lora_server)
    served.serve(name, "1")
    try:
        assert lora_server.lora_name == name and lora_server.get_model_info()["weight_version"] == "1"
        assert name in served.loaded()
        _check_served(lora_server, tiny_model_dir, adapter)
        lora_server.lora_name = None  # the base model, as before any sync
        _check_served(lora_server, tiny_model_dir, None)
    finally:
        lora_server.lora_name = None


def test_adapters_from_peft_folders_replace_each_other_and_at_most_two_stay_loaded(
    lora_server, tiny_model_dir, tmp_path
):
    served = ServedAdapters(lora_server)
    names = []
    try:
        for version in (2, 3, 4):
            adapter = _adapter(tiny_model_dir, seed=version)
            folder = tmp_path / f"v{version}"
            folder.mkdir()
            peft_names = {f"base_model.model.{n}": t for n, t in adapter.items()}
            save_file(peft_names, str(folder / "adapter_model.safetensors"))
            (folder / "adapter_config.json").write_text(json.dumps(_peft_config()))
            names.append(adapter_name(version, "d"))
            served.serve(names[-1], str(version), path=str(folder))
            assert lora_server.get_model_info()["weight_version"] == str(version)
            _check_served(lora_server, tiny_model_dir, adapter)
        assert served.names == names[-2:]
        assert sorted(n for n in served.loaded() if n.endswith("-d")) == sorted(names[-2:])  # v2 was unloaded
    finally:
        lora_server.lora_name = None
        for name in served.names:
            lora_server.call("/unload_lora_adapter", {"lora_name": name})


def test_a_server_without_lora_refuses_an_adapter_naming_the_flags(sglang_server, tiny_model_dir):
    adapter = _adapter(tiny_model_dir, seed=5)
    with pytest.raises(RolloutError, match=r"started with --enable-lora, --max-lora-rank") as e:
        load_adapter_from_tensors(sglang_server, adapter.items(), name=adapter_name(5, "x"), config=_peft_config())
    assert "\n" not in str(e.value)


def test_lora_server_args_leave_the_users_own_flags():
    assert lora_server_args(16, ["q_proj", "v_proj"]) == (
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
    )  # fmt: skip
    assert lora_server_args(16, ["q_proj"], given=["--max-lora-rank=64", "--dtype", "float32"]) == (
        "--enable-lora", "--lora-target-modules", "q_proj",
    )  # fmt: skip
    # memory release (GPU) keeps a host copy of the base weights: no adapter sync sends them again
    assert lora_server_args(4, ["v_proj"], given=["--enable-memory-saver"])[-1] == "--enable-weights-cpu-backup"
