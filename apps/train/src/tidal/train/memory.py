"""The job's memory plan: the actor's peak GPU memory, from the configs, before anything starts.

``check_memory`` refuses a job whose plan exceeds the trainer GPU (``--gpu-memory-gib``, else this machine's first
GPU) in one line that names the budget that fits; ``write_memory_plan`` logs the plan at start-up and writes it
to the run folder (``memory_plan.json``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from tidal.actor import MemoryInputs, MemoryPlan, ModelShape, largest_fitting_tokens, plan_memory
from tidal.ckpt import read_hf_config_json
from tidal.placement import gpu_memory_bytes
from tidal.rollout import server_arg_value
from tidal.train.logs import TERMINAL

logger = logging.getLogger(__name__)

GIB = 2**30

PROMPT_TOKENS = 1024
"""Prompt tokens assumed per sequence where only the response length is known (a fixed --micro-batch-size)."""
SGLANG_DEFAULT_FRACTION = 0.9
"""The engines' share of a co-located GPU assumed when --sglang-mem-fraction-static is not given."""


def engine_fraction(offloading, rollout, placement) -> float:
    """The share of a trainer GPU co-located engines hold while the actor trains (0 when they do not)."""
    args = list(rollout.sglang_server_args)
    if not placement.colocate:
        return 0.0
    released = (
        offloading.offload_rollout if offloading.offload_rollout is not None else offloading.offload
    ) is not False
    if released and "--enable-memory-saver" in args:
        return 0.0  # the engines release weights and KV cache while the actor trains
    fraction = server_arg_value(args, "--mem-fraction-static")  # checked in (0, 1) at parse time
    return SGLANG_DEFAULT_FRACTION if fraction is None else float(fraction)


def memory_inputs(parallel, actor, batching, rollout) -> MemoryInputs:
    """The plan's inputs of one job's configs."""
    cp = parallel.context_parallel_size
    sequence = rollout.rollout_max_response_len + PROMPT_TOKENS
    if batching.use_dynamic_batch_size:
        train_tokens = batching.max_tokens_per_gpu * cp
        logprob_tokens = (batching.log_probs_max_tokens_per_gpu or batching.max_tokens_per_gpu) * cp
    else:
        train_tokens = logprob_tokens = (batching.micro_batch_size or 1) * sequence
    return MemoryInputs.from_actor_config(
        actor,
        train_tokens=train_tokens,
        logprob_tokens=logprob_tokens,
        longest_sequence=sequence,
        tensor_parallel=parallel.tensor_model_parallel_size,
        pipeline_parallel=parallel.pipeline_model_parallel_size,
        context_parallel=cp,
        expert_parallel=parallel.expert_model_parallel_size,
        reference_model=actor.use_kl_loss or actor.kl_coef > 0,
        critic=actor.advantage_estimator == "ppo",
        teacher=teacher_shape(actor),
    )


def teacher_shape(actor) -> ModelShape | None:
    """The shape of ``--teacher-hf-checkpoint``'s config.json (None without a teacher, or one not plannable)."""
    if actor.teacher_hf_checkpoint is None:
        return None
    try:
        config = read_hf_config_json(actor.teacher_hf_checkpoint)
    except (OSError, ValueError):
        return None  # check_teacher reports the folder
    return ModelShape.from_hf_config(config) if plannable(config) else None


def job_memory_plan(
    parallel, offloading, actor, batching, rollout, placement, hf_config: dict[str, Any], gpu_bytes: int | None
) -> MemoryPlan:
    """The plan of one job on a GPU of ``gpu_bytes`` (None: unknown, no verdict)."""
    shape = ModelShape.from_hf_config(hf_config)
    inputs = memory_inputs(parallel, actor, batching, rollout)
    fraction = engine_fraction(offloading, rollout, placement)
    return plan_memory(shape, inputs, gpu_bytes=gpu_bytes, engine_fraction=fraction)


def plannable(hf_config: dict[str, Any] | None) -> bool:
    """Whether ``hf_config`` holds the dimensions a plan needs (a config.json the actor could build from)."""
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    return hf_config is not None and all(key in hf_config for key in needed)


def gpu_bytes_of(actor) -> int | None:
    """The trainer GPU's memory: ``--gpu-memory-gib``, else this machine's first GPU (None without one)."""
    return int(actor.gpu_memory_gib * GIB) if actor.gpu_memory_gib else gpu_memory_bytes()


