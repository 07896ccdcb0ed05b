"""Run an untrusted Python program in a sandbox: Linux namespaces and resource limits, driven from Python.

Each run gets its own user, mount, network, pid, IPC and UTS namespaces (built by :mod:`tidal.rollout.sandbox_init`):
no network (only a loopback that is down), a root of its own that shows the system's libraries and the interpreter
read-only and nothing else of the host (no run folder, no home, no ``/proc``), a writable throwaway ``/sandbox``
of bounded size, a clean environment, and limits on wall time, CPU time, address space, processes and output.
Killing the launcher's process group ends every process of the run (pid 1 dies with its parent; the pid
namespace dies with its pid 1). Nothing needs root or a system package: unprivileged user namespaces suffice,
and as root the program runs as nobody. :func:`check_sandbox` says at start-up whether this machine allows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tidal.rollout import sandbox_init

_LAUNCHER = Path(sandbox_init.__file__)
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_STDERR_KEPT = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """What one run may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the run is killed (its CPU limit is the same, rounded up)."""
    memory_mb: int = 1024
    """Address space of each process, MiB (an allocation beyond it fails: MemoryError)."""
    max_processes: int = 16
    """Processes and threads the program may have at once (a fork beyond it fails)."""
    max_output_bytes: int = 4 << 20
    """Bytes of stdout plus stderr before the run is killed."""
    disk_mb: int = 64
    """Size of the writable ``/sandbox`` (and the largest file), MiB."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    """How one sandboxed run ended."""

    stdout: bytes
    """What the program wrote to stdout (at most ``max_output_bytes``)."""
    stderr: str
    """The end of what it wrote to stderr (decoded, at most a few KiB)."""
    exit_code: int | None
    """Its exit status (128 + N: killed by signal N); None when the sandbox killed it."""
    seconds: float
    """Wall time from start to end."""
    killed: str | None = None
    """Why the sandbox killed it: "timeout" or "output_limit"; None when it ended by itself."""

    @property
    def setup_failed(self) -> bool:
        """Whether the sandbox itself could not be built (the program never ran)."""
        return self.exit_code == sandbox_init.SETUP_FAILED and "tidal-sandbox:" in self.stderr


def _interpreter() -> tuple[str, str]:
    """The base interpreter (outside any virtual environment) and its installation prefix."""
    executable = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return executable, os.path.realpath(sys.base_prefix)


def _job(files: dict[str, str], argv: list[str], root: str, limits: SandboxLimits) -> dict:
    executable, prefix = _interpreter()
    system = [p for p in _SYSTEM_PATHS if os.path.lexists(p)]
    binds = system + ([] if any(prefix == p or prefix.startswith(p + "/") for p in system) else [prefix])
    return {
        "root": root,
        "binds": binds + [d for d in _DEVICES if os.path.exists(d)],
        "files": files,
        "argv": [executable, "-E", "-s", *argv],  # not -I: the script's folder is on sys.path
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox", "LANG": "C.UTF-8"},
        "limits": {
            "cpu_s": limits.wall_s + 0.999,
            "memory_bytes": limits.memory_mb << 20,
            "processes": limits.max_processes,
            "disk_bytes": limits.disk_mb << 20,
        },
    }


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the program may exit or close stdin without reading it all
        stream.write(data)
        await stream.drain()
        stream.close()


async def _drain(stream: asyncio.StreamReader, out: bytearray, budget: list[int], keep_all: bool) -> None:
    """Read ``stream`` to its end into ``out`` while ``budget[0]`` (shared by stdout and stderr) lasts."""
    while chunk := await stream.read(1 << 16):
        budget[0] -= len(chunk)
        if budget[0] < 0:
            raise OverflowError
        out += chunk
        if not keep_all and len(out) > 2 * _STDERR_KEPT:
            del out[:-_STDERR_KEPT]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_program(
    files: dict[str, str], script: str, stdin: bytes = b"", *, limits: SandboxLimits = SandboxLimits()
) -> RunResult:
    """Run ``python -E -s SCRIPT`` in a new sandbox whose ``/sandbox`` (the working folder) holds ``files``.

    ``files`` maps plain file names to their text; ``stdin`` is the program's standard input. Returns when the
    program and every process it started are gone, at the latest about ``limits.wall_s`` seconds after the start.
    """
    workdir = tempfile.mkdtemp(prefix="tidal-sandbox-")
    try:
        os.chmod(workdir, 0o711)  # its root folder is entered as the sandbox's user (nobody, under root)
        root = os.path.join(workdir, "root")
        os.mkdir(root, 0o755)
        job_file = os.path.join(workdir, "job.json")
        with open(os.open(job_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            json.dump(_job(files, [script], root, limits), f)
        return await _run(job_file, stdin, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(job_file: str, stdin: bytes, limits: SandboxLimits) -> RunResult:
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        _interpreter()[0], "-I", "-S", str(_LAUNCHER), job_file,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={}, start_new_session=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err, budget = bytearray(), bytearray(), [limits.max_output_bytes]
    tasks = [
        asyncio.ensure_future(_feed(proc.stdin, stdin)),
        asyncio.ensure_future(_drain(proc.stdout, out, budget, keep_all=True)),
        asyncio.ensure_future(_drain(proc.stderr, err, budget, keep_all=False)),
    ]
    killed = None
    try:
        await asyncio.wait_for(asyncio.gather(*tasks[1:], proc.wait()), timeout=limits.wall_s)
    except TimeoutError:
        killed = "timeout"
    except OverflowError:
        killed = "output_limit"
    finally:
        if proc.returncode is None:  # unreaped, its pid (the group's id) cannot have been reused
            _kill_group(proc.pid)  # the launcher exits only after every process of its sandbox is gone
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await proc.wait()
    return RunResult(
        stdout=bytes(out[: limits.max_output_bytes]),
        stderr=err[-_STDERR_KEPT:].decode(errors="replace"),
        exit_code=None if killed else proc.returncode,
        seconds=time.monotonic() - start,
        killed=killed,
    )


@functools.cache
def sandbox_problem() -> str | None:
    """Why this machine cannot run the sandbox (one line), or None when a probe program ran in it as expected."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces, and this is {sys.platform}"
    probe = "import os, socket\nprint(sum(range(10)), os.getuid(), sorted(os.listdir('/')))\n"
    try:
        result = asyncio.run(run_program({"probe.py": probe}, "probe.py", limits=SandboxLimits(wall_s=30)))
    except OSError as e:
        return f"the sandbox's launcher could not start: {e}"
    last = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.exit_code}, no message"]
    if result.killed or not result.stdout.startswith(b"45 1000 "):
        return f"a probe program did not run in the sandbox ({last[0]})"
    return None


def check_sandbox(flag: str = "--rm-type code") -> None:
    """Raise ``ValueError`` (one line naming ``flag``) when the sandbox cannot run here; never runs unsandboxed."""
    problem = sandbox_problem()
    if problem is not None:
        raise ValueError(
            f"{flag} runs each program in a sandbox of unprivileged Linux user, mount, network and pid namespaces, "
            f"and this machine refused it: {problem}. Allow unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1 and kernel.apparmor_restrict_unprivileged_userns=0; in a container, "
            "a seccomp profile that permits unshare) or choose another --rm-type"
        )
