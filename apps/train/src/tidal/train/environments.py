"""Environments from other libraries (``--environment KIND:NAME``), run as agents through tidal's gateway.

An environment brings its own tasks and its own way of scoring them. tidal needs two things of it, the
:class:`Environment` protocol:

- ``rows()``: one row per task, ``{"prompt": [chat messages], "label": ..., "task": index}``; they become the run's
  prompt data (written once to a JSONL file in tidal's cache, read as ``--prompt-data`` is) and its held-out set;
- ``episode(base_url, api_key, row)``: run the row's task once, its model calls going to the OpenAI-compatible
  ``base_url`` (the episode's gateway session: tidal's engines sample every token, with log-probs, and the session
  keeps the trajectory), and return the episode's reward.

So an environment is an agent (``--agent-function-path``) that also supplies the data: ``--environment`` sets
``--prompt-data``, ``--eval-prompt-data`` and ``--agent-function-path`` (to :func:`episode`, which finds the
environment again from the row) and everything agents have (GRPO groups of episodes, failed episodes replaced,
partial rollout, evaluation, the failure logs) applies unchanged. A KIND is a loader in :data:`KINDS`, imported
only when named: ``verifiers`` (prime-rl's library, :mod:`tidal.train.verifiers_env`). A NeMo-Gym resource server
or an OpenEnv environment plugs in the same way: a class whose ``rows`` lists its tasks and whose ``episode``
drives one of them with an OpenAI client at ``base_url`` and returns the reward; ``verifiers`` 0.4 itself also
wraps both as tasksets (``verifiers.v1.tasksets.nemo_gym``, ``openenv``), which ``verifiers:`` then loads.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

FLAG = "--environment"
KINDS = {"verifiers": "tidal.train.verifiers_env:load"}
"""Each KIND of ``--environment KIND:NAME``: the ``module:function`` that loads ``NAME`` as an :class:`Environment`."""
AGENT = "tidal.train.environments:episode"
"""The agent function an ``--environment`` run uses: :func:`episode`."""
EXCLUDES = {
    "agent_function_path": "the environment runs its own episodes",
    "custom_generate_function_path": "the environment runs its own episodes",
    "custom_rm_path": "the environment's rubric scores each episode",
    "rm_type": "the environment's rubric scores each episode",
    "prompt_data": "the environment's tasks are the prompts",
    "eval_prompt_data": "the environment's tasks are the held-out set",
}
"""The options ``--environment`` refuses beside it (given on the command line or in ``--config``), and why."""


class RowKeys:
    """The keys of an environment's prompt rows."""

    PROMPT = "prompt"
    LABEL = "label"
    TASK = "task"
    ENVIRONMENT = "environment"


class EpisodeFailed(RuntimeError):
    """An environment's episode ended in an error (its run, a model call or its scoring); the group is replaced."""


class Environment(Protocol):
    """Tasks as prompt rows, and one scored episode of a row through an OpenAI-compatible endpoint."""

    def rows(self) -> list[dict[str, Any]]:
        """One row per task: ``prompt`` (chat messages), ``label`` and ``task`` (the task's index)."""
        ...

    async def episode(self, base_url: str, api_key: str, row: dict[str, Any]) -> float:
        """Run ``row``'s task once against the model at ``base_url``; the episode's reward.

        Raises:
            EpisodeFailed: the episode failed (counted by the run, its group replaced).
        """
        ...


def split_spec(spec: str) -> tuple[str, str]:
    """``(kind, name)`` of ``KIND:NAME``.

    Raises:
        ValueError: not ``KIND:NAME`` or an unknown KIND (one line naming --environment).
    """
    kind, sep, name = spec.partition(":")
    if not sep or not name or kind not in KINDS:
        raise ValueError(f"{FLAG} must look like 'KIND:NAME' with KIND one of {sorted(KINDS)}, got {spec!r}")
    return kind, name


def load_environment(spec: str) -> Environment:
    """The environment ``KIND:NAME`` (loaded once per process by its KIND's loader)."""
    from tidal.rollout import load_callable

    kind, name = split_spec(spec)
    return load_callable(KINDS[kind], flag=FLAG)(name)


async def episode(base_url: str, api_key: str, row: dict[str, Any]) -> float:
    """The agent function of an ``--environment`` run: the row's environment runs the row's task."""
    return await load_environment(row[RowKeys.ENVIRONMENT]).episode(base_url, api_key, row)


def environment_values(spec: str, given: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The options ``--environment spec`` sets: its rows as the prompt and held-out data, :func:`episode` as agent.

    ``given`` holds the options set on the command line or in ``--config``; ``values`` the merged ones (the
    recipe's too). An option the environment replaces is refused when ``given``, unless it holds what the
    environment sets (a run's own ``config.yaml`` does, so resuming with it works).

    Raises:
        ValueError: a malformed spec, an excluded option, or an environment that does not load (one line each).
    """
    split_spec(spec)
    for option, why in EXCLUDES.items():
        if given.get(option) is not None and not _set_by(spec, option, given[option]):
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{FLAG} and {flag} exclude each other: {why}; drop {flag}")
    keys = {"input_key": RowKeys.PROMPT, "label_key": RowKeys.LABEL}
    for option, key in keys.items():
        if given.get(option, key) != key:
            flag = "--" + option.replace("_", "-")
            raise ValueError(f"{FLAG} reads its own rows' {key!r} key, so {flag} cannot change it; drop {flag}")
    path = (str(rows_file(spec)),)  # loads the environment: its errors come before anything starts
    return {**values, **keys, "prompt_data": path, "eval_prompt_data": path, "agent_function_path": AGENT}


def _set_by(spec: str, option: str, value: Any) -> bool:
    """Whether ``value`` of ``option`` is what ``--environment spec`` sets (as a run's config.yaml records it)."""
    if option == "agent_function_path":
        return value == AGENT
    if option in ("prompt_data", "eval_prompt_data"):
        paths = [value] if isinstance(value, str) else list(value)
        return (
            len(paths) == 1
            and Path(paths[0]).parent == _cache_dir() / "environments"
            and (Path(paths[0]).name.startswith(_safe(spec) + "-"))
        )
    return False


def rows_file(spec: str) -> Path:
    """The environment's rows as a JSONL file in tidal's cache (``$TIDAL_CACHE/environments``), written once."""
    rows = [{**row, RowKeys.ENVIRONMENT: spec} for row in load_environment(spec).rows()]
    text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    path = _cache_dir() / "environments" / f"{_safe(spec)}-{digest}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(text)
        part.replace(path)  # atomic: a concurrent run reads the whole file or none
    return path


def _safe(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)


def _cache_dir() -> Path:
    if "TIDAL_CACHE" in os.environ:
        return Path(os.environ["TIDAL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tidal"
