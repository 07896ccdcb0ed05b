"""--rm-type code: programs run against their rows' tests in the sandbox, which holds against hostile programs."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
from tidal.rollout import RolloutConfig, Sample, resolve_reward_fn, rollout_metrics, score_samples
from tidal.rollout.code_tests import BadTests, last_code_block, parse_tests
from tidal.rollout.sandbox import sandbox_problem

# Skipped only where the machine refuses user namespaces; a sandbox that breaks anywhere else fails every test.
pytestmark = pytest.mark.skipif(
    "cannot create a user namespace" in (sandbox_problem() or ""), reason=f"no sandbox here: {sandbox_problem()}"
)

ADD = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
ADD_SOLUTION = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"


def _sample(program: str | None, label: object, group: int = 0) -> Sample:
    text = "Here is my answer." if program is None else f"Thinking...\n```python\n{program}```\nDone."
    return Sample(
        prompt_ids=[1], response_ids=[2], response_log_probs=[-0.1], finish_reason="stop",
        label=label, response_text=text, group_index=group,
    )  # fmt: skip


def _reward(**options) -> object:
    return resolve_reward_fn("code", RolloutConfig(rm_type="code", **options))


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_hostile_programs_are_contained_scored_zero_with_their_reason_and_the_run_goes_on(tmp_path, monkeypatch):
    marker = f"tidal-sandbox-test-{uuid.uuid4().hex}"
    secret = tmp_path / "sglang_api_key"
    secret.write_text("run-secret")
    monkeypatch.setenv("TIDAL_TEST_SECRET", "env-secret")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    escaped = tmp_path / "escaped"
    leave_behind = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\n"
    )
    three = {"inputs": [""], "outputs": ["3"]}
    hostile = [  # (what it tries, the reason it scores 0, program, label: what an escape would print)
        ("socket", "network", f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", ADD),
        (
            "writes outside",
            "runtime_error",
            f"open({str(escaped)!r}, 'w').write('x')\nopen('/escaped', 'w').write('x')\nprint(3)\n",
            three,
        ),
        (
            "reads secrets",
            "wrong_answer",
            "import os\n"
            f"try:\n    print(open({str(secret)!r}).read())\nexcept OSError:\n    print('no file')\n"
            "print(os.environ.get('TIDAL_TEST_SECRET'))\n",
            {"inputs": [""], "outputs": ["run-secret\nenv-secret\n"]},
        ),
        ("fork bomb", "process_limit", "import os\nwhile True:\n    os.fork()\n", ADD),
        ("new namespaces", "runtime_error", "import os\nos.unshare(os.CLONE_NEWUSER)\nprint(3)\n", three),  # seccomp
        ("10 GB", "memory_limit", "block = bytearray(10 * 2**30)\n", ADD),
        ("sleeps forever", "timeout", leave_behind + "time.sleep(3600)\n", ADD),
        ("prints 1 GB", "output_limit", "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)\n", ADD),
    ]
    samples = [_sample(program, label, g) for g, (_, _, program, label) in enumerate(hostile)]
    samples += [_sample(ADD_SOLUTION, ADD, len(samples)), _sample(None, ADD, len(samples) + 1)]
    start = time.monotonic()
    scored = score_samples(samples, _reward(code_sandbox_timeout_s=2.0, code_sandbox_max_concurrency=8))
    elapsed = time.monotonic() - start

    reasons = [reason for _, reason, _, _ in hostile]
    for sample, reason in zip(scored, [*reasons, None, "no_code"], strict=True):
        assert sample.reward_error is None
        if reason is None:
            assert sample.reward == 1.0 and sample.reward_metrics["code/cases_run"] == 2
        else:
            assert sample.reward == 0.0, reason
            assert sample.reward_metrics.get(f"code/zero/{reason}") == 1.0, (reason, sample.reward_metrics)
    metrics = rollout_metrics(scored)
    for reason in {*reasons, "no_code"}:
        assert metrics[f"rollout/code/zero/{reason}"] == [*reasons, "no_code"].count(reason)
    assert metrics["rollout/reward/mean"] == pytest.approx(1 / len(scored))
    assert metrics["rollout/code/sandbox_s"] >= 2.0  # the timed-out run's seconds are counted
    assert elapsed < 6  # killed at --code-sandbox-timeout-s 2, not left to sleep; the 10 GB failed at once
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection ever reached the host
    assert not escaped.exists() and not Path("/escaped").exists()
    assert _processes_with(marker) == []  # the setsid'd grandchild died with its sandbox


@pytest.mark.parametrize(
    ("layout", "tests", "right", "wrong"),
    [
        ("apps json string", json.dumps(ADD), ADD_SOLUTION, "print(3)\n"),
        (
            "deepcoder list",
            [{"input": "4\n", "output": "16"}, {"input": "0.5\n", "output": "0.25000000001"}],
            "print(float(input()) ** 2)\n",
            "print(float(input()) * 2)\n",
        ),
        (
            "apps fn_name",
            {"inputs": [[2, 3], [[1, 2], 4]], "outputs": [[5], [[1, 2, 4]]], "fn_name": "f"},
            "def f(a, b):\n    return a + b if isinstance(a, int) else a + [b]\n",
            "def f(a, b):\n    return a\n",
        ),
        (
            "leetcode Solution class",
            {"inputs": ["[3]"], "outputs": ["9"], "fn_name": "square"},
            "class Solution:\n    def square(self, x):\n        return x * x\n",
            "class Solution:\n    def square(self, x):\n        return x\n",
        ),
        (
            "mbpp test_list",
            {"test_list": ["assert add(1, 2) == 3", "assert add(K, 1) == 11"], "test_setup_code": "K = 10"},
            "def add(a, b):\n    return a + b\n",
            "def add(a, b):\n    return a - b\n",
        ),
        (
            "humaneval check",
            {"test": "def check(candidate):\n    assert candidate(2) == 4\n", "entry_point": "double"},
            "def double(x):\n    return 2 * x\n",
            "def double(x):\n    return x\n",
        ),
        (
            "kodcode test functions",
            {"test": "from solution import inc\ndef test_inc():\n    assert inc(1) == 2\n"},
            "def inc(x):\n    return x + 1\n",
            "def inc(x):\n    return x\n",
        ),
    ],
)
def test_each_test_layout_passes_a_right_program_and_fails_a_wrong_one(layout, tests, right, wrong):
    scored = score_samples([_sample(right, tests), _sample(wrong, tests)], _reward())
    assert [s.reward for s in scored] == [1.0, 0.0], (layout, [s.reward_metrics for s in scored])


def test_the_last_code_block_is_the_program_and_unreadable_tests_score_zero_with_their_reason():
    text = "```python\nprint(1)\n```\nbetter:\n```\nprint(2)\n```"
    assert last_code_block(text) == "print(2)\n"
    assert last_code_block("no code here") is None
    for bad in ("not json", {"inputs": ["1"], "outputs": []}, {"whatever": 1}, 7):
        with pytest.raises(BadTests):
            parse_tests(bad)
    (scored,) = score_samples([_sample("print(1)\n", "not json")], _reward())
    assert scored.reward == 0.0 and scored.reward_metrics["code/zero/bad_tests"] == 1.0


def test_memory_and_concurrency_follow_their_options():
    program = "block = bytes(300 * 2**20)\nimport time\ntime.sleep(0.5)\nprint(3)\n"
    label = {"inputs": [""], "outputs": ["3"]}
    samples = [_sample(program, label, g) for g in range(3)]
    start = time.monotonic()
    small = score_samples(samples[:1], _reward(code_sandbox_memory_mb=256))
    assert small[0].reward == 0.0 and small[0].reward_metrics["code/zero/memory_limit"] == 1.0
    start = time.monotonic()
    one_at_a_time = score_samples(samples, _reward(code_sandbox_max_concurrency=1))
    serial_s = time.monotonic() - start
    start = time.monotonic()
    together = score_samples(samples, _reward(code_sandbox_max_concurrency=3))
    parallel_s = time.monotonic() - start
    assert [s.reward for s in one_at_a_time + together] == [1.0] * 6  # 300 MB fits the default 1024 MiB
    assert serial_s >= 1.5 > parallel_s, (serial_s, parallel_s)
