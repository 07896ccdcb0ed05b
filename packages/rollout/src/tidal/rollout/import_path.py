"""Extension points loaded by import path (``pkg.module:fn``), with errors that name the flag and the path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(path: str, *, flag: str) -> Callable[..., Any]:
    """Import the callable that ``path`` (``pkg.module:fn``) names.

    Args:
        path: ``module:attribute``; the module is imported with :func:`importlib.import_module`.
        flag: The command-line flag the path came from (e.g. ``--custom-rm-path``), for error messages.

    Raises:
        ValueError: The path is malformed, the module cannot be imported, or the attribute is missing
            or not callable; the message names the flag and the path.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{flag} must look like 'pkg.module:fn', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{flag} {path!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{flag} {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{flag} {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn
