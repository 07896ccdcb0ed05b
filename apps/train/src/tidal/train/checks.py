"""Checks that span packages, or look at files, run once on the parsed flags before any process starts.

Each package's config checks its own fields when it is built; what needs two sections (GPU arithmetic, batch
divisibility, token budgets), the file system (data, model, output folders) or an import (reward functions) is
checked here. Every check raises ``ValueError`` with one line naming the flag, what it saw and the fix; a
:class:`Problems` collects the independent ones so that a user sees them all at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tidal.ckpt import read_hf_config_json
from tidal.train.teacher import check_teacher

T = TypeVar("T")
logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


class ConfigErrors(ValueError):
    """One or more configuration errors, one line each (``str`` joins them with newlines)."""

    def __init__(self, problems: list[str]) -> None:
        """Hold ``problems`` (one message each)."""
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class Problems:
    """Runs independent checks, keeps every ``ValueError`` message, and raises them together at the end."""

    def __init__(self) -> None:
        """Start with no problem."""
        self.lines: list[str] = []

    def run(self, check: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``check(*args, **kwargs)``; on ValueError, remember its message(s) and return None."""
        try:
            return check(*args, **kwargs)
        except ConfigErrors as e:
            self.lines += e.problems
        except ValueError as e:
            self.lines.append(str(e) or repr(e))
        return None

    def add(self, message: str) -> None:
        """Record a problem found without a check function."""
        self.lines.append(message)

    def raise_if_any(self) -> None:
        """Raise :class:`ConfigErrors` with every problem, in the order found."""
        if self.lines:
            raise ConfigErrors(list(dict.fromkeys(self.lines)))


def check_hf_checkpoint(path: str, flag: str = "--hf-checkpoint") -> dict[str, Any]:
    """An HF model folder (``flag``'s): a config.json of a known model family, a tokenizer and weights; returns it."""
    folder = Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{flag} {path} has no config.json; point it at a Hugging Face model directory")
    try:
        data = read_hf_config_json(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: config.json cannot be read as JSON ({e})") from e
    from tidal.actor import family_of

    family_of(data, source=f"{flag} {config}")  # an unknown architecture, before any process starts
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{flag} {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer "
            "into the model directory (tokenizer.save_pretrained(DIR))"
        )
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise ValueError(
            f"{flag} {path} has no weights (*.safetensors or *.bin); save the model with "
            "model.save_pretrained(DIR), or convert a Megatron checkpoint with `train convert`"
        )
    return data


def routed_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer of a ``config.json`` dict (0 for a dense model), under each family's key."""
    keys = ("num_experts", "num_local_experts", "n_routed_experts")  # qwen3_moe, transformers 5, glm4_moe
    return int(next((hf_config[k] for k in keys if hf_config.get(k)), 0))


def check_writable_dir(flag: str, path: str) -> None:
    """``path`` is a folder, or can be created as one, by this user."""
    target = Path(path).expanduser()
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"{flag} {path} is a file, not a folder; give a folder path (it is created if missing)")
        if not os.access(target, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path} is not writable by this user; give a folder you can write to")
        return
    parent = next(p for p in target.absolute().parents if p.exists())
    if not parent.is_dir():
        raise ValueError(f"{flag} {path} cannot be created: {parent} is a file; give another folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be created: {parent} is not writable; give a folder you can write to")


def check_import_path(flag: str, path: str) -> None:
    """``pkg.module:fn`` imports and names a callable (the module is imported here, as the run would)."""
    from tidal.rollout import load_callable

    fix = "give an importable module (installed, or on PYTHONPATH) and a function in it, as pkg.module:fn"
    try:
        if flag == "--agent-function-path":  # also checks that it is an async function
            from tidal.rollout import load_agent_fn

            load_agent_fn(path)
        else:
            load_callable(path, flag=flag)
    except ValueError as e:
        raise ValueError(f"{e}; {fix}") from e
    except Exception as e:  # the user's module raised at import: say so in one line, the run cannot work
        raise ValueError(f"{flag} {path!r}: importing it raised {type(e).__name__}: {e}; {fix}") from e


def check_model_parallel(parallel, placement) -> int:
    """TP x CP x PP divides the actor's GPUs; returns the data-parallel size."""
    gpus = placement.num_actor_gpus
    pp = parallel.pipeline_model_parallel_size
    model_parallel = parallel.tensor_model_parallel_size * parallel.context_parallel_size * pp
    if gpus % model_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {parallel.tensor_model_parallel_size} x --context-parallel-size "
            f"{parallel.context_parallel_size} x --pipeline-model-parallel-size {pp} = {model_parallel} does not "
            f"divide "
            f"the {gpus} actor GPU(s) (--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    return gpus // model_parallel


def check_expert_parallel(parallel, placement, hf_config: dict[str, Any] | None, hf: str) -> None:
    """The expert-parallel size divides the GPUs of a pipeline stage and the model's experts (a dense model: 1)."""
    ep = parallel.expert_model_parallel_size
    if ep == 1:
        return
    per_stage = placement.num_actor_gpus // parallel.pipeline_model_parallel_size
    if per_stage % ep:
        raise ValueError(
            f"--expert-model-parallel-size {ep} does not divide the {per_stage} actor GPU(s) of a pipeline stage "
            f"({placement.num_actor_gpus} actor GPU(s) / --pipeline-model-parallel-size "
            f"{parallel.pipeline_model_parallel_size}); pick a divisor of {per_stage}"
        )
    if hf_config is None:  # the embedded model may not exist yet: the actor checks it when it builds the model
        return
    experts = routed_experts(hf_config)
    if not experts:
        raise ValueError(
            f"--expert-model-parallel-size {ep} needs a mixture-of-experts model; {Path(hf) / 'config.json'} "
            f"(model_type {hf_config.get('model_type')!r}) has no experts: use --expert-model-parallel-size 1"
        )
    if experts % ep:
        raise ValueError(
            f"--expert-model-parallel-size {ep} does not divide the model's {experts} experts (num_experts in "
            f"{Path(hf) / 'config.json'})"
        )


def check_moe_context_parallel(parallel, hf_config: dict[str, Any] | None, hf: str) -> None:
    """Context parallelism is refused with a mixture-of-experts model (tidal.actor refuses it too, seconds later)."""
    cp = parallel.context_parallel_size
    if cp > 1 and hf_config and routed_experts(hf_config):
        raise ValueError(
            f"--context-parallel-size {cp} with a mixture-of-experts model ({Path(hf) / 'config.json'}) is not "
            "supported yet; use --context-parallel-size 1"
        )


def check_delta_lora(sync, actor) -> None:
    """--update-weight-delta is refused with --lora-rank: a LoRA sync's own path sends the adapter alone."""
    if sync.update_weight_delta and actor.lora_rank:
        raise ValueError(
            f"--update-weight-delta with --lora-rank {actor.lora_rank} is not supported: drop --update-weight-delta "
            "(a LoRA run's sync is small already)"
        )


def check_delta_glm(sync, hf_config: dict[str, Any] | None, hf: str) -> None:
    """--update-weight-delta is refused with a glm4_moe checkpoint (its engines' float32 routers are not modelled).

    SGLang holds a GLM-4.5's router weights and score-correction biases in float32; the delta's snapshot keeps one
    dtype, the engines'.
    """
    if sync.update_weight_delta and hf_config and hf_config.get("model_type") == "glm4_moe":
        raise ValueError(
            f"--update-weight-delta with --hf-checkpoint {hf} (glm4_moe) is not supported: SGLang holds a GLM-4.5's "
            "router weights and score-correction biases in float32 beside the model's dtype, and the delta's snapshot "
            "keeps one dtype; drop --update-weight-delta"
        )


def check_lora_moe(actor, hf_config: dict[str, Any] | None, hf: str) -> None:
    """LoRA is refused on a mixture-of-experts model: adapters on the grouped experts are not built yet."""
    if actor.lora_rank and hf_config and routed_experts(hf_config):
        raise ValueError(
            f"--lora-rank {actor.lora_rank} with a mixture-of-experts model ({Path(hf) / 'config.json'}) is not "
            "supported yet (no adapters on the experts); drop --lora-rank to fine-tune it fully"
        )


def check_moe_layers_servable(train, hf_config: dict[str, Any] | None, hf: str) -> None:
    """A qwen3_moe that SGLang 0.5.23 would serve as another model is refused when engines serve it.

    Its qwen3_moe makes every layer an MoE layer (it reads neither ``mlp_only_layers`` nor ``decoder_sparse_step``)
    and ignores ``tie_word_embeddings`` (its LM head is a separate weight, left random when the checkpoint ties it).
    """
    if train.debug_train_only or not hf_config or hf_config.get("model_type") != "qwen3_moe":
        return
    config = Path(hf) / "config.json"
    dense, step = hf_config.get("mlp_only_layers") or [], int(hf_config.get("decoder_sparse_step") or 1)
    if dense or step != 1:
        raise ValueError(
            f"{config} has dense layers (mlp_only_layers {dense}, decoder_sparse_step {step}), "
            "which SGLang 0.5.23's qwen3_moe does not read (it serves every layer as MoE, so the engines would "
            "generate from a different model than the actor trains); use a checkpoint whose every layer is MoE, or "
            "--debug-train-only"
        )
    if hf_config.get("tie_word_embeddings"):
        raise ValueError(
            f"{config} ties the LM head to the embedding (tie_word_embeddings true), which SGLang 0.5.23's qwen3_moe "
            "ignores (its LM head would stay random, so the engines would generate from a different model than the "
            "actor trains); save the checkpoint with an untied lm_head.weight, or --debug-train-only"
        )


def check_pipeline(parallel, hf_config: dict[str, Any] | None, hf: str) -> None:
    """Pipeline stages are allowed with this CP size and divide the model's layers (when the model exists)."""
    pp = parallel.pipeline_model_parallel_size
    if pp == 1:
        return
    cp = parallel.context_parallel_size
    if cp > 1:  # tidal.actor.distributed refuses it too, but importing it means torch and megatron: seconds
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} with --context-parallel-size {cp} is not supported by tidal-actor "
            "(pipeline stages are not wired to the context-parallel shards); use one of them, e.g. "
            "--context-parallel-size 1, or --pipeline-model-parallel-size 1"
        )
    layers = (hf_config or {}).get("num_hidden_layers", 0)  # the embedded model may not exist yet: checked later
    if hf_config is not None and layers % pp:
        raise ValueError(
            f"--pipeline-model-parallel-size {pp} does not divide the model's {layers} layers "
            f"(num_hidden_layers in {Path(hf) / 'config.json'}); pick a divisor of {layers}"
        )


def check_dynamic_sampling_rounds(batching, rollout) -> None:
    """``--dynamic-sampling-max-rounds`` rounds of over-sampling can fill ``--rollout-batch-size`` at all.

    Without a filter, partial rollout runs one round: its ``--over-sampling-batch-size`` prompts must fill the batch.
    """
    wanted = batching.rollout_batch_size
    over = rollout.over_sampling_batch_size
    if rollout.dynamic_sampling_filter_path is None:
        if rollout.partial_rollout and rollout.agent_function_path is None and over is not None and over < wanted:
            raise ValueError(
                f"--partial-rollout with --over-sampling-batch-size {over} below --rollout-batch-size {wanted}: "
                "without --dynamic-sampling-filter-path one round must fill the batch; raise "
                f"--over-sampling-batch-size to at least {wanted}"
            )
        return
    rounds = rollout.dynamic_sampling_max_rounds * (rollout.over_sampling_batch_size or wanted)
    if rounds < wanted:
        raise ValueError(
            f"--dynamic-sampling-max-rounds {rollout.dynamic_sampling_max_rounds} rounds of "
            f"--over-sampling-batch-size {rollout.over_sampling_batch_size} prompts can never fill "
            f"--rollout-batch-size {wanted}: raise either"
        )


