"""The fastest training configuration that fits: ``--max-tokens-per-gpu auto`` and ``--recompute-activations auto``.

Standard library only, like :mod:`tidal.actor.memory_plan`, whose estimate it searches. For every number of
recomputed layers (none, the first k, all of a stage) the largest token budget whose planned peak stays under
the card less the allocator's headroom and a safety margin (:data:`AUTO_MARGIN`) is found; each candidate's
training throughput is predicted by :class:`StepTimeModel`, and the fastest candidate whose budget holds the
run's longest sample wins. The log-prob pass keeps no activations, so its budget is simply the largest that
fits (capped, like the training budget, at the tokens a step can hold).

The throughput model: one optimizer step over ``T`` tokens on one GPU, split into ``ceil(T / budget)``
micro-batches, with ``k`` of ``L`` layers recomputed, takes

    T * (1 + forward_share * layer_share * k / L) + overhead_tokens * ceil(T / budget)   (one token's time = 1)

``forward_share`` is a layer's forward as a share of its forward and backward (what recomputing it adds),
``layer_share`` the decoder layers' share of a token's matmul work (the rest is the LM head's, from the shape),
``overhead_tokens`` the fixed cost of a micro-batch in tokens' worth of time. The first and last are fitted on an
H100 per training mode (full fine-tuning,
LoRA); bench/auto_plan_gpu.py measures them and bench/RESULTS.md holds the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tidal.actor.memory_plan import ALIGN, GIB, MemoryInputs, ModelShape, largest_fitting_tokens, plan_memory

AUTO_MARGIN = 0.03
"""Share of the card that ``auto`` keeps free beyond the plan's own 5% headroom: the plan is checked to stay within
2% below the measured peak, so a budget planned at the limit still fits with this margin."""
DEFAULT_STEP_TOKENS = 262144
"""Tokens one GPU trains in a step when the run cannot say (used to cap budgets: beyond a step's tokens a larger
budget buys nothing)."""
CPU_BUDGET = 8192
"""The training budget ``auto`` takes when no GPU is known (no memory to plan against): at least the longest
sample."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepTimeModel:
    """Predicted step time of one training configuration, relative to the time of one token's pass."""

    forward_share: float
    """A layer's forward as a share of its forward and backward: what recomputing it adds."""
    overhead_tokens: float
    """Fixed cost of one micro-batch, in tokens' worth of time."""

    def step_time(self, *, step_tokens: int, budget: int, recomputed: int, layers: int, layer_share: float) -> float:
        """Time of a step over ``step_tokens`` tokens in micro-batches of ``budget`` tokens.

        ``recomputed`` of ``layers`` layers are recomputed; ``layer_share`` is the decoder layers' share of the
        step's work (the rest is the LM head's); the unit is one token's pass without recompute.
        """
        micro_batches = math.ceil(step_tokens / budget)
        extra = self.forward_share * layer_share * recomputed / layers
        return step_tokens * (1.0 + extra) + self.overhead_tokens * micro_batches

    def tokens_per_time(self, **kwargs: float) -> float:
        """Tokens per unit of time (higher is faster); keyword arguments as :meth:`step_time`."""
        return kwargs["step_tokens"] / self.step_time(**kwargs)


FULL_FT = StepTimeModel(forward_share=0.32, overhead_tokens=400.0)
"""Full fine-tuning (bf16 with fp32 main parameters), fitted on an H100 (bench/RESULTS.md): close to the 1/3 of a
layer's forward in forward + backward (the backward computes input and weight gradients)."""
LORA = StepTimeModel(forward_share=0.46, overhead_tokens=400.0)
"""LoRA: the base's weight gradients are skipped, so a recomputed forward is close to half of a layer's work."""


def step_time_model(inputs: MemoryInputs) -> StepTimeModel:
    """The fitted model for the training mode of ``inputs``."""
    return LORA if inputs.lora_rank else FULL_FT


