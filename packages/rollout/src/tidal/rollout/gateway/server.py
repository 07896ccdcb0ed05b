"""The agent gateway: an OpenAI chat-completions server whose every call is token-in/token-out on SGLang.

``Gateway(engines, tokenizer, api_key=...)`` serves, on one port, a base URL per session
(``http://HOST:PORT/s/<session>/v1``) that the official ``openai`` client uses unmodified:
``POST /chat/completions`` (streamed token by token or not) and ``GET /models``. Each call renders its messages
with the tokenizer's chat template, sends token ids to SGLang's ``/generate`` (never SGLang's own OpenAI server,
which re-tokenizes), and records the exact ids and log-probs in the session's :class:`~.sessions.Episode`. Every
request needs ``Authorization: Bearer <api_key>``. Bad input gets the OpenAI API's 4xx JSON error, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from tidal.rollout.client import TOP_LOGPROBS_PARAM
from tidal.rollout.errors import RolloutError
from tidal.rollout.gateway.chat import Completion, GatewayError, token_logprobs
from tidal.rollout.gateway.sessions import Episode, Turn
from tidal.rollout.gateway.tool_calls import ToolCallFormat, tool_sampling_params
from tidal.rollout.tool_call_parsers import parser_for_template

if TYPE_CHECKING:
    from tidal.rollout.gateway.request import ChatRequest
    from tidal.rollout.partial_rollout import UpdateGate

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0
_MAX_RESUMES = 8  # an answer aborted more often than this (weight updates in a row) is a 503: the client retries


class Generator(Protocol):
    """What the gateway generates with: an SGLang client, engine or router (``SGLangClient.generate``).

    One that also has ``generate_stream`` (as ``SGLangClient`` does) streams the answers of ``stream: true`` calls
    token by token; without it they are sent once generated.
    """

    url: str

    def generate(self, input_ids: Sequence[Sequence[int]], sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        """One answer per prompt: ``output_ids``, ``output_log_probs``, ``finish_reason``, ``weight_version``."""
        ...


class Session:
    """One agent episode's state on the gateway: its tokens and the engine that serves it."""

    def __init__(self, session_id: str, episode: Episode, engine: Generator) -> None:
        """A session ``session_id`` recording into ``episode``, generating on ``engine``."""
        self.id, self.episode, self.engine = session_id, episode, engine
        self.calls = 0
        self.engine_urls: list[str] = []
        """The engine that served each call, in order."""
        self.resumes = 0
        """Generations resumed after an abort (a weight update cut them)."""


def pick_engine(session_id: str, engines: Sequence[Generator]) -> Generator:
    """The engine of a session: rendezvous (highest-random-weight) hashing of the session id over engine URLs.

    The same session always lands on the same engine (its prefix cache is reused), and removing one engine
    moves only that engine's sessions.
    """
    return max(engines, key=lambda e: hashlib.sha256(f"{session_id}@{e.url}".encode()).digest())