def check_token_budget(batching, rollout) -> None:
    """With dynamic batch size, one micro-batch must hold at least one full-length response and its prompt.

    The budget is the batch planner's: --max-tokens-per-gpu aligned to --pad-to-multiple-of, times the
    context-parallel size (``BatchingConfig.micro_batch_token_budget``); likewise --log-probs-max-tokens-per-gpu, the
    forward-only passes' own (``BatchingConfig.log_probs_token_budget``).
    """
    response = rollout.rollout_max_response_len
    for flag, value, budget in (
        ("--max-tokens-per-gpu", batching.max_tokens_per_gpu, batching.micro_batch_token_budget),
        ("--log-probs-max-tokens-per-gpu", batching.log_probs_max_tokens_per_gpu, batching.log_probs_token_budget),
    ):
        if budget is None or budget > response:
            continue
        pad, cp = batching.pad_to_multiple_of, batching.context_parallel_size
        suggestion = max(1024, 1 << (2 * (response + 1) - 1).bit_length())
        parts = [f" x --context-parallel-size {cp}"] if cp > 1 else []
        parts += [f" (aligned down to a multiple of --pad-to-multiple-of {pad})"] if pad > 1 else []
        budget_text = f"{''.join(parts)} = {budget} tokens per micro-batch" if parts else ""
        raise ValueError(
            f"{flag} {value}{budget_text} cannot hold one sample: a response alone may have "
            f"--rollout-max-response-len {response} tokens, plus its prompt; raise {flag} above the longest prompt + "
            f"{response} (e.g. {flag} {suggestion}) or lower --rollout-max-response-len"
        )


def check_modes(train, rollout, placement) -> None:
    """Debug modes and external engines: the combinations that cannot work."""
    problems = Problems()
    if train.debug_train_only and not rollout.load_debug_rollout_data:
        problems.add(
            "--debug-train-only trains on saved rollouts: give --load-debug-rollout-data DIR "
            "(written by an earlier run with --save-debug-rollout-data DIR)"
        )
    if rollout.load_debug_rollout_data and not Path(rollout.load_debug_rollout_data).is_dir():
        problems.add(
            f"--load-debug-rollout-data {rollout.load_debug_rollout_data} is not a directory; give the folder an "
            "earlier run wrote with --save-debug-rollout-data"
        )
    if train.debug_rollout_only and rollout.load_debug_rollout_data:
        problems.add("--debug-rollout-only generates rollouts; it cannot also --load-debug-rollout-data")
    if rollout.rollout_external_engine_addrs:
        clash = [
            flag
            for flag, given in (
                ("--debug-train-only", train.debug_train_only),
                ("--load-debug-rollout-data", rollout.load_debug_rollout_data),
                ("--use-fault-tolerance", train.use_fault_tolerance),  # tidal cannot restart a server it does not own
                (f"--rollout-num-gpus {placement.rollout_num_gpus}", placement.rollout_num_gpus > 0),
            )
            if given
        ]
        if clash:
            problems.add(
                f"--rollout-external-engine-addrs (SGLang servers run elsewhere) cannot be combined with {clash[0]}: "
                "drop one of them"
            )
    elif placement.rollout_num_gpus == 0 and not rollout.load_debug_rollout_data:
        problems.add(
            "--rollout-num-gpus 0 places no SGLang engine: give --rollout-external-engine-addrs HOST:PORT for "
            "servers run elsewhere, or --rollout-num-gpus 1 or more"
        )
    problems.raise_if_any()


