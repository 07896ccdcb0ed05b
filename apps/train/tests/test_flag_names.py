"""Every ``--flag`` that tidal's source names (messages, docstrings, comments) is one a user can pass.

A message that tells the user to pass a flag that does not exist, or one that tidal forwards to SGLang under
another name, is worse than no advice. Names are checked against the ``train`` parser, ``train convert``'s
parser, SGLang's and sglang-router's own options (read from their source: importing SGLang takes ~30 s), and a
short list of other tools' flags, each with its reason.
"""

import importlib.util
import re
from pathlib import Path

from tidal.train import convert
from tidal.train.flags import build_parser

ROOT = Path(__file__).resolve().parents[3]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")

# Flags of other tools, named for comparison or to build their command lines; never offered as `train` flags.
OTHER_TOOLS = {
    "--allgather-cp": "slime's flag, named where tidal's context-parallel attention does the same",
    "--get-mismatch-metrics": "slime's flag, named where tidal's engine-actor agreement (always on) does the same",
    "--make-vocab-size-divisible-by": "Megatron's flag, named where tidal pads the vocabulary the same way",
    "--out-dir": "`python -m tidal.train.task_data --out-dir`, the shipped data's own generator",
}


def _options(parser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _site_file(module: str, relative: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"{module} is not installed"
    return Path(spec.origin).parent / relative


def sglang_server_options() -> set[str]:
    """``sglang.launch_server``'s options: ServerArgs fields (``name: A[...]``) and the ones added by hand."""
    root = _site_file("sglang", "srt")
    names: set[str] = set()
    for path in [root / "server_args.py", *(root / "arg_groups").rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        names |= {"--" + m.replace("_", "-") for m in re.findall(r"^\s+([a-z][a-z0-9_]*)\s*:\s*A\[", text, re.M)}
        names |= set(re.findall(r"\"(--[a-z0-9-]+)\"", text))
    return names


def sglang_router_options() -> set[str]:
    """``sglang_router.launch_router``'s options (router_args.py writes them as ``f"--{prefix}name"``)."""
    text = _site_file("sglang_router", "router_args.py").read_text(encoding="utf-8")
    return {"--" + m for m in re.findall(r"f?\"--(?:\{prefix\})?([a-z0-9-]+)\"", text)}


def named_flags() -> dict[str, list[str]]:
    """``--flag`` -> where it appears, over every module of packages/*/src and apps/*/src."""
    found: dict[str, list[str]] = {}
    for path in sorted([*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")]):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for flag in FLAG.findall(line):
                found.setdefault(flag, []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_the_readers_of_sglang_options_still_find_them():
    # If SGLang reorganises its argument code, these readers must fail here rather than allow any name.
    server, router = sglang_server_options(), sglang_router_options()
    assert {"--mem-fraction-static", "--port", "--dtype", "--enable-memory-saver", "--api-key"} <= server
    assert "--startup-timeout-s" not in server  # the name tidal once told users to pass through
    assert {"--worker-urls", "--policy", "--cache-threshold", "--host"} <= router


def test_every_flag_named_in_the_source_exists():
    train = _options(build_parser())
    known = train | _options(convert.build_parser()) | set(OTHER_TOOLS)
    server, router = sglang_server_options(), sglang_router_options()
    wrong = {}
    for flag, places in named_flags().items():
        if flag in known:
            continue
        if flag.startswith("--sglang-router-") and "--" + flag.removeprefix("--sglang-router-") in router:
            continue  # passed to sglang-router as --NAME
        if flag.startswith("--sglang-") and "--" + flag.removeprefix("--sglang-") in server:
            continue  # passed to the SGLang server as --NAME
        if flag in server or flag in router:
            continue  # SGLang's or the router's own option, where tidal builds their command lines
        wrong[flag] = places[:3]
    assert not wrong, f"flags named in the source that no parser knows: {wrong}"
