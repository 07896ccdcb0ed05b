"""Delta weight updates: the wire format both sides share, and the loader that applies a delta inside SGLang.

A delta of one HF tensor holds only the elements whose bits changed since the version the engine serves: their
flat indices (int32, or int64 past 2**31 elements) or a bitmask of the tensor (one bit per element), whichever is
smaller, followed by the new values, all in one uint8 tensor whose name says how to read it
(``tidal.delta|KIND|CHANGED|DTYPE|SHAPE|HF_NAME``). :func:`encode_delta` builds it on the sender.

:func:`load_delta` runs inside the SGLang scheduler (each TP rank) as a custom weight loader: tidal's engines are
launched with ``--custom-weight-loader tidal.rollout.engine_delta.load_delta`` and the sender names it as the
``load_format`` of ``/update_weights_from_tensor``. For each delta it reads the HF tensor back from the engine's own
parameters, sets the changed elements and loads the result through the model's normal ``load_weights``. The read-back
uses SGLang's weight loaders themselves: loading a tensor of the HF positions (float64, exact below 2**53) with every
loader writing into a scratch buffer instead of its parameter maps each element of the parameter to the HF element
it holds, whatever the fusion (q/k/v, gate/up), TP sharding or padding. After loading, the tensor is read back again
and its :func:`delta_checksum` (where this rank holds every element) goes into a JSON report, one file per
server process, in the folder a ``tidal.report|DIR`` entry names; the sender compares them with its own. A
plain-named entry is a whole tensor (a fallback), loaded the normal way and checked the same. A ``tidal.file|PATH``
entry names a safetensors file of such entries (the disk transport), read here. A ``tidal.route|`` entry installs
:func:`route_broadcast_deltas` (the nccl transport's way in).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

LOADER = f"{__name__}.load_delta"
"""The import path SGLang's ``--custom-weight-loader`` and ``load_format`` name (``engine.DELTA_LOADER``)."""
DELTA = "tidal.delta|"
DELTA_REPORT = "tidal.report|"
DELTA_FILE = "tidal.file|"
DELTA_ROUTE = "tidal.route|"
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, its elements' bits as integers of the same width (bitwise equality, -0.0 and NaN included)."""
    return t.detach().reshape(-1).view(_INT[t.element_size()])


def delta_checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of ``t``'s bits modulo 2**64: equal bits in equal places, equal sums on any device."""
    bits, total = _bits(t), 0
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) * 2654435761 + 1
        total += int((part * weight).sum())
    return total & (2**64 - 1)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[n]`` -> uint8 ``[ceil(n / 8)]``; bit j of byte i is ``mask[8 i + j]``."""
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-mask.numel()) % 8)).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (padded << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).view(-1)[:n].bool()


def encode_delta(name: str, new: torch.Tensor, old: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """``(entry name, payload, changed flat indices)`` of ``new`` against ``old`` (same dtype, shape and device).

    None when nothing changed. When the delta would be no smaller than ``new`` itself, the entry is ``new`` under its
    plain name (a whole tensor).
    """
    changed = _bits(new) != _bits(old)
    idx = changed.nonzero().view(-1)
    k, n, size = idx.numel(), new.numel(), new.element_size()
    if k == 0:
        return None
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    by_index, by_mask = k * index_dtype.itemsize, (n + 7) // 8
    if min(by_index, by_mask) + k * size >= n * size:
        return name, new, idx
    if by_index <= by_mask:
        kind, head = "idx", idx.to(index_dtype).view(torch.uint8)
    else:
        kind, head = "mask", _pack_bits(changed)
    values = new.reshape(-1)[idx].view(torch.uint8)
    shape = "x".join(map(str, new.shape))
    dtype = str(new.dtype).removeprefix("torch.")
    return f"{DELTA}{kind}|{k}|{dtype}|{shape}|{name}", torch.cat([head, values]), idx


def decode_delta(key: str, payload: torch.Tensor) -> tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]:
    """``(hf_name, shape, changed flat indices (int64), new values)`` of an :func:`encode_delta` entry."""
    kind, k, dtype, shape, name = key.removeprefix(DELTA).split("|", 4)
    k, dims = int(k), tuple(int(d) for d in shape.split("x") if d)
    n, dtype = math.prod(dims), getattr(torch, dtype)
    if kind == "idx":
        index_dtype = torch.int32 if n < 2**31 else torch.int64
        head = k * index_dtype.itemsize
        idx = payload[:head].view(index_dtype).to(torch.int64)
    else:
        head = (n + 7) // 8
        idx = _unpack_bits(payload[:head], n).nonzero().view(-1)
    return name, dims, idx, payload[head:].view(dtype)


class _Redirect:
    """Every weight loader of ``model``, wrapped: inside :meth:`into` it writes into a scratch buffer instead.

    The buffer (float64, zeroed) is kept per parameter; outside :meth:`into` the loaders run as before.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        self.buffers: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] | None = None
        self._restore: list[tuple[torch.nn.Parameter, str, object]] = []
        for param in model.parameters():
            attr = "_weight_loader" if isinstance(getattr(type(param), "weight_loader", None), property) else None
            attr = attr or "weight_loader"
            loader = getattr(param, "weight_loader", None) or default_weight_loader
            self._restore.append((param, attr, param.__dict__.get(attr, _MISSING)))
            setattr(param, attr, self._wrap(loader))

    def _wrap(self, loader):
        def weight_loader(param, loaded, *args, **kwargs):
            if self.buffers is None:
                return loader(param, loaded, *args, **kwargs)
            if id(param) not in self.buffers:
                self.buffers[id(param)] = (param, torch.zeros(param.shape, dtype=torch.float64, device=param.device))
            data, param.data = param.data, self.buffers[id(param)][1]
            try:
                return loader(param, loaded, *args, **kwargs)
            finally:
                param.data = data

        return weight_loader

    @contextlib.contextmanager
    def into(self) -> Iterator[dict[int, tuple[torch.nn.Parameter, torch.Tensor]]]:
        self.buffers = {}
        try:
            yield self.buffers
        finally:
            self.buffers = None

    def close(self) -> None:
        for param, attr, before in self._restore:
            if before is _MISSING:
                delattr(param, attr)
            else:
                setattr(param, attr, before)


