"""The option mutant: TIDAL_OPTION_MUTANT neutralizes one option where parsed values become configs, and only then."""

import pytest
from tidal.actor import ActorConfig
from tidal.train.cli import main, parse_job
from tidal.train.option_mutant import ENV, parse_mutant, patch_configs

# the embedded recipe sets --rollout-batch-size 8 (BatchingConfig's field is required) and leaves --eps-clip alone


def test_without_the_variable_every_option_keeps_its_value(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    job = parse_job(["--eps-clip", "0.3", "--output-dir", str(tmp_path)])
    assert job.actor.eps_clip == 0.3
    assert patch_configs() is None
    assert ActorConfig(hf_checkpoint="m", eps_clip=0.3).eps_clip == 0.3


def test_a_mutant_puts_the_option_back_to_its_default_whatever_gave_it(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_text("eps-clip: 0.25\nlr: 0.001\n")
    monkeypatch.setenv(ENV, "--eps-clip")
    job = parse_job(["--config", str(path), "--output-dir", str(tmp_path / "run")])
    assert job.actor.eps_clip == ActorConfig.__dataclass_fields__["eps_clip"].default  # the file's 0.25 is gone
    assert job.actor.lr == 0.001  # and nothing else changed
    assert parse_job(["--eps-clip", "0.3", "--output-dir", str(tmp_path / "run")]).actor.eps_clip == 0.2


def test_a_mutant_with_a_value_replaces_the_recipes_value_before_validation(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "--rollout-batch-size=3")
    job = parse_job(["--output-dir", str(tmp_path)])
    assert job.batching.rollout_batch_size == 3
    monkeypatch.setenv(ENV, "--rollout-batch-size=0")
    with pytest.raises(ValueError, match="--rollout-batch-size must be >= 1, got 0"):
        parse_job(["--rollout-batch-size", "4", "--output-dir", str(tmp_path)])


def test_a_mutant_of_an_app_option_drops_it_from_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV, "--recipe")
    job = parse_job(["--recipe", "embedded-moe", "--output-dir", str(tmp_path)])
    assert job.actor.moe_aux_loss_coeff == 0.0  # the default recipe's, not embedded-moe's 0.01
    monkeypatch.setenv(ENV, "--config")
    path = tmp_path / "job.yaml"
    path.write_text("lr: 0.001\n")
    assert parse_job(["--config", str(path), "--output-dir", str(tmp_path)]).actor.lr != 0.001


def test_the_patched_config_class_takes_the_mutant_from_any_caller(monkeypatch):
    monkeypatch.setattr(ActorConfig, "__init__", ActorConfig.__init__)  # restored after the test
    monkeypatch.setenv(ENV, "--eps-clip=0.4")
    assert patch_configs() == parse_mutant("--eps-clip=0.4")
    assert ActorConfig(hf_checkpoint="m", eps_clip=0.1).eps_clip == 0.4
    monkeypatch.setenv(ENV, "--use-tis=on")
    patch_configs()
    assert ActorConfig(hf_checkpoint="m").use_tis is True


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("--no-such-flag", "--no-such-flag is no option"),
        ("--eps-clip=wide", "'wide' is no value of --eps-clip"),
        ("--use-tis=maybe", "a switch takes on or off"),
        ("--config=x.yaml", "its mutant takes no value"),
    ],
)
def test_a_bad_mutant_is_one_line_naming_it(text, says):
    with pytest.raises(ValueError, match=says) as info:
        parse_mutant(text)
    assert ENV in str(info.value) and "\n" not in str(info.value)


def test_a_mutant_of_list_recipes_runs_no_listing(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "--list-recipes")
    assert main(["--list-recipes", "--lr", "-1"]) == 2  # not listed: parsed as a job, whose --lr is refused
    assert "--lr" in capsys.readouterr().err
