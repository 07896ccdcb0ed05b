"""Ports that never conflict: one allocator actor per node IP hands out distinct, tested-free port blocks.

Within a job the allocator actor is the one owner of the cursor. Between jobs on one host (two ``train`` runs, each
with its own Ray), every reserved port also holds an exclusive ``flock`` on ``$TMPDIR/tidal-ports/PORT.lock`` for
the life of the allocator process: a port tested free by one job but not yet bound by its server is skipped by
the other job's allocator instead of handed out twice. The kernel drops the locks when the process dies, so a
killed run leaves nothing stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tidal.placement.errors import PlacementError

logger = logging.getLogger(__name__)

# Each handed-out port P reserves [P, P + PORT_SPAN): SGLang derives ports from its dist-init port
# (dist_init_port + 1 .. + 6) and, with DP attention on one node, from its HTTP port + 233 .. + 238.
PORT_SPAN = 8
SGLANG_DERIVED_OFFSETS = (0, 233)
# Below Linux's ephemeral range (32768+): bind(0) and outgoing connections never land here, and above
# Ray's worker ports (10002-19999).
PORT_RANGE = (20000, 32000)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnginePorts:
    """The ports of one SGLang server on ``host``: HTTP, NCCL (torch.distributed) and ``--dist-init-addr``."""

    host: str
    http_port: int
    nccl_port: int
    dist_init_port: int

    @property
    def url(self) -> str:
        """``http://host:http_port``."""
        return f"http://{self.host}:{self.http_port}"


def _is_free(port: int) -> bool:
    """Bind-then-release on all interfaces, without SO_REUSEADDR, as a server would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def _lock_dir() -> Path | None:
    """The host-wide folder of port lock files (made world-writable, sticky), or None where it cannot be made."""
    path = Path(tempfile.gettempdir()) / "tidal-ports"
    try:
        path.mkdir(mode=0o1777, exist_ok=True)
        with contextlib.suppress(OSError):
            path.chmod(0o1777)
    except OSError as e:
        logger.warning("port locks off (%s): concurrent jobs on this host rely on bind tests alone", e)
        return None
    return path


class _HostLocks:
    """Exclusive ``flock``s on ``PORT.lock`` files, held until :meth:`release` or this process's exit."""

    def __init__(self, folder: Path | None) -> None:
        self._folder = folder
        self._fds: dict[int, int] = {}

    def take(self, ports: list[int]) -> bool:
        """Lock every port of ``ports`` or none of them; False when another process holds one."""
        if self._folder is None:
            return True
        taken = []
        for port in ports:
            try:
                fd = os.open(self._folder / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            except OSError:
                self.release(taken)
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                self.release(taken)
                return False
            self._fds[port] = fd
            taken.append(port)
        return True

    def release(self, ports: list[int]) -> None:
        for port in ports:
            fd = self._fds.pop(port, None)
            if fd is not None:
                os.close(fd)  # closing the only descriptor drops the lock


class _PortBook:
    """The state of one node's allocator: a cursor and every port reserved so far in this run."""

    def __init__(
        self, low: int, high: int, span: int, offsets: tuple[int, ...], *, lock_dir: Path | bool | None = True
    ) -> None:
        self._low, self._high, self._span, self._offsets = low, high, span, offsets
        self._next = low
        self._reserved: set[int] = set()
        self._locks = _HostLocks(_lock_dir() if lock_dir is True else (lock_dir or None))

    def _block(self, base: int) -> list[int]:
        return [base + off + i for off in self._offsets for i in range(self._span)]

    def allocate(self, n: int) -> list[int]:
        """``n`` ports, each the base of a free, unreserved block; never handed out again in this run."""
        ports: list[int] = []
        tried = 0
        while len(ports) < n:
            if tried > (self._high - self._low) // self._span + 1:
                raise PlacementError(
                    f"no free port block of {self._span} left in [{self._low}, {self._high}) on this node "
                    f"after reserving {len(self._reserved)} ports; free some ports or widen the range"
                )
            base = self._next
            self._next = base + self._span if base + self._span < self._high else self._low
            tried += 1
            block = self._block(base)
            if max(block) > 65535 or self._reserved.intersection(block) or not self._locks.take(block):
                continue
            if not all(map(_is_free, block)):
                self._locks.release(block)
                continue
            self._reserved.update(block)
            ports.append(base)
        return ports

    def num_reserved(self) -> int:
        return len(self._reserved)


# One method runs at a time in a Ray actor, so concurrent callers never see the same cursor.
_PortBookActor = ray.remote(num_cpus=0)(_PortBook)

# Ray garbage-collects a named (non-detached) actor, and with it every reservation, once no handle to it is
# left; so each process keeps the handles it used until it exits. Keyed by cluster and job, so a new Ray
# session never sees a stale handle. (The actor also fate-shares with the process that created it: create it
# from the long-lived driver, as create_placement does.)
_HANDLES: dict[tuple[str, str, str, str], ray.actor.ActorHandle] = {}
_HANDLES_LOCK = threading.Lock()


class PortAllocator:
    """Client of the named allocator actor of one node IP (created on first use, shared by the whole job).

    Create it first in the driver (``create_placement`` does so for every node of the placement): the actor
    fate-shares with the process that created it.

    All callers on a node, in any process of the job, reach the same actor; it binds each candidate to test it
    and keeps every handed-out port reserved for the rest of the run, so a port is never given twice, even when
    many engines start at once, and stays reserved until (and after) its server has bound it.
    """

    def __init__(self, node_ip: str | None = None, *, name: str = "tidal-ports") -> None:
        """Connect to (or create) the allocator on the node with IP ``node_ip`` (default: this node)."""
        self.node_ip = node_ip or ray.util.get_node_ip_address()
        ctx = ray.get_runtime_context()
        key = (ctx.gcs_address, ctx.get_job_id(), name, self.node_ip)
        # Under the lock, so that threads of one process keep the handle that created (and owns) the actor:
        # a later thread's get-if-exists handle does not own it, and dropping the owner's would kill it.
        with _HANDLES_LOCK:
            if key not in _HANDLES:
                _HANDLES[key] = _PortBookActor.options(
                    name=f"{name}-{self.node_ip}",
                    get_if_exists=True,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(_node_id_for_ip(self.node_ip), soft=False),
                ).remote(PORT_RANGE[0], PORT_RANGE[1], PORT_SPAN, SGLANG_DERIVED_OFFSETS)
            self._actor = _HANDLES[key]

    def allocate(self, n: int, *, timeout_s: float = 60.0) -> list[int]:
        """Reserve ``n`` distinct ports on this node (each the base of a ``PORT_SPAN`` block)."""
        try:
            return ray.get(self._actor.allocate.remote(n), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise PlacementError(f"the port allocator on {self.node_ip} did not answer in {timeout_s} s") from e

    def engine_ports(self) -> EnginePorts:
        """HTTP, NCCL and dist-init ports for one SGLang server on this node."""
        http, nccl, dist = self.allocate(3)
        return EnginePorts(host=self.node_ip, http_port=http, nccl_port=nccl, dist_init_port=dist)


def forget_allocators() -> None:
    """Drop this process's allocator handles (called when Ray shuts down; the actors go with the job)."""
    _HANDLES.clear()


def _node_id_for_ip(node_ip: str) -> str:
    # Simulated multi-node clusters share one IP (and one port space), hence one allocator per IP.
    ids = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] == node_ip)
    if not ids:
        raise PlacementError(
            f"no alive Ray node has IP {node_ip}; known nodes: {[n['NodeManagerAddress'] for n in ray.nodes()]}"
        )
    return ids[0]
