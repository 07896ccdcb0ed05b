"""What SGLang's ``/generate`` answers, read: a whole answer (:func:`parse_output`) and a streamed one.

A streamed answer (``"stream": true``) comes as server-sent ``data: {...}`` chunks, one per decode step
(``--stream-interval``, default 1). By default each chunk is cumulative: its ``output_ids`` and
``meta_info.output_token_logprobs`` hold every token so far. Under
``--incremental-streaming-output`` (what tidal's engines are launched with: a long answer then costs linear, not
quadratic, bytes) each chunk holds only the new tokens, and the abort that ends a cut request repeats just the
last id. Every chunk's ``meta_info.completion_tokens`` counts all tokens so far, which tells the two forms apart,
so :class:`StreamedAnswer` reads either.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import requests
from tidal.rollout.errors import EngineUnavailableError, RolloutError


def _merge(held: list[Any], got: Sequence[Any], total: int, what: str, url: str) -> list[Any]:
    """``held`` grown by one chunk's ``got``, whichever form the chunk has (``total``: the tokens so far)."""
    if len(held) + len(got) == total:  # disjoint chunk (or the first one)
        return [*held, *got]
    if len(got) >= total:  # cumulative chunk
        return list(got)
    if len(held) == total:  # an abort's repeat of the last id, already held
        return held
    raise RolloutError(
        f"/generate at {url} streamed {len(got)} {what} on top of {len(held)} with completion_tokens={total}: "
        "neither a cumulative nor an incremental chunk"
    )


class StreamedAnswer:
    """One prompt's answer assembled from its stream chunks."""

    def __init__(self, url: str) -> None:
        """``url`` names the server in errors."""
        self.url = url
        self.output_ids: list[int] = []
        """Every token sampled so far."""
        self._log_probs: list[Any] = []
        self._top: list[Any] = []
        self._meta: dict[str, Any] = {}

    def add(self, chunk: Mapping[str, Any]) -> bool:
        """Take one chunk; True when it is the last one (it carries a finish reason)."""
        if "error" in chunk:
            error = chunk["error"]
            code = error.get("code", 400) if isinstance(error, Mapping) else 400
            raise RolloutError(f"/generate at {self.url} answered {code}: {json.dumps(dict(chunk))}")
        meta = dict(chunk["meta_info"])
        total = int(meta.get("completion_tokens", len(self.output_ids) + len(chunk["output_ids"])))
        self.output_ids = _merge(self.output_ids, [int(t) for t in chunk["output_ids"]], total, "ids", self.url)
        if "output_token_logprobs" in meta:
            self._log_probs = _merge(self._log_probs, meta["output_token_logprobs"], total, "log-probs", self.url)
        if meta.get("output_top_logprobs") is not None:
            self._top = _merge(self._top, meta["output_top_logprobs"], total, "top log-probs", self.url)
        self._meta = meta
        return meta.get("finish_reason") is not None

    def answer(self) -> dict[str, Any]:
        """The whole answer in ``/generate``'s non-streamed form (for ``parse_output``)."""
        meta = {**self._meta, "output_token_logprobs": self._log_probs}
        if self._top:
            meta["output_top_logprobs"] = self._top
        return {"output_ids": self.output_ids, "meta_info": meta}


def read_chunks(response: requests.Response, url: str) -> Iterator[dict[str, Any]]:
    """The decoded ``data:`` chunks of a streamed answer, up to ``[DONE]``.

    Raises:
        EngineUnavailableError: The connection broke mid-stream.
    """
    try:
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    except requests.RequestException as e:
        raise EngineUnavailableError(f"/generate at {url}: the stream broke mid-answer: {e}") from e


def _routed_experts(meta: Mapping[str, Any], num_output: int) -> np.ndarray | None:
    """SGLang's base64 int32 expert ids of every forwarded token -> ``[tokens, layers x top-k]`` int16 (or int32)."""
    encoded = meta.get("routed_experts")
    if not encoded:
        return None
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    rows = int(meta["prompt_tokens"]) + num_output - 1  # the last sampled token is never forwarded
    if rows <= 0 or flat.size % rows:
        raise RolloutError(f"SGLang returned {flat.size} routed-expert ids for {rows} forwarded tokens")
    small = flat.size == 0 or flat.max() < np.iinfo(np.int16).max
    return flat.reshape(rows, -1).astype(np.int16 if small else np.int32)


def parse_output(answer: Mapping[str, Any], *, routed_experts: bool = False) -> dict[str, Any]:
    """One ``/generate`` answer -> the tokens, log-probs and finish reason exactly as sampled.

    When the answer holds them (``top_logprobs_num`` asked), also "output_top_logprobs": the most likely tokens at
    each sampled position, ``[(log-prob, id), ...]``.

    With ``routed_experts`` also "routed_experts": the experts SGLang routed each token of the sequence (prompt and
    response, but the last) to, ``[tokens, layers x top-k]`` (row t: layer 0's top-k ids, then layer 1's, ...), or
    None when the answer carries none (a server started without ``--enable-return-routed-experts``).
    """
    meta = answer["meta_info"]
    output_ids = [int(t) for t in answer["output_ids"]]
    # Each entry is (log-prob, token id, token text or None).
    token_logprobs = meta["output_token_logprobs"]
    log_probs = [float(entry[0]) for entry in token_logprobs]
    logprob_ids = [int(entry[1]) for entry in token_logprobs]
    if logprob_ids != output_ids:
        raise RolloutError(
            f"SGLang returned log-probs for tokens {logprob_ids[:16]}... but output_ids {output_ids[:16]}...; "
            "refusing to pair log-probs with the wrong tokens"
        )
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    if kind not in ("stop", "length", "abort"):
        raise RolloutError(f"unexpected finish_reason {reason!r} from SGLang")
    out = {
        "output_ids": output_ids,
        "output_log_probs": log_probs,
        "finish_reason": kind,
        "weight_version": meta.get("weight_version"),
    }
    if meta.get("output_top_logprobs") is not None:  # asked for: each position's [(log-prob, id, text), ...]
        out["output_top_logprobs"] = [
            [(float(e[0]), int(e[1])) for e in top or []] for top in meta["output_top_logprobs"]
        ]
    if routed_experts:
        out["routed_experts"] = _routed_experts(meta, len(output_ids))
    return out
