"""The ``--sglang-*`` pass-through: tidal's flags mapped to SGLang's and sglang-router's arguments, and checked.

``--sglang-X V`` reaches ``sglang.launch_server`` as ``--X V``, ``--sglang-router-X V`` reaches
``sglang_router.launch_router`` as ``--X V``. The ``=`` form (``--sglang-X=V``) becomes the same two tokens, here and
nowhere else, so every reader of the mapped arguments (the engines' dtype default, the memory plan, the
tensor-parallel check, ``config.yaml``) finds a value as the token after its flag. The values tidal itself reads are
range-checked (:func:`sglang_value_problems`) and the flags tidal sets itself are refused, both without importing
SGLang; :func:`sglang_arg_problems` runs SGLang's own parsers on the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

SGLANG_FLAG_PREFIX = "--sglang-"
ROUTER_FLAG_PREFIX = "--sglang-router-"

OWNED_SERVER_FLAGS = {
    "--model-path": "--hf-checkpoint",
    "--port": "the placement (a free port per engine)",
    "--nccl-port": "the placement (a free port per engine)",
}
"""``sglang.launch_server`` flags tidal sets on each engine, with what sets them: a pass-through would override them."""
OWNED_ROUTER_FLAGS = {
    "--host": "the placement",
    "--port": "the placement (a free port)",
    "--worker-urls": "the engines tidal starts (or --rollout-external-engine-addrs)",
}
"""``sglang_router.launch_router`` flags tidal sets, with what sets them."""


def _split_flags(flags: Sequence[str], *, router: bool) -> tuple[str, ...]:
    """The ``--sglang-router-*`` flags (``router``) or the other ``--sglang-*`` flags, values kept with their flag.

    ``--sglang-X=V`` comes out as the two tokens ``--X``, ``V``.
    """
    out: list[str] = []
    keep = False
    for arg in flags:
        value: list[str] = []
        if arg.startswith("--"):
            arg, eq, rest = arg.partition("=")
            value = [rest] if eq else []
            if not arg.startswith(SGLANG_FLAG_PREFIX) or len(arg) == len(SGLANG_FLAG_PREFIX):
                raise ValueError(f"{arg!r} is not an SGLang pass-through flag: write it as --sglang-<server-option>")
            is_router = arg.startswith(ROUTER_FLAG_PREFIX)
            keep = is_router == router
            if keep:
                arg = "--" + arg[len(ROUTER_FLAG_PREFIX if router else SGLANG_FLAG_PREFIX) :]
        if keep:
            out += [arg, *value]
    return tuple(out)


def sglang_server_args(flags: Sequence[str]) -> tuple[str, ...]:
    """Map tidal's ``--sglang-*`` flags to ``sglang.launch_server`` arguments.

    ``["--sglang-mem-fraction-static=0.7", "--sglang-enable-metrics"]`` becomes
    ``("--mem-fraction-static", "0.7", "--enable-metrics")``; values pass through unchanged, so any
    SGLang option works without a code change here. ``--sglang-router-*`` flags (and their values) are
    left out: they are the router's (see :func:`sglang_router_args`).

    Raises:
        ValueError: A flag does not start with ``--sglang-``.
    """
    return _split_flags(flags, router=False)


TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
"""SGLang's names of an engine's tensor-parallel size."""


def with_engine_tp(server_args: Sequence[str], gpus_per_engine: int) -> tuple[str, ...]:
    """``server_args`` with ``--tp-size`` set to the GPUs each engine is given (added when missing and above 1).

    An engine is one SGLang server whose tensor parallelism spans its GPUs: without ``--tp-size`` it would serve
    on one of them while the weight sync addresses one rank per GPU.

    Raises:
        ValueError: ``--sglang-tp-size`` is given and differs from ``gpus_per_engine``.
    """
    args = tuple(server_args)
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name not in TP_FLAGS:
            continue
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if value != str(gpus_per_engine):
            raise ValueError(
                f"--sglang-{name[2:]} {value} disagrees with --rollout-num-gpus-per-engine {gpus_per_engine}: each "
                f"engine's tensor parallelism spans the GPUs it is given; drop --sglang-{name[2:]} (tidal starts "
                f"each SGLang server with a tensor-parallel size of {gpus_per_engine}) or set "
                f"--rollout-num-gpus-per-engine {value}"
            )
        return args
    return (*args, "--tp-size", str(gpus_per_engine)) if gpus_per_engine > 1 else args


def sglang_router_args(flags: Sequence[str]) -> tuple[str, ...]:
    """Map tidal's ``--sglang-router-*`` flags to ``sglang_router.launch_router`` arguments.

    ``["--sglang-mem-fraction-static", "0.7", "--sglang-router-cache-threshold", "0.5"]`` becomes
    ``("--cache-threshold", "0.5")``: any router option works without a code change here.

    Raises:
        ValueError: A flag does not start with ``--sglang-``.
    """
    return _split_flags(flags, router=True)


def sglang_arg_problems(server_args: Sequence[str], router_args: Sequence[str]) -> list[str]:
    """What SGLang's own argument parsers refuse in the pass-through flags: one line per flag, nothing started.

    ``server_args`` (from :func:`sglang_server_args`) go through ``sglang.launch_server``'s parser
    (``ServerArgs.add_cli_args``, imported here: about 4 s, as it imports torch), ``router_args`` through
    ``sglang_router.launch_router``'s (``RouterArgs.add_cli_args``); each flag is parsed alone, so every bad one is
    named: an unknown option (with the closest real one), a value of the wrong type, a value outside its choices,
    a wrong number of values. Ranges that SGLang checks only while it resolves the model and the device are not in
    its parsers: :func:`sglang_value_problems` checks those of the values tidal reads, the server the others.
    """
    problems: list[str] = []
    if server_args:
        from sglang.srt.server_args import ServerArgs

        parser = _refusing_parser("sglang.launch_server")
        ServerArgs.add_cli_args(parser)
        problems += _refused(parser, server_args, SGLANG_FLAG_PREFIX, required=["--model-path", "MODEL"])
    if router_args:
        from sglang_router.router_args import RouterArgs

        parser = _refusing_parser("sglang_router.launch_router")
        RouterArgs.add_cli_args(parser, use_router_prefix=False)
        problems += _refused(parser, router_args, ROUTER_FLAG_PREFIX, required=[])
    return problems


def _refusing_parser(prog: str):
    import argparse

    parser = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False)

    def error(message: str):
        raise ValueError(message)

    parser.error = error  # argparse reports some mistakes through error(), which would exit the process
    return parser


def _refused(parser, args: Sequence[str], prefix: str, *, required: list[str]) -> list[str]:
    import argparse
    import difflib

    known = sorted(parser._option_string_actions)
    chunks: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not chunks:
            chunks.append([arg])
        else:
            chunks[-1].append(arg)
    problems = []
    for chunk in chunks:
        name = chunk[0].split("=", 1)[0]
        ours = prefix + name[2:]
        given = " ".join([ours + chunk[0][len(name) :], *chunk[1:]])
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {prefix}{close[0][2:]}?" if close else ""
            problems.append(f"{ours} is not an option of {parser.prog} (tidal passes {prefix}X on as --X){hint}")
            continue
        try:
            _, extra = parser.parse_known_args([*required, *chunk])
        except (argparse.ArgumentError, ValueError) as e:
            problems.append(f"{given}: {parser.prog} refuses it ({e}); see `python -m {parser.prog} --help`")
            continue
        if extra:
            problems.append(f"{given}: {parser.prog} takes no value {' '.join(extra)!r} after {name}")
    return problems


def server_arg_value(server_args: Sequence[str], flag: str) -> str | None:
    """The value SGLang takes for ``flag`` in mapped ``server_args``, None when the flag is absent or has no value.

    The token after the flag's last occurrence: argparse keeps the last.
    """
    args, value = list(server_args), None
    for i, arg in enumerate(args):
        if arg == flag:
            after = args[i + 1] if i + 1 < len(args) else None
            value = after if after is not None and not after.startswith("--") else None
    return value


def sglang_value_problems(server_args: Sequence[str], router_args: Sequence[str]) -> list[str]:
    """The pass-through values tidal reads out of range, and the flags tidal sets itself: one line each.

    ``--mem-fraction-static`` (read by the memory plan) must lie in (0, 1); a value that is not a number at all is
    left to :func:`sglang_arg_problems`, which names SGLang's own message.
    """
    problems = [
        f"{SGLANG_FLAG_PREFIX}{flag[2:]} is set by tidal from {owner}: drop it"
        for flag, owner in OWNED_SERVER_FLAGS.items()
        if flag in server_args
    ]
    problems += [
        f"{ROUTER_FLAG_PREFIX}{flag[2:]} is set by tidal from {owner}: drop it"
        for flag, owner in OWNED_ROUTER_FLAGS.items()
        if flag in router_args
    ]
    fraction = server_arg_value(server_args, "--mem-fraction-static")
    try:
        bad = fraction is not None and not 0.0 < float(fraction) < 1.0
    except ValueError:
        bad = False
    if bad:
        problems.append(
            f"--sglang-mem-fraction-static {fraction}: must be in (0, 1), the share of each engine's GPU memory that "
            "SGLang takes for weights and KV cache; e.g. 0.8, or leave it out (SGLang picks one)"
        )
    return problems
