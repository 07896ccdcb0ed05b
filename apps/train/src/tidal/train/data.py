"""Prompt data in a seeded, resumable order (the position is a function of the rollout id).

The rows stay in memory-mapped Arrow tables (:mod:`tidal.train.prompt_tables`); a batch reads and tokenizes its own
rows only. Each epoch is a seeded permutation of every source's rows, so each prompt comes once per epoch, and a
resumed run (``--load``) draws the same batches as one that never stopped. A weighted mix gives each source its
share of an epoch's slots; a source then walks its own seeded epochs, each of its prompts once per pass over it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tidal.train.data_sources import get_key
from tidal.train.prompt_tables import PromptTable, open_sources

CHAT_CHECK_ROWS = 64
"""Prompts whose raw text the chat-template monitor looks at (``raw_texts``)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt, tokenized, with its reference answer."""

    text: str
    """Prompt text as given to the tokenizer (a chat conversation rendered with the chat template)."""
    ids: tuple[int, ...]
    """Prompt token ids sent to the engine."""
    label: Any
    """Reference answer for the reward."""
    row: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The record it came from (what an agent function receives)."""
    metadata: Any = field(default=None, compare=False, repr=False)
    """The row's ``--metadata-key`` value (None without one): handed to reward functions as ``sample.metadata``."""


def _without_nulls(value: Any) -> Any:
    """``value`` with every None-valued dict entry dropped, recursively.

    Arrow gives each row of a column the union of all rows' fields, the missing ones as nulls: a message without
    ``tool_calls`` would reach the chat template with ``tool_calls: None``, a tool schema with other tools' fields,
    an agent a row with keys its JSONL line never had.
    """
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


class PromptDataset:
    """Prompts in epochs of a seeded permutation; ``batch(k, n)`` is the same for the same ``(k, n)``, always."""

    def __init__(
        self,
        data: str | Path | list[str] | tuple[str, ...],
        tokenizer,
        *,
        input_key: str,
        label_key: str,
        seed: int,
        apply_chat_template: bool = False,
        tool_key: str = "tools",
        metadata_key: str | None = None,
        flag: str = "--prompt-data",
    ) -> None:
        """Open ``data`` (``PATH[:WEIGHT]`` sources) and check every row for the keys; nothing is tokenized yet.

        A prompt that is a list of chat messages is rendered with the tokenizer's chat template (with the row's
        ``tool_key`` list as its tools); with ``apply_chat_template`` a text prompt is rendered as one user turn.
        """
        specs = [str(data)] if isinstance(data, str | Path) else [str(d) for d in data]
        keys = {"--input-key": input_key, "--label-key": label_key}
        if metadata_key:
            keys["--metadata-key"] = metadata_key
        self.tables: list[PromptTable] = open_sources(flag, specs, keys=keys)
        self.tokenizer, self.seed = tokenizer, seed
        self.input_key, self.label_key, self.tool_key, self.metadata_key = input_key, label_key, tool_key, metadata_key
        self.apply_chat_template = apply_chat_template
        self._sizes = np.array([len(t) for t in self.tables], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._sizes)])
        self._slots = self._slot_counts([t.weight for t in self.tables])
        self._slot_starts = np.concatenate([[0], np.cumsum(self._slots)])
        self._orders: dict[tuple, np.ndarray] = {}
        first = self._row(0)
        if isinstance(get_key(first, input_key), list) and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{flag} {self.tables[0].paths[0]}: row 0's {input_key!r} is a chat conversation, and the tokenizer "
                "has no chat template to render it; use a checkpoint whose tokenizer ships one"
            )
        head = [self._row(i) for i in range(min(CHAT_CHECK_ROWS, len(self)))]
        self.raw_texts = [v for v in (get_key(r, input_key) for r in head) if isinstance(v, str)]

    def __len__(self) -> int:
        """Slots of one epoch: every row once when unweighted, else the rows of all sources together."""
        return int(self._slot_starts[-1])

    def _slot_counts(self, weights: list[float | None]) -> np.ndarray:
        if weights[0] is None:  # no weights: each source's share is its rows, each row once per epoch
            return self._sizes.copy()
        total, share = int(self._sizes.sum()), np.array(weights, dtype=np.float64) / sum(weights)
        slots = np.maximum(np.floor(share * total).astype(np.int64), 1)
        slots[int(np.argmax(share))] += total - int(slots.sum())  # the rounding remainder goes to the largest share
        return slots

    def _permutation(self, size: int, *key: int) -> np.ndarray:
        """A seeded permutation of ``range(size)``; the current epoch of each stream (and source) is kept."""
        if key not in self._orders:
            stream = key[:-1]
            rng = np.random.default_rng([self.seed % 2**63, *key])
            order = rng.permutation(size).astype(np.int32 if size < 2**31 else np.int64)
            self._orders = {k: v for k, v in self._orders.items() if k[:-1] != stream} | {key: order}
        return self._orders[key]

    def _global_row(self, position: int, stream: int) -> int:
        """Index over the concatenated sources of the prompt at ``position`` of ``stream``'s endless sequence."""
        epoch, offset = divmod(position, len(self))
        slot = int(self._permutation(len(self), stream, epoch)[offset])
        if self.tables[0].weight is None:
            return slot
        source = int(np.searchsorted(self._slot_starts, slot, side="right")) - 1
        draw = epoch * int(self._slots[source]) + slot - int(self._slot_starts[source])
        source_epoch, k = divmod(draw, int(self._sizes[source]))
        row = int(self._permutation(int(self._sizes[source]), stream, 1 + source, source_epoch)[k])
        return int(self._starts[source]) + row

    def _row(self, index: int) -> dict[str, Any]:
        source = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.tables[source].row(index - int(self._starts[source]))

    def _prompt(self, index: int) -> Prompt:
        row = _without_nulls(self._row(index))  # a JSONL row reaches agents and rewards as it was written
        value = get_key(row, self.input_key)
        chat = isinstance(value, list)
        if chat or self.apply_chat_template:
            messages = value if chat else [{"role": "user", "content": value}]
            tools = row.get(self.tool_key)
            tools = json.loads(tools) if isinstance(tools, str) else tools
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True
            )
            # A rendered template already holds its special tokens: do not let the tokenizer add a BOS twice.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            text, ids = value, self.tokenizer.encode(value)
        metadata = get_key(row, self.metadata_key) if self.metadata_key else None
        return Prompt(text=text, ids=tuple(ids), label=get_key(row, self.label_key), row=row, metadata=metadata)

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
        return [self._prompt(self._global_row(position, stream)) for position in range(start, start + size)]

    def head(self, size: int) -> list[Prompt]:
        """The first ``size`` prompts in file order (held-out evaluation uses the same ones every time)."""
        return [self._prompt(i) for i in range(min(size, int(self._starts[-1])))]