class Gateway:
    """OpenAI-compatible, token-in/token-out chat server over SGLang engines, with one base URL per session."""

    def __init__(
        self,
        engines: Generator | Sequence[Generator],
        tokenizer: Any,
        *,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = "tidal",
        context_length: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_concurrent_calls: int = 256,
        default_max_tokens: int | None = None,
        update_gate: UpdateGate | None = None,
        sampling_override: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
        extra_stop_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        """Describe the gateway; nothing listens until :meth:`start`.

        Args:
            engines: Where to generate: one, or several (each session is pinned to one by :func:`pick_engine`).
            tokenizer: A Hugging Face tokenizer with a chat template (the model's).
            api_key: The key every request must carry (a random one when None; read :attr:`api_key`).
            host: Address to listen on.
            port: Port (0: a free one; read :attr:`port` after :meth:`start`).
            model_name: What ``GET /models`` lists (any ``model`` is accepted in requests).
            context_length: Longest prompt + answer in tokens (None: the tokenizer's ``model_max_length``
                when it is a real limit, else unchecked here and left to the engine).
            stop_token_ids: Tokens that end an answer (None: the tokenizer's EOS and ``<|im_end|>`` if known).
            max_concurrent_calls: Engine calls in flight at once (threads waiting on ``/generate``).
            default_max_tokens: Answer length of a request that gives no ``max_tokens`` (None: up to the context).
            update_gate: The weight updates that abort the engines' requests (``--max-staleness``): a call they cut
                waits for the update before it resumes, so its next tokens come from the new weights (None: it
                resumes at once).
            sampling_override: SGLang sampling parameters forced on every call whatever the request asks, e.g.
                ``{"temperature": 0.0}`` for an evaluation's greedy episodes; the first call that asks for another
                ``temperature`` or ``top_p`` is logged (a warning, once per gateway).
            tool_call_parser: SGLang's name of the parser that reads the model's tool calls (``hermes``,
                ``llama3``, ``qwen3_coder``, ...; see :mod:`.tool_calls`); None: the one the chat template's tool-call
                markers call for, and calls with tools are refused when it has none.
            extra_stop_token_ids: Tokens that also end every answer, beside ``stop_token_ids`` (or its default).
            stop: Strings that also end every answer, beside each request's own ``stop``.
        """
        engine_list = [engines] if hasattr(engines, "generate") else list(engines)  # type: ignore[arg-type]
        if not engine_list:
            raise ValueError("Gateway needs at least one engine")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the gateway's tokenizer has no chat_template: give the model's tokenizer one")
        self.engines: list[Generator] = engine_list
        self.tokenizer = tokenizer
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.host, self.port, self.model_name = host, port, model_name
        limit = getattr(tokenizer, "model_max_length", None)
        self.context_length = context_length or (limit if isinstance(limit, int) and limit < 10**8 else None)
        stops = stop_token_ids if stop_token_ids is not None else self._default_stops()
        self.stop_token_ids = sorted({*stops, *extra_stop_token_ids})
        self.stop_strings = list(stop)
        self.default_max_tokens = default_max_tokens
        self.update_gate = update_gate
        self.sampling_override = dict(sampling_override or {})
        parser = tool_call_parser or parser_for_template(tokenizer.chat_template)
        self.tool_format = ToolCallFormat(parser, tokenizer) if parser is not None else None
        """How the model writes tool calls (None: unknown, so requests with tools are refused)."""
        self._override_logged = False
        self.sessions: dict[str, Session] = {}
        self._executor = ThreadPoolExecutor(max_workers=max_concurrent_calls, thread_name_prefix="tidal-gateway")
        self._server: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._thread: threading.Thread | None = None

    def _default_stops(self) -> list[int]:
        stops = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            stops.append(im_end)
        return stops

    # -- sessions -------------------------------------------------------------------------------------------------

    def open_session(self, session_id: str | None = None) -> str:
        """Start recording a new episode; returns its id (the path segment of :meth:`session_url`)."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        self.sessions[sid] = Session(sid, Episode(self._tokenize), pick_engine(sid, self.engines))
        return sid

    def close_session(self, session_id: str) -> Session:
        """Stop a session (later calls get 404) and return what it recorded."""
        return self.sessions.pop(session_id)

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of one session (``base_url`` of ``openai.OpenAI``)."""
        return f"http://{self.host}:{self.port}/s/{session_id}/v1"

    def keep_running(self, task: asyncio.Task) -> None:
        """Hold ``task`` (a streamed call, which outlives a client that left) until it is done."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- serving --------------------------------------------------------------------------------------------------

    def start(self) -> Gateway:
        """Listen (in a background thread) and return once the port accepts requests."""
        import uvicorn
        from tidal.rollout.gateway.app import build_app

        config = uvicorn.Config(build_app(self), host=self.host, port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="tidal-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RolloutError(f"the agent gateway did not start listening on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info("agent gateway listening on http://%s:%d", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stop listening and wait for the server thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- one call -------------------------------------------------------------------------------------------------

    def render(self, request: ChatRequest) -> str:
        """The prompt text of ``request``: its messages (and tools) through the chat template, generation prompt on.

        Raises:
            GatewayError: 400 when the template refuses the conversation (its message is passed on).
        """
        try:
            return self.tokenizer.apply_chat_template(
                request.messages, tools=request.tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # a template raises whatever its author chose (jinja errors, raise_exception)
            raise GatewayError(400, f"the chat template refused these messages: {e}", param="messages") from e

    def sampling_params(self, request: ChatRequest, prompt_len: int) -> dict[str, Any]:
        """SGLang sampling parameters of ``request`` (its answer capped to what the context has room for).

        Penalties, the JSON ``response_format`` and a forced ``tool_choice`` go to SGLang's sampler and grammar;
        ``top_logprobs`` asks ``/generate`` for the alternatives (``top_logprobs_num``).

        Raises:
            GatewayError: 400 for a prompt over the context, tools this gateway cannot read the calls of, or a
                ``tool_choice`` / ``parallel_tool_calls`` the tool-call format cannot enforce.
        """
        params: dict[str, Any] = {
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        tool_params = tool_sampling_params(self.tool_format, request)
        room = None if self.context_length is None else self.context_length - prompt_len
        if room is not None and room < 1:
            raise GatewayError(
                400,
                f"This model's maximum context length is {self.context_length} tokens; the messages take "
                f"{prompt_len} tokens. Please shorten the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        wanted = request.max_tokens if request.max_tokens is not None else (self.default_max_tokens or room)
        if wanted is not None:
            params["max_new_tokens"] = min(wanted, room) if room is not None else wanted
        stops = [*self._stops(request), *tool_params.pop("stop", [])]
        if stops:
            params["stop"] = stops
        params |= tool_params
        if request.json_schema is not None:
            params["json_schema"] = request.json_schema
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name) is not None:
                params[name] = getattr(request, name)
        if request.top_logprobs:
            params[TOP_LOGPROBS_PARAM] = request.top_logprobs
        if request.seed is not None:
            params["sampling_seed"] = request.seed
        if request.logit_bias:
            params["logit_bias"] = request.logit_bias
        self._log_override(request)
        return params | self.sampling_override

    def _stops(self, request: ChatRequest) -> list[str]:
        """The request's stop strings, then the gateway's own (``stop_strings``) it does not already list."""
        return [*request.stop, *(s for s in self.stop_strings if s not in request.stop)]

    def _log_override(self, request: ChatRequest) -> None:
        """Warn once when a call asks for a temperature or top-p other than the one ``sampling_override`` forces."""
        asked = {"temperature": request.temperature, "top_p": request.top_p}
        differ = {
            k: v
            for k, v in asked.items()
            if v is not None and k in self.sampling_override and v != self.sampling_override[k]
        }
        if differ and not self._override_logged:
            self._override_logged = True
            forced = {k: self.sampling_override[k] for k in differ}
            logger.warning(
                "an agent call asked for %s; every call samples at the run's %s (the trainer's log-probs assume it): "
                "logged once",
                differ,
                forced,
            )

    async def complete(
        self, session: Session, request: ChatRequest, *, on_tokens: Callable[[list[int]], None] | None = None
    ) -> Completion:
        """Answer one chat call of ``session``: render, extend or fork its tokens, generate, record, parse.

        A generation the engine aborts (a weight update interrupting it) is resumed, once the update is in when
        the gateway has an ``update_gate``: the prompt plus the tokens sampled so far go out again for the rest of
        the budget, each token keeping the weight version that sampled it.

        With ``on_tokens`` the engine streams (when it can: ``generate_stream``) and ``on_tokens`` is called, in
        a gateway thread, with every token of the answer sampled so far (across resumes) as each chunk arrives.
        What is recorded and answered does not depend on it.
        """
        turn = session.episode.prepare(self.render(request))
        params = self.sampling_params(request, len(turn.prompt_ids))
        whole = await self._generate(session, turn.prompt_ids, params, on_tokens)
        session.calls += 1
        session.engine_urls.append(session.engine.url)
        return self._answer(session, request, turn, whole)

    async def _generate(
        self,
        session: Session,
        prompt_ids: list[int],
        params: dict[str, Any],
        on_tokens: Callable[[list[int]], None] | None,
    ) -> dict[str, Any]:
        """The whole answer to ``prompt_ids`` on the session's engine, resumed after aborts (see :meth:`complete`)."""
        loop = asyncio.get_running_loop()
        engine = session.engine
        ids: list[int] = []
        log_probs: list[float] = []
        tops: list[Any] = []
        versions: list[str | None] = []
        out: dict[str, Any] = {}
        for _ in range(_MAX_RESUMES + 1):
            sent = dict(params)
            if "max_new_tokens" in sent:
                sent["max_new_tokens"] -= len(ids)
                if sent["max_new_tokens"] < 1:  # cut exactly at the budget: nothing left to resume
                    out = {**out, "finish_reason": "length"}
                    break
            try:
                if on_tokens is None or not hasattr(engine, "generate_stream"):
                    (out,) = await loop.run_in_executor(self._executor, engine.generate, [[*prompt_ids, *ids]], sent)
                else:
                    so_far = lambda new, before=list(ids): on_tokens([*before, *new])  # noqa: E731
                    out = await self._stream(engine, [*prompt_ids, *ids], sent, so_far)
            except RolloutError as e:
                raise _engine_refusal(e) from e
            ids += out["output_ids"]
            log_probs += out["output_log_probs"]
            tops += out.get("output_top_logprobs") or []
            versions += [out.get("weight_version")] * len(out["output_ids"])
            if out["finish_reason"] != "abort":
                break
            session.resumes += 1
            gate = self.update_gate
            if gate is not None and not await loop.run_in_executor(self._executor, gate.wait_idle):
                raise GatewayError(
                    503, f"a weight update did not finish in {gate.timeout_s:.0f} s; retry", kind="server_error"
                )
        else:
            raise GatewayError(503, f"generation was aborted {_MAX_RESUMES + 1} times; retry", kind="server_error")
        whole = {**out, "output_ids": ids, "output_log_probs": log_probs, "weight_versions": versions}
        return whole | ({"output_top_logprobs": tops} if tops else {})

    async def _stream(
        self, engine: Generator, input_ids: list[int], params: dict[str, Any], on_tokens: Callable[[list[int]], None]
    ) -> dict[str, Any]:
        """One streamed generation: ``on_tokens`` sees each chunk's tokens so far; returns the whole answer."""
        loop = asyncio.get_running_loop()
        chunks = engine.generate_stream(input_ids, params)  # type: ignore[attr-defined]

        def step() -> dict[str, Any] | None:
            out = next(chunks, None)
            if out is not None and out["finish_reason"] is None:
                on_tokens(out["output_ids"])
            return out

        try:
            while (out := await loop.run_in_executor(self._executor, step)) is not None:
                if out["finish_reason"] is not None:
                    return out
            raise RolloutError(f"the stream of {engine.url} ended without an answer")
        finally:
            with contextlib.suppress(ValueError):  # still running in a thread (this task was cancelled)
                await loop.run_in_executor(self._executor, chunks.close)

    def _answer(self, session: Session, request: ChatRequest, turn: Turn, out: dict[str, Any]) -> Completion:
        ids = out["output_ids"]
        sampled_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        session.episode.record(
            turn,
            output_ids=ids,
            log_probs=out["output_log_probs"],
            output_text=sampled_text,
            finish_reason=out["finish_reason"],
            weight_version=out.get("weight_version"),
            weight_versions=out.get("weight_versions"),
        )
        visible = ids[:-1] if ids and out["finish_reason"] == "stop" and ids[-1] in self.stop_token_ids else ids
        text = self.tokenizer.decode(visible, skip_special_tokens=False)
        for stop in self._stops(request):  # a matched stop string is not part of the answer (its tokens stay sampled)
            if stop in text:
                text = text[: text.index(stop)]
        tools = self.tool_format if request.parse_tools else None
        content, calls = tools.parse(text, request) if tools is not None else (text, [])
        finish = "tool_calls" if calls else ("length" if out["finish_reason"] == "length" else "stop")
        return Completion(
            model=request.model,
            content=content,
            tool_calls=calls,
            finish_reason=finish,
            prompt_tokens=len(turn.prompt_ids),
            completion_tokens=len(ids),
            logprobs=token_logprobs(self._token_text, out, len(visible), request.top_logprobs)
            if request.logprobs
            else None,
        )


def _engine_refusal(e: RolloutError) -> GatewayError:
    """An engine's refusal as an answer: its own 400 stays a 400 (bad ids, too long), anything else is a 503."""
    text = str(e)
    if " answered 400" in text:
        message = text.split(": ", 1)[-1]
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(message).get("error", {}).get("message", message)
        return GatewayError(400, f"the engine refused the request: {message}", code="engine_refused")
    return GatewayError(503, f"the engine is unavailable: {text}", kind="server_error", code="engine_unavailable")
