"""On-policy distillation through train_on_rollout: a frozen teacher of another shape scores the sampled tokens."""

import dataclasses
import itertools

import pytest
import torch
from tidal.actor import Actor, ActorConfig, TeacherModel
from tidal.actor.advantages import compute_advantages
from tidal.actor.distill import teacher_kl_metrics
from tidal.actor.memory_plan import MemoryInputs, ModelShape, plan_memory
from tidal.actor.trainer import train_on_rollout
from tidal.batching import BatchingConfig, pack
from tidal.ckpt import read_hf_config_json
from transformers import Qwen3Config, Qwen3ForCausalLM

# 2 prompts x 2 samples; the second sample's 4th token is a tool reply inside the response (loss mask 0).
TOKENS = [[5, 17, 99, 3, 61], [5, 17, 42, 7, 8, 9], [120, 0, 33, 33, 8], [120, 0, 4]]
MASKS = [[0, 0, 1, 1, 1], [0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A Qwen3 teacher with 3 layers of width 96 (the Qwen2 student: 2 of 64), the student's 128-token vocabulary."""
    torch.manual_seed(7)
    config = Qwen3Config(
        vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1)
            if "norm" in name:
                p.add_(1.0)
    out = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(out)
    return out


def _captured_step(actor: Actor) -> list:
    seen: list = []
    train_step = actor.train_step
    actor.train_step = lambda mbs: seen.extend(mbs) or train_step(mbs)
    return seen


@pytest.mark.parametrize(
    ("estimator", "coef", "lora_rank"),
    [("on_policy_distillation", 1.0, 0), ("grpo", 0.5, 0), ("on_policy_distillation", 2.0, 4)],
    ids=["distillation-alone", "mixed-with-grpo", "lora-student"],
)
def test_advantage_is_teacher_minus_old_log_prob_on_the_loss_tokens(
    dist_env, qwen2_dir, teacher_dir, hf_reference, estimator, coef, lora_rank
):
    cfg = ActorConfig(
        hf_checkpoint=str(qwen2_dir), lr=1e-2, advantage_estimator=estimator, teacher_hf_checkpoint=str(teacher_dir),
        teacher_kl_coef=coef, lora_rank=lora_rank,
    )  # fmt: skip
    actor = Actor(cfg)
    teacher = TeacherModel(cfg)
    assert teacher.offloaded and not any(p.requires_grad for p in teacher.model.parameters())
    assert teacher.num_params > sum(p.numel() for p in Actor(ActorConfig(hf_checkpoint=str(qwen2_dir))).params)
    shapes = [ModelShape.from_hf_config(read_hf_config_json(d)) for d in (qwen2_dir, teacher_dir)]
    inputs = MemoryInputs.from_actor_config(cfg, train_tokens=64, logprob_tokens=64, longest_sequence=8)
    with_teacher = plan_memory(shapes[0], dataclasses.replace(inputs, teacher=shapes[1]))
    assert dict(with_teacher.rows)["teacher model"] == teacher.num_params * 4  # float32, the teacher's own shape
    assert with_teacher.logprob_peak > plan_memory(shapes[0], inputs).logprob_peak + teacher.num_params * 4
    old = torch.split(actor.compute_log_probs(pack(TOKENS)), [len(t) for t in TOKENS])  # before any step
    _, teacher_lps = hf_reference(teacher_dir, TOKENS)  # transformers' own Qwen3 forward
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2, micro_batch_size=1)
    seen = _captured_step(actor)
    rollout = dict(tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2)
    with pytest.raises(ValueError, match="--teacher-hf-checkpoint and a teacher go together"):
        train_on_rollout(actor, batching, **rollout)
    metrics = train_on_rollout(actor, batching, **rollout, teacher=teacher)

    base = compute_advantages(torch.tensor(REWARDS), 2, estimator=estimator)
    assert len(seen) == 4 and teacher.offloaded
    kl = []
    for mb in seen:
        i, n = int(mb.sample_indices[0]), len(TOKENS[int(mb.sample_indices[0])])
        mask = torch.tensor(MASKS[i], dtype=torch.float32)
        torch.testing.assert_close(mb.token_fields["teacher_log_probs"][:n], teacher_lps[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(mb.token_fields["old_log_probs"][:n], old[i], atol=1e-5, rtol=0)
        expected = float(base[i]) + coef * (teacher_lps[i] - old[i]) * mask
        torch.testing.assert_close(mb.token_fields["advantages"][:n], expected, atol=1e-4, rtol=0)
        kl.append((old[i] - teacher_lps[i])[mask.bool()])
    kl = torch.cat(kl).double()
    assert metrics["distill/teacher_kl/mean"] == pytest.approx(float(kl.mean()), abs=1e-4)
    assert metrics["distill/teacher_kl/max"] == pytest.approx(float(kl.max()), abs=1e-4)
    assert metrics["distill/teacher_kl/p50"] == pytest.approx(float(torch.quantile(kl, 0.5)), abs=1e-4)
    assert metrics["distill/teacher_kl/p10"] <= metrics["distill/teacher_kl/p50"] <= metrics["distill/teacher_kl/p90"]
    assert metrics["time/teacher"] > 0 and metrics["train/grad_norm"] > 0


def test_teacher_kl_metrics_count_only_loss_tokens():
    batch = pack([[1, 2, 3, 4]], loss_masks=[[0, 1, 0, 1]])
    fields = {"old_log_probs": torch.tensor([0.0, -1.0, -9.0, -2.0]), "teacher_log_probs": torch.tensor([0, -3, 0, -3])}
    mb = dataclasses.replace(batch, token_fields=fields)
    metrics = teacher_kl_metrics([[mb]])
    assert metrics["distill/teacher_kl/mean"] == pytest.approx(1.5)  # (2 + 1) / 2; the masked -9 is not counted
    assert metrics["distill/teacher_kl/max"] == pytest.approx(2.0)
    assert teacher_kl_metrics([[dataclasses.replace(mb, loss_mask=torch.zeros(4))]]) == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"advantage_estimator": "on_policy_distillation"}, r"needs a teacher: add --teacher-hf"),
        ({"teacher_kl_coef": 0.5}, r"--teacher-kl-coef 0.5 weighs a teacher's term and this run has none"),
        ({"teacher_hf_checkpoint": "T", "teacher_kl_coef": 0.0}, r"--teacher-kl-coef must be > 0"),
        ({"teacher_hf_checkpoint": "T", "advantage_estimator": "ppo"}, r"with --advantage-estimator ppo is not"),
        ({"teacher_hf_checkpoint": "T", "advantage_estimator": "reinforce_plus_plus"}, r"not per sample"),
        ({"teacher_hf_checkpoint": "T", "loss_type": "sft_loss"}, r"with --loss-type sft_loss"),
        (
            {"teacher_hf_checkpoint": "T", "advantage_estimator": "on_policy_distillation",
             "custom_advantage_function_path": "m:f"},
            r"--custom-advantage-function-path with --advantage-estimator on_policy_distillation",
        ),
    ],
)  # fmt: skip
def test_teacher_settings_are_refused_in_one_line_naming_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ActorConfig(hf_checkpoint="S", **kwargs)
    assert "\n" not in str(info.value)


def test_steps_on_the_teachers_signal_bring_the_student_to_the_teacher(dist_env, qwen2_dir, teacher_dir):
    """Each rollout's step on the same samples lowers their reverse KL to the teacher (the student moves to it)."""
    cfg = ActorConfig(
        hf_checkpoint=str(qwen2_dir), lr=3e-4, advantage_estimator="on_policy_distillation",
        teacher_hf_checkpoint=str(teacher_dir),
    )  # fmt: skip
    actor, teacher = Actor(cfg), TeacherModel(cfg)
    batching = BatchingConfig(rollout_batch_size=2, n_samples_per_prompt=2)
    rollout = dict(tokens=TOKENS, loss_masks=MASKS, rewards=REWARDS, group_size=2, teacher=teacher)
    kl = [train_on_rollout(actor, batching, **rollout)["distill/teacher_kl/mean"] for _ in range(4)]
    assert all(a > b > 0 for a, b in itertools.pairwise(kl)), kl
    assert kl[-1] < 0.7 * kl[0], kl
