"""The curves of a run, redrawn as a PNG after every rollout: reward, held-out accuracy, agreement, teacher KL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_AGREEMENT = (
    ("rollout/logprob_abs_diff/mean", "mean |Δ log-prob|"),
    ("rollout/logprob_abs_diff/max", "max |Δ log-prob|"),
    ("rollout/engine_actor_kl", "KL(engine || actor), k3"),
)
_TEACHER_KL = "distill/teacher_kl/"
_FLOOR = 1e-9  # a log scale needs > 0: exact agreement (fp32 serving) is drawn at the floor


def write_curves(
    path: Path,
    history: list[dict[str, Any]],
    *,
    eval_before: float | None = None,
    mismatch_threshold: float | None = None,
) -> Path:
    """Draw reward, held-out accuracy and, when recorded, the engine-actor agreement into ``path``; returns it.

    The top panel: mean reward per rollout and held-out accuracy (before RL at x=0). The next (runs with an
    actor and engines): the gap between the engine's and the actor's log-probs of the sampled tokens, on a log
    scale, with ``mismatch_threshold`` (``--mismatch-warn-threshold``) dashed. The last (runs with
    ``--teacher-hf-checkpoint``): the reverse KL to the teacher per token, its mean and its 10-90 % band.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    agreement = [r for r in history if _AGREEMENT[0][0] in r]
    teacher = [r for r in history if _TEACHER_KL + "mean" in r]
    panels = 1 + bool(agreement) + bool(teacher)
    fig, axes = plt.subplots(panels, 1, figsize=(6, 3.5 + 2.5 * (panels - 1)), dpi=120, squeeze=False)
    _rewards(axes[0][0], history, eval_before)
    if agreement:
        _agreement(axes[1][0], agreement, mismatch_threshold)
    if teacher:
        _teacher_kl(axes[-1][0], teacher)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)  # a viewer never sees a half-written file
    return path


def _rewards(ax, history: list[dict[str, Any]], eval_before: float | None) -> None:
    rollouts = [r["rollout"] + 1 for r in history]
    ax.plot(rollouts, [r["rollout/reward/mean"] for r in history], marker=".", label="train reward (mean)")
    keys = _eval_keys(history) or ["eval/accuracy"]
    for index, key in enumerate(keys):
        evals = [(0, eval_before)] if eval_before is not None and index == 0 else []
        evals += [(r["rollout"] + 1, r[key]) for r in history if key in r]
        if evals:
            xs, ys = zip(*evals, strict=True)
            label = "held-out accuracy" if key == "eval/accuracy" else key.removeprefix("eval/")
            ax.plot(xs, ys, marker="o", linestyle="--" if "/pass@" in key else "-", label=label)
    ax.set_xlabel("rollout")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _eval_keys(history: list[dict[str, Any]]) -> list[str]:
    """Each eval set's mean@k and its largest pass@k (k > 1), first set first (``eval/<name>/...`` keys)."""
    keys: dict[str, None] = {}
    for record in history:
        keys |= dict.fromkeys(k for k in record if k.startswith("eval/") and k.count("/") == 2)
    chosen = []
    for name in dict.fromkeys(k.split("/")[1] for k in keys):
        mine = [k for k in keys if k.split("/")[1] == name]
        chosen += [k for k in mine if "/mean@" in k]
        passes = sorted((int(k.rsplit("@", 1)[1]), k) for k in mine if "/pass@" in k)
        if passes and passes[-1][0] > 1:
            chosen.append(passes[-1][1])
    return chosen


def _agreement(ax, records: list[dict[str, Any]], threshold: float | None) -> None:
    rollouts = [r["rollout"] + 1 for r in records]
    for key, label in _AGREEMENT:
        ax.plot(rollouts, [max(float(r.get(key, 0.0)), _FLOOR) for r in records], marker=".", label=label)
    if threshold:
        ax.axhline(
            threshold, color="grey", linestyle="--", linewidth=1, label="--mismatch-warn-threshold (on the mean)"
        )
    ax.set_yscale("log")
    ax.set_xlabel("rollout")
    ax.set_ylabel("nats")
    ax.set_title("engine vs actor log-probs of the sampled tokens", fontsize="small")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def _teacher_kl(ax, records: list[dict[str, Any]]) -> None:
    rollouts = [r["rollout"] + 1 for r in records]
    ax.plot(rollouts, [r[_TEACHER_KL + "mean"] for r in records], marker=".", label="mean")
    low, high = _TEACHER_KL + "p10", _TEACHER_KL + "p90"
    if all(low in r and high in r for r in records):
        ax.fill_between(rollouts, [r[low] for r in records], [r[high] for r in records], alpha=0.25, label="p10-p90")
    ax.set_xlabel("rollout")
    ax.set_ylabel("nats per token")
    ax.set_title("reverse KL to the teacher on the sampled tokens", fontsize="small")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
