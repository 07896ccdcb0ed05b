"""The feature-interaction matrix of `train`: which runs of the suite meet which features, and which pairs are refused.

The table of record. Each pair of the 15 features is met in a run (an end-to-end `train` run of the suite, whose
tests assert the effect of each of its features), refused at parse time with one line naming both, or listed as
open with what it lacks. tests/test_feature_matrix.py checks it against the runs' own argument lists and `train`'s
own parser, and keeps the table in apps/train/README.md. ``python tests/feature_matrix.py`` rewrites that section.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

README = Path(__file__).parent.parent / "apps" / "train" / "README.md"
BEGIN, END = "<!-- feature-matrix: begin (tests/feature_matrix.py writes it) -->", "<!-- feature-matrix: end -->"


@dataclass(frozen=True, kw_only=True, slots=True)
class Feature:
    title: str
    """How the README names it."""
    short: str
    """Its column head in the README's grid."""
    argv: tuple[str, ...]
    """`train` arguments that turn it on (``{moe}``: a Qwen3-MoE folder the test writes); alone, `train` takes them."""
    names: tuple[str, ...]
    """A refusal names the feature by one of these (its flag, or what the flag asks for)."""


DECOUPLED = ("--no-colocate", "--rollout-num-gpus")
SFT_DATA = str(Path(__file__).parent.parent / "apps/train/src/tidal/train/data/addition_train.jsonl")
FEATURES = {
    "lora": Feature(title="LoRA (`--lora-rank`)", short="LoRA", argv=("--lora-rank", "8"), names=("--lora-rank",)),
    "delta": Feature(title="delta weight sync (`--update-weight-delta`)", short="Δ",
                     argv=("--update-weight-delta",), names=("--update-weight-delta",)),
    "moe_r3": Feature(title="Qwen3-MoE with R3 (`--use-rollout-routing-replay`)", short="MoE",
                      argv=("--recipe", "embedded", "--hf-checkpoint", "{moe}", "--use-rollout-routing-replay"),
                      names=("--use-rollout-routing-replay", "mixture-of-experts")),
    "agents": Feature(title="agents (`--agent-function-path`)", short="Ag",
                      argv=("--agent-function-path", "tidal.train.agent_task:run"), names=("--agent-function-path",)),
    "custom_generate": Feature(title="custom generate function (`--custom-generate-function-path`)", short="CG",
                               argv=("--custom-generate-function-path", "tidal_train_plugins:two_turns_with_a_tool"),
                               names=("--custom-generate-function-path",)),
    "dynamic_sampling": Feature(title="dynamic sampling (`--dynamic-sampling-filter-path`)", short="DS",
                                argv=("--dynamic-sampling-filter-path", "reward_variance"),
                                names=("--dynamic-sampling-filter-path",)),
    "partial_rollout": Feature(title="partial rollout (`--partial-rollout`)", short="PR", argv=("--partial-rollout",),
                               names=("--partial-rollout",)),
    "max_staleness": Feature(title="`--max-staleness` >= 1", short="St",
                             argv=("--max-staleness", "1", *DECOUPLED, "1"), names=("--max-staleness",)),
    "router": Feature(title="two engines behind sglang-router", short="Rt", argv=(*DECOUPLED, "2", "--use-router"),
                      names=("--use-router", "sglang-router")),
    "fault_tolerance": Feature(title="fault tolerance (`--use-fault-tolerance`, an engine killed)", short="FT",
                               argv=("--use-fault-tolerance",), names=("--use-fault-tolerance",)),
    "decoupled": Feature(title="decoupled (`--no-colocate`, or external engines)", short="Dec",
                         argv=(*DECOUPLED, "1"), names=("--no-colocate", "--rollout-external-engine-addrs")),
    "tp_pp": Feature(title="TP=2 or PP=2", short="TP/PP",
                     argv=("--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"),
                     names=("--tensor-model-parallel-size", "--pipeline-model-parallel-size")),
    "ppo": Feature(title="PPO with a critic (`--advantage-estimator ppo`)", short="PPO",
                   argv=("--advantage-estimator", "ppo"), names=("--advantage-estimator",)),
    "eval": Feature(title="evaluation", short="Ev", argv=("--eval-interval", "1"),
                    names=("--eval-interval", "--num-eval-prompts")),
    "sft": Feature(title="the SFT stage (`--stage sft`)", short="SFT", argv=("--stage", "sft", "--sft-data", SFT_DATA),
                   names=("--stage",)),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    test_id: str
    """``tests/FILE.py::FUNCTION``: the fixture or test that starts the run."""
    argv: str
    """The variable (in that function, or the module) that holds its `train` arguments."""
    effects: dict[str, str]
    """Feature -> the test (same file) that asserts its effect in this run."""
    unasserted: tuple[str, ...] = ()
    """Features the arguments turn on whose effect no test of this run asserts: they meet nothing here."""


RUNS = {
    "A": Run(test_id="tests/test_train_e2e.py::_jobs", argv="args",
             effects={"eval": "test_accuracy_is_reported_before_and_after"}),
    "B": Run(test_id="tests/test_train_modes_e2e.py::resumed", argv="args", effects={
        "tp_pp": "test_each_pipeline_stage_sent_its_own_tensors_to_the_colocated_engine",
        "eval": "test_checkpoints_hf_copies_and_evaluations_follow_their_options",
        "decoupled": "test_external_engine_got_the_weights_by_broadcast_and_serves_them"}),
    "C": Run(test_id="tests/test_train_modes_e2e.py::one_step_off", argv="args", effects={
        "max_staleness": "test_one_step_off_trains_on_samples_at_most_one_version_old",
        "tp_pp": "test_each_pipeline_stage_broadcast_its_own_tensors_and_both_engines_serve_all",
        "decoupled": "test_each_pipeline_stage_broadcast_its_own_tensors_and_both_engines_serve_all",
        "eval": "test_one_step_off_trains_on_samples_at_most_one_version_old"}),
    "D": Run(test_id="tests/test_train_modes_e2e.py::debug_runs", argv="gen",
             effects=dict.fromkeys(("partial_rollout", "router"), "test_rollout_only_generates_without_training"),
             unasserted=("decoupled", "eval")),  # --debug-rollout-only: no actor, no weight sync
    "E": Run(test_id="tests/test_train_modes_e2e.py::debug_runs", argv="trn",
             effects={"ppo": "test_train_only_trains_on_the_saved_rollouts_with_a_critic"}),  # no engine
    "F": Run(test_id="tests/test_train_agents_e2e.py::agent_run", argv="args", effects={
        "agents": "test_agents_train_through_the_gateway_and_failed_groups_are_replaced",
        "ppo": "test_a_critic_fits_the_agents_graded_rewards",
        "eval": "test_agents_train_through_the_gateway_and_failed_groups_are_replaced",
        "decoupled": "test_agent_samples_are_covered_by_the_engine_actor_agreement_metrics"}),
    "G": Run(test_id="tests/test_train_agents_e2e.py::async_agent_run", argv="args", effects={
        name: "test_async_partial_agents_resume_the_checkpointed_episodes_and_lose_or_repeat_no_prompt"
        for name in ("agents", "max_staleness", "partial_rollout", "decoupled")}, unasserted=("eval",)),
    "H": Run(test_id="tests/test_train_agents_e2e.py::test_the_embedded_agent_recipe_trains_its_shipped_agent_and_"
             "evaluates_episodes", argv="args", effects=dict.fromkeys(
        ("agents", "delta", "dynamic_sampling", "decoupled", "eval"),
        "test_the_embedded_agent_recipe_trains_its_shipped_agent_and_evaluates_episodes")),
    "I": Run(test_id="tests/test_train_router_e2e.py::routed", argv="args", effects={
        "custom_generate": "test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers",
        "dynamic_sampling": "test_dynamic_sampling_fills_rollout_0_in_its_second_round_and_writes_its_metrics",
        "router": "test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers",
        "eval": "test_the_custom_generate_function_made_every_sample_through_the_router_and_in_the_workers",
        **dict.fromkeys(("delta", "max_staleness"), "test_one_step_off_through_the_router_with_delta_syncs"),
        **dict.fromkeys(("ppo", "tp_pp", "decoupled"),
                        "test_the_tp2_actor_and_its_critic_trained_and_both_engines_serve_the_synced_weights")}),
    "J": Run(test_id="tests/test_lora_sync_e2e.py::tensor_run", argv="args", effects={
        "lora": "test_each_sync_sends_the_adapter_alone_and_the_engine_serves_the_actors_log_probs",
        "fault_tolerance": "test_a_restarted_engine_gets_the_current_adapter_before_it_serves",
        **dict.fromkeys(("custom_generate", "dynamic_sampling", "tp_pp"), "test_every_sample_is_the_custom_functions_"
                        "on_the_adapter_filtered_and_both_stages_adapters_synced")},
        unasserted=("eval",)),
    "K": Run(test_id="tests/test_lora_sync_e2e.py::disk_run", argv="args",
             effects=dict.fromkeys(("lora", "agents", "partial_rollout", "decoupled", "tp_pp", "eval"),
                                   "test_over_disk_each_engine_loads_the_peft_folder_and_only_the_newest_is_kept")),
    "L": Run(test_id="tests/test_delta_sync.py::test_a_server_serving_another_version_gets_the_next_sync_whole_then_"
             "deltas_again", argv="args", effects={
        name: "test_a_server_serving_another_version_gets_the_next_sync_whole_then_deltas_again"
        for name in ("delta", "custom_generate", "tp_pp", "decoupled", "eval")}),
    "M": Run(test_id="tests/test_multi_node.py::two_host_run", argv="args", effects={
        "decoupled": "test_the_restarted_server_got_the_actors_weights_before_serving",
        "fault_tolerance": "test_a_killed_server_on_the_other_host_is_restarted",
        "delta": "test_the_restarted_server_got_the_actors_weights_before_serving",
        "ppo": "test_the_critic_trained_beside_the_actor_through_the_restart",
        "eval": "test_the_run_spans_two_hosts_and_completes"}),
    "N": Run(test_id="tests/test_train_e2e.py::_jobs", argv="COMPANION_ARGS", effects=dict.fromkeys(
        ("moe_r3", "delta", "dynamic_sampling", "partial_rollout", "max_staleness", "decoupled", "tp_pp", "ppo",
         "eval"), "test_the_companion_replays_the_moe_routing_one_step_off_with_filtered_partial_rollouts_and_deltas")),
}  # fmt: skip
"""The covering runs, by the letter the README's grid uses."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    why: str
    """Why, in a few words (the README's)."""
    depends_on: str = ""
    """The branch that adds this refusal, when main does not refuse the pair yet."""


REFUSED = {
    ("lora", "delta"): Refusal(why="a LoRA sync sends the adapter alone already"),
    ("lora", "moe_r3"): Refusal(why="no adapters on the experts yet"),
    ("lora", "ppo"): Refusal(why="no critic beside adapters yet"),
    ("moe_r3", "agents"): Refusal(why="the gateway records no routing per call"),
    ("moe_r3", "custom_generate"): Refusal(why="a custom sample (several calls) carries no routed experts"),
    ("moe_r3", "router"): Refusal(why="sglang-router 0.3.2 drops return_routed_experts from the requests it forwards"),
    ("agents", "custom_generate"): Refusal(why="an agent and a custom function each own the episode"),
    ("agents", "router"): Refusal(why="the gateway pins each episode to one engine and sends nothing through a router"),
    ("custom_generate", "partial_rollout"): Refusal(why="a custom sample cannot be resumed as one continuation"),
    ("max_staleness", "fault_tolerance"): Refusal(why="a dead engine met by the generation ahead and the sync at "
                                                  "once is restarted twice"),
    ("lora", "sft"): Refusal(why="no adapters in the SFT stage yet"),
    **{(name, "sft"): Refusal(why="an RL option: the SFT stage runs no engine, rollout or reward")
       for name in ("delta", "moe_r3", "agents", "custom_generate", "dynamic_sampling", "partial_rollout",
                    "max_staleness", "router", "fault_tolerance", "decoupled", "ppo")},
}  # fmt: skip
"""Pairs `train` refuses before any process starts (both features' ``argv`` together); any other pair it accepts."""

NOT_MET = "no run meets it yet"
NEEDS_MOE_RUN = "the one MoE run (N, the companion job of test_train_e2e.py) has it not: needs a run or a refusal"
FT_RUNS = "an engine is killed in J (LoRA, co-located, a custom generate function) and M (two hosts, one engine) only"

OPEN = {
    **{
        pair: NEEDS_MOE_RUN
        for pair in itertools.combinations(FEATURES, 2)
        if "moe_r3" in pair and not set(pair) <= set(RUNS["N"].effects) and pair not in REFUSED
    },
    ("lora", "max_staleness"): "the LoRA runs (J, K) are on-policy: K's check that the engine's log-probs of agent "
    "samples are the actor's after each update needs it",
    ("lora", "router"): "each LoRA run starts its own server (LoRA serving is a launch flag): two engines are a "
    "start-up more",
    ("partial_rollout", "fault_tolerance"): FT_RUNS + "; tried in M one step off (6 prompts for 4 groups): partial "
    "rollout's finished surplus groups, carried and taken first, were two versions old and masked whole, so half the "
    "rollouts trained on no token (a fault of partial rollout with --max-staleness, to fix first)",
    ("agents", "fault_tolerance"): "a dead engine under agents is restarted and its groups replaced "
    "(tests/test_agent_engine_restart.py, below a train run); no train run kills an engine under agents yet",
    ("router", "fault_tolerance"): FT_RUNS + "; the router run (I) is on external servers, which tidal cannot restart",
    ("tp_pp", "sft"): "the SFT run (tests/conftest.py::sft_run) has one rank: needs an SFT run with TP or PP",
    ("eval", "sft"): "the SFT run (tests/conftest.py::sft_run, asserted in tests/test_train_sft_e2e.py) evaluates its "
    "held-out NLL every --eval-interval steps, but its fixture is shared with test_train_modes_e2e.py, so no run "
    "letter names it",
}
"""Pairs neither met nor refused yet, with what they lack beyond a run (any other such pair: NOT_MET)."""


@dataclass(frozen=True, slots=True)
class Cell:
    runs: tuple[str, ...] = ()
    refusal: Refusal | None = None
    open: str = field(default="")


def pairs() -> list[tuple[str, str]]:
    """Every pair (105 of 15 features), each in FEATURES order."""
    return list(itertools.combinations(FEATURES, 2))


def key(a: str, b: str) -> tuple[str, str]:
    order = list(FEATURES)
    return (a, b) if order.index(a) < order.index(b) else (b, a)


def cells() -> dict[tuple[str, str], Cell]:
    """Each pair: the runs meeting it, its refusal, or what it lacks."""
    refused = {key(*p): r for p, r in REFUSED.items()}
    opened = {key(*p): why for p, why in OPEN.items()}
    out = {}
    for a, b in pairs():
        runs = tuple(letter for letter, run in RUNS.items() if a in run.effects and b in run.effects)
        out[a, b] = Cell(runs, refused.get((a, b)), "" if runs or (a, b) in refused else opened.get((a, b), NOT_MET))
    return out


def render() -> str:
    """The README section: a grid of the pairs, the runs, the refusals and the open pairs."""
    table = cells()
    names = list(FEATURES)
    notes = {p: i for i, p in enumerate((p for p, c in table.items() if c.refusal), start=1)}
    lines = [BEGIN, "", "| | " + " | ".join(FEATURES[n].short for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        row = []
        for b in names:
            if a == b:
                row.append("")
                continue
            c = table[key(a, b)]
            row.append(",".join(c.runs) if c.runs else f"no{notes[key(a, b)]}" if c.refusal else "·")
        lines.append(f"| **{FEATURES[a].short}** | " + " | ".join(row) + " |")
    met = sum(1 for c in table.values() if c.runs)
    refused = sum(1 for c in table.values() if c.refusal and not c.runs)
    on_branch = sum(1 for c in table.values() if c.refusal and c.refusal.depends_on and not c.runs)
    lines += ["", f"{met} of {len(table)} pairs meet in a run, {refused} are refused ({on_branch} on another branch), "
              f"{len(table) - met - refused} are open (·)." + " Features: " +
              "; ".join(f"{f.short} {f.title}" for f in FEATURES.values()) + ".", "", "Runs (each asserts the "
              "effect of every feature listed; a feature on but unasserted meets nothing there):", ""]  # fmt: skip
    for letter, run in RUNS.items():
        shown = ", ".join(FEATURES[n].short for n in names if n in run.effects)
        lines.append(f"- {letter}: `{run.test_id}` ({run.argv}): {shown}")
    lines += ["", "Refused before any process starts (one line naming both flags):", ""]
    for (a, b), n in notes.items():
        refusal = table[a, b].refusal
        pending = f" (on branch {refusal.depends_on})" if refusal.depends_on else ""
        lines.append(f"{n}. {FEATURES[a].short} + {FEATURES[b].short}: {refusal.why}{pending}")
    lines += ["", "Open:", ""]
    for (a, b), c in table.items():
        if c.open:
            lines.append(f"- {FEATURES[a].short} + {FEATURES[b].short}: {c.open}")
    return "\n".join([*lines, "", END])


def readme_section(text: str) -> str | None:
    """The section between the markers, markers included (None: the README has none)."""
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def write_readme() -> None:
    """Put the rendered section in apps/train/README.md, in place of the old one."""
    text = README.read_text()
    old = readme_section(text)
    if old is None:
        raise SystemExit(f"{README} has no section between {BEGIN!r} and {END!r}: add the two markers first")
    README.write_text(text.replace(old, render()))


if __name__ == "__main__":
    write_readme()
    sys.exit(0)
