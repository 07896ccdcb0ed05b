"""SGLangEngine against a real SGLang server on CPU (one per session, see conftest.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tidal.rollout import RolloutError, SGLangClient, SGLangEngine
from tidal.rollout.engine import CPU_SERVER_ARGS, missing_bytecode_note

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def _procs() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgid) of every live process, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if fields[0] != "Z":
            out.append((int(entry), int(fields[1]), int(fields[2])))
    return out


def _descendants(pid: int) -> set[int]:
    procs = _procs()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, ppid, _ in procs if ppid in frontier} - found
        found |= frontier
    return found


def test_command_on_cpu_adds_cpu_flags_and_lets_extra_args_win(tmp_path: Path) -> None:
    engine = SGLangEngine(
        "/m", port=1234, nccl_port=1235, log_dir=tmp_path, extra_server_args=["--max-total-tokens", "2048"], cpu=True
    )
    cmd = engine.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--nccl-port") + 1] == "1235"
    for flag in CPU_SERVER_ARGS:
        assert flag[0] in cmd
    assert cmd.count("--max-total-tokens") == 1
    assert cmd[cmd.index("--max-total-tokens") + 1] == "2048"
    gpu_cmd = SGLangEngine("/m", port=1234, log_dir=tmp_path, cpu=False).command()
    assert "--device" not in gpu_cmd and "--nccl-port" not in gpu_cmd
    assert cmd.count("--incremental-streaming-output") == gpu_cmd.count("--incremental-streaming-output") == 1


def test_crash_diagnostics_are_off_unless_the_environment_turns_them_on(tmp_path: Path, monkeypatch) -> None:
    from tidal.rollout.engine import CRASH_DIAGNOSTICS_ENV

    pyspy, coredump = CRASH_DIAGNOSTICS_ENV
    monkeypatch.delenv(pyspy, raising=False)
    monkeypatch.setenv(coredump, "1")
    env = SGLangEngine("/m", port=1234, log_dir=tmp_path, cpu=True).server_env()
    assert env[pyspy] == "0" and env[coredump] == "1"


def test_missing_bytecode_is_reported_only_when_every_start_would_compile(tmp_path: Path, monkeypatch) -> None:
    import importlib
    import py_compile

    package = tmp_path / "tidal_bytecode_probe"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    no_write = {"PYTHONDONTWRITEBYTECODE": "1"}
    assert missing_bytecode_note({}, "tidal_bytecode_probe") is None  # the first start writes the .pyc files
    assert "uv sync --compile-bytecode" in missing_bytecode_note(no_write, "tidal_bytecode_probe")
    prefix = tmp_path / "pycache"
    with_prefix = {**no_write, "PYTHONPYCACHEPREFIX": str(prefix)}
    py_compile.compile(str(package / "__init__.py"))  # what `uv sync --compile-bytecode` writes
    assert missing_bytecode_note(no_write, "tidal_bytecode_probe") is None
    assert missing_bytecode_note(with_prefix, "tidal_bytecode_probe") is not None  # Python looks only there
    tag = sys.implementation.cache_tag
    in_prefix = prefix / package.relative_to("/") / f"__init__.{tag}.pyc"
    py_compile.compile(str(package / "__init__.py"), cfile=str(in_prefix))
    assert missing_bytecode_note(with_prefix, "tidal_bytecode_probe") is None


def test_non_loopback_host_needs_an_api_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set --sglang-api-key"):
        SGLangEngine("/m", host="0.0.0.0", port=1234, log_dir=tmp_path)
    engine = SGLangEngine("/m", host="0.0.0.0", port=1234, log_dir=tmp_path, api_key="k3y", cpu=True)
    cmd = engine.command()
    assert cmd[cmd.index("--api-key") + 1] == "k3y"


def test_server_on_cpu_runs_with_the_sgl_kernel_stand_in(sglang_server: SGLangEngine) -> None:
    if not sglang_server.cpu:
        pytest.skip("CUDA present: the real sgl_kernel is used")
    # SGLang still imports sgl_kernel on the CPU path (else the stand-in could go), and got ours.
    assert "[tidal cpu_stub] serving sgl_kernel" in sglang_server.log_path.read_text(errors="replace")
    assert sglang_server.get_model_info()["is_generation"] is True


def test_generate_returns_sampled_tokens_with_their_log_probs(sglang_server: SGLangEngine, tiny_model_dir) -> None:
    from transformers import Qwen2ForCausalLM

    params = {"n": 3, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    outputs = sglang_server.generate(PROMPTS, params)
    assert len(outputs) == len(PROMPTS) * 3
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    for out in outputs:
        assert 1 <= len(out["output_ids"]) <= 8
        assert len(out["output_log_probs"]) == len(out["output_ids"])
        assert all(lp <= 0.0 for lp in out["output_log_probs"])
        assert all(0 <= t < vocab for t in out["output_ids"])
        assert out["finish_reason"] in ("stop", "length")
        assert out["weight_version"] is not None
    # The log-probs are those of the sampled tokens under the served weights: recompute them with HF.
    model = Qwen2ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i, out in enumerate(outputs):
        prompt = PROMPTS[i // 3]  # prompt-major: the 3 samples of prompt 0 come first
        tokens = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
        positions = torch.arange(len(prompt) - 1, tokens.shape[1] - 1)
        expected = log_probs[positions, tokens[0, len(prompt) :]]
        torch.testing.assert_close(torch.tensor(out["output_log_probs"]), expected, atol=2e-3, rtol=0)


def test_max_new_tokens_truncates_with_finish_reason_length(sglang_server: SGLangEngine) -> None:
    outputs = sglang_server.generate(PROMPTS, {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True})
    assert [out["finish_reason"] for out in outputs] == ["length"] * len(PROMPTS)
    assert all(len(out["output_ids"]) == 3 for out in outputs)


def test_stop_token_ends_generation_and_is_kept(sglang_server: SGLangEngine, tiny_model_dir) -> None:
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    # Every token id stops (specials too: a random model samples <pad>/<unk> now and then, seen in CI), so the
    # first sampled token ends the response and is kept.
    stop_ids = list(range(vocab))
    outputs = sglang_server.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 1.0, "stop_token_ids": stop_ids})
    for out in outputs:
        assert out["finish_reason"] == "stop"
        assert len(out["output_ids"]) == 1
        assert out["output_ids"][0] in stop_ids or out["output_ids"][0] == 2  # a stop id or the model's EOS


def test_update_weights_from_disk_changes_greedy_outputs(
    sglang_server: SGLangEngine, tiny_model_dir: Path, other_model_dir: Path
) -> None:
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    before = [out["output_ids"] for out in sglang_server.generate(PROMPTS, greedy)]
    assert [out["output_ids"] for out in sglang_server.generate(PROMPTS, greedy)] == before  # greedy is repeatable
    try:
        sglang_server.update_weights_from_disk(other_model_dir, weight_version="v1")
        assert sglang_server.get_model_info()["weight_version"] == "v1"
        after = sglang_server.generate(PROMPTS, greedy)
        assert [out["output_ids"] for out in after] != before
        assert {out["weight_version"] for out in after} == {"v1"}
    finally:
        sglang_server.update_weights_from_disk(tiny_model_dir, weight_version="v2")
    sglang_server.flush_cache()
    assert [out["output_ids"] for out in sglang_server.generate(PROMPTS, greedy)] == before


def test_update_weights_from_missing_dir_raises_with_server_message(sglang_server: SGLangEngine, tmp_path) -> None:
    with pytest.raises(RolloutError, match="refused update_weights_from_disk"):
        sglang_server.update_weights_from_disk(tmp_path / "no_such_checkpoint")
    assert sglang_server.generate([[3, 4]], {"max_new_tokens": 2})[0]["output_ids"]  # still serving


def test_bad_model_fails_fast_with_log_tail_and_leaves_no_process(tmp_path: Path, free_port) -> None:
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no_such_architecture"}')
    engine = SGLangEngine(bad, port=free_port(), log_dir=tmp_path / "logs", startup_timeout_s=300)
    start = time.monotonic()
    with pytest.raises(RolloutError, match="exited with code") as info:
        engine.start()
    assert time.monotonic() - start < 200
    assert "last" in str(info.value) and "lines of" in str(info.value)
    assert "no_such_architecture" in str(info.value)  # the server's own complaint, from its log
    assert engine.pid is None and not engine.is_running()


def test_a_server_killed_by_a_bad_option_names_the_option_in_the_first_line(tmp_path: Path, tiny_model_dir, free_port):
    engine = SGLangEngine(
        tiny_model_dir,
        port=free_port(),
        log_dir=tmp_path / "logs",
        extra_server_args=["--mem-fraction-static", "most"],
        startup_timeout_s=300,
    )
    with pytest.raises(RolloutError) as info:
        engine.start()
    first = str(info.value).splitlines()[0]
    assert "exited with code" in first
    assert "cause: SGLang refused an option (--mem-fraction-static invalid float value: 'most')" in first
    assert "fix --sglang-mem-fraction-static" in first
    assert not engine.is_running()


def test_startup_timeout_raises_and_kills_the_server(tiny_model_dir: Path, tmp_path: Path, free_port) -> None:
    engine = SGLangEngine(tiny_model_dir, port=free_port(), log_dir=tmp_path, startup_timeout_s=1.0)
    engine.start(wait=False)
    pgid = engine.pid
    with pytest.raises(RolloutError, match="not healthy after 1 s"):
        engine.wait_healthy()
    assert not [p for p, _, g in _procs() if g == pgid]


def _cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def test_an_idle_cpu_server_does_not_spin(sglang_server: SGLangEngine) -> None:
    if not sglang_server.cpu:
        pytest.skip("--sleep-on-idle is a CPU default")
    # without --sleep-on-idle the scheduler's busy loop took ~65% of a core here while no request came
    sglang_server.generate([[3, 4]], {"max_new_tokens": 2})
    pids = {sglang_server.pid, *_descendants(sglang_server.pid)}
    start_cpu, start = _cpu_seconds(pids), time.monotonic()
    time.sleep(3.0)  # measuring idleness: nothing to wait for
    used = (_cpu_seconds(pids) - start_cpu) / (time.monotonic() - start)
    assert used < 0.2, f"the idle server used {used:.0%} of a core"


@pytest.mark.stops_sglang_server
def test_shutdown_leaves_no_process(sglang_server: SGLangEngine) -> None:
    pid = sglang_server.pid
    assert pid is not None
    children = _descendants(pid)
    assert children, "SGLang runs its scheduler and detokenizer as child processes"
    sglang_server.shutdown()
    live = {p for p, _, _ in _procs()}
    assert not ({pid} | children) & live
    assert not [p for p, _, g in _procs() if g == pid]
    sglang_server.shutdown()  # idempotent
    # SGLang's crash diagnostics (a 5 s sleep, py-spy, a CUDA core dump) did not run on a deliberate stop
    assert "before crash diagnostics" not in sglang_server.log_path.read_text()


def test_sglang_still_reads_the_crash_diagnostics_switches_tidal_turns_off() -> None:
    from sglang.srt.environ import envs
    from tidal.rollout.engine import CRASH_DIAGNOSTICS_ENV

    for name in CRASH_DIAGNOSTICS_ENV:  # renamed upstream: shutdowns would sleep 5 s again
        assert hasattr(envs, name), name


def test_memory_release_and_resume_keep_the_weights(sglang_server: SGLangEngine) -> None:
    # On CPU this runs SGLang's real release/resume protocol (tags in slime's order: weights back first, then the
    # KV cache); the stand-in's CpuMemoryReleaseFinder keeps its torch.cuda.synchronize() from killing the server.
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    before = [out["output_ids"] for out in sglang_server.generate(PROMPTS, greedy)]
    with pytest.raises(ValueError, match="unknown memory tags"):
        sglang_server.release_memory_occupation(["activations"])
    sglang_server.release_memory_occupation(["weights", "kv_cache"])
    sglang_server.resume_memory_occupation(["weights"])
    sglang_server.resume_memory_occupation(["kv_cache"])
    assert sglang_server.health_ok()
    assert [out["output_ids"] for out in sglang_server.generate(PROMPTS, greedy)] == before
    if sglang_server.cpu:
        assert "[tidal cpu_stub] release_memory_occupation" in sglang_server.log_path.read_text()


def test_a_plain_client_drives_a_server_it_did_not_start(sglang_server: SGLangEngine, free_port) -> None:
    # What --rollout-external-engine-addrs uses: no process, only the URL.
    client = SGLangClient(sglang_server.url)
    client.wait_healthy(30.0)
    assert client.generate([[3, 4]], {"max_new_tokens": 2})[0]["output_ids"]
    with pytest.raises(RolloutError, match=r"not healthy after 1 s: is a server running there\?"):
        SGLangClient(f"http://127.0.0.1:{free_port()}").wait_healthy(1.0)


def test_flush_waits_for_a_busy_server_to_be_idle(sglang_server: SGLangEngine) -> None:
    # SGLang answers 400 to /flush_cache while a request runs; flush_cache asks again until the server is idle
    long = {"max_new_tokens": 500, "temperature": 1.0, "ignore_eos": True}  # the tiny model's context is 512
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(sglang_server.generate, [[3, 4, 5]] * 8, long)
        refused = False
        deadline = time.monotonic() + 60
        while not refused and not running.done() and time.monotonic() < deadline:
            refused = sglang_server._post("/flush_cache").status_code == 400  # no wait: refused while busy
        assert refused, "no refusal seen while the request ran"
        with pytest.raises(RolloutError, match="requests still running"):
            sglang_server.flush_cache(idle_timeout_s=0.3)
        sglang_server.flush_cache(idle_timeout_s=300)  # returns once the generation is over
        assert [len(out["output_ids"]) for out in running.result(timeout=60)] == [500] * 8


def test_a_wildcard_listen_host_binds_every_interface_and_advertises_the_given_host(tmp_path: Path) -> None:
    engine = SGLangEngine("/m", host="10.1.2.3", listen_host="0.0.0.0", port=1234, log_dir=tmp_path, api_key="k")
    cmd = engine.command()
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"  # bound on what the user gave
    assert engine.url == "http://10.1.2.3:1234"  # reached at the node's address, usable from another node
    with pytest.raises(ValueError, match=r"SGLang host '0\.0\.0\.0' is reachable from other machines"):
        SGLangEngine("/m", host="127.0.0.1", listen_host="0.0.0.0", port=1234, log_dir=tmp_path)
