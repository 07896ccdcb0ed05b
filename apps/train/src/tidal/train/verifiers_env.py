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

import asyncio
import contextlib
import functools
import logging
import os
import threading
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
            self.config = vf.resolve_env_config({"taskset": {"id": name}, "agent": {"runtime": {"type": "subprocess"}}})
            self.tasks = list(vf.load_environment(self.config).taskset)
        except Exception as e:  # the environment's own code: anything may be raised
            raise ValueError(f"--environment {KIND}:{name}: loading it failed: {type(e).__name__}: {e}") from e
        if not self.tasks:
            raise ValueError(f"--environment {KIND}:{name}: its taskset has no tasks")
        self._served: dict[asyncio.AbstractEventLoop, _Serving] = {}
        self._lock = threading.Lock()

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
        async with self._serving() as env:
            episode = await env.run_episode(task, context)
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.ok or not traces:
            first = errors[0] if errors else None
            stopped = f"stopped by {episode.traces[-1].stop_condition!r}" if episode.traces else "no agent of it ran"
            why = f"{first.type}: {first.message}" if first else stopped
            raise EpisodeFailed(f"{KIND}:{self.name} episode of task {row[RowKeys.TASK]} failed: {why}")
        return sum(t.reward for t in traces) / len(traces)

    @contextlib.asynccontextmanager
    async def _serving(self):
        """The environment serving on the running event loop, shared by the episodes that run on it.

        A verifiers ``Env`` keeps its serving resources (the interception server, shared tool servers) on itself and
        binds them to one event loop; tidal runs episodes on several loops (one per round of a rollout, evaluation's,
        a partial rollout's thread). So each loop gets an ``Env`` of its own (built from the same config; the tasks
        are loaded once), served while any episode on that loop runs and stopped after the last one.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            serving = self._served.get(loop)
            if serving is None:
                serving = self._served[loop] = _Serving(_vf().load_environment(self.config), loop)
            serving.users += 1
        try:
            await asyncio.shield(serving.ready)
            yield serving.env
        finally:
            with self._lock:
                serving.users -= 1
                last = serving.users == 0
                if last:
                    del self._served[loop]
            if last:
                await serving.stop()


class _Serving:
    """One ``Env``'s ``serving()`` context on one event loop, held open by a task of its own until :meth:`stop`.

    One task enters and leaves the context (its servers may hold task-bound scopes); episodes wait on ``ready``.
    """

    def __init__(self, env: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.env, self.users = env, 0
        self.ready: asyncio.Future = loop.create_future()
        self._leave = asyncio.Event()
        self._task = loop.create_task(self._hold())

    async def _hold(self) -> None:
        try:
            async with self.env.serving():
                self.ready.set_result(None)
                await self._leave.wait()
        except Exception as e:
            if not self.ready.done():
                self.ready.set_exception(e)  # the episodes waiting on it fail with the cause
            else:
                logger.warning("stopping the %s environment's servers failed: %s", KIND, e)

    async def stop(self) -> None:
        """Leave the serving context (the last episode on this loop ended)."""
        self._leave.set()
        await self._task


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
