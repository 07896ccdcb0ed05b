"""The PEFT folder --save-hf writes, loaded by the real ``peft`` library on the HF base.

peft's model must compute what tidal's merge computes (``train convert --lora-adapter``'s ``merged_hf_tensors``)
and what the LoRA actor computes; peft's own merge must give tidal's merged tensors. An adapter of another base
(shape, family, depth or target modules) is refused by the merge and by --load's check, one line each.
"""

import importlib
import sys
from pathlib import Path

import pytest
import torch
from tidal.actor import ActorConfig
from tidal.batching import pack

WORKER = Path(__file__).with_name("lora_worker.py")
SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]


def _worker():
    sys.path.insert(0, str(WORKER.parent))
    try:
        return importlib.import_module("lora_worker")
    finally:
        sys.path.pop(0)


def _hf_logits(model, seqs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float() for s in seqs]


def _tidal_log_probs(logits: list[torch.Tensor]) -> torch.Tensor:
    """Per-token log-probs in the actor's packed convention (0 at each sequence's first token)."""
    out = []
    for seq, lg in zip(SEQS, logits, strict=True):
        lp = torch.log_softmax(lg, dim=-1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
        out.append(torch.cat([torch.zeros(1), lp]))
    return torch.cat(out)


@pytest.mark.parametrize(
    ("targets", "alpha", "dropout"),
    [(("all-linear",), 16.0, 0.0), (("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"), 8.0, 0.1)],
)
def test_peft_loads_the_folder_and_computes_tidals_merge(dist_env, qwen2_dir, tmp_path, rl_batch, targets, alpha,
                                                         dropout):  # fmt: skip
    from peft import PeftConfig, PeftModel
    from tidal.actor import Actor, gather_adapter_tensors, merged_hf_tensors, peft_adapter_config, write_peft_adapter
    from tidal.actor.lora_targets import resolve_target_modules
    from tidal.ckpt import HFCheckpointReader, save_hf_checkpoint
    from transformers import AutoModelForCausalLM

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, lora_alpha=alpha, lora_dropout=dropout,
                              lora_target_modules=targets, lr=1e-2))  # fmt: skip
    worker = _worker()
    actor.lora.load_adapter_tensors(worker.seeded_adapters({p.lora_hf_name: p.lora_full_shape for p in actor.params}))
    actor.train_step([rl_batch(actor, SEQS[:3])])  # A and B both non-zero, and moved by a real step
    adapters = gather_adapter_tensors(actor.lora)
    folder = write_peft_adapter(
        tmp_path / "adapter", adapters, peft_adapter_config(actor.lora.settings, base_model=str(qwen2_dir))
    )

    # the fields peft reads are the ones tidal was given
    read = PeftConfig.from_pretrained(str(folder))
    assert (read.peft_type.value, read.task_type, read.r, read.lora_alpha) == ("LORA", "CAUSAL_LM", 4, alpha)
    assert read.lora_dropout == dropout
    assert set(read.target_modules) == set(resolve_target_modules(targets))
    assert read.base_model_name_or_path == str(qwen2_dir)

    base = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    base_logits = _hf_logits(base.eval(), SEQS)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    # every adapter tensor landed under its own name (a name peft did not match would keep its fresh init)
    state = {n.replace(".default.", "."): t for n, t in model.state_dict().items() if ".lora_" in n}
    assert state.keys() == {f"base_model.model.{n}" for n in adapters}
    for name, t in adapters.items():
        assert torch.equal(state[f"base_model.model.{name}"], t), name
    peft_logits = _hf_logits(model, SEQS)
    assert not torch.allclose(torch.cat(peft_logits), torch.cat(base_logits), atol=1e-2)  # the adapter acts

    # tidal's merge (train convert --lora-adapter) as an HF model: peft's logits
    merged = dict(merged_hf_tensors(HFCheckpointReader(qwen2_dir), folder))
    save_hf_checkpoint(tmp_path / "merged", iter(merged.items()), source_dir=qwen2_dir)
    tidal_model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    for ours, theirs in zip(_hf_logits(tidal_model, SEQS), peft_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    # the LoRA actor's own forward: peft's log-probs (Megatron's and transformers' kernels differ in the last bits)
    torch.testing.assert_close(actor.compute_log_probs(pack(SEQS)), _tidal_log_probs(peft_logits), atol=1e-4, rtol=0)

    # peft's merge_and_unload: tidal's merged tensors
    unloaded = model.merge_and_unload().state_dict()
    assert unloaded.keys() - {"lm_head.weight"} == merged.keys() - {"lm_head.weight"}
    for name, t in merged.items():
        torch.testing.assert_close(unloaded[name], t, atol=1e-6, rtol=1e-6, msg=name)


def test_an_adapter_of_another_shape_or_family_is_one_line(dist_env, qwen2_dir, qwen3_dir, tmp_path):
    """Merged by train convert, or resumed by --load: an adapter of qwen2's tiny model does not go on another base."""
    from tidal.actor import Actor, check_adapter_checkpoint, merged_hf_tensors, peft_adapter_config, write_peft_adapter
    from tidal.ckpt import HFCheckpointReader, save_checkpoint

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4))
    adapters = actor.lora.adapter_tensors()
    config = peft_adapter_config(actor.lora.settings, base_model=str(qwen2_dir))
    folder = write_peft_adapter(tmp_path / "adapter", adapters, config)
    fix = r"\(an adapter .*another .*family.*\): give the base it was trained on as --hf-checkpoint$"

    # another shape: qwen3's tiny model (head_dim 32) has wider k/v projections than qwen2's (head_dim 16)
    with pytest.raises(ValueError, match=r"does not fit model\.layers\.0\.self_attn\.k_proj\.weight \(64, 64\): "
                       r"lora_A \(4, 64\), lora_B \(32, 4\) " + fix) as err:  # fmt: skip
        merged_hf_tensors(HFCheckpointReader(qwen3_dir), folder)
    assert "\n" not in str(err.value)
    # another family: Phi-3's fused qkv_proj, which a Qwen2 base does not have
    phi = {n.replace("self_attn.q_proj", "self_attn.qkv_proj"): t for n, t in adapters.items()}
    write_peft_adapter(tmp_path / "phi", phi, config)
    with pytest.raises(ValueError, match=r"adapts model\.layers\.0\.self_attn\.qkv_proj\.weight, which the base "
                       r"checkpoint does not have " + fix):  # fmt: skip
        merged_hf_tensors(HFCheckpointReader(qwen2_dir), tmp_path / "phi")

    # --load of the LoRA run's checkpoint onto another base: checked from the metadata and the base's headers
    save_checkpoint(tmp_path / "ckpt", 1, actor.sharded_state_dict())
    check_adapter_checkpoint(tmp_path / "ckpt", lora_rank=4, hf_checkpoint=qwen2_dir)
    with pytest.raises(ValueError, match=r"^--load .*ckpt: the adapter does not fit model\.layers\.0\.self_attn\."
                       r"k_proj\.weight \(64, 64\).* " + fix):  # fmt: skip
        check_adapter_checkpoint(tmp_path / "ckpt", lora_rank=4, hf_checkpoint=qwen3_dir)
    # the adapters are the ones --lora-target-modules selects in the base, no more and no fewer (other targets, or
    # another base with more layers): one line before start, not the load's mismatch of tensor names
    extra = r"holds adapters for 8 weights that --lora-target-modules q k v does not select \(model\.layers\.0\.mlp"
    with pytest.raises(ValueError, match=rf"^--load .*ckpt {extra}\.down_proj\.weight, \.\.\.\): give the "):
        check_adapter_checkpoint(
            tmp_path / "ckpt", lora_rank=4, hf_checkpoint=qwen2_dir, target_modules=("q", "k", "v")
        )
    q_only = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, lora_target_modules=("q_proj",)))
    save_checkpoint(tmp_path / "q_only", 1, q_only.sharded_state_dict())
    check_adapter_checkpoint(tmp_path / "q_only", lora_rank=4, hf_checkpoint=qwen2_dir, target_modules=("q_proj",))
    missing = r"holds no adapter for model\.layers\.0\.mlp\.down_proj\.weight \(12 of the 14 weights"
    with pytest.raises(ValueError, match=rf"^--load .*q_only {missing} --lora-target-modules all-linear selects in "):
        check_adapter_checkpoint(tmp_path / "q_only", lora_rank=4, hf_checkpoint=qwen2_dir)
