"""Recipes: `train` alone runs the embedded one; --recipe picks one; a field's default never depends on other flags."""

import dataclasses
import json

import pytest
from tidal.train.cli import main, parse_job
from tidal.train.flags import options, section_defaults
from tidal.train.recipes import DEFAULT_RECIPE, RECIPES, recipe_options

# The embedded job's values: the README's main command and its learning result (bench/RESULTS.md) rest on them.
EMBEDDED = {
    "num_rollout": 110,
    "rollout_batch_size": 64,
    "n_samples_per_prompt": 8,
    "rollout_max_response_len": 6,
    "rollout_temperature": 1.0,
    "rm_type": "numeric_match",
    "lr": 4e-4,
    "use_dynamic_batch_size": True,
    "max_tokens_per_gpu": 8192,
    "eval_interval": 10,
    "num_eval_prompts": 256,
    "colocate": True,
}


@pytest.fixture
def user(tmp_path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 4}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "data.jsonl"), "--output-dir",
            str(tmp_path / "run")]  # fmt: skip


def _value(job, name: str):
    section = next(o.section for o in options() if o.name == name)
    return getattr(getattr(job, section), name)


def test_train_alone_runs_the_embedded_recipe_with_its_values(tmp_path):
    job = parse_job(["--output-dir", str(tmp_path / "run")])
    assert {name: _value(job, name) for name in EMBEDDED} == EMBEDDED
    assert job.train.hf_checkpoint is None and job.train.prompt_data[0].endswith("addition_train.jsonl")
    assert parse_job(["--recipe", "embedded", "--output-dir", str(tmp_path / "run")]) == job


def test_a_users_model_names_its_recipe_rather_than_taking_the_embedded_ones_values(user):
    assert DEFAULT_RECIPE == "embedded"
    with pytest.raises(ValueError, match="--hf-checkpoint is given without --recipe: add --recipe base"):
        parse_job([*user, "--rollout-batch-size", "4"])
    job = parse_job([*user, "--rollout-batch-size", "4", "--recipe", "base"])
    assert job.actor.lr == section_defaults("actor")["lr"] and not job.placement.colocate
    recipe = parse_job([*user, "--recipe", "embedded"])  # asked for: the recipe's values on the user's model
    assert recipe.actor.lr == EMBEDDED["lr"] and recipe.actor.hf_checkpoint == user[1]
    assert recipe.train.prompt_data == (user[3],)  # flags override the recipe


def test_a_fields_default_is_the_same_whatever_other_flags_are_given(user, tmp_path):
    # Every option no recipe sets has its field's default, with and without --hf-checkpoint.
    embedded = parse_job(["--output-dir", str(tmp_path / "run")])
    base = parse_job([*user, "--rollout-batch-size", "4", "--recipe", "base"])
    for o in options():
        if o.name in RECIPES["embedded"]() or o.default is dataclasses.MISSING:
            continue
        if o.name in ("hf_checkpoint", "prompt_data", "output_dir", "save", "eval_prompt_data"):
            continue  # given in `user`, or derived from what is (OUTPUT_DIR/ckpt, --prompt-data)
        assert _value(embedded, o.name) == _value(base, o.name) == o.default, o.flag


def test_base_recipe_asks_for_what_it_does_not_set(tmp_path):
    with pytest.raises(ValueError) as info:
        parse_job(["--recipe", "base", "--output-dir", str(tmp_path / "run")])
    assert "--rollout-batch-size is required" in str(info.value) and "--prompt-data is required" in str(info.value)


def test_an_unknown_recipe_names_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"--recipe 'nope' is not a recipe; pick one of "
        r"\['base', 'embedded', 'embedded-agent', 'embedded-math', 'embedded-moe'\]",
    ):
        parse_job(["--recipe", "nope"])


@pytest.mark.parametrize("argv", [["--recipe", "list"], ["--list-recipes"], ["--recipe=list"]])
def test_recipe_list_lists_them(argv, capsys):
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(RECIPES)


