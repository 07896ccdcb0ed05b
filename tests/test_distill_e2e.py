"""`train --advantage-estimator on_policy_distillation` end to end: a frozen teacher of its own architecture on the
actor's rank scores the student's sampled tokens, and the student moves towards it.

The student is the embedded Qwen2 (dense, tied embeddings); the teacher the embedded Qwen3-MoE (8 experts, q/k norm,
its own LM head), warm-started apart from it on the same task with the same tokenizer: two models that agree on the
answers often but differ token by token. The run attaches to the session's SGLang server (``external_engine``), so
it pays no server start-up of its own; its cost is the actor's and the teacher's build and two small rollouts.

That the teacher KL falls as the student trains is shown in packages/actor/tests/test_teacher.py, on fixed samples:
on fresh samples, a few rollouts of this size move it less than its rollout-to-rollout noise.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_modes_e2e import COMMON, _records, _train

pytestmark = pytest.mark.slow

NUM_ROLLOUT = 2


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, external_engine):
    from tidal.train.embedded_model import MOE_SPEC, ensure_embedded_model

    teacher = ensure_embedded_model(spec=MOE_SPEC)
    out = tmp_path_factory.mktemp("distill") / "run"
    args = [*COMMON, "--num-rollout", str(NUM_ROLLOUT),
            "--advantage-estimator", "on_policy_distillation", "--teacher-hf-checkpoint", str(teacher),
            "--calculate-per-token-loss",  # the loss is then the mean of -advantage x ratio over the response tokens
            "--rollout-external-engine-addrs", external_engine]  # fmt: skip
    code, log, leftovers = _train(args, out=out)
    assert code == 0, log[-6000:]
    plan = json.loads((out / "memory_plan.json").read_text())
    return _records(out), log, leftovers, plan


def test_each_token_is_trained_on_minus_its_reverse_kl_to_the_teacher(distill_run):
    """One step per rollout from the weights that sampled it (ratio 1): the policy loss, the mean over the rollout's
    response tokens of -advantage, is the mean reverse KL to the teacher the same pass measured, rollout by rollout:
    every token's advantage is teacher minus student log-prob, with no reward term."""
    records, log, leftovers, _ = distill_run
    assert [r["rollout"] for r in records] == list(range(NUM_ROLLOUT))
    for r in records:
        kl = r["distill/teacher_kl/mean"]
        assert kl > 0.05, r  # two different models: a real gap
        assert r["train/loss"] == pytest.approx(kl, abs=1e-4), r
        assert r["distill/teacher_kl/p10"] <= r["distill/teacher_kl/p50"] <= r["distill/teacher_kl/p90"]
        assert r["distill/teacher_kl/p90"] <= r["distill/teacher_kl/max"]
        assert r["time/teacher"] > 0
        assert r["rollout/logprob_abs_diff/mean"] < 1e-4  # the engine samples from the student the actor trains
    assert "teacher model from" in log
    assert not leftovers, leftovers


def test_the_memory_plan_counts_the_teachers_weights(distill_run):
    from tidal.actor import ModelShape
    from tidal.ckpt import read_hf_config_json
    from tidal.train.embedded_model import MOE_SPEC, embedded_model_path

    *_, plan = distill_run
    teacher = ModelShape.from_hf_config(read_hf_config_json(embedded_model_path(spec=MOE_SPEC)))
    assert plan["rows_gib"]["teacher model"] == round(teacher.num_params() * 4 / 2**30, 3)  # float32, one GPU
    assert plan["inputs"]["teacher"]["num_experts"] == MOE_SPEC.num_experts
