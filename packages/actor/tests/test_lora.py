"""LoRA adapters on the actor: the base at init, frozen base, merged export, the free reference, TP=2 and PP=2."""

import dataclasses
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tidal.actor import ActorConfig
from tidal.batching import pack

WORKER = Path(__file__).with_name("lora_worker.py")
SEQS = [[5, 17, 99, 3, 42, 7, 64], [1, 2, 3], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77], [9, 8, 7, 6, 5]]


def _import(name: str):
    sys.path.insert(0, str(WORKER.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _seed_adapters(actor) -> None:
    worker = _import("lora_worker")
    actor.lora.load_adapter_tensors(worker.seeded_adapters({p.lora_hf_name: p.lora_full_shape for p in actor.params}))


def test_lora_at_init_is_the_base_and_trains_only_adapters(dist_env, qwen2_dir, rl_batch):
    from tidal.actor import Actor

    base = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir)))
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=8, lr=1e-2))
    probe = pack(SEQS)
    assert torch.equal(actor.compute_log_probs(probe), base.compute_log_probs(probe))
    # all-linear: q, k, v, o, gate, up, down of both layers, an A and a B each; nothing else trains
    names = {p.lora_hf_name for p in actor.params}
    assert len(names) == 2 * 7 * 2
    assert {n.split(".")[4] for n in names} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    frozen = {n: p.detach().clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    assert len(frozen) == len(list(base.model.parameters()))
    assert [p for g in actor.optimizer.param_groups for p in g["params"]] == actor.params
    actor.train_step([rl_batch(actor, SEQS[:3])])
    # AdamW holds state for the adapters alone: 2 x 4 bytes per adapter element
    assert set(actor.optimizer.state) == set(actor.params)
    assert all(p.grad is None for n, p in actor.model.named_parameters() if n in frozen)
    after = dict(actor.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in frozen.items())
    # B started at zero and moved; A's first gradient is zero (B = 0), so it stays
    tensors = actor.lora.adapter_tensors()
    assert all(t.abs().sum() > 0 for n, t in tensors.items() if ".lora_B." in n)
    assert not torch.allclose(actor.compute_log_probs(probe), base.compute_log_probs(probe), atol=1e-4)
    with actor.lora.disabled():
        assert torch.equal(actor.compute_log_probs(probe), base.compute_log_probs(probe))


def test_merged_export_is_w_plus_scaled_ba(dist_env, qwen2_dir, hf_reference, tmp_path):
    from tidal.actor import Actor

    worker = _import("lora_worker")
    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_target_modules=worker.TARGETS, **worker.CFG))
    _seed_adapters(actor)
    adapters = actor.lora.adapter_tensors()
    original = load_file(qwen2_dir / "model.safetensors")
    exported = dict(actor.named_hf_tensors())
    assert set(exported) == set(original)
    scale = worker.CFG["lora_alpha"] / worker.CFG["lora_rank"]
    merged = 0
    for name, tensor in exported.items():
        module = name.removesuffix(".weight")
        a = adapters.get(f"{module}.lora_A.weight")
        expected = original[name] if a is None else original[name] + scale * adapters[f"{module}.lora_B.weight"] @ a
        merged += a is not None
        torch.testing.assert_close(tensor, expected, atol=1e-6, rtol=1e-6)
    assert merged == 2 * len(worker.TARGETS)
    assert not torch.equal(exported["model.layers.0.self_attn.q_proj.weight"],
                           original["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(exported["model.layers.0.self_attn.k_proj.weight"],
                       original["model.layers.0.self_attn.k_proj.weight"])  # fmt: skip
    for _ in range(2):  # the buckets are computed again at each export (the adapters change between syncs)
        buckets = {n: t.clone() for b in actor.hf_tensor_buckets(bucket_bytes=16 * 2**10) for n, t in b}
        assert all(torch.equal(t, exported[n].to(torch.bfloat16)) for n, t in buckets.items())
        actor.lora.load_adapter_tensors({n: t * 0.5 for n, t in adapters.items()})
        exported = dict(actor.named_hf_tensors())
    # the merged weights, as an HF model, compute the LoRA actor's log-probs
    out = tmp_path / "merged"
    out.mkdir()
    shutil.copy(qwen2_dir / "config.json", out / "config.json")
    save_file({n: t.contiguous() for n, t in exported.items()}, out / "model.safetensors", metadata={"format": "pt"})
    _, ref = hf_reference(out, SEQS)
    torch.testing.assert_close(actor.compute_log_probs(pack(SEQS)), torch.cat(ref), atol=1e-4, rtol=0)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_base_reference_equals_a_separately_loaded_reference(dist_env, qwen2_dir):
    from tidal.actor import Actor, ReferenceModel
    from tidal.actor.lora import BaseReference

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, kl_loss_coef=0.1, use_kl_loss=True))
    _seed_adapters(actor)
    reference = BaseReference(actor)
    separate = ReferenceModel(ActorConfig(hf_checkpoint=str(qwen2_dir)))
    probe = pack(SEQS)
    with reference.loaded():
        ref = reference.compute_log_probs(probe)
    torch.testing.assert_close(ref, separate.compute_log_probs(probe), atol=1e-6, rtol=0)
    assert not torch.allclose(actor.compute_log_probs(probe), ref, atol=1e-3)  # the adapters are back on after
    with pytest.raises(ValueError, match="needs an actor with LoRA"):
        BaseReference(separate._actor)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(lora_rank=-1), r"--lora-rank must be >= 0 \(0: full fine-tuning"),
        (dict(lora_rank=4, lora_target_modules=("qkv_proj",)), "'qkv_proj' matches no linear module.*q_proj, k_proj"),
        (dict(lora_rank=4, lora_target_modules=(",",)), "names no module"),
        (dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha must be > 0"),
        (dict(lora_rank=4, lora_dropout=1.0), r"--lora-dropout must be in \[0, 1\)"),
        (dict(lora_rank=4, advantage_estimator="ppo"), "--lora-rank 4 with --advantage-estimator ppo .* not supported"),
    ],
)
def test_bad_lora_settings_are_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        ActorConfig(hf_checkpoint="/m", **kw)
    assert "\n" not in str(err.value)


