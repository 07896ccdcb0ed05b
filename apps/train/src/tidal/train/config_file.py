"""``--config FILE``: the same options as the flags, from YAML or TOML; the command line overrides the file.

Keys are flag names without the leading dashes, with ``-`` or ``_`` (``rollout-batch-size`` or
``rollout_batch_size``), or ``recipe``; ``sglang-*`` keys pass through to the SGLang server like the flags do.
The options and their kinds are the fields the command line is generated from (:mod:`tidal.train.flags`).
The file becomes argv tokens placed *before* the command line's, so argparse's "last one wins" gives flags the
final say.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from tidal.train.flags import flag_kinds


def config_path(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``), if given."""
    for i, token in enumerate(argv):
        if token == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file: --config FILE.yaml or FILE.toml")
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


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


def config_to_argv(data: dict[str, Any], *, source: str) -> list[str]:
    """Turn ``{option: value}`` into argv tokens; an unknown option is an error naming it and the file."""
    kinds = flag_kinds()
    argv: list[str] = []
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        if key == "config":
            raise ValueError(f"--config {source}: a config file cannot name another config file")
        flag = "--" + key.replace("_", "-")
        if key == "recipe":
            argv += [flag, str(value)]
            continue
        if key.startswith("sglang_") and key not in kinds:
            argv += [flag, _scalar(value)] if value is not True else [flag]
            continue
        kind = kinds.get(key) or next((k for k in kinds.values() if k["flag"] == flag), None)
        if kind is None:
            raise ValueError(f"--config {source}: unknown option {raw_key!r}; see `train --help` for the names")
        flag = kind["flag"]
        action = kind.get("action")
        if action in ("store_true", "store_false"):  # `no-recompute-lm-head: true` passes the flag
            if not isinstance(value, bool):
                raise ValueError(f"--config {source}: {raw_key} must be true or false, got {value!r}")
            if action == "store_false" and key in kinds:  # the field's name: `recompute-lm-head: false` negates it
                value = not value
            argv += [flag] if value else []
        elif action is not None and action != "append":  # BooleanOptionalAction
            if not isinstance(value, bool):
                raise ValueError(f"--config {source}: {raw_key} must be true or false, got {value!r}")
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            if action == "append":
                for item in value:
                    argv += [flag, _scalar(item)]
            else:
                argv += [flag, *map(_scalar, value)]
        else:
            argv += [flag, _scalar(value)]
    return argv


def expand_config(argv: list[str]) -> list[str]:
    """``argv`` with the ``--config`` file's options in front of it (``--config`` itself kept last)."""
    path = config_path(argv)
    if path is None:
        return argv
    return [*config_to_argv(read_config_file(path), source=path), *argv]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


_PER_INVOCATION = ("overwrite_output_dir",)  # said for one command, not part of the job a config file repeats


def effective_options(job) -> dict[str, Any]:
    """Every ``train`` option's value in ``job`` (a JobConfig), keyed by flag name: a file ``--config`` reads back.

    Unset (None) and empty values are left out: they are every recipe's (a recipe sets values, never None).
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