_MISSING = object()


def _positions(model, redirect: _Redirect, name: str, shape: tuple[int, ...], device) -> list[tuple]:
    """Per parameter HF tensor ``name`` loads into: ``(parameter, where it holds elements, their HF flat indices)``."""
    code = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64, device=device).view(shape)
    with redirect.into() as buffers:
        model.load_weights([(name, code)])
    maps = []
    for param, buf in buffers.values():
        held = buf > 0
        maps.append((param, held, buf[held].to(torch.int64) - 1))
    return maps


def _read_back(maps: list[tuple], numel: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, bool]:
    """The HF tensor as the parameters hold it (flat, ``dtype``) and whether this rank holds every element."""
    flat = torch.zeros(numel, dtype=dtype, device=device)
    covered = torch.zeros(numel, dtype=torch.bool, device=device)
    for param, held, idx in maps:
        flat[idx] = param.data[held].to(dtype)
        covered[idx] = True
    return flat, bool(covered.all())


def _apply(model, redirect: _Redirect, key: str, tensor: torch.Tensor) -> tuple[str, int | None]:
    """Load one entry (a delta or a whole tensor); ``(hf_name, checksum after loading or None: not held whole)``."""
    if key.startswith(DELTA):
        name, shape, idx, values = decode_delta(key, tensor)
    else:
        name, shape = key, tuple(tensor.shape)
    device = tensor.device
    maps = _positions(model, redirect, name, shape, device)
    if not maps:
        return name, None  # a tensor this rank does not serve (another pipeline rank's layer, a tied head)
    dtype = maps[0][0].dtype  # read back and checked in the engine's dtype, which the sender's snapshot follows
    if key.startswith(DELTA):
        flat, _ = _read_back(maps, math.prod(shape), dtype, device)
        flat[idx] = values.to(dtype)
        tensor = flat.view(shape)
    model.load_weights([(name, tensor)])
    after, whole = _read_back(maps, math.prod(shape), dtype, device)
    return name, delta_checksum(after) if whole else None


def _entries(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str | None, list]:
    report, entries = None, []
    for key, tensor in named_tensors:
        if key.startswith(DELTA_REPORT):
            report = key.removeprefix(DELTA_REPORT)
        elif key.startswith(DELTA_FILE):
            from safetensors.torch import load_file

            entries += load_file(key.removeprefix(DELTA_FILE), device=str(tensor.device)).items()
        elif not key.startswith(DELTA_ROUTE):
            entries.append((key, tensor))
    return report, entries


def load_delta(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: apply each delta or whole tensor, then report the checksums (see the module).

    Nothing raises out of it (an exception here would kill SGLang's scheduler): an entry that cannot be applied is
    reported as "error", and a report that cannot be written leaves the sender one report short, which it names.
    """
    try:
        if any(key.startswith(DELTA_ROUTE) for key, _ in named_tensors):
            route_broadcast_deltas(model)
        report, entries = _entries(named_tensors)
    except Exception as e:
        logger.warning("tidal delta entries could not be read: %r", e)
        return
    sums = {}
    try:
        redirect = _Redirect(model)
        try:
            for key, tensor in entries:
                try:
                    name, total = _apply(model, redirect, key, tensor)
                    sums[name] = None if total is None else str(total)
                except Exception as e:  # the sender sees "error" and sends the tensor whole
                    logger.warning("tidal delta entry %s could not be applied: %r", key[:200], e)
                    sums[key.rsplit("|", 1)[-1]] = "error"
        finally:
            redirect.close()
        if report is not None:
            out = Path(report) / f"{socket.gethostname()}-{os.getpid()}.json"
            tmp = out.with_suffix(".tmp")
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            tmp.write_text(json.dumps({"dtype": dtype, "sums": sums}))
            tmp.replace(out)
    except Exception as e:
        logger.warning("tidal delta update failed: %r", e)


def route_broadcast_deltas(model: torch.nn.Module) -> None:
    """Wrap ``model.load_weights`` (once): a request opening with a report entry goes to :func:`load_delta`.

    Every other call passes through unchanged (lazily: a checkpoint's iterator stays one). A workaround of an
    upstream limit, in this one place: SGLang's ``/update_weights_from_distributed`` (the nccl transport) hands the
    tensors it receives to ``model.load_weights`` itself and, unlike ``/update_weights_from_tensor``, dispatches to
    no custom weight loader (its ``load_format`` only selects the flattened-bucket receipt). The sender installs the
    wrapper with a ``tidal.route|`` entry through ``/update_weights_from_tensor`` before each delta sync over nccl (a
    restarted server starts without it), then broadcasts requests whose first entry is ``tidal.report|DIR``.
    ``tests/test_engine_delta.py`` fails when SGLang changes that path.
    """
    if getattr(model.load_weights, "tidal_routes_deltas", False):
        return
    plain = model.load_weights

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args, **kwargs):
        weights = iter(weights)
        first = next(weights, None)
        if first is not None and first[0].startswith(DELTA_REPORT):
            return load_delta(model, [first, *weights])
        return plain(weights if first is None else itertools.chain([first], weights), *args, **kwargs)

    load_weights.tidal_routes_deltas = True
    model.load_weights = load_weights