def test_target_names_resolve_to_hf_modules():
    from tidal.actor.lora_targets import resolve_target_modules

    assert resolve_target_modules(["linear_qkv", "down"]) == ("q_proj", "k_proj", "v_proj", "down_proj")
    assert resolve_target_modules(["v_proj,q_proj", "linear_fc1"]) == ("q_proj", "v_proj", "gate_proj", "up_proj")
    assert len(resolve_target_modules(["all-linear"])) == 7
    assert ActorConfig(hf_checkpoint="/m").lora_rank == 0  # off by default


def test_adapter_of_another_rank_is_refused(dist_env, qwen2_dir):
    from tidal.actor import Actor

    actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, lora_target_modules=("q_proj",)))
    other = {n: torch.zeros((8, t.shape[1]) if ".lora_A." in n else (t.shape[0], 8)) for n, t in
             actor.lora.adapter_tensors().items()}  # fmt: skip
    with pytest.raises(ValueError, match=r"adapter.x has rank 8 .*--lora-rank is 4: pass --lora-rank 8"):
        actor.lora.load_adapter_tensors(other, source="adapter.x")
    with pytest.raises(ValueError, match=r"has no tensor model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight"):
        actor.lora.load_adapter_tensors({})


@pytest.fixture(scope="module")
def single(dist_env, qwen2_dir):
    return _import("lora_worker").lora_part(0, 1, 0, 1, 1, str(qwen2_dir))  # process group already up: port unused


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_tp2_and_pp2_match_one_process(single, qwen2_dir, tmp_path):
    spawn = _import("test_context_parallel").spawn
    results = spawn(tmp_path, WORKER, 2, [str(qwen2_dir)])
    assert not torch.allclose(single["log_probs"], single["init_log_probs"], atol=1e-3)
    assert single["metrics"]["train/grad_norm"] > 0.5  # clipped
    for layout in ("tp", "pp"):
        grads = {}
        for r in (res[layout] for res in results):
            for key in ("init_log_probs", "log_probs", "base_log_probs"):
                torch.testing.assert_close(r[key], single[key], atol=1e-5, rtol=0, msg=f"{layout} {key}")
            assert r["export"].keys() == single["export"].keys()
            for name, t in r["export"].items():
                torch.testing.assert_close(t, single["export"][name], atol=1e-6, rtol=1e-5, msg=f"{layout} {name}")
            assert r["buckets"].keys() == single["buckets"].keys()
            for key in ("train/loss", "train/grad_norm", "train/entropy"):
                assert r["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4), (layout, key)
            torch.testing.assert_close(r["log_probs_after"], single["log_probs_after"], atol=2e-4, rtol=0)
            grads |= r["grads"]
        # every adapter's gradient (TP: whole on each rank; PP: each stage its own layers') equals one process's
        assert grads.keys() == single["grads"].keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, single["grads"][name], atol=1e-6, rtol=1e-4, msg=f"{layout} {name}")
        assert any(g.abs().sum() > 0 for n, g in grads.items() if ".lora_A." in n)
        # the PEFT folder's tensors: every stage's adapters, whole, on global rank 0 alone
        seeded = _import("lora_worker").seeded_adapters({n: t.shape for n, t in single["grads"].items()})
        first, *others = (res[layout]["gathered"] for res in results)
        assert first.keys() == seeded.keys() and all(not o for o in others)
        for name, t in first.items():
            torch.testing.assert_close(t, seeded[name], atol=0, rtol=0, msg=f"{layout} {name}")


