"""The distillation teacher (``--teacher-hf-checkpoint``) checked against the run before any process starts.

The teacher scores the student's sampled token ids, so both must read ids the same way: the same vocabulary
(each token's id) and the same special tokens. What the teacher path has not been tested with is refused here in
one line naming both flags: a parallel layout beyond one GPU per model replica (tensor, pipeline, context or expert
parallel), samples older than the actor (``--max-staleness``, ``--partial-rollout``, ``--use-tis``), routing replay,
and a KL term to the reference model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""tokenizer_config.json's special tokens that must agree."""


def check_teacher(actor, parallel, train, rollout, hf: str) -> None:
    """``--teacher-hf-checkpoint`` (an HF model folder, checked apart) has the student's tokenizer, in a tested run."""
    teacher = actor.teacher_hf_checkpoint
    if teacher is None:
        return
    refused = _refused_with(actor, parallel, train, rollout)
    if refused:
        raise ValueError(
            f"--teacher-hf-checkpoint with {refused} is not supported yet (distillation is tested without it): "
            "drop one of them"
        )
    if (Path(hf) / "config.json").is_file():  # the embedded student is built at start: compared once it exists
        check_same_tokenizer(hf, teacher)


def _refused_with(actor, parallel, train, rollout) -> str | None:
    """The first given option the teacher path refuses, as the user wrote it; None when there is none."""
    options = (
        ("--tensor-model-parallel-size", parallel and parallel.tensor_model_parallel_size, 1),
        ("--pipeline-model-parallel-size", parallel and parallel.pipeline_model_parallel_size, 1),
        ("--context-parallel-size", parallel and parallel.context_parallel_size, 1),
        ("--expert-model-parallel-size", parallel and parallel.expert_model_parallel_size, 1),
        ("--max-staleness", train and train.max_staleness, 0),
    )
    for flag, value, alone in options:
        if value and value != alone:
            return f"{flag} {value}"
    switches = (
        ("--partial-rollout", rollout is not None and rollout.partial_rollout),
        ("--use-tis", bool(actor.use_tis)),
        ("--use-rollout-routing-replay", actor.use_rollout_routing_replay),
        ("--use-kl-loss", actor.use_kl_loss),
        (f"--kl-coef {actor.kl_coef}", actor.kl_coef > 0),
    )
    return next((flag for flag, given in switches if given), None)


def check_same_tokenizer(student: str, teacher: str) -> None:
    """The teacher's vocabulary and special tokens are the student's, else one line saying what differs."""
    mine, theirs = tokenizer_identity(student), tokenizer_identity(teacher)
    keys = [*mine, *(key for key in theirs if key not in mine)]
    differs = next((key for key in keys if mine.get(key) != theirs.get(key)), None)
    if differs is None:
        return
    raise ValueError(
        f"--teacher-hf-checkpoint {teacher} has another tokenizer than --hf-checkpoint {student} (its {differs} "
        "differ): the teacher scores the student's token ids, so both need one vocabulary; pick a teacher of the "
        "student's family (e.g. a larger Qwen3 for a Qwen3 student), or fine-tune the student on the teacher's "
        "outputs first (SFT), which needs no shared vocabulary"
    )


def tokenizer_identity(folder: str) -> dict[str, Any]:
    """What decides a token id's meaning in an HF folder: the vocabulary, the added tokens and the special tokens."""
    root = Path(folder)
    out: dict[str, Any] = {}
    fast = root / "tokenizer.json"
    if fast.is_file():
        data = _json(fast)
        model = data.get("model") or {}
        out["vocabulary"] = model.get("vocab")
        out["merges"] = model.get("merges")
        out["added tokens"] = sorted(
            (t.get("id"), t.get("content"), bool(t.get("special"))) for t in data.get("added_tokens") or ()
        )
    else:  # a slow tokenizer's files, compared byte for byte
        for name in ("vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json"):
            if (root / name).is_file():
                out[name] = (root / name).read_bytes()
    config = root / "tokenizer_config.json"
    specials = _json(config) if config.is_file() else {}
    for key in SPECIAL_KEYS:
        value = specials.get(key)
        out[f"special tokens ({key})"] = value.get("content") if isinstance(value, dict) else value
    return out


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}); save the tokenizer again (save_pretrained)") from e
