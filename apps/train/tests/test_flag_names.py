"""Every ``--flag`` that tidal's source (messages, docstrings, comments) or a README names is one a user can pass,
and every option is one config field whose flag, kind, default and help agree.

A message that tells the user to pass a flag that does not exist, or one that tidal forwards to SGLang under
another name, is worse than no advice. Names are checked against the ``train`` parser, ``train convert``'s
parser, SGLang's and sglang-router's own options (read from their source: importing SGLang takes ~30 s), and a
short list of other tools' flags, each with its reason.
"""

import argparse
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
from tidal.train import convert
from tidal.train.flags import APP_OPTIONS, SECTIONS, build_parser, options
from tidal.train.shared import SHARED

ROOT = Path(__file__).resolve().parents[3]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")

# Flags of other tools, named for comparison or to build their command lines; never offered as `train` flags.
OTHER_TOOLS = {
    "--allgather-cp": "slime's flag, named where tidal's context-parallel attention does the same",
    "--get-mismatch-metrics": "slime's flag, named where tidal's engine-actor agreement (always on) does the same",
    "--make-vocab-size-divisible-by": "Megatron's flag, named where tidal pads the vocabulary the same way",
    "--out-dir": "`python -m tidal.train.task_data --out-dir`, the shipped data's own generator",
    "--compile-bytecode": "uv's (`uv sync --compile-bytecode`), named where SGLang's start-up would compile it",
    "--wandb-key": "slime's flag, named where tidal refuses it (a key on a command line shows in the process list)",
    "--json": "W&B's (`wandb leet inspect --json`), named where an offline W&B run is read back",
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


# Placeholders and other tools' flags in the READMEs' prose.
README_ONLY = {
    "--package": "uv's (`uv run --package`)",
    "--flag": "a placeholder for any flag",
    "--x": "a placeholder for an SGLang option",
    "--sglang-x": "a placeholder for an SGLang pass-through",
}


def named_flags(readmes: bool = False) -> dict[str, list[str]]:
    """``--flag`` -> where it appears, over every module of packages/*/src and apps/*/src (or the READMEs)."""
    found: dict[str, list[str]] = {}
    sources = [*ROOT.glob("packages/*/src/**/*.py"), *ROOT.glob("apps/*/src/**/*.py")]
    if readmes:
        sources = [ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("apps/*/README.md")]
    for path in sorted(sources):
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


@pytest.mark.parametrize("readmes", [False, True], ids=["source", "readmes"])
def test_every_flag_named_in_the_source_exists(readmes):
    train = _options(build_parser())
    known = train | _options(convert.build_parser()) | set(OTHER_TOOLS) | (set(README_ONLY) if readmes else set())
    server, router = sglang_server_options(), sglang_router_options()
    wrong = {}
    for flag, places in named_flags(readmes).items():
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


# Fields of a section that are no command-line option, and who fills them (besides the SHARED targets).
FILLED_BY_THE_APP = {
    ("rollout", "sglang_server_args"): "the --sglang-* pass-through",
    ("rollout", "sglang_router_args"): "the --sglang-router-* pass-through",
    ("actor", "fused_kernels"): "on wherever CUDA is (tests and benches switch it off in code)",
}


def test_each_option_is_one_field_with_a_flag_and_a_help():
    found = options()
    assert len({o.flag for o in found}) == len(found), "two fields share a flag"
    assert len({o.name for o in found}) == len(found), "two options share a field name (argparse dest)"
    for o in found:
        assert o.name in {f.name for f in dataclasses.fields(SECTIONS[o.section])}
        assert o.help, f"{o.flag}: its field {o.section}.{o.name} has no docstring (the option's help)"
        assert "(default" not in o.help, f"{o.flag}: --help states the default itself; drop it from the docstring"
        assert o.flag not in o.help, f"{o.flag}: the docstring repeats its own flag (it is derived from the field)"
        if o.flag != "--" + o.name.replace("_", "-"):  # named in metadata: only slime's exceptions
            assert o.flag in {"--placement-timeout", "--lr-warmup-iters"} or o.flag.startswith("--no-"), o.flag


def test_the_parser_holds_exactly_the_fields_options():
    expected = {"-h", "--help", *APP_OPTIONS}
    for o in options():
        expected.add(o.flag)
        if o.short:
            expected.add(o.short)
        if o.kwargs.get("action") is argparse.BooleanOptionalAction:
            expected.add("--no-" + o.flag[2:])
    assert _options(build_parser()) == expected
    dests = {a.dest: a for a in build_parser()._actions}
    for o in options():
        assert dests[o.name].option_strings[0] == o.flag  # the flag fills the field of the same name


def test_a_flags_kind_agrees_with_its_fields_type_and_default():
    for o in options():
        kind = o.kwargs.get("type")
        if o.default is dataclasses.MISSING or o.default is None:
            continue
        if kind is not None and o.kwargs.get("nargs") is None:
            assert isinstance(o.default, kind) and not isinstance(o.default, bool), (o.flag, o.default)
        action = o.kwargs.get("action")
        if action in ("store_true", "store_false"):
            assert o.default is (action == "store_false"), (o.flag, o.default)


def test_every_field_that_is_no_option_is_filled_by_the_app():
    targets = {t for ts in SHARED.values() for t in ts}
    by_field = {(o.section, o.name): o for o in options()}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if (section, f.name) not in by_field:
                assert (section, f.name) in targets or (section, f.name) in FILLED_BY_THE_APP, (section, f.name)
    for source, ts in SHARED.items():
        assert source in by_field, f"{source}: a shared value must be one package's option"
        assert not set(ts) & set(by_field), f"{ts}: a copy of a shared value must not be an option too"


def test_unknown_field_metadata_is_refused():
    from tidal.train.flags import _option

    @dataclasses.dataclass
    class C:
        x: int = dataclasses.field(default=1, metadata={"flags": "--y"})

    with pytest.raises(TypeError, match="unknown option metadata"):
        _option("train", dataclasses.fields(C)[0], int, "doc")


def test_help_shows_every_default_and_the_embedded_recipes_values():
    from tidal.train.recipes import recipe_options

    text = build_parser(("embedded", recipe_options("embedded"))).format_help()
    assert text.count("(default:") == len(options()) + 1  # and --recipe's
    assert "(default: 1e-06; recipe embedded: 0.0004)" in " ".join(text.split())
    assert "without it `embedded`" in " ".join(text.split())  # the rule that picks the recipe