def test_checkpoint_holds_the_adapters_alone_and_resumes_exactly(dist_env, qwen2_dir, tmp_path, rl_batch):
    from tidal.actor import Actor
    from tidal.actor.lora_checkpoint import check_adapter_checkpoint
    from tidal.ckpt import load_checkpoint, save_checkpoint

    cfg = ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, lr_warmup_steps=3, lora_rank=4)
    a = Actor(cfg)
    a.train_step([rl_batch(a, SEQS[:3])])
    state = a.sharded_state_dict()
    assert set(state["model"]) == {f"lora.{p.lora_hf_name}" for p in a.params}  # no base weight
    save_checkpoint(tmp_path / "ckpt", 1, state)
    full = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2))
    full.train_step([rl_batch(full, SEQS[:3])])
    save_checkpoint(tmp_path / "full", 1, full.sharded_state_dict())
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).rglob("*") if f.is_file()) for d in ("ckpt", "full")}
    assert size["ckpt"] < size["full"] / 3, size  # adapters + their Adam moments only

    # the adapter rank (or its absence) is checked before a load, from the metadata alone
    check_adapter_checkpoint(tmp_path / "ckpt", lora_rank=4)
    for path, rank, match in (
        ("ckpt", 8, r"holds LoRA adapters of rank 4, and --lora-rank is 8: pass --lora-rank 4$"),
        ("ckpt", 0, r"holds LoRA adapters of rank 4: pass --lora-rank 4$"),
        ("full", 4, r"holds a full fine-tuning checkpoint, not LoRA adapters, and --lora-rank is 4: drop"),
    ):
        with pytest.raises(ValueError, match=match):
            check_adapter_checkpoint(tmp_path / path, lora_rank=rank)
    check_adapter_checkpoint(tmp_path / "full", lora_rank=0)

    b = Actor(cfg, weights="checkpoint")  # what --load builds: a LoRA checkpoint has no base, so it is read from HF
    assert b.hf_bytes_read > 0
    state, _ = load_checkpoint(tmp_path / "ckpt", b.sharded_state_dict())
    b.load_state_dict(state)
    assert b.num_steps == 1
    for pa, pb in zip(a.params, b.params, strict=True):
        assert torch.equal(pa, pb), pa.lora_hf_name
    ma, mb = a.train_step([rl_batch(a, SEQS[:3])]), b.train_step([rl_batch(b, SEQS[:3])])
    assert ma["train/lr"] == mb["train/lr"]
    for pa, pb in zip(a.params, b.params, strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0, msg=pa.lora_hf_name)
    torch.testing.assert_close(a.compute_log_probs(pack(SEQS)), b.compute_log_probs(pack(SEQS)), atol=0, rtol=0)


def test_rollout_with_kl_takes_the_base_as_reference(dist_env, qwen2_dir):
    from tidal.actor import Actor, ReferenceModel, train_on_rollout
    from tidal.actor.lora import BaseReference
    from tidal.batching import BatchingConfig

    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (20, 14, 25, 18)]
    masks = [[0] * 5 + [1] * (len(t) - 5) for t in tokens]
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=2)
    metrics = {}
    for name in ("lora", "separate"):
        actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-2, lora_rank=4, kl_loss_coef=0.5))
        _seed_adapters(actor)  # the policy is away from the base: the KL is not zero
        reference = (
            BaseReference(actor) if name == "lora" else ReferenceModel(ActorConfig(hf_checkpoint=str(qwen2_dir)))
        )
        metrics[name] = train_on_rollout(actor, batching, tokens=tokens, loss_masks=masks, rewards=[1.0, 0.0, 0.0, 1.0],
                                         group_size=2, reference=reference)  # fmt: skip
    assert metrics["lora"]["train/kl"] > 1e-3
    for key in ("train/kl", "train/loss", "train/grad_norm"):
        assert metrics["lora"][key] == pytest.approx(metrics["separate"][key], rel=1e-5), key


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj", "down_proj")])
def test_memory_plan_counts_the_adapters_state_and_the_frozen_base(dist_env, qwen3_dir, targets):
    from tidal.actor import Actor, MemoryInputs, ModelShape, plan_memory
    from tidal.ckpt import read_hf_config_json

    cfg = ActorConfig(hf_checkpoint=str(qwen3_dir), lora_rank=4, lora_target_modules=targets, use_kl_loss=True,
                      kl_loss_coef=0.1)  # fmt: skip
    actor = Actor(cfg)
    shape = ModelShape.from_hf_config(read_hf_config_json(qwen3_dir))
    budget = dict(train_tokens=256, logprob_tokens=256, longest_sequence=64, reference_model=True)
    rows = dict(plan_memory(shape, MemoryInputs.from_actor_config(cfg, **budget)).rows)
    adapters = sum(p.numel() * 4 for p in actor.params)
    assert rows["LoRA adapters"] == rows["gradients"] == adapters
    assert rows["AdamW moments"] == 2 * adapters
    assert rows["frozen base parameters (float32)"] == sum(p.numel() * 4 for p in actor.model.parameters()) - adapters
    assert "reference model" not in rows  # the base is the reference
    full = plan_memory(shape, MemoryInputs.from_actor_config(dataclasses.replace(cfg, lora_rank=0), **budget))
    assert "reference model" in dict(full.rows)
    assert plan_memory(shape, MemoryInputs.from_actor_config(cfg, **budget)).train_peak < full.train_peak


