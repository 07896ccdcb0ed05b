"""A ``verifiers`` environment (prime-rl's, ``verifiers.v1``) run as it is, through tidal's agent gateway.

``--environment verifiers:NAME`` names a taskset as ``vf-eval NAME`` does (an installed package or an importable
module exporting its ``Taskset`` subclass, and optionally its ``Env`` or ``Harness``; ``owner/name@version`` Hub ids
resolve to the installed ``name``). The environment is loaded with ``verifiers.load_environment``, with its own env
class and its taskset's default harness; only the runtime is tidal's choice: the ``subprocess`` runtime, so the
harness runs on this machine and its model calls reach the gateway on localhost (no tunnel, no sandbox service).

Each of the taskset's tasks is one prompt row. An episode is ``Env.run_episode`` with a model context whose OpenAI
client points at the episode's gateway session: every model call of the harness (verifiers' interception server
forwards them) is sampled by tidal's engines, token in and token out, and the session keeps the trajectory, which a
multi-turn conversation extends. The episode's reward is its rubric's: the weighted sum of the ``@vf.reward``
functions of the trainable agent's trace (the mean over trainable traces when an env runs several).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from tidal.train.environments import EpisodeFailed, RowKeys

logger = logging.getLogger(__name__)

KIND = "verifiers"
INSTALL = "uv add 'tidal-train[environments]' (or pip install verifiers)"
_KEY_VAR = "TIDAL_VERIFIERS_API_KEY"
"""The environment variable verifiers' client reads the gateway's key from (its configs name a variable, not a key)."""


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ValueError(f"--environment {KIND}:...: the verifiers package is not installed: {INSTALL}") from e
    return vf


class VerifiersEnvironment:
    """One ``verifiers.v1`` environment: its tasks as prompt rows, and one episode per call of :meth:`episode`."""

    def __init__(self, name: str) -> None:
        """Load the environment ``name`` (a taskset id) with the local subprocess runtime.

        Raises:
            ValueError: verifiers is missing, or ``name`` does not load (one line naming --environment).
        """
        vf = _vf()
        self.name = name
        try:
            config = vf.resolve_env_config({"taskset": {"id": name}, "agent": {"runtime": {"type": "subprocess"}}})
            self.env = vf.load_environment(config)
            self.tasks = list(self.env.taskset)
        except Exception as e:  # the environment's own code: anything may be raised
            raise ValueError(f"--environment {KIND}:{name}: loading it failed: {type(e).__name__}: {e}") from e
        if not self.tasks:
            raise ValueError(f"--environment {KIND}:{name}: its taskset has no tasks")

    def rows(self) -> list[dict[str, Any]]:
        """One row per task, in the taskset's order: the prompt as chat messages, the task's id as the label."""
        rows = []
        for index, task in enumerate(self.tasks):
            data = task.data
            messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            if isinstance(data.prompt, str):
                messages.append({"role": "user", "content": data.prompt})
            else:
                messages += [_plain_message(m) for m in data.prompt or ()]
            if not messages:
                raise ValueError(f"--environment {KIND}:{self.name}: task {index} has no prompt (a user-opened task)")
            label = data.id or data.name or str(index)
            rows.append({RowKeys.PROMPT: messages, RowKeys.LABEL: label, RowKeys.TASK: index})
        return rows

    async def episode(self, base_url: str, api_key: str, row: dict[str, Any]) -> float:
        """Run the row's task once with the model behind ``base_url``; its rubric's reward.

        Raises:
            EpisodeFailed: the episode failed (an error of the harness, a model call or a reward function).
        """
        vf = _vf()
        from verifiers.v1.clients import EvalClientConfig

        os.environ[_KEY_VAR] = api_key  # one key for the whole job: every episode sets the same value
        client = EvalClientConfig(base_url=base_url, api_key_var=_KEY_VAR)
        context = vf.ModelContext(model="tidal", client=client)
        task = self.tasks[int(row[RowKeys.TASK])]
        async with self.env.serving():  # its interception server lives on this episode's event loop
            episode = await self.env.run_episode(task, context)
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.ok or not traces:
            first = errors[0] if errors else None
            why = f"{first.type}: {first.message}" if first else f"stopped by {episode.traces[-1].stop_condition!r}"
            raise EpisodeFailed(f"{KIND}:{self.name} episode of task {row[RowKeys.TASK]} failed: {why}")
        return sum(t.reward for t in traces) / len(traces)


def _plain_message(message: Any) -> dict[str, Any]:
    """A verifiers message as a plain chat message (text content only, as the chat template renders it)."""
    raw = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    content = raw.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {"role": raw["role"], "content": content or ""}


@functools.cache
def load(name: str) -> VerifiersEnvironment:
    """The environment ``name``, loaded once per process (each episode reuses its tasks and harness)."""
    return VerifiersEnvironment(name)
