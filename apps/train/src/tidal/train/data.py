"""Prompt data: JSONL records in a seeded, resumable order (the position is a function of the rollout id)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.train.task_data import read_jsonl


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt, tokenized once, with its reference answer."""

    text: str
    """Prompt text as given to the tokenizer."""
    ids: tuple[int, ...]
    """Prompt token ids sent to the engine."""
    label: Any
    """Reference answer for the reward."""
    row: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The JSONL record it came from (what an agent function receives)."""


class PromptDataset:
    """Prompts in epochs of a seeded permutation; ``batch(k, n)`` is the same for the same ``(k, n)``, always."""

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        *,
        input_key: str,
        label_key: str,
        seed: int,
        apply_chat_template: bool = False,
    ) -> None:
        """Read ``path`` (JSONL) and tokenize every prompt; a record missing a key is an error naming it.

        With ``apply_chat_template`` each prompt is rendered as a one-message user conversation with the
        tokenizer's chat template (generation prompt added) before tokenizing (``--apply-chat-template``).
        """
        records = read_jsonl(path)
        if not records:
            raise ValueError(f"{path} holds no records; point --prompt-data at a JSONL file with prompts")
        for line_no, record in enumerate(records, start=1):
            for flag, key in (("--input-key", input_key), ("--label-key", label_key)):
                if key not in record:
                    raise ValueError(
                        f"{path}: record {line_no} has no key {key!r} (keys: {sorted(record)}); set {flag}"
                    )
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.seed = seed
        self._orders: dict[tuple[int, int], list[int]] = {}
        texts = self.raw_texts = [r[input_key] for r in records]  # as given, before any chat template
        if apply_chat_template:
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
        # A rendered template already holds its special tokens: do not let the tokenizer add a BOS twice.
        encode = {"add_special_tokens": False} if apply_chat_template else {}
        self.prompts = [
            Prompt(text=t, ids=tuple(tokenizer.encode(t, **encode)), label=r[label_key], row=r)
            for t, r in zip(texts, records, strict=True)
        ]

    def __len__(self) -> int:
        return len(self.prompts)

    def _order(self, epoch: int, stream: int = 0) -> list[int]:
        if (stream, epoch) not in self._orders:
            order = list(range(len(self.prompts)))
            random.Random((self.seed + stream) * 1_000_003 + epoch).shuffle(order)
            # batches walk forward: keep only the current epoch of each stream
            self._orders = {k: v for k, v in self._orders.items() if k[0] != stream} | {(stream, epoch): order}
        return self._orders[(stream, epoch)]

    def batch(self, index: int, size: int) -> list[Prompt]:
        """Prompts ``[index * size, (index + 1) * size)`` of the endless epoch sequence."""
        return self._slice(index * size, size, stream=0)

    def more_batch(self, index: int, round_no: int, size: int, *, max_rounds: int) -> list[Prompt]:
        """Dynamic sampling's round ``round_no`` (2 .. ``max_rounds``) of rollout ``index``: ``size`` prompts.

        They come from a second seeded order, at a position set by ``(index, round_no)``, so that a resumed run draws
        the same ones and the first rounds (``batch(index, size)``) are those of a run without dynamic sampling.
        """
        return self._slice(((index * (max_rounds - 1)) + round_no - 2) * size, size, stream=1)

    def _slice(self, start: int, size: int, *, stream: int) -> list[Prompt]:
        out = []
        for position in range(start, start + size):
            epoch, offset = divmod(position, len(self.prompts))
            out.append(self.prompts[self._order(epoch, stream)[offset]])
        return out

    def head(self, size: int) -> list[Prompt]:
        """The first ``size`` prompts in file order (held-out evaluation uses the same ones every time)."""
        return self.prompts[:size]