def check_router(rollout, placement) -> None:
    """Partial rollout and dynamic sampling send every request from the driver: to one engine, or the router.

    A custom generate function runs on every path (each engine's worker, or the driver), but partial rollout resumes
    a cut response as one continuation, which a custom sample (turns, inserted tokens) is not: that pair is refused.
    """
    engines = len(rollout.rollout_external_engine_addrs) or placement.num_engines
    # agents reach every engine through their gateway, which pins each session to one: no router needed
    agents = rollout.agent_function_path is not None
    partial = rollout.partial_rollout and not agents
    driver_side = partial or (rollout.dynamic_sampling_filter_path is not None and not agents)
    if rollout.custom_generate_function_path and rollout.partial_rollout:
        raise ValueError(
            "--partial-rollout resumes a cut response as one continuation, and a --custom-generate-function-path "
            "sample (several turns, inserted tokens) cannot be resumed that way: drop --partial-rollout or "
            "--custom-generate-function-path"
        )
    if driver_side and engines > 1 and rollout.use_router is False:
        what = "--partial-rollout" if partial else "--dynamic-sampling-filter-path"
        raise ValueError(
            f"{what} with {engines} engines sends every request through sglang-router: drop --no-use-router "
            "(or use one engine)"
        )


def check_routing_replay_sources(rollout, placement) -> None:
    """Routing replay trains on the experts the engine reported per sample: two paths bring back none, refused.

    A custom generate function builds its own sample from several calls (``tidal.rollout.MultiTurn`` records no
    routed experts), and sglang-router 0.3.2 re-writes each ``/generate`` request without ``return_routed_experts``
    (the engines never see it), so either would fail only after a whole rollout.
    """
    if not rollout.return_routed_experts:
        return
    if rollout.custom_generate_function_path:
        raise ValueError(
            "--use-rollout-routing-replay with --custom-generate-function-path is not supported: a custom sample "
            "(several turns, inserted tokens) carries no routed experts for the actor to replay; drop one of them"
        )
    engines = len(rollout.rollout_external_engine_addrs) or placement.num_engines
    if rollout.router_wanted(engines):
        raise ValueError(
            f"--use-rollout-routing-replay with {engines} engine(s) behind sglang-router is not supported: "
            "sglang-router 0.3.2 drops return_routed_experts from the requests it forwards, so no sample would carry "
            "the experts to replay; pass --no-use-router (each engine generates its own share) or drop the flag"
        )


def check_engine_tp(rollout, placement) -> None:
    """``--sglang-tp-size``, where given, equals --rollout-num-gpus-per-engine (tidal passes it to each engine)."""
    from tidal.rollout import with_engine_tp

    if not rollout.rollout_external_engine_addrs:
        with_engine_tp(rollout.sglang_server_args, placement.rollout_num_gpus_per_engine)


def check_async(train, sync, rollout, placement) -> None:
    """``--max-staleness K >= 1`` overlaps generation with training: engines of their own, a weight sync per rollout.

    Not with --use-fault-tolerance yet: an engine worker's two restart paths (a generation that meets the dead server,
    and the driver's ``ensure_alive`` before a sync) are not serialised, so an overlapped run can start one server
    twice (seen in the two-host test made one step off: the second start failed with EADDRINUSE on the NCCL port).
    """
    k = train.max_staleness
    if k == 0:
        return
    if placement.colocate and not rollout.rollout_external_engine_addrs:
        raise ValueError(
            f"--max-staleness {k} generates the next rollouts while the actor trains, but with --colocate the engines "
            "share the actor's GPUs and take turns with it, so nothing can overlap; pass --no-colocate (engines on "
            "their own GPUs, --rollout-num-gpus) or drop --max-staleness"
        )
    clash = [
        flag
        for flag, given in (
            ("--debug-rollout-only", train.debug_rollout_only),  # no actor: the weights never advance
            ("--debug-train-only", train.debug_train_only),  # no engine: nothing to overlap
            ("--load-debug-rollout-data", rollout.load_debug_rollout_data),
        )
        if given
    ]
    if clash:
        raise ValueError(f"--max-staleness {k} overlaps generation with training; {clash[0]} has only one of them")
    if train.use_fault_tolerance and not rollout.rollout_external_engine_addrs:
        raise ValueError(
            f"--max-staleness {k} with --use-fault-tolerance is not supported yet: an engine that dies while the "
            "generation ahead and the weight sync both reach it is restarted by each at once, and the second start "
            "fails on the first's ports; drop one of them"
        )
    if sync.update_weights_interval != 1:
        raise ValueError(
            f"--max-staleness {k} counts staleness in weight versions, one per rollout; --update-weights-interval "
            f"{sync.update_weights_interval} would make it {sync.update_weights_interval} times looser: drop it"
        )


