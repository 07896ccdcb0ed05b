"""`train` across two hosts: two network namespaces on this machine, each with its own address, one Ray cluster.

Host A (198.51.100.1, a documentation range) runs the Ray head, the driver and the actor; host B (198.51.100.2) a
Ray worker node and the SGLang engine. The namespaces are joined by a veth pair and reach nothing but each other
and their own loopback. The run is decoupled (actor and engine on a GPU each, one logical GPU per host), so the
engine must listen on B's address and every request and weight update crosses hosts, with the per-run API key.
Midway, B's SGLang server is SIGKILLed; --use-fault-tolerance restarts it, the actor's current weights go into it
before it serves again over the broadcast transport (nccl's CPU form, gloo, with a fresh group that includes the new
server; gloo is pinned to each host's interface, since these namespaces resolve their host names to 127.0.0.1),
checked on the probe (--check-weight-update-equal), and the run completes. Its weights go as deltas
(--update-weight-delta): whole to the restarted server, and whole once more at the sync after it, deltas again
after that. Its actor trains a PPO critic beside it (--advantage-estimator ppo) through the restart.

Building the namespaces needs CAP_NET_ADMIN: as root the test runs `ip` itself, otherwise through passwordless
`sudo -n` (what GitHub's hosted runners give the job user). Every process on the two hosts runs as the test's own
user either way (setpriv, with the test's environment), so the run's files stay the user's and the test can stop it.
Where neither root nor passwordless sudo is available the test fails with that reason; it skips only when
TIDAL_SKIP_MULTI_NODE=1 says to (CI never sets it). CI runs it in the `integration` job (hosted runner, through sudo)
and in `.ci/run` (as root).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from server_procs import sglang_server_pids
from test_train_e2e import _alive, _children, _set_child_subreaper
from test_train_modes_e2e import COMMON, _kill_until_none_left, _records

pytestmark = pytest.mark.slow

HOST_A, HOST_B = "198.51.100.1", "198.51.100.2"
RAY_PORT = 6379  # inside host A's namespace: no other process can hold it
OPT_OUT = "TIDAL_SKIP_MULTI_NODE"
"""Set to 1 to skip this test where it cannot run (no root, no passwordless sudo); CI must not set it."""


def _tool(name: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if found is None:
        pytest.fail(f"`{name}` is not installed: this test needs iproute2 (ip) and util-linux (setpriv)")
    return found


def net_admin_prefix() -> list[str]:
    """What runs `ip` with CAP_NET_ADMIN: nothing as root, else `sudo -n`; fails (skips when opted out) if neither."""
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo and subprocess.run([sudo, "-n", "true"], capture_output=True, timeout=60).returncode == 0:
        return [sudo, "-n"]
    reason = (
        f"this test builds two hosts from network namespaces (`ip netns`), which needs root or passwordless sudo; "
        f"user {os.geteuid()} has neither ({'sudo asks for a password' if sudo else 'no sudo'})"
    )
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"{reason}; skipped because {OPT_OUT}=1")
    pytest.fail(f"{reason}: run it as root or with passwordless sudo, or set {OPT_OUT}=1 to skip it knowingly")


class Hosts:
    """Two network namespaces joined by a veth pair: ``ip`` runs with ``prefix``, commands on them as this user."""

    def __init__(self, prefix: list[str]) -> None:
        self.prefix, self.ip = prefix, _tool("ip")
        self.as_user = [_tool("setpriv"), f"--reuid={os.getuid()}", f"--regid={os.getgid()}", "--clear-groups", "--"]

    def run_ip(self, *args: str) -> None:
        proc = subprocess.run([*self.prefix, self.ip, *args], capture_output=True, text=True, timeout=60)
        if proc.returncode:
            pytest.fail(f"`{' '.join([*self.prefix, 'ip', *args])}` failed: {proc.stderr.strip()}")

    def command(self, ns: str, cmd: list[str], env: dict[str, str]) -> list[str]:
        """``cmd`` on host ``ns`` as this user with exactly ``env`` (sudo would reset the environment)."""
        environment = ["env", "-i", *(f"{k}={v}" for k, v in env.items())]
        return [*self.prefix, self.ip, "netns", "exec", ns, *self.as_user, *environment, *cmd]


@contextlib.contextmanager
def _two_hosts(hosts: Hosts):
    """Namespaces ``(a, b)`` joined by a veth pair, addressed HOST_A and HOST_B; removed afterwards, also on failure."""
    tag = f"td{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    made = []
    try:
        for ns in (a, b):
            hosts.run_ip("netns", "add", ns)
            made.append(ns)
        hosts.run_ip("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v")
        for ns, addr in ((a, HOST_A), (b, HOST_B)):
            hosts.run_ip("link", "set", f"{ns}v", "netns", ns)
            hosts.run_ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"{ns}v")
            hosts.run_ip("-n", ns, "link", "set", "lo", "up")
            hosts.run_ip("-n", ns, "link", "set", f"{ns}v", "up")
        yield a, b
    finally:
        for ns in made:
            subprocess.run([*hosts.prefix, hosts.ip, "netns", "del", ns], capture_output=True)  # and the veth pair


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants that this user may signal (under sudo: all but sudo itself, which exits
    with its command)."""
    pids, i = [pid], 0
    while i < len(pids):
        with contextlib.suppress(OSError):
            pids += sorted(_children(pids[i]))
        i += 1
    for p in reversed(pids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _ray(hosts: Hosts, ns: str, *args: str, env: dict[str, str]) -> None:
    ray = str(Path(sys.executable).parent / "ray")
    proc = subprocess.run(hosts.command(ns, [ray, "start", *args], env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def two_host_run(tmp_path_factory):
    """Ray head on A, worker on B, `train` on A with its engine on B; B's server SIGKILLed after rollout 0."""
    hosts = Hosts(net_admin_prefix())
    root = tmp_path_factory.mktemp("multi_node")
    token = root / "ray_token"
    token.write_text(os.urandom(32).hex())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))  # a cluster reachable from the network
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])  # --custom-rm
    out = root / "run"
    ray_tmp = tempfile.mkdtemp(prefix="tdray")  # short: Ray's socket paths under it must fit in 107 bytes
    killed: list[int] = []
    before = _children(os.getpid())
    _set_child_subreaper(True)  # Ray's daemons and the servers they start stay ours, so all are stopped after
    try:
        with _two_hosts(hosts) as (a, b):
            common = ["--num-cpus", "2", "--num-gpus", "1", "--disable-usage-stats"]
            _ray(hosts, a, "--head", "--node-ip-address", HOST_A, "--port", str(RAY_PORT),
                 "--include-dashboard", "false", "--temp-dir", ray_tmp, *common, env=env)  # fmt: skip
            _ray(hosts, b, "--address", f"{HOST_A}:{RAY_PORT}", "--node-ip-address", HOST_B, *common, env=env)
            # 8 rollouts of ~0.15 s each: the kill, polled every 50 ms from rollout 0's record, lands mid-run
            args = [*COMMON, "--num-rollout", "8", "--no-colocate", "--actor-num-gpus-per-node", "1",
                    "--rollout-num-gpus", "1", "--update-weight-transport", "nccl", "--use-fault-tolerance",
                    "--check-weight-update-equal", "--update-weight-delta",
                    "--advantage-estimator", "ppo", "--custom-rm-path", "tidal_train_plugins:reward_by_length",
                    "--ray-address", f"{HOST_A}:{RAY_PORT}",
                    "--output-dir", str(out)]  # fmt: skip
            log = root / "train.log"
            with log.open("w") as f:
                train = [sys.executable, "-m", "tidal.train.cli", *args]
                proc = subprocess.Popen(hosts.command(a, train, env), stdout=f, stderr=subprocess.STDOUT)
                deadline = time.monotonic() + 1200
                while proc.poll() is None and time.monotonic() < deadline:
                    if not killed and len(_records(out)) >= 1:
                        for pid in sglang_server_pids(host=HOST_B):
                            with contextlib.suppress(ProcessLookupError):
                                os.killpg(os.getpgid(pid), signal.SIGKILL)  # the server and its schedulers
                                killed.append(pid)
                    time.sleep(0.05)
                if proc.poll() is None:
                    _kill_tree(proc.pid)
                code = proc.wait(timeout=120)
            servers_after = [p for p in sglang_server_pids(host=HOST_B) if _alive(p)]
            _kill_until_none_left(before)
    finally:
        _set_child_subreaper(False)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return code, log.read_text(), out, killed, servers_after


