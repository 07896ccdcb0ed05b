"""Two `train` jobs started at the same moment on one host, each its own OS process with its own Ray and SGLang.

Their port allocators (one per job, tidal.placement.ports) test ports free and reserve them, and each reserved port
holds a host-wide lock file until the job ends, so neither job can be handed a port the other tested free but has
not bound yet: the SGLang servers' HTTP and NCCL ports and the actor's rendezvous port. Both must finish, on
distinct ports, leaving no process behind. One pair of tiny runs (2 rollouts each) for the whole module; each job
also shows, in its actor's log, that its rank read the HF weights once.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: siblings are not importable otherwise
from test_train_e2e import _children, _leftovers, _set_child_subreaper

pytestmark = pytest.mark.slow

ARGS = [
    "--num-rollout", "2",
    "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4",
    "--rollout-max-response-len", "6",
    "--num-eval-prompts", "4",
    "--verbose",  # the workers' INFO lines (the ports SGLang was started on)
]  # fmt: skip


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """``[(returncode, output, run folder)]`` of the two jobs, and the processes either left behind."""
    from tidal.train.embedded_model import ensure_embedded_model

    ensure_embedded_model()  # built once here, not twice at once by the two jobs
    outs = [tmp_path_factory.mktemp(f"job{i}") for i in range(2)]
    before = _children(os.getpid())
    _set_child_subreaper(True)
    procs = []
    try:
        for out in outs:
            log = (out.parent / f"{out.name}.log").open("w")
            cmd = [sys.executable, "-m", "tidal.train.cli", *ARGS, "--output-dir", str(out / "run")]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + 1500
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                codes.append(proc.wait(timeout=60))
            log.close()
        leftovers = _leftovers(before)
    finally:
        _set_child_subreaper(False)
    logs = [Path(log.name).read_text() for _, log in procs]
    results = [(code, log, out / "run") for code, log, out in zip(codes, logs, outs, strict=True)]
    return results, leftovers


def test_both_jobs_finish(two_jobs):
    results, _ = two_jobs
    for code, output, run in results:
        assert code == 0, output[-6000:]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["rollout"] for r in records] == [0, 1]


def test_their_servers_ran_on_distinct_ports(two_jobs):
    results, _ = two_jobs
    ports = []
    for _, output, _ in results:
        started = re.findall(r"starting SGLang server at http://[\d.]+:(\d+):.* --nccl-port (\d+)", output)
        assert len(started) == 1, output[-3000:]  # one server each, started once: no port had to be retried
        ports.append({int(p) for p in started[0]})
    assert not ports[0] & ports[1], ports


def test_each_job_read_the_hf_weights_once(two_jobs):
    from safetensors.torch import load_file
    from tidal.train.embedded_model import embedded_model_path

    tensors = load_file(embedded_model_path() / "model.safetensors").values()
    total = sum(t.numel() * t.element_size() for t in tensors)
    results, _ = two_jobs
    for _, _, run in results:
        log = (run / "logs" / "actor_r0.log").read_text()
        assert re.findall(r"actor weights: .*this rank read (\d+) bytes of HF weights", log) == [str(total)]


def test_no_process_is_left(two_jobs):
    _, leftovers = two_jobs
    assert not leftovers, leftovers