def check_load(ckpt) -> None:
    """``--load`` names a loadable Megatron checkpoint (each kind of bad folder has its own message)."""
    if not ckpt.load:
        return
    from tidal.ckpt import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(ckpt.load, ckpt_step=ckpt.ckpt_step)
    except CheckpointError as e:
        raise ValueError(str(e) if "--load" in str(e) else f"--load {ckpt.load}: {e}") from e


def check_lora_load(actor, ckpt) -> None:
    """``--load``'s LoRA adapters: --lora-rank's rank (a full checkpoint: none), on --lora-target-modules' weights."""
    if not ckpt.load or not actor.lora_rank:
        return
    from tidal.actor import check_adapter_checkpoint
    from tidal.ckpt import CheckpointError

    try:
        check_adapter_checkpoint(
            ckpt.load,
            lora_rank=actor.lora_rank,
            ckpt_step=ckpt.ckpt_step,
            hf_checkpoint=actor.hf_checkpoint,
            target_modules=actor.lora_target_modules,
        )
    except CheckpointError:  # --load (or --hf-checkpoint) not loadable at all: another check says why
        return


def check_ref_load(actor, ckpt) -> None:
    """``--ref-load`` loads the reference model of a KL term, and names a loadable checkpoint."""
    if not ckpt.ref_load:
        return
    if actor.lora_rank:
        raise ValueError(
            f"--ref-load {ckpt.ref_load} with --lora-rank {actor.lora_rank}: a LoRA run's reference is its base model "
            "(the adapters switched off), no second model is loaded; drop --ref-load"
        )
    if actor.kl_loss_coef == 0 and actor.kl_coef == 0:
        raise ValueError(
            f"--ref-load {ckpt.ref_load} loads the reference model of a KL term, and this run has none: add "
            "--use-kl-loss --kl-loss-coef C (or --kl-coef C), or drop --ref-load"
        )
    from tidal.ckpt import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(ckpt.ref_load, flag="--ref-load")
    except CheckpointError as e:
        raise ValueError(str(e)) from e


def check_critic(actor, ckpt) -> None:
    """``--critic-load`` starts the critic of ``--advantage-estimator ppo`` and names a loadable checkpoint."""
    if not ckpt.critic_load:
        return
    if actor.advantage_estimator != "ppo":
        raise ValueError(
            f"--critic-load starts the critic of --advantage-estimator ppo (got --advantage-estimator "
            f"{actor.advantage_estimator}): pass --advantage-estimator ppo or drop --critic-load"
        )
    from tidal.ckpt import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(ckpt.critic_load, flag="--critic-load")
    except CheckpointError as e:
        raise ValueError(str(e)) from e


def check_data_files(train: dict[str, Any], evaluation: dict[str, Any], problems: Problems) -> None:
    """``--prompt-data`` is given, and each source's files exist and their first record holds the keys.

    ``--eval-prompt-data`` left unset is each ``--prompt-data`` source, filled in here. Every row is checked when the
    data is opened (``tidal.train.data.PromptDataset``), still before any process starts.
    """
    from tidal.train.data_sources import check_prompt_source
    from tidal.train.flags import section_defaults

    if "prompt_data" not in train:
        problems.add(
            "--prompt-data is required (the base recipe has none): JSONL, JSON or Parquet files of prompts and "
            "labels, or --recipe embedded for the shipped addition task"
        )
        return
    from tidal.train.config import held_out_sets

    specs = [train["prompt_data"]] if isinstance(train["prompt_data"], str) else list(train["prompt_data"])
    defaults = section_defaults("train")
    names = ("input_key", "label_key", "metadata_key")
    keys = {f"--{k.replace('_', '-')}": train.get(k) or defaults[k] for k in names if train.get(k) or defaults[k]}
    problems.run(check_prompt_source, "--prompt-data", specs, keys=keys)
    try:
        sets = held_out_sets(evaluation.get("eval_prompt_data"), specs)
    except ValueError:
        return  # EvalConfig reports it
    pairs = tuple(v for pair in sets for v in pair) if len(sets) > 1 else (sets[0][1],)
    evaluation.setdefault("eval_prompt_data", pairs)
    for _, path in sets:
        problems.run(check_prompt_source, "--eval-prompt-data", path, keys=keys)


