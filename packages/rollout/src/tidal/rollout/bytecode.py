"""Compile an environment's bytecode once, before an SGLang server start would compile its imports from source.

With ``PYTHONDONTWRITEBYTECODE`` set, a module without a ``.pyc`` is compiled from source on every import, in every
process: an SGLang server's launcher, scheduler and detokenizer each import sglang, torch and transformers, so an
environment installed without bytecode pays that on every start (about half of it, bench/RESULTS.md). uv installs
without bytecode unless asked (``uv sync --compile-bytecode``). :func:`compile_site_packages` compiles the
``site-packages`` folder that holds a package, once: later starts, and every other Python process of that
environment, read the bytecode.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 1800.0
"""Longest wait for the compilation (about 1-2 minutes for ~40,000 files on two cores)."""


def site_packages_of(package: str) -> Path | None:
    """The folder ``package`` is installed in (its ``site-packages``), found without importing it; None if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).parent.parent


def compile_site_packages(
    env: Mapping[str, str], *, package: str = "sglang", timeout_s: float = COMPILE_TIMEOUT_S, log_every_s: float = 30.0
) -> float | None:
    """Byte-compile the ``site-packages`` holding ``package``, as a process with ``env`` would look for it.

    ``python -m compileall`` runs with ``env`` (so ``PYTHONPYCACHEPREFIX`` is honoured) on all cores; a file lock
    makes concurrent callers (two engines starting at once) wait for one compilation instead of running two. Progress
    is logged every ``log_every_s``. A failure or a timeout is logged and not raised: the server then starts without
    bytecode, only slower.

    Returns:
        Seconds spent compiling, or None when ``package`` is not installed from source files or compiling failed.
    """
    folder = site_packages_of(package)
    if folder is None:
        return None
    # The lock lives in the folder being compiled (which must be writable for the bytecode anyway).
    lock_path = folder / ".tidal-bytecode.lock"
    start = time.monotonic()
    try:
        lock = open(lock_path, "w")  # noqa: SIM115 (closed below, after the compilation it guards)
    except OSError as e:
        logger.warning("cannot compile %s's bytecode (%s); starting without it", folder, e)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent compilation finishes first; compileall then skips fresh files
        logger.warning(
            "compiling the bytecode of %s once (%s is installed without it and PYTHONDONTWRITEBYTECODE is set): "
            "every later SGLang start and Python process of this environment reads it; about 1-2 min on two cores",
            folder,
            package,
        )
        cmd = [sys.executable, "-m", "compileall", "-q", "-j", "0", str(folder)]
        proc = subprocess.Popen(cmd, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while True:
            try:
                _, err = proc.communicate(timeout=log_every_s)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed > timeout_s:
                    proc.kill()
                    proc.wait()
                    logger.warning(
                        "compiling %s's bytecode ran past %.0f s; stopped, starting without it", folder, timeout_s
                    )
                    return None
                logger.info("compiling %s's bytecode: %.0f s so far", folder, elapsed)
    seconds = time.monotonic() - start
    # compileall exits 1 when any file fails to compile (e.g. a test fixture with a syntax error): the rest is compiled.
    if proc.returncode not in (0, 1):
        logger.warning("compiling %s's bytecode failed (exit %s): %s", folder, proc.returncode, (err or "")[-500:])
        return None
    logger.info("compiled %s's bytecode in %.1f s", folder, seconds)
    return seconds
