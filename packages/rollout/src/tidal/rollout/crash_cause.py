"""Why a server died, read from its log: the cause in a few words and the option to change.

A dead SGLang server's log usually ends in a long traceback whose meaning is known: a CUDA out-of-memory, an
illegal memory access (most often memory pressure), a kernel or library that is missing, a port another process
holds, an option SGLang refused, or nothing at all when the kernel's OOM killer sent SIGKILL. ``crash_cause`` turns
the log's tail (and the exit code) into one phrase that a one-line error can quote.
"""

from __future__ import annotations

import re
import signal

# (pattern, cause): the first pattern found in the log, read from its end, names the cause.
_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"error: argument (--[\w-]+): (.*)"),
        "SGLang refused an option ({0} {1}): fix --sglang-{2}",
    ),
    (
        re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static", re.I),
        "too little GPU memory left for the KV cache: raise --sglang-mem-fraction-static, or lower "
        "--sglang-max-total-tokens",
    ),
    (
        re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.I),
        "out of GPU memory: lower --sglang-mem-fraction-static (more room for activations and CUDA graphs), "
        "--sglang-max-running-requests or --sglang-chunked-prefill-size",
    ),
    (
        re.compile(r"illegal memory access", re.I),
        "an illegal memory access, most often memory pressure: lower --sglang-mem-fraction-static, or try "
        "--sglang-disable-cuda-graph",
    ),
    (
        re.compile(r"Address already in use|Errno 98|EADDRINUSE", re.I),
        "a port it needs is held by another process: start again (tidal picks free ports), or stop the other job",
    ),
    (
        re.compile(r"(No module named '[\w.]+'|undefined symbol: \w+|lib[\w.-]+\.so[\d.]*: cannot open shared object)"),
        "a kernel or library is missing ({0}): install the sglang and sglang-kernel builds for this CUDA",
    ),
    (
        re.compile(r"\bMemoryError\b|Cannot allocate memory", re.I),
        "out of host memory: lower --sglang-max-total-tokens, or give the machine more memory",
    ),
)


def crash_cause(log_text: str, returncode: int | None = None) -> str | None:
    """The cause of a server's death in one phrase with the option to change, or None when the log says nothing.

    Args:
        log_text: the tail of the server's log.
        returncode: its exit code (``-9``: killed by SIGKILL), if known.
    """
    lines = log_text.splitlines()
    for pattern, cause in _CAUSES:
        for line in reversed(lines):
            match = pattern.search(line)
            if match is None:
                continue
            groups = [g.strip() for g in match.groups()]
            if pattern.pattern.startswith("error: argument"):
                groups.append(groups[0].removeprefix("--"))
            return cause.format(*groups)
    if returncode == -signal.SIGKILL:
        return (
            "killed by SIGKILL with nothing in its log: the kernel's OOM killer when host memory runs out (lower "
            "--sglang-max-total-tokens), or a kill from outside"
        )
    return None
