"""The ``train`` command line, generated from the fields of each package's config (argparse, standard library).

An option is declared once: as a field of the config dataclass of the package that owns it (:data:`SECTIONS`).
From the field come

- the flag: the field's name with dashes (``rollout_batch_size`` -> ``--rollout-batch-size``, slime's names),
  or the one its metadata names (``field(default=300.0, metadata={"flag": "--placement-timeout"})``);
- the help: the docstring under the field; ``--help`` adds the field's default and the default recipe's value;
- the argparse kind, from the field's type: ``bool`` is a switch (``store_true``; on a field that defaults to
  True, a ``--no-...`` flag that stores False); ``bool | None``, or ``metadata={"negatable": True}``, is a
  pair such as ``--colocate/--no-colocate`` (``BooleanOptionalAction``); ``int``/``float`` (or ``| None``)
  parse as such; ``tuple[T, ...]`` takes one or more values; ``metadata={"action": "append"}`` repeats the
  flag (``--ray-env``) and ``metadata={"metavar": ...}`` names the value in ``--help``; ``metadata={"auto": True}``
  lets the flag also take ``auto`` (a switch then takes an optional value), resolved by :mod:`tidal.train.auto_memory`.

A field with ``metadata={"flag": None}`` is no option: the app fills it (a value shared between packages,
:data:`tidal.train.shared.SHARED`, or the ``--sglang-*`` pass-through). argparse stays the parser (it is the
standard library's); every flag's argparse default is None, so that "given" and "not given" stay distinct: a
recipe and a ``--config`` file fill only what the command line left unset.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from types import UnionType
from typing import Any

from tidal.actor import ActorConfig
from tidal.batching import BatchingConfig
from tidal.ckpt import CkptConfig
from tidal.placement import PlacementConfig
from tidal.rollout import RolloutConfig
from tidal.train.config import EvalConfig, LogConfig, OffloadConfig, ParallelConfig, TrainConfig, WeightSyncConfig
from tidal.train.sft_config import SftConfig

# section -> its config class, in the order of `train --help`; JobConfig has one attribute per section.
SECTIONS: dict[str, type] = {
    "train": TrainConfig,
    "eval": EvalConfig,
    "parallel": ParallelConfig,
    "sync": WeightSyncConfig,
    "offload": OffloadConfig,
    "logging": LogConfig,
    "sft": SftConfig,
    "ckpt": CkptConfig,
    "placement": PlacementConfig,
    "rollout": RolloutConfig,
    "batching": BatchingConfig,
    "actor": ActorConfig,
}

TITLES = {
    "train": "run (apps/train)",
    "eval": "evaluation (apps/train)",
    "parallel": "actor parallel layout (apps/train)",
    "sync": "weight sync (apps/train)",
    "offload": "offload (apps/train)",
    "logging": "logging and warnings (apps/train)",
    "sft": "SFT stage (apps/train)",
    "ckpt": "checkpoints (tidal-ckpt)",
    "placement": "placement (tidal-placement)",
    "rollout": "rollout (tidal-rollout); any other --sglang-<option> VALUE is passed to the SGLang server as "
    "--<option> VALUE, and --sglang-router-<option> VALUE to sglang-router",
    "batching": "batching (tidal-batching)",
    "actor": "actor (tidal-actor)",
}

METADATA_KEYS = frozenset({"flag", "short", "negatable", "action", "metavar", "auto"})
"""What a field's metadata may say about its option (anything else is a mistake the generator refuses)."""

# The app's own options: how the job is assembled, not a field of any section.
APP_OPTIONS: dict[str, dict[str, Any]] = {
    "--config": {"metavar": "FILE", "help": "YAML or TOML file of options (flag names without dashes); flags "
                 "override it"},
    "--recipe": {"metavar": "NAME", "help": "start from this recipe (`--recipe list` lists them); flags and "
                 "--config override it (default: embedded; with --hf-checkpoint give one, e.g. base)"},
    "--list-recipes": {"action": "store_true", "help": "list the recipes and exit"},
}  # fmt: skip


@dataclass(frozen=True)
class Option:
    """One command-line option: the field it fills and how argparse reads it."""

    section: str
    """The JobConfig section (a key of SECTIONS)."""
    name: str
    """The field's name, also argparse's ``dest``."""
    flag: str
    """The flag: the field's name with dashes, unless the field's metadata names another."""
    kwargs: dict[str, Any]
    """argparse keyword arguments (action, type, nargs, metavar), without default and help."""
    help: str
    """The field's docstring, on one line."""
    default: Any
    """The field's default; ``dataclasses.MISSING`` for a required field."""
    short: str | None = None
    """A one-letter alias of the flag (``-v``), if the field's metadata names one."""


@functools.cache
def options() -> tuple[Option, ...]:
    """Every option of ``train``, in --help order (section by section, field by field)."""
    found: list[Option] = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            option = _option(section, f, hints[f.name], docs.get(f.name, ""))
            if option is not None:
                found.append(option)
    return tuple(found)


