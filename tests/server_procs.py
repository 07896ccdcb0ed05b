"""Process look-ups of the cross-package tests: which SGLang servers run, found through /proc."""

from __future__ import annotations

from pathlib import Path


def sglang_server_pids(**flags: str | int) -> list[int]:
    """Pids of the SGLang launch_server processes whose command line has each ``--FLAG VALUE`` of ``flags``.

    ``sglang_server_pids(port=30000)``: the server on port 30000; ``sglang_server_pids(host="198.51.100.2")``: those
    listening on that address.
    """
    wanted = [(f"--{k}".encode(), str(v).encode()) for k, v in flags.items()]
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"sglang.launch_server" in cmd and all(_value(cmd, flag) == value for flag, value in wanted):
            pids.append(int(proc.name))
    return pids


def _value(cmd: list[bytes], flag: bytes) -> bytes | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else None
