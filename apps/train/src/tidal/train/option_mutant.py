"""Option mutation: one ``train`` option neutralized, to check that the test named for it notices.

Active only when the environment variable ``TIDAL_OPTION_MUTANT`` is set (tools/option_mutation.py sets it for
the test runs it starts); nothing else turns it on, and unset every function here is a no-op. Its value names
one option: ``--FLAG`` replaces the option's value by its default (as if neither a recipe, ``--config`` nor the
command line gave it), ``--FLAG=VALUE`` by VALUE (``on``/``off`` for a switch, ``none`` for None, words split on
blanks for an option taking several values).

The value is replaced where parsed values become configs, before validation:

- in ``train`` (:func:`tidal.train.cli.parse_job`): in the merged values of the recipe, ``--config`` and the
  flags, so every section, shared copy and process of the run (Ray actors and engines receive the configs built
  there) sees the mutant; ``--config``, ``--recipe`` and ``--list-recipes`` are dropped from the command line;
- in a test process (the repository's conftest.py calls :func:`patch_configs`): the owning config class's
  ``__init__`` takes the mutant's value whatever its caller passes, so a test that builds the config itself
  (``ActorConfig(eps_clip=0.1)``) gets the mutant too; configs built by ``parse_job`` are left to it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ENV = "TIDAL_OPTION_MUTANT"
"""The environment variable naming the mutant (unset: no mutant)."""
APP_FLAGS = ("--config", "--recipe", "--list-recipes")
"""The app's own options, which fill no config field: a mutant drops them from the command line."""

_NONE = object()  # "no value given": the option's default
_IN_PARSE_JOB: contextvars.ContextVar[bool] = contextvars.ContextVar("tidal_option_mutant_in_parse_job", default=False)


@dataclass(frozen=True)
class Mutant:
    """One option neutralized: its flag, the config field it fills and the value that replaces it."""

    flag: str
    """The option's flag, as ``train --help`` lists it."""
    section: str | None
    """The JobConfig section of its field; None for an app option (``--config``, ``--recipe``, ``--list-recipes``)."""
    name: str
    """The field's name (argparse's dest)."""
    value: Any = _NONE
    """The replacing value; unset: the field's default."""

    @property
    def to_default(self) -> bool:
        """Whether the option goes back to its default (no value given)."""
        return self.value is _NONE


def parse_mutant(text: str) -> Mutant:
    """The mutant ``text`` (``--FLAG`` or ``--FLAG=VALUE``) names.

    Raises:
        ValueError: no such option, or a VALUE its type does not take.
    """
    from tidal.train.flags import options

    flag, sep, raw = text.partition("=")
    if flag in APP_FLAGS:
        if sep:
            raise ValueError(f"{ENV}={text}: {flag} is an app option; its mutant takes no value (give {flag})")
        return Mutant(flag, None, flag.removeprefix("--").replace("-", "_"))
    found = next((o for o in options() if flag in (o.flag, o.short)), None)
    if found is None:
        raise ValueError(f"{ENV}={text}: {flag} is no option of `train --help`; give --FLAG or --FLAG=VALUE")
    if not sep:
        return Mutant(found.flag, found.section, found.name)
    try:
        value = _typed(raw, found.kwargs)
    except ValueError as e:
        raise ValueError(f"{ENV}={text}: {raw!r} is no value of {flag}: {e}") from e
    return Mutant(found.flag, found.section, found.name, value)


def _typed(raw: str, kind: dict[str, Any]) -> Any:
    """``raw`` as the option of argparse kind ``kind`` holds it in its config."""
    if raw.lower() == "none":
        return None
    action = kind.get("action")
    if action is not None and action != "append" and kind.get("nargs") is None and "type" not in kind:
        switch = {"on": True, "true": True, "off": False, "false": False}
        if raw.lower() not in switch:
            raise ValueError("a switch takes on or off")
        return switch[raw.lower()]
    if kind.get("nargs") == "+" or action == "append":
        item = kind.get("type", str)
        words = raw.split()
        return tuple(item(w) for w in words) if kind.get("nargs") == "+" else [item(w) for w in words]
    return kind.get("type", str)(raw)


@functools.cache
def _from_env(text: str) -> Mutant:
    return parse_mutant(text)


def active() -> Mutant | None:
    """The mutant ``TIDAL_OPTION_MUTANT`` names, or None when it is unset (every normal run)."""
    text = os.environ.get(ENV)
    return _from_env(text) if text else None


def neutralize_argv(argv: list[str]) -> list[str]:
    """``argv`` without the app option the mutant names (and the value it takes); ``argv`` itself otherwise."""
    mutant = active()
    if mutant is None or mutant.section is not None:
        return argv
    takes_value = mutant.flag != "--list-recipes"
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == mutant.flag:
            skip = takes_value
        elif not token.startswith(mutant.flag + "="):
            out.append(token)
    return out


def neutralize_values(values: dict[str, Any]) -> dict[str, Any]:
    """The merged option values (field name -> value) with the mutant's field replaced; ``values`` when none is."""
    mutant = active()
    if mutant is None or mutant.section is None:
        return values
    out = {k: v for k, v in values.items() if k != mutant.name}
    if not mutant.to_default:
        out[mutant.name] = mutant.value
    return out


@contextlib.contextmanager
def parsing_job() -> Iterator[None]:
    """Marks configs built by ``parse_job``, which has applied the mutant already (see :func:`patch_configs`)."""
    token = _IN_PARSE_JOB.set(True)
    try:
        yield
    finally:
        _IN_PARSE_JOB.reset(token)


def patch_configs() -> Mutant | None:
    """Make every instance of the mutant's config class, built in this process, carry the mutant's value.

    A no-op returning None unless ``TIDAL_OPTION_MUTANT`` names a config field. Configs built inside
    :func:`parsing_job` are left alone: ``parse_job`` replaced the value before the app derived anything from it.
    """
    mutant = active()
    if mutant is None or mutant.section is None:
        return mutant
    from tidal.train.flags import SECTIONS

    cls = SECTIONS[mutant.section]
    original = cls.__init__
    if getattr(original, "__option_mutant__", None) == mutant:
        return mutant
    default = next(f for f in dataclasses.fields(cls) if f.name == mutant.name)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not _IN_PARSE_JOB.get():
            if mutant.to_default:
                if default.default is dataclasses.MISSING and default.default_factory is dataclasses.MISSING:
                    raise TypeError(f"{ENV}: {mutant.flag} is required; give its mutant a value (--FLAG=VALUE)")
                kwargs.pop(mutant.name, None)
            else:
                kwargs[mutant.name] = mutant.value
        original(self, *args, **kwargs)

    __init__.__option_mutant__ = mutant  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
    return mutant
