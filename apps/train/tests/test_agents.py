"""The agent options (--agent-function-path and its bounds): parsed, checked in one line, listed by --help."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from tidal.train.cli import parse_job
from tidal.train.data import PromptDataset
from tidal.train.driver_rollouts import DriverRollouts
from tidal.train.flags import build_parser


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--agent-function-path", "no_colon"], "--agent-function-path must look like 'pkg.module:fn'"),
        (
            ["--agent-function-path", "asyncio:sleep", "--custom-generate-function-path", "asyncio:sleep"],
            "--agent-function-path and --custom-generate-function-path exclude",
        ),
        (["--agent-function-path", "asyncio:sleep", "--agent-timeout-s", "0"], "--agent-timeout-s must be > 0"),
        (
            ["--agent-function-path", "asyncio:sleep", "--agent-max-concurrency", "0"],
            "--agent-max-concurrency must be >= 1",
        ),
        (
            ["--agent-function-path", "asyncio:sleep", "--tool-call-parser", "qwen3-xml"],
            "--tool-call-parser must be one of SGLang's tool-call parsers",
        ),
    ],
)
def test_bad_agent_options_are_one_line(argv, expected) -> None:
    with pytest.raises(ValueError) as refused:
        parse_job(argv)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_agent_options_reach_the_rollout_config_and_the_help() -> None:
    job = parse_job(
        ["--agent-function-path", "asyncio:sleep", "--agent-max-concurrency", "3", "--agent-timeout-s", "9"]
    )
    assert (job.rollout.agent_function_path, job.rollout.agent_max_concurrency) == ("asyncio:sleep", 3)
    assert job.rollout.agent_timeout_s == 9.0
    text = build_parser().format_help()
    for flag in ("--agent-function-path", "--agent-max-concurrency", "--agent-timeout-s"):
        assert flag in text


def _driver(job) -> DriverRollouts:
    """The job's driver-side rollouts in front of one (unstarted) engine."""
    return DriverRollouts(
        job.rollout,
        SimpleNamespace(engines=[1], router=None),
        None,
        None,
        rollout_batch_size=job.batching.rollout_batch_size,
        fault_tolerant=job.train.use_fault_tolerance,
        tokenizer=None,
    )


def test_agents_take_the_driver_side_path_and_rows_keep_their_record(tmp_path) -> None:
    with pytest.raises(ValueError, match="--agent-function-path 'json:loads': must be 'async def"):
        parse_job(["--agent-function-path", "json:loads"])  # importable, but not an async function
    job = parse_job(["--agent-function-path", "asyncio:sleep"])  # an async function is taken
    assert _driver(job).driver_side and not _driver(parse_job([])).driver_side
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2", "tools": ["calc"]}\n')
    from tidal.train.embedded_model import ensure_embedded_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    (prompt,) = PromptDataset(data, tokenizer, input_key="prompt", label_key="label", seed=0).prompts
    assert prompt.row == {"prompt": "1+1", "label": "2", "tools": ["calc"]}


def test_partial_rollout_with_agents_is_taken_and_needs_no_router() -> None:
    from tidal.train.checks import check_router

    agents = ["--agent-function-path", "asyncio:sleep", "--over-sampling-batch-size", "3"]
    job = parse_job([*agents, "--partial-rollout", "--no-use-router"])
    assert job.rollout.partial_rollout and job.rollout.over_sampling_batch_size == 3
    check_router(job.rollout, SimpleNamespace(num_engines=2))  # the gateway reaches each engine itself
    with pytest.raises(ValueError, match="--partial-rollout with 2 engines sends every request through"):
        check_router(parse_job(["--partial-rollout", "--no-use-router"]).rollout, SimpleNamespace(num_engines=2))


def test_a_checkpoints_agent_groups_are_kept_for_the_pool_and_dropped_with_a_warning_elsewhere(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tidal.train.driver_rollouts")
    finished = {"row": {"prompt": "1+1"}, "label": "2", "started_in": 3, "episodes": []}
    running = {"row": {"prompt": "2+2"}, "label": "4", "started_in": 4}
    plain = [[{"prompt_ids": [1], "response_ids": [], "response_log_probs": [], "finish_reason": "abort"}]]
    agents = _driver(parse_job(["--agent-function-path", "asyncio:sleep", "--partial-rollout"]))
    assert agents.carry_state() is None
    agents.restore_carry([finished, running])  # held until the first rollout starts the pool with them
    assert agents.carry_state() == [finished, running] and agents.agent_pool is None
    assert "resumed 2 carried agent group(s) from the checkpoint: 1 finished, 1 to run again" in caplog.text
    agents_off = _driver(parse_job(["--agent-function-path", "asyncio:sleep"]))
    agents_off.restore_carry([finished, running])
    assert agents_off.carry_state() is None and "2 agent group(s) but --partial-rollout is off: dropped" in caplog.text
    agents.restore_carry(plain)  # a plain run's cut responses cannot become agent episodes
    assert "1 unfinished partial-rollout group(s) but this run's generation differs: dropped" in caplog.text
    generation = _driver(parse_job(["--partial-rollout"]))
    generation.restore_carry([finished])
    assert generation.carry_state() is None and "1 agent group(s) but this run's generation differs" in caplog.text


def test_the_tool_call_parser_reaches_the_agents_gateway(tmp_path) -> None:
    """``--tool-call-parser`` picks the parser the gateway reads calls with; without it, the chat template's own."""
    from tidal.train.embedded_model import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()  # its template writes no tool calls: no parser of its own
    parsers = {}
    for argv in (["--tool-call-parser", "llama3"], ["--tool-call-parser", "qwen3_coder"], []):
        job = parse_job(["--agent-function-path", "asyncio:sleep", *argv])
        engines = SimpleNamespace(
            cfg=job.rollout, engine_urls=["http://127.0.0.1:9"], update_gate=None, log_dir=tmp_path
        )  # never called: the gateway is only built and started
        driver = DriverRollouts(
            job.rollout, engines, None, None, rollout_batch_size=1, fault_tolerant=False, tokenizer=tokenizer
        )
        runner = driver._start_runner(1, default_max_tokens=8)
        try:
            parsers[job.rollout.tool_call_parser] = getattr(runner.gateway.tool_format, "name", None)
        finally:
            runner.gateway.stop()
    assert parsers == {"llama3": "llama3", "qwen3_coder": "qwen3_coder", None: None}
