"""The driver's agent rollout (``DriverRollouts``, through the real gateway and agent runner) on the session's server.

- Under --use-fault-tolerance an engine that dies fails its episodes, which are counted and replaced: the rollout
  runs on an engine address where nothing listens at first (a dead server: connections are refused). Every episode
  of round 1 fails and drops its group; before round 2 the driver restarts the dead engines, here by opening that
  address onto the session's SGLang server (launched engines are restarted by their Ray workers, which this test
  does not start), and round 2's groups fill the batch.
- --agent-max-concurrency bounds the episodes in flight, as the agent itself counts them.
"""

import contextlib
import json
import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from tidal_train_plugins import AGENT_CHAT_TEMPLATE

pytestmark = pytest.mark.slow


class Forwarder:
    """Listens on ``port`` and passes each connection on to ``upstream`` (the engine, back at its address)."""

    def __init__(self, port: int, upstream: str) -> None:
        host, up_port = upstream.rsplit(":", 1)
        self.upstream = (host, int(up_port))
        self.server = socket.create_server(("127.0.0.1", port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            up = socket.create_connection(self.upstream)
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=_pump, args=(src, dst), daemon=True).start()

    def close(self) -> None:
        self.server.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _manager(tmp_path: Path, agent: str, *flags: str):
    """The rollout manager of a job running ``tidal_train_plugins:<agent>`` on 16 addition prompts (no engine yet)."""
    from tidal.train.cli import parse_job
    from tidal.train.cluster import rollout_manager_of
    from tidal.train.data import PromptDataset
    from tidal.train.embedded_model import ensure_embedded_model
    from transformers import AutoTokenizer

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a:02d}+{a + 3:02d}=", "label": f"{2 * a + 3:03d}"}) + "\n"
                            for a in range(10, 26)))  # fmt: skip
    job = parse_job(
        ["--agent-function-path", f"tidal_train_plugins:{agent}", "--prompt-data", str(rows),
         "--rollout-max-response-len", "4", "--output-dir", str(tmp_path / "run"), *flags]
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    data = PromptDataset(rows, tokenizer, input_key="prompt", label_key="label", seed=0)
    return rollout_manager_of(job, data, tmp_path / "run")


def test_episodes_a_dead_engine_failed_are_counted_and_replaced_after_its_restart(tmp_path, external_engine):
    manager = _manager(tmp_path, "steady_arithmetic_agent", "--use-fault-tolerance", "--rollout-batch-size", "2",
                       "--n-samples-per-prompt", "2", "--rollout-request-retries", "0")  # fmt: skip
    port = _free_port()
    manager.engine_urls = [f"http://127.0.0.1:{port}"]  # a dead engine: nothing listens there
    back: list[Forwarder] = []

    def restart_dead_engines() -> int:  # the engine's server comes back at its address
        if back:
            return 0
        back.append(Forwarder(port, external_engine))
        return 1

    manager.restart_dead_engines = restart_dead_engines
    try:
        samples, metrics = manager.driver.generate(0)
    finally:
        manager.driver.shutdown()
        for forwarder in back:
            forwarder.close()
    assert metrics["rollout/agent/engines_restarted"] == 1.0 and metrics["rollout/agent/rounds"] == 2.0
    # round 1: both groups lost every episode to the dead engine; they were counted, dropped and replaced
    assert metrics["rollout/agent/failed"] == 4.0 and metrics["rollout/agent/groups_dropped"] == 2.0
    assert metrics["rollout/agent/episodes"] == 8.0
    assert sum(v for k, v in metrics.items() if k.startswith("rollout/agent/failed/")) == 4.0
    assert len({(s.group_index, s.episode) for s in samples}) == 4 and all(s.response_ids for s in samples)
    (failure_log,) = (tmp_path / "run").rglob("agent_failures.log")
    assert failure_log.read_text().count("--- ") == 4


@pytest.mark.parametrize("bound", [2, 5])
def test_agent_max_concurrency_bounds_the_episodes_in_flight(tmp_path, external_engine, bound):
    # 3 groups of 2 episodes, each episode one model call and 0.2 s more: the agent counts the most running at once
    from tidal_train_plugins import IN_FLIGHT

    manager = _manager(tmp_path, "counting_agent", "--agent-max-concurrency", str(bound), "--rollout-batch-size", "3",
                       "--n-samples-per-prompt", "2")  # fmt: skip
    manager.engine_urls = [f"http://{external_engine}"]
    IN_FLIGHT.update(now=0, max=0)
    try:
        samples, metrics = manager.driver.generate(0)
    finally:
        manager.driver.shutdown()
    assert metrics["rollout/agent/failed"] == 0.0 and metrics["rollout/agent/episodes"] == 6.0
    assert len({(s.group_index, s.episode) for s in samples}) == 6
    assert (IN_FLIGHT["max"], IN_FLIGHT["now"]) == (bound, 0)  # reached, never passed (6 would run at once)
