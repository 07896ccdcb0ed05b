"""Build the embedded models: a character tokenizer and a tiny Qwen2 (or Qwen3-MoE), warm-started with supervised steps.

The chat model (``--recipe embedded-agent``) has a byte-level Qwen2 tokenizer with a ChatML template instead.

No model hub is reachable, so ``uv run train`` with no ``--hf-checkpoint`` builds its own model once and caches it.
The result is an ordinary Hugging Face checkpoint (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``): the rest of tidal loads it through exactly the path a user's checkpoint takes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import string
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.train.logs import TERMINAL
from tidal.train.task_data import TRAIN_FILE, read_jsonl, shipped_path

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
UNK = "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""The chat model's template, Qwen's ChatML shape: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n`` to answer; the model ends a turn with ``<|im_end|>`` (its EOS)."""
BUILDER_VERSION = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddedModelSpec:
    """Shape and warm-start of the embedded model; its hash names the cache folder."""

    hidden_size: int = 128
    """Model width."""
    num_hidden_layers: int = 4
    """Transformer layers."""
    num_attention_heads: int = 4
    """Query heads (head dim = hidden_size / heads)."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA)."""
    intermediate_size: int = 512
    """MLP width (of a dense model)."""
    num_experts: int = 0
    """Experts per layer: 0 builds a dense Qwen2; more, a Qwen3-MoE whose every layer is MoE (what SGLang serves)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (MoE)."""
    moe_intermediate_size: int = 128
    """Each expert's MLP width (MoE)."""
    chat: bool = False
    """A chat model: ``<|im_start|>``/``<|im_end|>`` tokens, a ChatML template, warm-started on the two-turn
    hidden-operand episodes of :mod:`tidal.train.agent_task` (what ``--recipe embedded-agent`` trains)."""
    sft_steps: int = 1500
    """Length of the supervised warm-start schedule (one-cycle); it usually stops early, see below."""
    sft_target_accuracy: float = 0.3
    """Stop the warm start at the first check where greedy accuracy on training prompts reaches this: RL then
    starts from a model that is sometimes right and has most of the way still to go (1.0: run every step)."""
    sft_check_every: int = 25
    """Warm-start steps between accuracy checks."""
    sft_batch_size: int = 64
    """Sequences per supervised step."""
    sft_lr: float = 3e-3
    """Peak learning rate of the warm start."""
    seed: int = 1
    """Seed of initialisation and warm start."""

    def digest(self) -> str:
        """Stable short hash of the spec and builder version (a dense spec's leaves the MoE fields out)."""
        fields = asdict(self)
        if not self.num_experts:  # the dense model's folder name predates the MoE fields
            fields = {
                k: v
                for k, v in fields.items()
                if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
            }
        else:
            fields["moe_builder"] = 2  # 2: an untied LM head
        if not self.chat:  # nor the chat field
            fields.pop("chat")
        else:
            fields["chat_builder"] = 1  # the chat tokenizer and warm start, versioned apart from the others
        blob = json.dumps({"v": BUILDER_VERSION, **fields}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_dir() -> Path:
    """``$TIDAL_CACHE`` or ``$XDG_CACHE_HOME/tidal`` or ``~/.cache/tidal``."""
    if "TIDAL_CACHE" in os.environ:
        return Path(os.environ["TIDAL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tidal"


def build_tokenizer(texts: list[str], *, chat: bool = False):
    """Train a character-level tokenizer on the task text (digits and operators stay single tokens).

    ``chat``: :func:`build_chat_tokenizer` instead (``texts`` are not needed).
    """
    if chat:
        return build_chat_tokenizer()
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Printable ASCII is in the vocabulary too, so any English text (SGLang's warm-up prompt, a user's chat
    # template) encodes to real tokens; an empty encoding would crash the server's first forward pass.
    trainer = trainers.WordLevelTrainer(special_tokens=[EOS, UNK])
    tok.train_from_iterator([*texts, string.printable], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=UNK)


def build_chat_tokenizer():
    """A Qwen2 tokenizer with a byte-level vocabulary and no merges: one token per byte, ChatML special tokens.

    Being Qwen2's own class (its pre-tokenizer, byte-level mapping and decoder), it loads back from the checkpoint
    unchanged through ``AutoTokenizer`` (which rebuilds a ``qwen2`` model's tokenizer as ``Qwen2Tokenizer``), so
    newlines, spaces and every other byte survive. ``<|im_start|>``, ``<|im_end|>`` (the EOS) and the role names
    are single tokens; it carries :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {token: i for i, token in enumerate([EOS, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=EOS,
        eos_token=IM_END,
        pad_token=EOS,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )
    tok.add_tokens(list(ROLES))  # as in a BPE vocabulary; keeps an episode's turns short
    return tok


MOE_SPEC = EmbeddedModelSpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
"""The embedded mixture-of-experts model (``--recipe embedded-moe``): the dense model's width and depth, 8 experts
of a quarter of its MLP width each, 2 per token (so a token's MLP costs half the dense model's)."""
CHAT_SPEC = EmbeddedModelSpec(chat=True)
"""The embedded chat model (``--recipe embedded-agent``): the dense model's shape with a ChatML template."""


def embedded_spec_of(hf_checkpoint: str | None) -> EmbeddedModelSpec | None:
    """The spec whose cache folder ``hf_checkpoint`` is (None: the default embedded model's), or None if no spec's."""
    if hf_checkpoint is None:
        return EmbeddedModelSpec()
    for spec in (EmbeddedModelSpec(), MOE_SPEC, CHAT_SPEC):
        if Path(hf_checkpoint) == embedded_model_path(spec=spec):
            return spec
    return None


def embedded_model_path(cache_dir: Path | None = None, spec: EmbeddedModelSpec | None = None) -> Path:
    """Where the embedded model lives (or will, once built): the cache folder named by the spec's hash."""
    spec = spec or EmbeddedModelSpec()
    return (cache_dir or default_cache_dir()) / f"embedded-addition-{spec.digest()}"


def ensure_embedded_model(cache_dir: Path | None = None, spec: EmbeddedModelSpec | None = None) -> Path:
    """Return the folder of the embedded model, building it (atomically) if the cache lacks it."""
    spec = spec or EmbeddedModelSpec()
    target = embedded_model_path(cache_dir, spec)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the embedded default model into %s (once; later runs reuse it)", target, extra=TERMINAL)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _build(staging, spec)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; theirs is as good as ours
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(out: Path, spec: EmbeddedModelSpec) -> None:
    import torch
    from transformers import GenerationConfig

    records = read_jsonl(shipped_path(TRAIN_FILE))
    tokenizer = build_tokenizer([r["prompt"] + r["label"] for r in records], chat=spec.chat)
    probe = None
    if spec.chat:  # two-turn episodes of the agent task, rendered by the chat template
        from tidal.train.agent_task import warm_start_records

        records, probe = warm_start_records(tokenizer, records)
    model = new_model(tokenizer, spec)
    threads = torch.get_num_threads()
    # One thread: this model is too small to gain from more, and several threads spin-waiting against other busy
    # processes slow the warm start by orders of magnitude on a loaded machine with few cores.
    torch.set_num_threads(1)
    try:
        warm_start(model, tokenizer, records, spec, probe=probe)
    finally:
        torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one shard, written at once: its bar would be a redraw in a log file
    try:
        model.save_pretrained(out)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id).save_pretrained(out)
    (out / "tidal_embedded.json").write_text(json.dumps(asdict(spec), indent=2))


def new_model(tokenizer, spec: EmbeddedModelSpec):
    """The spec's randomly initialised model (seeded) for ``tokenizer``'s vocabulary.

    A Qwen2 with tied embeddings when ``spec.num_experts`` is 0, else a Qwen3-MoE (softmax top-k router, normalised
    top-k weights, q/k norm, its own LM head) whose every layer is MoE: what SGLang's qwen3_moe serves.
    """
    import torch

    torch.manual_seed(spec.seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        rope_theta=10000.0,
    )
    if not spec.num_experts:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(intermediate_size=spec.intermediate_size, **common))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    common["tie_word_embeddings"] = False  # SGLang's qwen3_moe has no tied LM head
    config = Qwen3MoeConfig(
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        head_dim=spec.hidden_size // spec.num_attention_heads,
        **common,
    )
    return Qwen3MoeForCausalLM(config)


def warm_start(
    model, tokenizer, records: list[dict], spec: EmbeddedModelSpec, *, probe: list[dict] | None = None
) -> None:
    """Supervised steps on prompt→answer pairs (loss on the answer and EOS only), on the model's device.

    A record is ``{"prompt": ..., "label": ...}``, or ``{"turns": [[context, answer], ...]}``: one sequence of
    several answers, each after its context (the text since the previous answer's EOS), loss on every answer and
    its EOS. Stops after ``spec.sft_steps``, or earlier once greedy accuracy on 128 training prompts (of ``probe``
    if given, checked every ``spec.sft_check_every`` steps) reaches ``spec.sft_target_accuracy``.
    """
    import torch

    device = next(model.parameters()).device

    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.sft_lr, total_steps=spec.sft_steps, pct_start=0.1)
    sequences = [_supervised(tokenizer, r) for r in records]
    model.train()
    start = last_log = time.monotonic()
    probe_records = probe or records
    probe_idx = torch.randperm(len(probe_records), generator=gen)[:128].tolist()
    for step in range(1, spec.sft_steps + 1):
        idx = torch.randint(len(records), (spec.sft_batch_size,), generator=gen).tolist()
        width = max(len(sequences[i][0]) for i in idx)
        ids = torch.full((len(idx), width), tokenizer.eos_token_id)
        labels = torch.full((len(idx), width), -100)
        for row, i in enumerate(idx):
            seq, target = sequences[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, : len(seq)] = torch.tensor(target)
        loss = model(input_ids=ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % spec.sft_check_every == 0:
            accuracy = greedy_accuracy(model, tokenizer, [probe_records[i] for i in probe_idx])
            if accuracy >= spec.sft_target_accuracy:
                stop = "warm start stops at step %d: greedy accuracy %.2f on training prompts"
                logger.info(stop, step, accuracy, extra=TERMINAL)
                break
        now = time.monotonic()
        if now - last_log > 10 or step == spec.sft_steps:
            rate = step / (now - start)
            logger.info(
                "warm start %d/%d loss %.3f (%.1f steps/s, ETA %.0f s)",
                step,
                spec.sft_steps,
                loss.item(),
                rate,
                (spec.sft_steps - step) / rate,
                extra=TERMINAL,
            )
            last_log = now
    model.eval()


def _supervised(tokenizer, record: dict) -> tuple[list[int], list[int]]:
    """A warm-start record's token ids and labels (-100 on context tokens, the token itself on answers and EOS)."""
    ids: list[int] = []
    labels: list[int] = []
    for context, answer in record.get("turns") or [(record["prompt"], record["label"])]:
        prompt = tokenizer.encode(context, add_special_tokens=False)
        target = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        ids += prompt + target
        labels += [-100] * len(prompt) + target
    return ids, labels


def greedy_accuracy(model, tokenizer, records: list[dict]) -> float:
    """Share of ``records`` whose greedy answer (up to EOS, at most 8 tokens) equals the label; restores train mode."""
    import torch

    eos = tokenizer.eos_token_id
    prompts = [tokenizer.encode(r["prompt"]) for r in records]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), eos)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding: RoPE makes the shift harmless
        ids[row, width - len(p) :] = torch.tensor(p)
        attention[row, width - len(p) :] = 1
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=eos,
        ).cpu()
    model.train()
    hits = 0
    for row, record in enumerate(records):
        answer = out[row, width:].tolist()
        answer = answer[: answer.index(eos)] if eos in answer else answer
        hits += tokenizer.decode(answer) == record["label"]
    return hits / len(records)
