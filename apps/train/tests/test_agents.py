"""The agent options (--agent-function-path and its bounds): parsed, checked in one line, listed by --help."""

from __future__ import annotations

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
            ["--agent-function-path", "asyncio:sleep", "--partial-rollout"],
            "--agent-function-path and --partial-rollout exclude",
        ),
        (
            ["--agent-function-path", "asyncio:sleep", "--custom-generate-function-path", "asyncio:sleep"],
            "--agent-function-path and --custom-generate-function-path exclude",
        ),
        (["--agent-function-path", "asyncio:sleep", "--agent-timeout-s", "0"], "--agent-timeout-s must be > 0"),
        (
            ["--agent-function-path", "asyncio:sleep", "--agent-max-concurrency", "0"],
            "--agent-max-concurrency must be >= 1",
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
