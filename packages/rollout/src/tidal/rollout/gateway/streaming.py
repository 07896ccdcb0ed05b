"""A streamed chat answer (``stream: true``): content deltas sent as the engine samples, the rest at the end.

The call itself is :meth:`Gateway.complete <tidal.rollout.gateway.server.Gateway.complete>`, as without streaming
(same resumes after aborts, same recording), with a callback that sees every token sampled so far.
:class:`ContentStream` turns those tokens into the text that is safe to send already: a prefix of the content the
finished answer will have, whatever tokens come next. At the end the rest of the content, the tool calls and the
finish reason follow, from the same :class:`~.chat.Completion` a non-streamed call answers.

The call runs as its own task: a client that disconnects mid-stream stops receiving, while the generation goes
on and is recorded whole (as a non-streamed call whose client left).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tidal.rollout.gateway.chat import GatewayError, chunk, sse

if TYPE_CHECKING:
    from tidal.rollout.gateway.request import ChatRequest
    from tidal.rollout.gateway.server import Gateway, Session
    from tidal.rollout.gateway.tool_calls import ToolCallFormat

logger = logging.getLogger(__name__)

_END = object()


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers`` (without being all of it)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class ContentStream:
    """What of an answer in the making may be sent as content: a prefix of the finished answer's content.

    The sampled ids so far are decoded whole (a token may end mid-character: a trailing U+FFFD waits for the rest
    of its bytes), a trailing stop token is left out, the text is cut at the first stop string, and an end that
    may begin a stop string waits. With tools, nothing from where a call of the tool-call format may begin is
    content (:meth:`~.tool_calls.ToolCallFormat.content_prefix`: its start marker on, or an end that may begin
    it); trailing whitespace waits (content before a tool call is stripped), and so does all of an answer
    that begins with whitespace (without a tool call it is kept, with one it is stripped).
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        stop_token_ids: Sequence[int],
        request: ChatRequest,
        tool_format: ToolCallFormat | None = None,
    ):
        """``decode`` turns ids into text (special tokens kept), as the finished answer is decoded.

        ``tool_format`` reads the calls of a request with tools.
        """
        self._decode = decode
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = list(request.stop)
        self._tools = tool_format if request.parse_tools else None
        self.sent = ""
        """The content sent so far."""

    def safe_text(self, ids: Sequence[int]) -> str:
        """The content that ``ids`` (every token sampled so far) make certain."""
        ids = list(ids[:-1] if ids and ids[-1] in self._stop_ids else ids)
        text = self._decode(ids).rstrip("\ufffd")
        cuts = [text.index(stop) for stop in self._stops if stop in text]
        text = text[: min(cuts)] if cuts else text[: len(text) - partial_suffix(text, self._stops)]
        if self._tools is not None:
            text = self._tools.content_prefix(text)
            text = "" if text[:1].isspace() else text.rstrip()
        return text

    def update(self, ids: Sequence[int]) -> str:
        """The content newly made certain by ``ids`` (empty when none); it counts as sent."""
        text = self.safe_text(ids)
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def rest(self, content: str | None) -> str:
        """What of the finished answer's ``content`` is not sent yet."""
        content = content or ""
        if not content.startswith(self.sent):
            logger.warning("gateway: streamed content %r is not a prefix of the answer %r", self.sent, content)
            return ""
        return content[len(self.sent) :]


@dataclasses.dataclass(frozen=True, slots=True)
class _Head:
    id: str
    created: int
    model: str


class StreamedCall:
    """One ``stream: true`` call of a session: run with :meth:`start`, then iterate the events it returns."""

    def __init__(self, gateway: Gateway, session: Session, request: ChatRequest) -> None:
        """The call ``request`` of ``session`` on ``gateway``; nothing runs until :meth:`start`."""
        self.gateway, self.session, self.request = gateway, session, request
        self.head = _Head(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), request.model)
        self.content = ContentStream(
            lambda ids: gateway.tokenizer.decode(ids, skip_special_tokens=False),
            stop_token_ids=gateway.stop_token_ids,
            request=request,
            tool_format=gateway.tool_format,
        )
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._started = False

    async def start(self) -> AsyncIterator[str]:
        """Start the call; once the engine has answered, the server-sent events of the answer.

        Raises:
            GatewayError: What the call raised before the engine sent anything (a refusal: the usual JSON error).
        """
        loop = asyncio.get_running_loop()
        self.gateway.keep_running(asyncio.create_task(self._run(loop)))
        first = await self._queue.get()
        if isinstance(first, GatewayError):
            raise first
        return self._events(first)

    def _put(self, loop: asyncio.AbstractEventLoop, item: Any) -> None:
        loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _begin(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._started:
            self._started = True
            self._put(loop, chunk(self.head, {"role": "assistant", "content": ""}))

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        def on_tokens(ids: list[int]) -> None:  # in a gateway thread, once per engine chunk
            self._begin(loop)
            delta = self.content.update(ids)
            if delta:
                self._put(loop, chunk(self.head, {"content": delta}))

        try:
            completion = await self.gateway.complete(self.session, self.request, on_tokens=on_tokens)
        except GatewayError as e:
            self._put(loop, e)
            return
        except Exception as e:  # a bug: answered as the app answers one (500), logged with its traceback
            logger.exception("gateway: a streamed call of session %s failed", self.session.id)
            self._put(loop, GatewayError(500, f"internal gateway error: {type(e).__name__}: {e}", kind="server_error"))
            return
        self._begin(loop)
        completion = dataclasses.replace(completion, id=self.head.id, created=self.head.created)
        rest = self.content.rest(completion.content)
        for item in completion.end_chunks(include_usage=self.request.include_usage, content=rest):
            self._put(loop, item)
        self._put(loop, _END)

    async def _events(self, first: dict[str, Any]) -> AsyncIterator[str]:
        item = first
        while item is not _END:
            if isinstance(item, GatewayError):  # after the answer began: an error event (the openai client raises)
                yield sse(item.body())
                break
            yield sse(item)
            item = await self._queue.get()
        yield sse("[DONE]")
