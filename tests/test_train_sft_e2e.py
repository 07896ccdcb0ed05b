"""`train --stage sft` end to end on the real Ray and Megatron-core actor, with no SGLang engine.

The run (the session fixture ``sft_run``, tests/conftest.py) trains the embedded model for 2 epochs on 192 rows of
the shipped addition task, evaluates the NLL of 64 of them, checkpoints every 4 steps and writes --save-hf. The RL
run that starts from its weights is the --debug-train-only run of test_train_modes_e2e.py, whose --hf-checkpoint is
this run's --save-hf folder (its test asserts that its actor read them).
"""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 12  # 192 rows / 32 per step, 2 epochs
LOSS_TOKENS_PER_ROW = 4  # the three answer digits and EOS: no prompt token counts


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_the_nll_of_its_rows_counting_response_tokens_only(sft_run):
    out, _, log = sft_run
    records = _records(out)
    assert [r["rollout"] for r in records] == list(range(STEPS))
    assert [r["sft/epoch"] for r in records] == [0] * 6 + [1] * 6
    assert all(r["train/num_loss_tokens"] == 32 * LOSS_TOKENS_PER_ROW for r in records), records[0]
    assert all(r["train/lr"] == 1e-3 and r["batching/logprob_num_micro_batches"] == 0 for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_nll_after"] < summary["eval_nll_before"] - 0.05, summary
    assert [r["eval/nll"] for r in records if "eval/nll" in r][-1] == pytest.approx(summary["eval_nll_after"])
    assert [r["rollout"] for r in records if "eval/nll" in r] == [5, 11]  # --eval-interval 6 steps
    losses = [r["train/sft_loss"] for r in records]
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert f"SFT step {STEPS}/{STEPS} (epoch 2/2)" in log and "steps/s, ETA" in log
    assert (out / "curves.png").stat().st_size > 0


def test_sft_checkpoints_every_save_interval_and_writes_the_hf_folder_without_an_engine(sft_run):
    out, _, log = sft_run
    ckpt = out / "ckpt"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000012"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    hf = out / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in hf.iterdir()}
    assert not list((out / "logs").glob("sglang_*")) and "no engine" in log
    assert json.loads((out / "summary.json").read_text())["hf_dirs"] == [str(hf)]