def _option(section: str, f: dataclasses.Field, tp: Any, doc: str) -> Option | None:
    meta = dict(f.metadata)
    unknown = set(meta) - METADATA_KEYS
    if unknown:
        raise TypeError(f"{section}.{f.name}: unknown option metadata {sorted(unknown)}; use {sorted(METADATA_KEYS)}")
    flag = meta.get("flag", "--" + f.name.replace("_", "-"))
    if flag is None:
        return None
    default = f.default
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    text = " ".join(doc.split())
    return Option(section, f.name, flag, _kind(tp, default, flag, meta), text, default, meta.get("short"))


def _kind(tp: Any, default: Any, flag: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The argparse kwargs for a field of type ``tp``."""
    args = typing.get_args(tp)
    optional = isinstance(tp, UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else tp
    kind: dict[str, Any] = {k: meta[k] for k in ("action", "metavar") if k in meta}
    if meta.get("auto"):  # the value may also be `auto`: the app's memory plan chooses it (tidal.train.auto_memory)
        from tidal.train.auto_memory import bool_or_auto, int_or_auto

        if base is bool:
            return kind | {"nargs": "?", "const": True, "type": bool_or_auto, "metavar": "auto"}
        return kind | {"type": int_or_auto, "metavar": "N|auto"}
    if base is bool:
        if optional or meta.get("negatable"):
            kind["action"] = argparse.BooleanOptionalAction
        elif default is True:
            if not flag.startswith("--no-"):
                raise TypeError(f"{flag}: a switch on a field that defaults to True must be named --no-...")
            kind["action"] = "store_false"
        else:
            kind["action"] = "store_true"
    elif typing.get_origin(base) is tuple:
        kind["nargs"] = "+"
        item = typing.get_args(base)[0]
        if item in (int, float):
            kind["type"] = item
    elif base in (int, float):
        kind["type"] = base
    return kind


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``field name -> the docstring written under it`` in ``cls``'s source (attribute docstrings, PEP 257)."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        named = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[stmt.target.id] = str(after.value.value)
    return docs


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (one line, naming the flag) instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(f"{message}; see `train --help`")


def build_parser(recipe: tuple[str, dict[str, Any]] | None = None) -> argparse.ArgumentParser:
    """The ``train`` argument parser, grouped by the package that owns each option; every default is None.

    ``recipe`` (a recipe's name and options) is shown in --help beside the fields' defaults where it differs.
    Abbreviations are off: ``--sglang-<option>`` must reach SGLang as written, never as a prefix of a tidal flag.
    """
    parser = _Parser(
        prog="train",
        description="RL post-training: Megatron actor, SGLang rollouts. A job starts from a recipe (--recipe; "
        "without it `embedded`, which a --hf-checkpoint must not take by accident: give --recipe base, the "
        "defaults below, for your model), then --config, then the flags. `train convert --help`: HF <-> "
        "Megatron checkpoint conversion.",
        allow_abbrev=False,
    )
    for flag, kwargs in APP_OPTIONS.items():
        parser.add_argument(flag, default=None, **kwargs)
    groups = {section: parser.add_argument_group(TITLES[section]) for section in SECTIONS}
    name, values = recipe or ("", {})
    for option in options():
        text = help_text(option, name, values.get(option.name, option.default))
        flags = (option.flag, option.short) if option.short else (option.flag,)
        groups[option.section].add_argument(
            *flags, dest=option.name, default=None, help=text.replace("%", "%%"), **option.kwargs
        )
    return parser


def help_text(option: Option, recipe: str, recipe_value: Any) -> str:
    """The option's help: its field's docstring, its default, and ``recipe``'s value when that differs."""
    default = "required" if option.default is dataclasses.MISSING else show(option, option.default)
    if option.kwargs.get("action") == "store_false":  # the help describes the field; the flag switches it off
        default = f"{option.name} {show(option, option.default)}; {option.flag} turns it off"
    shown = f"default: {default}"
    if recipe_value != option.default:
        shown += f"; recipe {recipe}: {show(option, recipe_value)}"
    return f"{option.help} ({shown})"


def show(option: Option, value: Any) -> str:
    """A value as --help shows it: booleans as on/off, empty as none."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or (isinstance(value, tuple | list | dict) and not value):
        return "none"
    return " ".join(map(str, value)) if isinstance(value, tuple | list) else str(value)


def flag_kinds() -> dict[str, dict[str, Any]]:
    """``field name -> {"flag": ..., argparse kwargs}`` of every option (the config file reader needs each kind)."""
    return {o.name: {"flag": o.flag, **o.kwargs} for o in options()}


def section_defaults(section: str) -> dict[str, Any]:
    """``field name -> default`` of every field of ``section`` that has one (options or not)."""
    out = {}
    for f in dataclasses.fields(SECTIONS[section]):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out
