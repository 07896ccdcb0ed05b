"""``--config FILE``: the same options as the flags, from YAML or TOML; the command line overrides the file.

Keys are flag names without the leading dashes, with ``-`` or ``_`` (``rollout-batch-size`` or
``rollout_batch_size``), or ``recipe``; ``sglang-*`` keys pass through to the SGLang server like the flags do.
The options and their kinds are the fields the command line is generated from (:mod:`tidal.train.flags`).
Its values merge with the recipe's and the flags' as values (recipe, then file, then flags), in
``tidal.train.cli.parse_job``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from tidal.train.flags import flag_kinds


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file into a flat mapping; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path} is not a file")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ValueError(f"--config {path}: use a .yaml, .yml or .toml file")
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ValueError(f"--config {path} could not be parsed: {e}") from e
    except Exception as e:  # yaml.YAMLError without importing yaml at module level
        raise ValueError(f"--config {path} could not be parsed: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of option names to values, got {type(data).__name__}")
    return data


def config_values(data: dict[str, Any], *, source: str) -> tuple[dict[str, Any], list[str]]:
    """``{field name: value}`` of a file's options, typed as the flags would give them, and its SGLang pass-through.

    Each value is what argparse makes of the same flag (``lr: 3e-4`` -> 3e-4, ``rollout-stop: [a, b]`` -> a list),
    so a file and the flags merge as values; a switch set to ``false`` in the file is ``False``, not "not given".
    ``sglang-*`` / ``sglang-router-*`` keys become the argv tokens SGLang's parser reads. ``recipe`` is kept as is.

    Raises:
        ValueError: an unknown option, a value of the wrong kind, or a nested ``config``; naming the file and key.
    """
    kinds = flag_kinds()
    by_flag = {kind["flag"]: name for name, kind in kinds.items()}
    values: dict[str, Any] = {}
    passthrough: list[str] = []
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        flag = "--" + key.replace("_", "-")
        if key == "config":
            raise ValueError(f"--config {source}: a config file cannot name another config file")
        if key == "recipe":
            values["recipe"] = str(value)
            continue
        if key.startswith("sglang_") and key not in kinds:
            passthrough += [flag, _scalar(value)] if value is not True else [flag]
            continue
        name = key if key in kinds else by_flag.get(flag)
        if name is None:
            raise ValueError(f"--config {source}: unknown option {raw_key!r}; see `train --help` for the names")
        values[name] = _typed(kinds[name], value, negated=name != key, where=f"--config {source}: {raw_key}")
    return values, passthrough


def _typed(kind: dict[str, Any], value: Any, *, negated: bool, where: str) -> Any:
    """``value`` as the field gets it from the flag of ``kind`` (``negated``: the key is the ``--no-`` flag's name)."""
    action = kind.get("action")
    if action is not None and action != "append":  # store_true, store_false, BooleanOptionalAction
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return not value if negated else value
    convert = kind.get("type", str)

    def one(item: Any) -> Any:
        try:
            return convert(_scalar(item))
        except ValueError:
            raise ValueError(f"{where}: invalid {convert.__name__} value {item!r}") from None

    if action == "append" or kind.get("nargs") == "+":
        return [one(item) for item in (value if isinstance(value, list) else [value])]
    if isinstance(value, list):
        raise ValueError(f"{where} takes one value, got a list {value!r}")
    return one(value)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


_PER_INVOCATION = ("overwrite_output_dir",)  # said for one command, not part of the job a config file repeats


def effective_options(job) -> dict[str, Any]:
    """Every ``train`` option's value in ``job`` (a JobConfig), keyed by flag name: a file ``--config`` reads back.

    Unset (None) and empty values are left out: they are every recipe's (a recipe sets values, never None); so
    is ``--rm-type`` with agents (each episode's reward is its agent's).
    """
    from tidal.train.flags import options

    found: dict[str, Any] = {}
    for option in options():
        value = getattr(getattr(job, option.section), option.name)
        if value is None or (isinstance(value, tuple | list | dict) and not value):
            continue
        if option.name in _PER_INVOCATION or (
            option.name == "save" and value == str(Path(job.train.output_dir) / "ckpt")
        ):
            continue  # a rerun with another --output-dir must not write into this run's folder
        if option.name == "rm_type" and job.rollout.agent_function_path:
            continue  # agents score their own episodes: a rerun given --rm-type would be refused
        if option.kwargs.get("action") == "store_false":  # --no-recompute-lm-head: the option negates the field
            value = not value
        elif option.name == "ray_env":
            value = [f"{k}={v}" for k, v in value.items()]
        found[option.flag[2:]] = list(value) if isinstance(value, tuple) else value
    passthrough = (("sglang-", job.rollout.sglang_server_args), ("sglang-router-", job.rollout.sglang_router_args))
    for prefix, args in passthrough:
        args, i = list(args), 0
        while i < len(args):  # "--mem-fraction-static 0.5" -> sglang-mem-fraction-static: 0.5
            key = prefix + args[i][2:]
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                found[key], i = args[i + 1], i + 2
            else:
                found[key], i = True, i + 1
    return found


def write_effective_config(job, out_dir: str | Path) -> Path:
    """``OUT/config.yaml``: the run's effective options (rerun: ``train --config OUT/config.yaml --output-dir NEW``)."""
    import yaml

    path = Path(out_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# effective options of this run; `uv run train --config THIS_FILE --output-dir NEW_DIR` repeats it\n"
        + yaml.safe_dump(effective_options(job), sort_keys=False),
        encoding="utf-8",
    )
    return path
