"""Debug rollout data (``--save-debug-rollout-data`` / ``--load-debug-rollout-data``): samples as JSONL.

One file per rollout, ``DIR/rollout_<id>.jsonl``: a header line, then one sample per line with every
:class:`Sample` field. JSON floats round-trip exactly (``repr``), so a replayed rollout equals the saved one
token for token and log-prob for log-prob, and training can be debugged without any server. The routed experts
(``--use-rollout-routing-replay``) are stored as their shape, dtype and bytes in base64.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tidal.rollout.types import Sample

logger = logging.getLogger(__name__)

FORMAT = "tidal-rollout-samples/1"
_SEQUENCE_FIELDS = (
    "prompt_ids",
    "response_ids",
    "response_log_probs",
    "response_loss_mask",
    "response_weight_versions",
)
_ARRAY_FIELD = "rollout_routed_experts"  # an int array: shape, dtype and base64 bytes


def rollout_data_path(path: str | os.PathLike[str], rollout_id: int) -> Path:
    """The file that holds rollout ``rollout_id`` under the directory ``path``."""
    return Path(path) / f"rollout_{rollout_id:06d}.jsonl"


def _encode_array(values: np.ndarray) -> dict[str, Any]:
    """An int array as JSON-friendly data: shape, dtype and its bytes in base64 (a fraction of nested lists)."""
    values = np.ascontiguousarray(values)
    return {"shape": list(values.shape), "dtype": values.dtype.str, "b64": base64.b64encode(values.tobytes()).decode()}


def _decode_array(record: dict[str, Any]) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(record["b64"]), dtype=np.dtype(record["dtype"]))
    return flat.reshape(record["shape"]).copy()


def _record(sample: Sample) -> dict[str, Any]:
    record = {field.name: getattr(sample, field.name) for field in dataclasses.fields(Sample)}
    for name in _SEQUENCE_FIELDS:
        if record[name] is not None:
            record[name] = list(record[name])
    if record[_ARRAY_FIELD] is not None:
        record[_ARRAY_FIELD] = _encode_array(record[_ARRAY_FIELD])
    return record


def sample_records(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Every field of each sample as plain data (lists, not tuples): what a checkpoint or a JSONL line stores."""
    return [_record(sample) for sample in samples]


def samples_from_records(records: Sequence[dict[str, Any]]) -> list[Sample]:
    """The samples :func:`sample_records` described, equal to the originals (unknown keys are ignored)."""
    names = {field.name for field in dataclasses.fields(Sample)}
    samples = []
    for record in records:
        fields = {k: v for k, v in record.items() if k in names}
        if fields.get(_ARRAY_FIELD) is not None:
            fields[_ARRAY_FIELD] = _decode_array(fields[_ARRAY_FIELD])
        samples.append(Sample(**fields))
    return samples


def save_rollout_data(path: str | os.PathLike[str], rollout_id: int, samples: Sequence[Sample]) -> Path:
    """Write one rollout's samples (tokens, log-probs, masks, rewards, labels, weight versions) atomically.

    Args:
        path: Directory (created if missing); the file is ``rollout_<id>.jsonl`` in it.
        rollout_id: Index of the rollout.
        samples: The rollout's samples, in order.

    Returns:
        The file written.

    Raises:
        ValueError: A label is not JSON-serializable (the message names the sample).
    """
    out = rollout_data_path(path, rollout_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"format": FORMAT, "rollout_id": rollout_id, "num_samples": len(samples)})]
    for i, sample in enumerate(samples):
        try:
            lines.append(json.dumps(_record(sample)))
        except TypeError as e:
            raise ValueError(f"--save-debug-rollout-data: sample {i} of rollout {rollout_id} is not JSON: {e}") from e
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out)  # a reader never sees half a rollout
    logger.info("saved %d samples of rollout %d to %s", len(samples), rollout_id, out)
    return out


def load_rollout_data(path: str | os.PathLike[str], rollout_id: int) -> list[Sample]:
    """Read back the samples :func:`save_rollout_data` wrote for ``rollout_id``, equal to those saved.

    Raises:
        ValueError: No such file (the message lists the rollouts present), or the file is not a complete
            rollout in this format.
    """
    file = rollout_data_path(path, rollout_id)
    if not file.is_file():
        present = sorted(p.name for p in Path(path).glob("rollout_*.jsonl")) if Path(path).is_dir() else []
        raise ValueError(
            f"--load-debug-rollout-data {path}: no rollout {rollout_id} ({file.name}); present: {present or 'none'}"
        )
    lines = file.read_text().splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
        records = [json.loads(line) for line in lines[1:]]
    except ValueError as e:
        raise ValueError(f"--load-debug-rollout-data: {file} is not valid JSONL: {e}") from e
    if header.get("format") != FORMAT or header.get("rollout_id") != rollout_id:
        raise ValueError(f"--load-debug-rollout-data: {file} has header {header!r}, expected format {FORMAT!r}")
    if header.get("num_samples") != len(records):
        raise ValueError(
            f"--load-debug-rollout-data: {file} declares {header.get('num_samples')} samples but holds {len(records)}"
        )
    try:
        return samples_from_records(records)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--load-debug-rollout-data: {file} holds a malformed sample: {e}") from e
