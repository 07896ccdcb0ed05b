"""SFT rows as token ids and loss masks: prompt/response pairs, or chat conversations with loss on the assistant turns.

A conversation is rendered once with the tokenizer's chat template. Each assistant turn's text is located by
rendering prefixes: it starts where the conversation before it, with the generation prompt, ends, and ends where the
conversation through it ends (its end-of-turn token included). Both prefixes must be prefixes of the whole rendering;
a template that renders an earlier turn differently once later turns follow (one that drops earlier reasoning) is
refused with the row named. The text is then tokenized segment by segment, so each token belongs to one side.
The mask follows tidal's convention: position t says whether token t counts in the loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from tidal.train.data import _without_nulls
from tidal.train.data_sources import get_key
from tidal.train.prompt_tables import PromptTable, open_sources


@dataclass(frozen=True, slots=True)
class SftSample:
    """One row, tokenized."""

    tokens: list[int]
    """The whole sequence's token ids."""
    loss_mask: list[int]
    """1 on the tokens the loss counts (the response and its EOS, or each assistant turn), 0 elsewhere."""


def assistant_mask(tokenizer, messages: list[dict[str, Any]], *, tools=None, where: str = "") -> SftSample:
    """The conversation's token ids, and a mask that is 1 exactly on its assistant turns as the template renders them.

    Raises:
        ValueError: no assistant turn, or a template whose renderings of the prefixes are not prefixes of the whole
            (``where`` names the row).
    """

    def render(part: list[dict[str, Any]], *, generation: bool = False) -> str:
        if not part:
            return ""
        return tokenizer.apply_chat_template(part, tools=tools, tokenize=False, add_generation_prompt=generation)

    full = render(messages)
    bounds: list[int] = [0]
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(messages[:i], generation=True), render(messages[: i + 1])
        start, end = len(before), len(through)
        if not (full.startswith(before) and full.startswith(through)):
            raise ValueError(
                f"{where}: the chat template renders turn {i} differently once later turns follow (e.g. it drops "
                "earlier reasoning), so its assistant tokens cannot be located; split the conversation into rows that "
                "each end with one assistant turn"
            )
        if start < bounds[-1] or end < start:
            raise ValueError(f"{where}: the chat template's assistant turn {i} overlaps the turn before it")
        bounds += [start, end]
    if len(bounds) == 1:
        raise ValueError(f"{where}: the conversation has no assistant turn to learn from; drop the row")
    bounds.append(len(full))
    tokens: list[int] = []
    mask: list[int] = []
    for k in range(len(bounds) - 1):  # even segments: context; odd ones: an assistant turn
        text = full[bounds[k] : bounds[k + 1]]
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        tokens += ids
        mask += [k % 2] * len(ids)
    if not any(mask[1:]):
        raise ValueError(f"{where}: the assistant turns hold no token after the first; drop the row")
    mask[0] = 0  # the first token has no context to be predicted from
    return SftSample(tokens, mask)


def pair_sample(tokenizer, prompt: str, response: str, *, chat: bool, where: str = "") -> SftSample:
    """A prompt and its response: the prompt as the prompt data's (or one user turn), the response and EOS learned."""
    if chat:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return assistant_mask(tokenizer, messages, where=where)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{where}: the tokenizer has no EOS token to end the response with; give chat messages")
    context = tokenizer.encode(prompt)
    target = [*tokenizer.encode(response, add_special_tokens=False), tokenizer.eos_token_id]
    if not context:
        raise ValueError(f"{where}: the prompt is empty; every response needs a prompt before it")
    return SftSample([*context, *target], [0] * len(context) + [1] * len(target))


class SftDataset:
    """SFT rows in seeded epochs; every row is checked for ``--input-key`` when opened, tokenized when read."""

    def __init__(
        self,
        data: tuple[str, ...] | list[str],
        tokenizer,
        *,
        input_key: str,
        label_key: str,
        seed: int,
        tool_key: str = "tools",
        apply_chat_template: bool = False,
        flag: str = "--sft-data",
    ) -> None:
        """Open ``data`` (``PATH[:WEIGHT]`` sources, as the prompt data's); nothing is tokenized yet."""
        self.tables: list[PromptTable] = open_sources(flag, list(data), keys={"--input-key": input_key})
        self.tokenizer, self.seed, self.flag = tokenizer, seed, flag
        self.input_key, self.label_key, self.tool_key = input_key, label_key, tool_key
        self.apply_chat_template = apply_chat_template
        sizes = [len(t) for t in self.tables]
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        weights = [t.weight for t in self.tables]
        self._shares = None if weights[0] is None else np.array(weights, dtype=np.float64) / sum(weights)
        self._order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        """Rows of one epoch (a weighted mix: the same count, drawn by the weights)."""
        return int(self._starts[-1])

    def order(self, epoch: int) -> np.ndarray:
        """The row indices of epoch ``epoch``: a seeded permutation (a weighted mix draws each row's source first)."""
        if self._order[0] != epoch:  # the current epoch's is kept: each step reads a slice of it
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            if self._shares is None:
                order = rng.permutation(len(self))
            else:
                sources = rng.choice(len(self.tables), size=len(self), p=self._shares)
                order = self._starts[sources] + rng.integers(0, np.diff(self._starts)[sources])
            self._order = (epoch, order)
        return self._order[1]

    def sample(self, index: int) -> SftSample:
        """Row ``index`` (over the sources end to end) as token ids and loss mask."""
        source = int(np.searchsorted(self._starts, index, side="right")) - 1
        table = self.tables[source]
        row = _without_nulls(table.row(index - int(self._starts[source])))
        where = f"{self.flag} {table.paths[0]} row {index - int(self._starts[source])}"
        value = get_key(row, self.input_key)
        if isinstance(value, list):
            tools = row.get(self.tool_key)
            tools = json.loads(tools) if isinstance(tools, str) else tools
            return assistant_mask(self.tokenizer, value, tools=tools or None, where=where)
        try:
            response = get_key(row, self.label_key)
        except KeyError:
            response = None
        if response is None:
            raise ValueError(
                f"{where}: its --input-key {self.input_key!r} is a prompt text, and it has no --label-key "
                f"{self.label_key!r} response to learn; give the response key with --label-key"
            )
        return pair_sample(self.tokenizer, str(value), str(response), chat=self.apply_chat_template, where=where)

    def head(self, size: int) -> list[SftSample]:
        """The first ``size`` rows in file order (the held-out rows are the same ones each evaluation)."""
        return [self.sample(i) for i in range(min(size, len(self)))]


def check_sft_data(train: dict[str, Any], sft: dict[str, Any], problems) -> None:
    """``--sft-data`` and ``--sft-eval-data`` exist in a known format and their first row holds ``--input-key``."""
    from tidal.train.data_sources import check_prompt_source
    from tidal.train.flags import section_defaults

    key = train.get("input_key") or section_defaults("train")["input_key"]
    for flag, name in (("--sft-data", "sft_data"), ("--sft-eval-data", "sft_eval_data")):
        if sft.get(name):
            problems.run(check_prompt_source, flag, list(sft[name]), keys={"--input-key": key})