def check_import_paths(rollout: dict[str, Any], problems: Problems, actor: dict[str, Any] | None = None) -> None:
    """Every ``pkg.module:fn`` option imports (a malformed one is RolloutConfig's or ActorConfig's to report)."""
    names = ("custom_rm_path", "custom_generate_function_path", "dynamic_sampling_filter_path", "agent_function_path")
    keys = [(rollout, k) for k in names]
    keys += [(actor or {}, k) for k in ("custom_loss_function_path", "custom_advantage_function_path")]
    for section, key in keys:
        if ":" in (section.get(key) or ""):
            problems.run(check_import_path, f"--{key.replace('_', '-')}", section[key])


def check_code_sandbox(rollout: dict[str, Any], problems: Problems) -> None:
    """``--rm-type code`` runs only where this machine can sandbox programs; refused otherwise, never unsandboxed."""
    if rollout.get("rm_type") == "code" and not rollout.get("custom_rm_path"):
        from tidal.rollout import check_sandbox

        problems.run(check_sandbox)


def check_output_folders(train: dict[str, Any], ckpt: dict[str, Any], rollout: dict[str, Any], problems) -> None:
    """Every folder the run writes is a folder (or can be created as one); the run folder holds no other run."""
    from tidal.train.run_folder import check_output_dir

    save_hf = (train.get("save_hf") or "").replace("{rollout_id}", "0")
    for flag, path in (
        ("--output-dir", train["output_dir"]),
        ("--save", ckpt["save"]),
        ("--save-debug-rollout-data", rollout.get("save_debug_rollout_data")),
        ("--save-hf", save_hf),
    ):
        if path:
            problems.run(check_writable_dir, flag, path)
    resuming, overwrite = bool(ckpt.get("load")), bool(train.get("overwrite_output_dir"))
    problems.run(
        check_output_dir, Path(train["output_dir"]), Path(ckpt["save"]), resuming=resuming, overwrite=overwrite
    )


def check_routing_replay(actor, hf_config: dict[str, Any] | None, hf: str) -> None:
    """--use-rollout-routing-replay is refused on a dense model (tidal.actor refuses it too, later)."""
    moe = hf_config and routed_experts(hf_config)
    if actor.use_rollout_routing_replay and hf_config is not None and not moe:
        raise ValueError(
            f"--use-rollout-routing-replay replays the experts of a mixture-of-experts model, but "
            f"{Path(hf) / 'config.json'} describes a dense one ({hf_config.get('model_type')}); drop the flag"
        )