def test_dropout_acts_in_training_only(dist_env, qwen2_dir):
    from tidal.actor import Actor

    actors = [Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, lora_dropout=p)) for p in (0.0, 0.5)]
    for actor in actors:
        _seed_adapters(actor)
    probe = pack(SEQS)
    # the log-prob passes run in eval mode: no dropout
    assert torch.equal(actors[0].compute_log_probs(probe), actors[1].compute_log_probs(probe))
    adapter = actors[1].lora.adapters["decoder.layers.0.self_attention.linear_qkv.weight"]
    x = torch.randn(5, 1, 64)
    adapter.train()
    assert not torch.allclose(adapter.delta(x), adapter.delta(x))
    adapter.eval()
    torch.testing.assert_close(adapter.delta(x), adapter.delta(x), atol=0, rtol=0)


def test_peft_folder_merges_back_into_the_base_as_the_actor_exports(dist_env, qwen2_dir, tmp_path):
    from tidal.actor import Actor
    from tidal.actor.lora_peft import (
        ADAPTER_CONFIG,
        ADAPTER_WEIGHTS,
        gather_adapter_tensors,
        merged_hf_tensors,
        peft_adapter_config,
        write_peft_adapter,
    )
    from tidal.ckpt import HFCheckpointReader

    targets = ("q_proj", "v_proj", "down_proj")
    a = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, lora_alpha=8.0, lora_target_modules=targets))
    _seed_adapters(a)
    config = peft_adapter_config(a.lora.settings, str(qwen2_dir))
    out = write_peft_adapter(tmp_path / "peft", gather_adapter_tensors(a.lora), config)
    written = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (written["peft_type"], written["r"], written["lora_alpha"]) == ("LORA", 4, 8.0)
    assert written["target_modules"] == list(targets)
    assert set(load_file(out / ADAPTER_WEIGHTS)) == {f"base_model.model.{p.lora_hf_name}" for p in a.params}

    merged = dict(merged_hf_tensors(HFCheckpointReader(qwen2_dir), out))
    exported = dict(a.named_hf_tensors())
    assert merged.keys() == exported.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(merged[name], tensor.to(merged[name].dtype), msg=name)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        load_file(next(qwen2_dir.glob("*.safetensors")))["model.layers.0.self_attn.q_proj.weight"],
    )

    # an adapter of another shape (another base) is one error before anything is read
    shifted = {n.removeprefix("base_model.model."): t[:, :-1] if ".lora_A." in n else t
               for n, t in load_file(out / ADAPTER_WEIGHTS).items()}  # fmt: skip
    write_peft_adapter(tmp_path / "other", shifted, config)
    with pytest.raises(
        ValueError,
        match=r"does not fit model\.layers\.0\.mlp\.down_proj\.weight \(64, 128\): lora_A \(4, 127\).* another shape",
    ):
        merged_hf_tensors(HFCheckpointReader(qwen2_dir), tmp_path / "other")


def test_the_seed_draws_the_initial_a_matrices(dist_env, qwen2_dir):
    """The app's --seed reaches the adapters' initialisation: another seed, other A matrices (B starts at zero)."""
    from tidal.actor import Actor

    def initial(seed):
        actor = Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lora_rank=4, seed=seed))
        return {n: t for n, t in actor.lora.adapter_tensors().items() if ".lora_A." in n}

    one, again, other = initial(1), initial(1), initial(2)
    assert one.keys() == other.keys() and one
    assert all(torch.equal(t, again[n]) for n, t in one.items())
    assert all(not torch.equal(t, other[n]) for n, t in one.items())
