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
        (  # the agent's reward is the episode's: a reward function would be loaded and never called
            ["--agent-function-path", "asyncio:sleep", "--custom-rm-path", "json:loads"],
            "--agent-function-path scores each episode with the reward its agent returns, so --custom-rm-path",
        ),
        (  # given by the user (the embedded recipe's own --rm-type is taken: the tests above run on it)
            ["--agent-function-path", "asyncio:sleep", "--rm-type", "exact_match"],
            "--agent-function-path scores each episode with the reward its agent returns, so --rm-type would be",
        ),
        (
            ["--recipe", "embedded-moe", "--agent-function-path", "asyncio:sleep", "--use-rollout-routing-replay"],
            "--use-rollout-routing-replay with --agent-function-path is not supported",
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
    rows = PromptDataset(data, tokenizer, input_key="prompt", label_key="label", seed=0)
    (prompt,) = rows.head(len(rows))
    assert prompt.row == {"prompt": "1+1", "label": "2", "tools": ["calc"]}


def test_partial_rollout_with_agents_is_taken_and_needs_no_router() -> None:
    from tidal.train.checks import check_router

    agents = ["--agent-function-path", "asyncio:sleep", "--over-sampling-batch-size", "3"]
    job = parse_job([*agents, "--partial-rollout", "--no-use-router"])
    assert job.rollout.partial_rollout and job.rollout.over_sampling_batch_size == 3
    check_router(job.rollout, SimpleNamespace(num_engines=2))  # the gateway reaches each engine itself
    with pytest.raises(ValueError, match="--partial-rollout with 2 engines sends every request through"):
        check_router(parse_job(["--partial-rollout", "--no-use-router"]).rollout, SimpleNamespace(num_engines=2))


def test_agents_start_no_router_and_each_router_option_is_refused_in_one_line_naming_both() -> None:
    from tidal.train.checks import check_router
    from tidal.train.cli import error_line

    agents = ["--agent-function-path", "asyncio:sleep", "--rollout-external-engine-addrs", "h:1", "h:2"]
    assert not parse_job(agents).rollout.router_wanted(2)  # each episode stays on the engine its session is pinned to
    assert not parse_job([*agents, "--no-use-router"]).rollout.router_wanted(2)
    for given, first in (
        (["--use-router", "--sglang-router-policy", "round_robin"], "--use-router"),
        (["--sglang-router-cache-threshold", "0.3"], "--sglang-router-*"),
        (["--sglang-router-policy", "round_robin"], "--sglang-router-policy"),
    ):
        with pytest.raises(ValueError) as refused:
            parse_job([*agents, *given])
        (line,) = str(refused.value).splitlines()
        assert error_line(refused.value) == line
        assert line.startswith(f"{first} with --agent-function-path is not supported: the agent gateway pins"), line
    assert parse_job(["--rollout-external-engine-addrs", "h:1", "h:2"]).rollout.router_wanted(2)  # without agents
    dapo = parse_job([*agents, "--dynamic-sampling-filter-path", "reward_variance", "--no-use-router"])
    check_router(dapo.rollout, SimpleNamespace(num_engines=2))  # agent groups need no router either


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
    from tidal.rollout import SGLangClient
    from tidal.train.embedded_model import build_chat_tokenizer

    tokenizer = build_chat_tokenizer()  # its template writes no tool calls: no parser of its own
    parsers = {}
    for argv in (["--tool-call-parser", "llama3"], ["--tool-call-parser", "qwen3_coder"], []):
        job = parse_job(["--agent-function-path", "asyncio:sleep", *argv])
        engines = SimpleNamespace(
            cfg=job.rollout,
            engine_urls=["http://127.0.0.1:9"],
            update_gate=None,
            log_dir=tmp_path,
            engine_client=SGLangClient,
        )  # never called: the gateway is only built and started
        driver = DriverRollouts(
            job.rollout, engines, None, None, rollout_batch_size=1, fault_tolerant=False, tokenizer=tokenizer
        )
        runner = driver._start_runner(1, job.rollout.sampling_params())
        try:
            parsers[job.rollout.tool_call_parser] = getattr(runner.gateway.tool_format, "name", None)
        finally:
            runner.gateway.stop()
    assert parsers == {"llama3": "llama3", "qwen3_coder": "qwen3_coder", None: None}


TEMPLATE = "{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}assistant: "


def test_agent_calls_sample_the_served_adapter_at_the_runs_sampling(tmp_path, caplog) -> None:
    from tidal.rollout import parse_request
    from tidal.train.cluster import rollout_manager_of
    from tidal.train.embedded_model import ensure_embedded_model
    from tidal.train.rollout_manager import eval_sampling_params
    from transformers import AutoTokenizer

    job = parse_job(
        ["--agent-function-path", "asyncio:sleep", "--rollout-temperature", "0.7", "--rollout-top-p", "0.9",
         "--rollout-top-k", "5", "--rollout-stop", "zz", "--rollout-stop-token-ids", "3", "--eval-temperature", "0",
         "--rollout-max-response-len", "7", "--output-dir", str(tmp_path / "run")]
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    tokenizer.chat_template = TEMPLATE
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    manager = rollout_manager_of(job, PromptDataset(data, tokenizer, input_key="prompt", label_key="label", seed=0),
                                 tmp_path / "run")  # fmt: skip
    manager.engine_urls = ["http://127.0.0.1:9", "http://127.0.0.1:11"]  # never called: no episode runs here
    try:
        rollouts = manager.driver._agent_runner().gateway  # started before the first adapter, as in a run
        manager.serve_adapter("tidal-lora-v1", 1)  # no engine worker here: the driver's clients are what is renamed
        manager.driver.evaluate_agents([], 1, eval_sampling_params(job.rollout, job.eval))  # started after it
        evaluation = manager.driver.eval_agents.gateway
        assert [c.lora_name for c in [*rollouts.engines, *evaluation.engines]] == ["tidal-lora-v1"] * 4
        manager.serve_adapter("tidal-lora-v2", 2)
        assert [c.lora_name for c in [*rollouts.engines, *evaluation.engines]] == ["tidal-lora-v2"] * 4

        asks = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.3, "stop": "yy"}
        with caplog.at_level(logging.WARNING, logger="tidal.rollout.gateway.server"):
            params = [rollouts.sampling_params(parse_request(asks), 3) for _ in range(2)]
        assert params[0] == params[1]
        sampled = {k: params[0][k] for k in ("temperature", "top_p", "top_k", "stop", "max_new_tokens")}
        assert sampled == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "stop": ["yy", "zz"], "max_new_tokens": 7}
        assert 3 in params[0]["stop_token_ids"] and tokenizer.eos_token_id in params[0]["stop_token_ids"]
        assert caplog.text.count("an agent call asked for {'temperature': 1.3}") == 1  # logged once
        greedy = evaluation.sampling_params(parse_request(asks), 3)
        assert (greedy["temperature"], greedy["top_k"], greedy["stop"]) == (0.0, 5, ["yy", "zz"])
    finally:
        manager.driver.shutdown()


def test_an_agent_runs_effective_config_reruns_without_the_refused_rm_type(tmp_path) -> None:
    from tidal.train.config_file import write_effective_config

    job = parse_job(["--agent-function-path", "asyncio:sleep", "--output-dir", str(tmp_path / "run")])
    path = write_effective_config(job, tmp_path / "run")
    assert (
        "rm-type" not in path.read_text() and "rm-type" in write_effective_config(parse_job([]), tmp_path).read_text()
    )
    again = parse_job(["--config", str(path), "--output-dir", str(tmp_path / "rerun")])
    assert again.rollout.agent_function_path == "asyncio:sleep"
