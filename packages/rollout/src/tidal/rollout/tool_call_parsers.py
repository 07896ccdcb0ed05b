"""Names of SGLang's tool-call parsers, and which one a chat template's own markers call for (standard library only).

The names are SGLang's ``--tool-call-parser`` names, read from its dependency-free ``parser_names`` module as a
file (importing ``sglang`` costs seconds; the command line answers before that), so a bad name is refused while
options are parsed.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

FLAG = "--tool-call-parser"
TEMPLATE_MARKERS = (
    ("<function=", "qwen3_coder"),
    ("<arg_key>", "glm45"),
    ("<|python_tag|>", "llama3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
)
"""A chat template holding the marker (checked in this order) writes tool calls the way the parser reads them:
Qwen3-Coder's XML, GLM-4.5's XML, Llama 3.x JSON, Mistral, and the Hermes/Qwen ``<tool_call>`` JSON."""


def known_parser_names() -> list[str] | None:
    """SGLang's tool-call parser names (None when the installed SGLang has no ``parser_names`` module to read)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt" / "function_call" / "parser_names.py"
    try:
        tree = ast.parse(path.read_text())
    except OSError:
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "TOOL_CALL_PARSER_NAMES" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def check_parser_name(name: str) -> None:
    """Raise ``ValueError`` (one line, naming the flag) when ``name`` is not one of SGLang's parsers."""
    names = known_parser_names()
    if names is not None and name not in names:
        raise ValueError(f"{FLAG} must be one of SGLang's tool-call parsers {sorted(names)}, got {name!r}")


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser for the tool calls a chat template writes (None: no known marker in it)."""
    for marker, name in TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None
