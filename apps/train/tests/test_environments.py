"""`--environment KIND:NAME`: an agent run on the environment's own rows; what it replaces is refused in one line."""

import json
import textwrap
from pathlib import Path

import pytest
from tidal.train.cli import parse_job

TASKSET = textwrap.dedent(
    """
    import verifiers.v1 as vf
    from verifiers.v1.harnesses.null import NullHarness


    class EchoData(vf.TaskData):
        answer: str


    class EchoTask(vf.Task[EchoData]):
        @vf.reward(weight=2.0)
        async def same(self, trace: vf.Trace) -> float:
            return float(trace.last_reply.strip() == self.data.answer)


    class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
        def load(self):
            prompts = ["say 1", [{"role": "user", "content": "say 2"}]]
            return [EchoTask(EchoData(prompt=p, answer=str(i + 1), system_prompt="be brief" if i else None),
                             self.config.task) for i, p in enumerate(prompts)]


    __all__ = ["EchoTaskset", "NullHarness"]
    """
)


@pytest.fixture
def echo_env(tmp_path, monkeypatch):
    """A two-task verifiers taskset module ``tidal_echo_env`` on sys.path, and a fresh tidal cache."""
    (tmp_path / "tidal_echo_env.py").write_text(TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return "verifiers:tidal_echo_env"


def test_an_environment_is_an_agent_run_on_its_own_rows(echo_env, tmp_path):
    from tidal.train.environments import AGENT, load_environment

    job = parse_job(["--environment", echo_env, "--output-dir", str(tmp_path / "run")])
    (path,) = job.train.prompt_data
    assert job.eval.eval_prompt_data == (path,) and job.rollout.agent_function_path == AGENT
    assert job.train.environment == echo_env and (job.train.input_key, job.train.label_key) == ("prompt", "label")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert rows == [
        {"environment": echo_env, "label": "0", "prompt": [{"role": "user", "content": "say 1"}], "task": 0},
        {
            "environment": echo_env,
            "label": "1",
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 2"}],
            "task": 1,
        },
    ]
    assert load_environment(echo_env) is load_environment(echo_env)  # loaded once per process
    # the run's own config.yaml holds the options --environment set: a rerun from it is not refused
    from tidal.train.config_file import write_effective_config

    again = parse_job(["--config", str(write_effective_config(job, tmp_path / "run")), "--output-dir", str(tmp_path)])
    assert again.train.prompt_data == (path,) and again.rollout.agent_function_path == AGENT  # the same file


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--custom-generate-function-path", "json:loads"], "--environment and --custom-generate-function-path"),
        (["--agent-function-path", "tidal.train.agent_task:run"], "--environment and --agent-function-path exclude"),
        (["--rm-type", "math"], "--environment and --rm-type exclude each other: the environment's rubric scores"),
        (["--custom-rm-path", "json:loads"], "--environment and --custom-rm-path exclude each other"),
        (["--prompt-data", "x.jsonl"], "--environment and --prompt-data exclude each other"),
        (["--eval-prompt-data", "x.jsonl"], "--environment and --eval-prompt-data exclude each other"),
        (["--input-key", "question"], "--environment reads its own rows' 'prompt' key, so --input-key"),
    ],
)
def test_what_an_environment_replaces_is_refused_in_one_line(echo_env, extra, message):
    with pytest.raises(ValueError) as e:
        parse_job(["--environment", echo_env, *extra])
    assert any(line.startswith(message) for line in str(e.value).splitlines()), str(e.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tidal_echo_env", "--environment must look like 'KIND:NAME' with KIND one of ['verifiers']"),
        ("gym:tidal_echo_env", "--environment must look like 'KIND:NAME'"),
        ("verifiers:no_such_env_here", "--environment verifiers:no_such_env_here: loading it failed: "),
    ],
)
def test_a_bad_environment_is_one_line(echo_env, spec, message):
    with pytest.raises(ValueError) as e:
        parse_job(["--environment", spec])
    assert str(e.value).startswith(message) and "Traceback" not in str(e.value), str(e.value)


def test_help_lists_the_option():
    from tidal.train.flags import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--environment KIND:NAME Train on an environment of another library, unmodified: verifiers:NAME" in text