def layer_share(shape: ModelShape) -> float:
    """The decoder layers' share of a token's matmul work (active parameters: top-k experts), against the LM head's."""
    h = shape.hidden_size
    dense = shape.layer_params()
    moe = 0
    if shape.num_moe_layers:
        routed = shape.experts_per_token * 3 * h * shape.moe_ffn_hidden_size
        moe = dense - 3 * h * shape.ffn_hidden_size + shape.num_experts * h + routed
    layers = (shape.num_layers - shape.num_moe_layers) * dense + shape.num_moe_layers * moe
    return layers / (layers + shape.vocab_size * h)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One configuration the search weighed."""

    recompute_num_layers: int | None
    """Layers recomputed per stage (None: no recompute; the stage's layer count: all)."""
    train_tokens: int
    """The largest training budget that fits with the margin (0: none does)."""
    relative_speed: float
    """Predicted throughput relative to no recompute at an unbounded budget (1.0)."""
    note: str = ""
    """Why it was not chosen, when it was not."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryChoice:
    """What ``auto`` chose, and the candidates it beat."""

    max_tokens_per_gpu: int
    """The training budget per GPU (``--max-tokens-per-gpu``)."""
    recompute_activations: bool
    """Whether layers are recomputed."""
    recompute_num_layers: int
    """Layers recomputed per stage (0: all of them, with ``recompute_activations``)."""
    log_probs_max_tokens_per_gpu: int | None
    """The log-prob pass's budget (None: the training budget)."""
    reason: str
    """One line: why this one."""
    candidates: tuple[Candidate, ...] = field(default=())
    """Every configuration weighed, fastest first."""

    def to_dict(self) -> dict:
        """The choice as plain values, for ``memory_plan.json``."""
        return {
            "max_tokens_per_gpu": self.max_tokens_per_gpu,
            "recompute_activations": self.recompute_activations,
            "recompute_num_layers": self.recompute_num_layers,
            "log_probs_max_tokens_per_gpu": self.log_probs_max_tokens_per_gpu,
            "reason": self.reason,
            "alternatives": [
                {
                    "recompute_num_layers": c.recompute_num_layers,
                    "max_tokens_per_gpu": c.train_tokens,
                    "relative_speed": round(c.relative_speed, 4),
                    "note": c.note,
                }
                for c in self.candidates
            ],
        }


def _aligned_up(tokens: int) -> int:
    return -(-tokens // ALIGN) * ALIGN


def choose_memory_config(
    shape: ModelShape,
    inputs: MemoryInputs,
    *,
    gpu_bytes: int | None,
    longest_sample: int,
    engine_fraction: float = 0.0,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    choose_budget: bool = True,
    choose_recompute: bool = True,
    choose_logprob_budget: bool = True,
) -> MemoryChoice:
    """The configuration with the highest predicted training throughput that fits ``gpu_bytes``.

    Args:
        shape: the model's dimensions.
        inputs: the actor's options and layout; its budgets and recompute fields are the user's fixed values for
            what is not chosen here.
        gpu_bytes: the card's memory (None: no GPU known; then no recompute and ``CPU_BUDGET``).
        longest_sample: the longest prompt + response the run can produce (tokens, whole; each GPU holds 1/CP).
        engine_fraction: the card's share co-located engines hold while the actor trains.
        step_tokens: tokens one GPU trains per optimizer step (at most); budgets are capped there.
        choose_budget: the training budget is ``auto`` (else ``inputs.train_tokens`` is kept).
        choose_recompute: recompute is ``auto`` (else the recompute of ``inputs`` is kept).
        choose_logprob_budget: the log-prob budget is ``auto`` (else ``inputs.logprob_tokens`` is kept).

    Raises:
        ValueError: no configuration holds the longest sample; the message says which of context parallelism,
            recompute or tensor parallelism would, with the number to use.
    """
    cp = inputs.context_parallel
    need = _aligned_up(-(-longest_sample // cp))  # tokens per GPU of the longest sample
    cap = max(need, _aligned_up(-(-step_tokens // cp)))
    if gpu_bytes is None:
        budget = max(need, CPU_BUDGET) if choose_budget else inputs.train_tokens // cp
        return MemoryChoice(
            max_tokens_per_gpu=budget,
            recompute_activations=False if choose_recompute else inputs.recompute_activations,
            recompute_num_layers=0 if choose_recompute else inputs.recompute_num_layers,
            log_probs_max_tokens_per_gpu=None if choose_logprob_budget else inputs.logprob_tokens // cp,
            reason=f"no GPU known (--gpu-memory-gib not given): no recompute, a budget of {budget} tokens",
        )
    layers = -(-shape.num_layers // inputs.pipeline_parallel)
    model, share = step_time_model(inputs), layer_share(shape)
    limit = gpu_bytes * (1.0 - AUTO_MARGIN)  # the plan's own 5% headroom comes on top
    engine_fraction = engine_fraction / (1.0 - AUTO_MARGIN)  # the engines' bytes stay what they are
    settings: list[int | None] = [None, *range(1, layers + 1)] if choose_recompute else [_fixed_recompute(inputs)]
    candidates = []
    for recomputed in settings:
        trial = _with_recompute(inputs, recomputed)
        if choose_budget:
            fits = largest_fitting_tokens(shape, trial, gpu_bytes=int(limit), engine_fraction=engine_fraction) // cp
            budget = min(fits, cap)
        else:
            budget = inputs.train_tokens // cp
            plan = plan_memory(shape, trial, gpu_bytes=int(limit), engine_fraction=engine_fraction)
            fits = budget if plan.fits() else 0
        k = 0 if recomputed is None else (layers if recomputed == 0 else recomputed)
        note = ""
        if fits < need:
            note = f"{fits} tokens fit, the longest sample needs {need}"
            speed = 0.0
        else:
            ideal = dict(step_tokens=cap, budget=cap, recomputed=0, layers=layers, layer_share=share)
            speed = model.tokens_per_time(**ideal | dict(budget=budget, recomputed=k)) / model.tokens_per_time(**ideal)
        candidates.append(
            Candidate(recompute_num_layers=recomputed, train_tokens=budget, relative_speed=speed, note=note)
        )
    ranked = sorted(candidates, key=lambda c: (-c.relative_speed, _recompute_order(c)))
    best = ranked[0]
    if best.relative_speed == 0.0:
        if not choose_budget:  # the user's budget fits with no recompute setting: the plan's own check says so
            return MemoryChoice(
                max_tokens_per_gpu=inputs.train_tokens // cp,
                recompute_activations=inputs.recompute_activations,
                recompute_num_layers=inputs.recompute_num_layers,
                log_probs_max_tokens_per_gpu=None,
                reason="no recompute setting fits the given budget (the memory plan's check names what would)",
                candidates=tuple(ranked),
            )
        raise ValueError(_nothing_fits(shape, inputs, gpu_bytes, engine_fraction, longest_sample, need))
    logprob = None
    if choose_logprob_budget:
        fits = largest_fitting_tokens(
            shape, inputs, gpu_bytes=int(limit), engine_fraction=engine_fraction, logprob=True
        )
        logprob = max(best.train_tokens, min(fits // cp, cap))
    elif inputs.logprob_tokens != inputs.train_tokens:
        logprob = inputs.logprob_tokens // cp
    recompute = best.recompute_num_layers
    marked = tuple(
        c
        if c is best or c.note
        else replace(c, note=f"{best.relative_speed / max(c.relative_speed, 1e-9):.3f}x slower")
        for c in ranked
    )
    what = (
        "no recompute"
        if recompute is None
        else ("every layer recomputed" if recompute in (0, layers) else f"the first {recompute} layers recomputed")
    )
    reason = (
        f"{what} and {best.train_tokens} tokens per micro-batch: the fastest predicted configuration that fits "
        f"{gpu_bytes / GIB:.1f} GiB with a {AUTO_MARGIN:.0%} margin and holds the longest sample ({need} tokens)"
    )
    return MemoryChoice(
        max_tokens_per_gpu=best.train_tokens,
        recompute_activations=recompute is not None,
        recompute_num_layers=0 if recompute is None or recompute >= layers else recompute,
        log_probs_max_tokens_per_gpu=logprob,
        reason=reason,
        candidates=marked,
    )


def _fixed_recompute(inputs: MemoryInputs) -> int | None:
    return inputs.recompute_num_layers if inputs.recompute_activations else None


def _recompute_order(c: Candidate) -> int:
    return -1 if c.recompute_num_layers is None else c.recompute_num_layers


def _with_recompute(inputs: MemoryInputs, recomputed: int | None) -> MemoryInputs:
    if recomputed is None:
        return replace(inputs, recompute_activations=False, recompute_num_layers=0)
    return replace(inputs, recompute_activations=True, recompute_num_layers=recomputed)


def _nothing_fits(
    shape: ModelShape, inputs: MemoryInputs, gpu_bytes: int, engine_fraction: float, longest: int, need: int
) -> str:
    """The one line when no budget holds the longest sample: which of recompute, CP or TP would, with the number."""
    limit = int(gpu_bytes * (1.0 - AUTO_MARGIN))
    engine_fraction = engine_fraction / (1.0 - AUTO_MARGIN)
    head = (
        f"no token budget holds the longest sample ({longest} tokens: --rollout-max-response-len plus the longest "
        f"prompt) on a {gpu_bytes / GIB:.1f} GiB GPU"
    )
    fix = fix_for_longest_sample(shape, inputs, gpu_bytes=limit, engine_fraction=engine_fraction, longest=longest)
    return f"{head}: {fix}"


def fix_for_longest_sample(
    shape: ModelShape, inputs: MemoryInputs, *, gpu_bytes: int, engine_fraction: float, longest: int
) -> str:
    """What makes a micro-batch of the longest sample fit: recompute, context parallelism or tensor parallelism.

    Returns the advice as a clause ("add --recompute-activations (every layer): 24576 tokens then fit"), or, when
    none of them within 8-way does, what the plan found.
    """

    def fits(trial: MemoryInputs) -> int:
        return largest_fitting_tokens(shape, trial, gpu_bytes=gpu_bytes, engine_fraction=engine_fraction)

    options = []
    if not (inputs.recompute_activations and inputs.recompute_num_layers == 0):
        full = _with_recompute(inputs, 0)
        if (got := fits(full)) >= _aligned_up(longest // inputs.context_parallel):
            options.append(f"add --recompute-activations (every layer): {got // inputs.context_parallel} tokens fit")
    for cp in (2, 4, 8):
        if cp <= inputs.context_parallel:
            continue
        split = replace(inputs, context_parallel=cp)
        if fits(split) >= _aligned_up(longest):
            options.append(f"--context-parallel-size {cp} (each GPU holds 1/{cp} of a sample)")
            break
        if fits(_with_recompute(split, 0)) >= _aligned_up(longest):
            options.append(f"--context-parallel-size {cp} with --recompute-activations")
            break
    for tp in (2, 4, 8):
        if tp <= inputs.tensor_parallel or shape.num_key_value_heads % tp:
            continue
        need = _aligned_up(longest // inputs.context_parallel)
        trial = replace(inputs, tensor_parallel=tp)
        if fits(trial) // inputs.context_parallel >= need:
            options.append(f"--tensor-model-parallel-size {tp}")
            break
        if fits(_with_recompute(trial, 0)) // inputs.context_parallel >= need:
            options.append(f"--tensor-model-parallel-size {tp} with --recompute-activations")
            break
    if not options:
        return "neither full recompute nor up to 8-way context or tensor parallelism fits it: use more GPUs per model"
    return " or ".join(options)
