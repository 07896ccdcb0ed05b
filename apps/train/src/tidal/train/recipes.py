"""Recipes: named functions returning a job's options on top of the configs' own defaults.

A recipe is a function registered by name (as torchtitan's config registry does) that returns
``{field name: value}`` for the options it sets; every other option keeps its config field's default. A job
starts from one recipe, then a ``--config`` file, then the flags: each overrides the one before.

Which recipe: ``--recipe NAME``, else :data:`DEFAULT_RECIPE` (``embedded``: ``uv run train`` alone runs it),
whatever other flags are given. ``train --recipe list`` (or ``--list-recipes``) lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Recipe = Callable[[], dict[str, Any]]

RECIPES: dict[str, Recipe] = {}
"""Every recipe by name, in the order registered."""


def register(fn: Recipe) -> Recipe:
    """Register ``fn`` as the recipe named like the function (``embedded_moe`` -> ``--recipe embedded-moe``)."""
    RECIPES[fn.__name__.replace("_", "-")] = fn
    return fn


AUTO_MEMORY = {"max_tokens_per_gpu": "auto", "log_probs_max_tokens_per_gpu": "auto", "recompute_activations": "auto"}
"""What the recipes leave to the memory plan (``auto``)."""


@register
def base() -> dict[str, Any]:
    """The configs' own defaults (slime's): give --prompt-data and --rollout-batch-size (and --hf-checkpoint)."""
    # On a GPU the memory plan picks the token budgets and the layers to recompute (the fastest configuration that
    # fits, tidal.train.auto_memory); a value given on the command line or in --config is kept.
    return dict(AUTO_MEMORY)


@register
def embedded() -> dict[str, Any]:
    """The embedded tiny Qwen2 on the shipped fixed-width addition task, GRPO on one co-located (logical) GPU."""
    from tidal.train.task_data import EVAL_FILE, TRAIN_FILE, shipped_path

    # Measured in bench/rl_recipe_grid.py and reproduced on the real stack (bench/RESULTS.md): one optimizer step
    # per rollout of 64 prompts x 8 samples; sizes that suit the ~1M-parameter model on a 2-core CPU. 110 rollouts
    # at lr 4e-4 reach +25 points of held-out accuracy by rollout 70-90 and end the run within about 5 minutes on
    # such a CPU (bench/RESULTS.md has the runs, and the longer, slower-rate schedules it was chosen over).
    return {
        "prompt_data": (str(shipped_path(TRAIN_FILE)),),
        "eval_prompt_data": (str(shipped_path(EVAL_FILE)),),
        "num_rollout": 110,
        "rollout_batch_size": 64,
        "n_samples_per_prompt": 8,
        "rollout_max_response_len": 6,
        "rollout_temperature": 1.0,
        "rm_type": "numeric_match",
        "lr": 4e-4,
        "use_dynamic_batch_size": True,
        **AUTO_MEMORY,  # on a CPU: no recompute and 8192 tokens, the budget measured here
        "eval_interval": 10,
        "num_eval_prompts": 256,
        "colocate": True,  # one CPU box: actor and engine share the (logical) GPU
    }


@register
def embedded_moe() -> dict[str, Any]:
    """The embedded recipe on a tiny Qwen3-MoE (8 experts, top-2), with the load-balancing loss on."""
    from tidal.train.embedded_model import MOE_SPEC, embedded_model_path

    return embedded() | {"hf_checkpoint": str(embedded_model_path(spec=MOE_SPEC)), "moe_aux_loss_coeff": 1e-2}


@register
def embedded_agent() -> dict[str, Any]:
    """A two-turn agent (openai client; tidal.train.agent_task) on the embedded chat model, through the gateway."""
    from tidal.train.agent_task import MAX_TOKENS
    from tidal.train.embedded_model import CHAT_SPEC, embedded_model_path

    # The agent must ask for the hidden operand in its first turn and add in its second; the held-out evaluation
    # runs its episodes greedily. The embedded recipe's sizes and lr; 15 rollouts (each ~2 calls per episode, so
    # several times a plain rollout's cost) gain 20+ points within 6 minutes on a 2-core CPU (bench/RESULTS.md).
    return embedded() | {
        "hf_checkpoint": str(embedded_model_path(spec=CHAT_SPEC)),
        "agent_function_path": "tidal.train.agent_task:run",
        "rollout_max_response_len": MAX_TOKENS,
        "num_rollout": 15,
        "eval_interval": 5,
    }


@register
def embedded_math() -> dict[str, Any]:
    """The embedded chat model on chat problems stored as Parquet (verl's layout), rewarded by math-verify."""
    from tidal.train.agent_task import MAX_TOKENS
    from tidal.train.embedded_model import CHAT_SPEC, embedded_model_path
    from tidal.train.task_data import CHAT_EVAL_FILE, CHAT_TRAIN_FILE, shipped_path

    # The shipped addition problems as a data set is stored: each row's "prompt" holds chat messages (rendered with
    # the model's template), its answer sits in "reward_model.ground_truth", and --rm-type math grades the sum.
    return embedded() | {
        "hf_checkpoint": str(embedded_model_path(spec=CHAT_SPEC)),
        "prompt_data": (str(shipped_path(CHAT_TRAIN_FILE)),),
        "eval_prompt_data": (str(shipped_path(CHAT_EVAL_FILE)),),
        "label_key": "reward_model.ground_truth",
        "rm_type": "math",
        "rollout_max_response_len": MAX_TOKENS,
        "num_rollout": 30,
    }


DEFAULT_RECIPE = "embedded"
"""The recipe of a job without ``--recipe``."""


def recipe_for(name: str | None, given: dict[str, Any]) -> str:
    """The recipe a job starts from: ``name`` (its ``--recipe``), else :data:`DEFAULT_RECIPE`.

    Raises:
        ValueError: ``--hf-checkpoint`` without ``--recipe``: the embedded recipe's values (lr 4e-4, the shipped
            task) suit only the built-in model, so a user's model says which recipe it wants.
    """
    if name is not None:
        return name
    if given.get("hf_checkpoint"):
        raise ValueError(
            "--hf-checkpoint is given without --recipe: add --recipe base (the configs' own defaults, slime's, e.g. "
            "--lr 1e-6) for your model; the default recipe, embedded, sets values for the built-in tiny model "
            "(--lr 4e-4, the shipped addition task), so it is not picked for you (--recipe embedded to use them)"
        )
    return DEFAULT_RECIPE


def recipe_options(name: str) -> dict[str, Any]:
    """The options recipe ``name`` sets.

    Raises:
        ValueError: no recipe has that name (the message lists them).
    """
    if name not in RECIPES:
        raise ValueError(f"--recipe {name!r} is not a recipe; pick one of {sorted(RECIPES)} (`train --recipe list`)")
    return RECIPES[name]()


def describe() -> str:
    """One line per recipe: its name and what it is (``train --recipe list``)."""
    width = max(map(len, RECIPES))
    lines = []
    for name, fn in RECIPES.items():
        summary = (fn.__doc__ or "").strip().splitlines()[0]
        lines.append(f"{name:<{width}}  {summary}")
    return "\n".join(lines)
