"""Tool calls in the model's own format, read and enforced by SGLang's function-call parsers.

A :class:`ToolCallFormat` is one of SGLang's parsers (``sglang.srt.function_call``), named as SGLang's
``--tool-call-parser`` names them (hermes, qwen25, llama3, qwen3_coder, glm45, mistral, ...), by default the one
the chat template's own tool-call markers call for (:func:`~tidal.rollout.tool_call_parsers.parser_for_template`).
It splits an answer's text into content and OpenAI tool calls, tells a stream where a call may begin, and turns
``tool_choice`` "required" or a named function into the grammar SGLang constrains decoding with (its
``structural_tag`` or ``json_schema`` sampling parameter), as SGLang's own OpenAI server does.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from tidal.rollout.gateway.chat import GatewayError
from tidal.rollout.gateway.streaming import partial_suffix
from tidal.rollout.tool_call_parsers import FLAG, check_parser_name, known_parser_names

if TYPE_CHECKING:
    from tidal.rollout.gateway.request import ChatRequest

logger = logging.getLogger(__name__)

# Where a detector keeps the text that opens a call, in the order looked at.
_START_ATTRIBUTES = ("tool_call_start_token", "_tool_calls_marker", "bot_token")
# Parsers that also read an answer that is nothing but a JSON object as a call (no start marker).
_BARE_JSON = frozenset({"llama3"})


def _arguments(parameters: str) -> str:
    """OpenAI ``arguments`` (a JSON string) of a parsed call: a call that wrote its arguments as a string keeps it."""
    try:
        value = json.loads(parameters)
    except json.JSONDecodeError:
        return parameters
    return value if isinstance(value, str) else parameters


class ToolCallFormat:
    """One SGLang function-call parser, for every call of a gateway."""

    def __init__(self, name: str, tokenizer: Any = None) -> None:
        """The parser SGLang calls ``name``; ``tokenizer`` is handed to the parsers that read special tokens.

        SGLang's parser module (seconds to import) is imported at the first call that has tools.

        Raises:
            ValueError: ``name`` is not one of SGLang's parsers (naming ``--tool-call-parser``).
        """
        if known_parser_names() is None:  # no list to read: ask SGLang itself
            from sglang.srt.function_call.function_call_parser import FunctionCallParser

            if name not in FunctionCallParser.ToolCallParserEnum:
                raise ValueError(f"{FLAG} must be one of {sorted(FunctionCallParser.ToolCallParserEnum)}, got {name!r}")
        check_parser_name(name)
        self.name, self.tokenizer = name, tokenizer

    @functools.cached_property
    def _markers(self) -> tuple[list[str], str | None]:
        detector = self._parser([], "auto").detector
        starts = (getattr(detector, a, "") for a in _START_ATTRIBUTES)
        start = next((s.strip() for s in starts if isinstance(s, str) and s.strip()), "")
        end = getattr(detector, "tool_call_end_token", "") or getattr(detector, "eot_token", "")
        return ([start] if start else []), (end.strip() if start and isinstance(end, str) and end.strip() else None)

    @property
    def start_markers(self) -> list[str]:
        """Text that opens a call; with none known, no content is streamed before the answer ends."""
        return self._markers[0]

    @property
    def end_marker(self) -> str | None:
        """Text that closes a call, when the format has one (a stop string ends the answer after one call)."""
        return self._markers[1]

    def _parser(self, tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> Any:
        from sglang.srt.entrypoints.openai.protocol import Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        chosen = [Tool.model_validate(t) for t in tools if named is None or t["function"]["name"] == named]
        return FunctionCallParser(
            chosen, self.name, tokenizer=self.tokenizer, tool_choice={"name": named} if named else tool_choice
        )

    def parse(self, text: str, request: ChatRequest) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of an answer's text, OpenAI's way (``arguments`` a JSON string).

        ``content`` is the text outside the calls (None when only whitespace). Text with no call the parser can read
        (none written, a broken one, an unknown function) is all content,
        with no call: a model that wrote a broken call gets no call made.
        """
        try:
            content, items = self._parser(request.tools or [], request.tool_choice).parse_non_stream(text)
        except Exception as e:  # a parser's own error on text it cannot read: no call was made
            logger.info("gateway: the %s parser read no tool call (%s: %s)", self.name, type(e).__name__, e)
            return text, []
        if not items or any(not item.name for item in items):
            return text, []
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": item.name, "arguments": _arguments(item.parameters)},
            }
            for item in items
        ]
        return content.strip() or None, calls

    def sampling_params(self, request: ChatRequest) -> dict[str, Any]:
        """SGLang sampling parameters that enforce ``request``'s ``tool_choice`` and ``parallel_tool_calls``.

        Raises:
            GatewayError: 400 naming the field this parser cannot enforce.
        """
        if not request.parse_tools:
            return {}
        params: dict[str, Any] = {}
        if not request.parallel_tool_calls:
            if self.end_marker is None:
                raise GatewayError(
                    400,
                    f"'parallel_tool_calls': false cannot be enforced with the {self.name} tool-call format (its calls "
                    f"have no end marker to stop at): drop it, or start the gateway with another {FLAG}",
                    param="parallel_tool_calls",
                )
            params["stop"] = [self.end_marker]  # the answer ends with its first call
        if not request.forces_tool_call:
            return params
        choice = request.tool_choice
        tool_choice: Any = choice
        if isinstance(choice, dict):
            from sglang.srt.entrypoints.openai.protocol import ToolChoice

            tool_choice = ToolChoice(function={"name": choice["function"]["name"]})
        parser = self._parser(request.tools or [], choice)
        constraint = parser.get_structure_constraint(tool_choice, parallel_tool_calls=request.parallel_tool_calls)
        if constraint is None:
            raise GatewayError(
                400,
                f"'tool_choice' {json.dumps(choice)} cannot be enforced with the {self.name} tool-call format: use "
                f'"auto", or start the gateway with another {FLAG}',
                param="tool_choice",
            )
        kind, value = constraint
        if hasattr(value, "model_dump"):
            value = value.model_dump(by_alias=True)
        if kind == "full_assistant_ebnf":
            return {**params, "ebnf": value, "ebnf_full_assistant": True}
        return {**params, kind: value if isinstance(value, str) else json.dumps(value)}

    def content_prefix(self, text: str) -> str:
        """The start of an answer in the making that no call of this format can be part of (what may be streamed)."""
        if self.name in _BARE_JSON and text.lstrip()[:1] in ("{", ""):
            return ""
        if not self.start_markers:
            return ""
        cuts = [text.index(m) for m in self.start_markers if m in text]
        if cuts:
            return text[: min(cuts)]
        return text[: len(text) - partial_suffix(text, self.start_markers)]


def tool_sampling_params(tool_format: ToolCallFormat | None, request: ChatRequest) -> dict[str, Any]:
    """SGLang sampling parameters enforcing ``request``'s tool fields (see :meth:`ToolCallFormat.sampling_params`).

    Raises:
        GatewayError: 400 naming ``tools`` when the request has tools but the model's tool-call format is unknown,
            or the field ``tool_format`` cannot enforce.
    """
    if tool_format is not None:
        return tool_format.sampling_params(request)
    if request.parse_tools:
        raise GatewayError(
            400,
            "this gateway cannot read the model's tool calls (its chat template has no known tool-call marker): "
            f"start it with {FLAG} NAME, or send no 'tools'",
            param="tools",
        )
    return {}
