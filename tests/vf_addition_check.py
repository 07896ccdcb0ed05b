"""A multi-turn ``verifiers`` environment written with verifiers itself, for the `train --environment` tests.

The addition tasks of :mod:`vf_addition`, played in two turns by the environment's own harness (an OpenAI client
talking to the endpoint verifiers hands it): the model answers, the user says ``check``, the model answers again.
The rubric scores the final answer: 1.0 for the exact sum.
"""

import openai
import verifiers.v1 as vf
from vf_addition import AdditionData, AdditionTaskset

FEEDBACK = "check"
MAX_TOKENS = 6


class CheckedAdditionTask(vf.Task[AdditionData]):
    """The rubric: the final answer is the exact sum."""

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class CheckedAdditionTaskset(vf.Taskset[CheckedAdditionTask, vf.TasksetConfig]):
    """The sums of :class:`vf_addition.AdditionTaskset`, each asked twice."""

    def load(self) -> list[CheckedAdditionTask]:
        tasks = AdditionTaskset(self.config).load()
        return [CheckedAdditionTask(t.data, self.config.task) for t in tasks]


class CheckHarness(vf.Harness[vf.HarnessConfig]):
    """Two model calls on one conversation: the answer, then the answer again after the user's ``check``."""

    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            messages = [{"role": "user", "content": data.prompt}]
            first = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=MAX_TOKENS)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}]
            messages += [{"role": "user", "content": FEEDBACK}]
            await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=MAX_TOKENS)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CheckHarness", "CheckedAdditionTaskset"]