def test_the_run_spans_two_hosts_and_completes(two_host_run):
    code, log, out, _, _ = two_host_run
    assert code == 0, log[-6000:]
    assert [r["rollout"] for r in _records(out)] == list(range(8))
    assert all(r["rollout/weight_version"] == r["rollout"] for r in _records(out))  # each rollout saw its sync
    assert f"SGLang server at http://{HOST_B}:" in log  # the engine listens on host B's address, not loopback
    assert json.loads((out / "summary.json").read_text())["eval_after"] is not None


def test_servers_on_node_addresses_get_a_per_run_key(two_host_run):
    _, log, out, _, _ = two_host_run
    key = out / "sglang_api_key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert key.read_text().strip() not in log  # written only to its file


def test_a_killed_server_on_the_other_host_is_restarted(two_host_run):
    _, log, _, killed, servers_after = two_host_run
    assert killed, "no SGLang server on host B was found to kill"
    # whichever call meets the dead server first (generation or the next weight sync) restarts it
    assert f"restarting SGLang server at http://{HOST_B}:" in log
    assert not servers_after  # and the run stopped it at the end


def test_the_restarted_server_got_the_actors_weights_before_serving(two_host_run):
    # The kill lands after rollout 0's record: during a generation (the restarted server holds its requests until the
    # driver resyncs it: "resync.nccl") or during a weight sync (its broadcast, version check or probe: the sync runs
    # again to every engine, "retry"). Either way, before the restarted server generated again, the actor's current
    # weights went in over the run's transport, the server reported that version, and its probe matched the actor's.
    _, log, out, _, _ = two_host_run
    records = _records(out)
    assert all(r["weight_sync/transport"] == "nccl" for r in records)
    events = [json.loads(line) for line in (out / "handoff.jsonl").read_text().splitlines()]
    at = [i for i, e in enumerate(events) if e["event"] == "resync.nccl" or e.get("retry")]
    assert len(at) == 1, events
    version = events[at[0]]["version"]
    assert version >= 1, events[at[0]]  # the initial weights are version 0
    if events[at[0]]["event"] == "resync.nccl":
        assert version == events[at[0]]["rollout"]  # the rollout it was generating
        assert "syncing the current weights into them" in log
    else:
        assert events[at[0]]["event"] == "sync.nccl", events[at[0]]
        assert "died and restarted; syncing again" in log
    assert records[version]["rollout/weight_version"] == version
    check = events[at[0] + 1]
    assert check["event"] == "sync.check" and check["mean"] < 1e-3, check  # fp32 engine and actor
    generated = [i for i, e in enumerate(events) if e["event"] == "engines.generate" and e["rollout"] == version]
    assert at[0] < generated[-1]  # the restarted server's generation with that version came after it
    # --update-weight-delta: the first sync whole, then deltas; the restarted server got the weights whole (the resync
    # or the sync run again), and the delta snapshots were rebuilt by one more whole sync: the one after the resync,
    # or the retried sync itself (record version - 1); deltas again after it, none sent again whole
    full = [r["weight_sync/delta_full"] for r in records]
    again = version if events[at[0]]["event"] == "resync.nccl" else version - 1
    assert full == [1.0 if i in (0, again) else 0.0 for i in range(len(records))], (full, again)
    assert all(r["weight_sync/delta_fallbacks"] == 0.0 for r in records)


def test_the_critic_trained_beside_the_actor_through_the_restart(two_host_run):
    # --advantage-estimator ppo: every rollout trained the critic (no critic-only steps) on returns above 0
    # (--custom-rm-path: each sample's reward is its response length / 10)
    _, log, out, _, _ = two_host_run
    records = _records(out)
    assert len(records) == 8, log[-6000:]
    for r in records:
        assert r["train/critic_only"] == 0.0 and r["critic/returns_mean"] > 0.0, r
        assert r["critic/value_loss"] > 0.0 and r["critic/grad_norm"] > 0.0, r


def test_without_root_or_passwordless_sudo_it_fails_with_the_reason(monkeypatch, tmp_path):
    # The other tests fail (never skip silently) where the namespaces cannot be built; only the opt-out skips.
    monkeypatch.setattr(os, "geteuid", lambda: 4321)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sudo on it
    monkeypatch.delenv(OPT_OUT, raising=False)
    with pytest.raises(pytest.fail.Exception, match="needs root or passwordless sudo; user 4321 has neither"):
        net_admin_prefix()
    monkeypatch.setenv(OPT_OUT, "1")
    with pytest.raises(pytest.skip.Exception, match=f"skipped because {OPT_OUT}=1"):
        net_admin_prefix()