def test_recipes_set_only_options_and_every_switch_they_turn_on_can_be_turned_off():
    kinds = {o.name: o for o in options()}
    for name in RECIPES:
        for key, value in recipe_options(name).items():
            assert key in kinds, f"recipe {name} sets {key}, which is no option"
            if value is True:  # a store_true switch could not be undone on the command line
                assert kinds[key].kwargs["action"].__name__ == "BooleanOptionalAction", (name, key)


def test_the_embedded_moe_recipe_is_the_embedded_one_on_the_moe_model_with_the_balance_loss(tmp_path):
    from tidal.train.embedded_model import MOE_SPEC, embedded_model_path, embedded_spec_of

    job = parse_job(["--recipe", "embedded-moe", "--output-dir", str(tmp_path / "run")])
    assert job.actor.hf_checkpoint == str(embedded_model_path(spec=MOE_SPEC)) == job.train.hf_checkpoint
    assert embedded_spec_of(job.train.hf_checkpoint) == MOE_SPEC and MOE_SPEC.num_experts == 8
    assert job.actor.moe_aux_loss_coeff == 0.01
    assert {name: _value(job, name) for name in EMBEDDED} == EMBEDDED
    assert embedded_spec_of(str(tmp_path)) is None  # a user's folder is checked, never built


def test_the_embedded_agent_recipe_trains_the_shipped_agent_on_the_chat_model(tmp_path):
    from tidal.rollout import load_agent_fn
    from tidal.train.agent_task import MAX_TOKENS, run
    from tidal.train.embedded_model import CHAT_SPEC, embedded_model_path, embedded_spec_of

    job = parse_job(["--recipe", "embedded-agent", "--output-dir", str(tmp_path / "run")])
    assert job.actor.hf_checkpoint == str(embedded_model_path(spec=CHAT_SPEC)) == job.train.hf_checkpoint
    assert embedded_spec_of(job.train.hf_checkpoint) == CHAT_SPEC and CHAT_SPEC.chat
    assert load_agent_fn(job.rollout.agent_function_path) is run
    assert job.rollout.rollout_max_response_len == MAX_TOKENS and job.train.num_rollout == 15
    rest = {k: v for k, v in EMBEDDED.items() if k not in ("rollout_max_response_len", "num_rollout", "eval_interval")}
    assert {name: _value(job, name) for name in rest} == rest  # the embedded recipe's sizes and lr otherwise


def test_the_embedded_math_recipe_reads_chat_rows_from_parquet_and_grades_with_math_verify(tmp_path):
    from tidal.rollout import Sample, resolve_reward_fn, score_samples
    from tidal.train.agent_task import ASK, MAX_TOKENS, second_turn
    from tidal.train.data import PromptDataset
    from tidal.train.embedded_model import CHAT_SPEC, build_chat_tokenizer, embedded_model_path
    from tidal.train.task_data import EVAL_FILE, read_jsonl, shipped_path

    job = parse_job(["--recipe", "embedded-math", "--output-dir", str(tmp_path / "run")])
    assert job.actor.hf_checkpoint == str(embedded_model_path(spec=CHAT_SPEC))
    assert job.train.prompt_data[0].endswith(".parquet") and job.train.label_key == "reward_model.ground_truth"
    assert job.rollout.rm_type == "math" and job.rollout.rollout_max_response_len == MAX_TOKENS
    tokenizer = build_chat_tokenizer()
    (held_out,) = job.eval.eval_prompt_data
    data = PromptDataset(held_out, tokenizer, input_key=job.train.input_key, label_key=job.train.label_key, seed=0)
    records = read_jsonl(shipped_path(EVAL_FILE))  # the same problems as the plain task's held-out file
    prompts = data.head(3)
    for prompt, record in zip(prompts, records, strict=False):
        rendered = tokenizer.apply_chat_template(second_turn(record, ASK), tokenize=False, add_generation_prompt=True)
        assert (prompt.text, prompt.label) == (rendered, record["label"])
    label = prompts[0].label  # "093"-style; math-verify takes "93" as the same number, and another as wrong
    samples = [Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[0.0], finish_reason="stop",
                      response_text=text, label=label) for text in
               (str(int(label)), str(int(label) + 1))]  # fmt: skip
    assert [s.reward for s in score_samples(samples, resolve_reward_fn("math"))] == [1.0, 0.0]