def check_job(
    problems: Problems,
    *,
    train,
    eval,
    parallel,
    sync,
    offload,
    logging,
    placement,
    rollout,
    batching,
    actor,
    ckpt,
    hf: str,
    hf_config: dict[str, Any] | None,
    given: dict[str, dict[str, Any]],
) -> None:
    """The checks that span sections, on every section that could be built (None: it already has a problem)."""
    if rollout is not None and placement is not None:
        problems.run(check_router, rollout, placement)
        problems.run(check_engine_tp, rollout, placement)
        problems.run(check_routing_replay_sources, rollout, placement)
        if train is not None and sync is not None:
            problems.run(check_async, train, sync, rollout, placement)
    if parallel is not None:
        _check_layout(problems, parallel, placement, batching, hf_config, hf)
    if logging is not None:
        _warn_without_wandb(given["logging"], logging)
    if train is not None:
        problems.run(check_moe_layers_servable, train, hf_config, hf)
        if rollout is not None:
            if placement is not None:
                problems.run(check_modes, train, rollout, placement)
                if sync is not None and offload is not None:
                    from tidal.train.weight_sync import resolve_sync_plan

                    problems.run(resolve_sync_plan, sync, offload, placement, rollout, actor)
            _warn_without_fault_tolerance(given["rollout"], train)
    if batching is not None and rollout is not None:
        problems.run(check_token_budget, batching, rollout)
        problems.run(check_dynamic_sampling_rounds, batching, rollout)
        if None not in (parallel, offload, actor, placement):
            from tidal.train.memory import check_memory

            problems.run(check_memory, parallel, offload, actor, batching, rollout, placement, hf_config)
    if actor is not None:
        _check_actor(problems, actor, sync, hf_config, hf)
        _check_teacher(problems, actor, parallel, train, rollout, hf)
    if ckpt is not None:
        problems.run(check_load, ckpt)
        if actor is not None:
            problems.run(check_lora_load, actor, ckpt)
            problems.run(check_ref_load, actor, ckpt)
            problems.run(check_critic, actor, ckpt)
        if train is not None and eval is not None:
            problems.run(check_keep_best_by, train, eval, ckpt)


def _check_actor(problems: Problems, actor, sync, hf_config: dict[str, Any] | None, hf: str) -> None:
    """The actor's options against the model (LoRA, routing replay) and the weight sync (deltas)."""
    problems.run(check_lora_moe, actor, hf_config, hf)
    problems.run(check_routing_replay, actor, hf_config, hf)
    if sync is not None:
        problems.run(check_delta_lora, sync, actor)
        problems.run(check_delta_glm, sync, hf_config, hf)


def _check_teacher(problems: Problems, actor, parallel, train, rollout, hf: str) -> None:
    """``--teacher-hf-checkpoint``: an HF model folder, then what distillation takes (:mod:`tidal.train.teacher`)."""
    teacher = actor.teacher_hf_checkpoint
    if teacher is None or problems.run(check_hf_checkpoint, teacher, "--teacher-hf-checkpoint") is not None:
        problems.run(check_teacher, actor, parallel, train, rollout, hf)


def _check_layout(problems: Problems, parallel, placement, batching, hf_config: dict[str, Any] | None, hf: str) -> None:
    """The actor's parallel layout against the model and the GPUs; resolves the batch arithmetic with its DP size."""
    problems.run(check_pipeline, parallel, hf_config, hf)
    problems.run(check_moe_context_parallel, parallel, hf_config, hf)
    if placement is not None:
        problems.run(check_expert_parallel, parallel, placement, hf_config, hf)
        dp = problems.run(check_model_parallel, parallel, placement)
        if dp is not None and batching is not None:
            problems.run(batching.resolve, dp_size=dp)


def check_keep_best_by(train, evaluation, ckpt) -> None:
    """``--keep-best-by eval/...`` names a metric the evaluation records."""
    from tidal.train.config import eval_metric_keys

    key = ckpt.keep_best_by
    if key is not None and key.startswith("eval/") and key not in (keys := eval_metric_keys(train, evaluation)):
        raise ValueError(f"--keep-best-by {key} is no metric this run's evaluation records; one of {keys}")


def _warn_without_wandb(given: dict[str, Any], logging_config) -> None:
    for key in ("wandb_mode", "wandb_project", "wandb_group", "wandb_host"):
        if key in given and not logging_config.use_wandb:
            logger.warning("--%s has no effect without --use-wandb", key.replace("_", "-"))


def _warn_without_fault_tolerance(rollout: dict[str, Any], train) -> None:
    for key in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        if key in rollout and not train.use_fault_tolerance:
            logger.warning("--%s has no effect without --use-fault-tolerance", key.replace("_", "-"))
