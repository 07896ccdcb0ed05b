import signal

import pytest
from tidal.rollout.crash_cause import crash_cause

TORCH_OOM = """[2026-12-05 08:01:02 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/x/sglang/srt/managers/scheduler.py", line 2120, in run_scheduler_process
    scheduler.event_loop_overlap()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB
"""
KV = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: 0.3"
ILLEGAL = "RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronous"
PORT = "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use"
KERNEL = "ImportError: libcuda.so.1: cannot open shared object file: No such file or directory"
MODULE = "ModuleNotFoundError: No module named 'sgl_kernel.common_ops'"
ARGPARSE = "usage: sglang serve [-h] ...\nsglang serve: error: argument --mem-fraction-static: invalid float value: 'x'"


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (TORCH_OOM, "out of GPU memory: lower --sglang-mem-fraction-static"),
        (KV, "raise --sglang-mem-fraction-static"),
        (ILLEGAL, "illegal memory access, most often memory pressure: lower --sglang-mem-fraction-static"),
        (PORT, "a port it needs is held by another process"),
        (KERNEL, "a kernel or library is missing (libcuda.so.1: cannot open shared object)"),
        (MODULE, "a kernel or library is missing (No module named 'sgl_kernel.common_ops')"),
        (
            ARGPARSE,
            "SGLang refused an option (--mem-fraction-static invalid float value: 'x'): fix "
            "--sglang-mem-fraction-static",
        ),
    ],
    ids=["oom", "kv-cache", "illegal-access", "port", "library", "module", "option"],
)
def test_the_log_names_the_cause_and_the_option(log, expected):
    cause = crash_cause("INFO: loading weights\n" + log + "\n[INFO] shutting down")
    assert cause is not None and expected in cause
    assert "\n" not in cause


def test_the_last_cause_in_the_log_wins_within_a_kind_and_known_causes_beat_a_bare_kill():
    assert "out of GPU memory" in crash_cause(TORCH_OOM, -signal.SIGKILL)
    assert crash_cause("all fine\nthen nothing", -signal.SIGKILL).startswith("killed by SIGKILL")


def test_no_cause_is_none_rather_than_a_guess():
    assert crash_cause("INFO: Uvicorn running\nINFO: shutting down", 1) is None
    assert crash_cause("", None) is None