def check_memory(parallel, offloading, actor, batching, rollout, placement, hf_config: dict[str, Any] | None) -> None:
    """Refuse a job whose memory plan exceeds the trainer GPU, naming the budget (or option) that fits."""
    gpu = gpu_bytes_of(actor)
    if not plannable(hf_config) or gpu is None:
        return  # no model yet (the embedded one is built at start), no shape to plan, or no GPU to check against
    plan = job_memory_plan(parallel, offloading, actor, batching, rollout, placement, hf_config, gpu)
    if plan.fits():
        return
    shape = ModelShape.from_hf_config(hf_config)
    frac = plan.engine_bytes / gpu
    card = f"the {plan.limit / GIB:.1f} GiB a {gpu / GIB:.1f} GiB GPU allows (5% kept for the allocator)"
    engines = f" beside the co-located engines' {plan.engine_bytes / GIB:.1f} GiB" if plan.engine_bytes else ""
    head = f"the memory plan needs {plan.peak / GIB:.1f} GiB per trainer GPU{engines}, more than {card}"
    if plan.logprob_peak > plan.train_peak:
        fits = largest_fitting_tokens(shape, plan.inputs, gpu_bytes=gpu, engine_fraction=frac, logprob=True)
        flag = "--log-probs-max-tokens-per-gpu"
        raise ValueError(f"{head}: {_budget_advice(flag, fits, parallel.context_parallel_size)}")
    fits = largest_fitting_tokens(shape, plan.inputs, gpu_bytes=gpu, engine_fraction=frac)
    longest = plan.inputs.longest_sequence
    if batching.use_dynamic_batch_size and 0 < fits < longest:  # a budget that fits but cannot hold a sample
        from tidal.actor import fix_for_longest_sample

        fix = fix_for_longest_sample(shape, plan.inputs, gpu_bytes=gpu, engine_fraction=frac, longest=longest)
        raise ValueError(
            f"{head}; the budget that fits ({fits // parallel.context_parallel_size} tokens) cannot hold the longest "
            f"sample ({longest} tokens: --rollout-max-response-len plus the prompt): {fix}"
        )
    advice = [_budget_advice("--max-tokens-per-gpu", fits, parallel.context_parallel_size, batching)]
    if not plan.inputs.recompute_activations:
        recomputed = replace(plan.inputs, recompute_activations=True, recompute_num_layers=0)
        more = largest_fitting_tokens(shape, recomputed, gpu_bytes=gpu, engine_fraction=frac)
        if more >= plan.inputs.train_tokens:
            advice.append("or add --recompute-activations (the plan then fits)")
    if not plan.inputs.optimizer_cpu_offload:
        advice.append("or --optimizer-cpu-offload")
    raise ValueError(f"{head}: {', '.join(advice)}")


def _budget_advice(flag: str, fits: int, cp: int, batching=None) -> str:
    if fits == 0:
        return (
            "not even 128 tokens fit beside the weights and optimizer state: use a larger --tensor-model-parallel-size"
        )
    if batching is not None and not batching.use_dynamic_batch_size:
        return f"{fits} tokens per micro-batch fit: lower --micro-batch-size"
    return f"{flag} {fits // cp} fits"


def write_memory_plan(job, hf_config: dict[str, Any], out_dir: str | Path) -> MemoryPlan | None:
    """Log the plan (a table when a GPU is known, one line otherwise) and write ``memory_plan.json``.

    None, and nothing written, when the model's config.json lacks the dimensions (the actor then says what is wrong).
    """
    if not plannable(hf_config):
        return None
    gpu = gpu_bytes_of(job.actor)
    plan = job_memory_plan(
        job.parallel, job.offload, job.actor, job.batching, job.rollout, job.placement, hf_config, gpu
    )
    path = Path(out_dir) / "memory_plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = json.loads(plan.to_json())
    chosen = ""
    if job.memory_choice is not None:  # what `auto` chose and the configurations it beat
        record["auto"] = job.memory_choice.to_dict()
        chosen = f"\n  auto: {job.memory_choice.reason}"
    path.write_text(json.dumps(record, indent=2) + "\n")
    if gpu is None:
        line = "memory plan: %.2f GiB peak per trainer GPU (no GPU here to check it against; %s)"
        logger.info(line, plan.peak / GIB, path, extra=TERMINAL)
    else:
        logger.info("%s%s\n  (%s)", plan.table(), chosen, path, extra=TERMINAL)
    return plan
