"""LoRA adapters served by SGLang beside the base model: server flags, loading (tensors or a PEFT folder), naming.

An SGLang server started with ``--enable-lora`` serves its base model and every adapter loaded at run time; a
``/generate`` request that names an adapter (``lora_path``) is served by base + adapter, one without by the base.
A training job loads each new adapter under its own versioned name (:func:`adapter_name`), points every
``/generate`` of its clients at it (``SGLangClient.lora_name``), and unloads the adapters before the previous one
(:class:`ServedAdapters`): requests sent under the previous name just before the switch still finish, and an
engine never holds more than two adapters.

Two ways in:

* in memory (:func:`load_adapter_from_tensors`, ``/load_lora_adapter_from_tensors``): the tensors go as torch
  ``ForkingPickler`` handles (shared memory on the same host, as ``weight_sync.update_weights_from_tensor``), so no
  adapter bytes cross HTTP;
* from disk (:meth:`ServedAdapters.serve` with a path, ``/load_lora_adapter``): a PEFT folder
  (``adapter_config.json`` + ``adapter_model.safetensors``) the server can read.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # importing it registers the tensor reductions with ForkingPickler
from tidal.rollout.client import SGLangClient
from tidal.rollout.errors import RolloutError

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "tidal-lora-v"
"""Start of every adapter name tidal loads (``tidal-lora-v3-...``: an adapter of weight version 3)."""
KEEP = 2
"""Adapters one engine holds at most: the served one and the one before it (its requests may still run)."""


def adapter_name(version: int | str, tag: str) -> str:
    """The name the adapter of weight version ``version`` is loaded and requested under (``tag``: unique per load).

    A sync that runs again (an engine died in it) loads the same version under a new tag: the engines that took the
    first attempt still hold its name, and SGLang refuses a name twice.
    """
    return f"{ADAPTER_PREFIX}{version}-{tag}"


def lora_server_args(rank: int, target_modules: Sequence[str], *, given: Sequence[str] = ()) -> tuple[str, ...]:
    """``sglang.launch_server`` flags that let a server take adapters of ``rank`` on ``target_modules`` at run time.

    ``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules`` (HF names, e.g. ``q_proj``); on CPU the engine
    adds ``--lora-backend torch_native`` (``engine.CPU_LORA_BACKEND``). With ``--enable-memory-saver`` in ``given``
    also ``--enable-weights-cpu-backup``: the base weights a server releases come back from a host copy, since no
    sync sends them again. A flag already in ``given`` (the user's ``--sglang-*`` flags) is left to the user.
    """
    flags = [("--enable-lora",), ("--max-lora-rank", str(rank)), ("--lora-target-modules", *target_modules)]
    named = {arg.split("=", 1)[0] for arg in given if arg.startswith("--")}
    if "--enable-memory-saver" in named:
        flags.append(("--enable-weights-cpu-backup",))
    return tuple(part for flag in flags if flag[0] not in named for part in flag)


def _serialize(tensors: dict[str, torch.Tensor]) -> str:
    """Base64 of the ``ForkingPickler`` dump (what sglang's ``MultiprocessingSerializer`` reads) of ``tensors``."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def load_adapter_from_tensors(
    engines: SGLangClient | Sequence[SGLangClient],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    name: str,
    config: Mapping[str, Any],
    tp_size: int = 1,
) -> dict[str, float]:
    """Load one adapter into every engine from tensors in this process's memory (handles, not bytes, over HTTP).

    Args:
        engines: Running engines started with the flags of :func:`lora_server_args`, on this host.
        named_tensors: ``(name, tensor)`` of every ``lora_A`` / ``lora_B`` weight (PEFT's names).
        name: The adapter's name (:func:`adapter_name`); it must not be loaded yet.
        config: PEFT's ``adapter_config.json`` as a dict (rank, alpha, target modules).
        tp_size: Tensor-parallel size of each engine (each TP rank gets its own copy of the handles).

    Returns:
        Metrics: ``weight_sync/seconds``, ``weight_sync/mb`` (the adapter's bytes), ``weight_sync/num_tensors``.

    Raises:
        RolloutError: An engine refused (e.g. a server started without ``--enable-lora``; the message says how).
    """
    engines = [engines] if isinstance(engines, SGLangClient) else list(engines)
    torch.multiprocessing.set_sharing_strategy("file_system")  # else the server rejects the handles
    start = time.perf_counter()
    tensors = {n: t.detach().contiguous() for n, t in named_tensors}
    payload = {
        "lora_name": name,
        "config_dict": dict(config),
        "serialized_named_tensors": [_serialize(tensors) for _ in range(tp_size)],
    }
    for engine in engines:
        _call(engine, "/load_lora_adapter_from_tensors", payload, name)
    seconds = time.perf_counter() - start
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.info("LoRA adapter %s from tensors: %.2f MB, %d tensors, %.2f s", name, total / 2**20, len(tensors), seconds)
    return {"weight_sync/seconds": seconds, "weight_sync/mb": total / 2**20, "weight_sync/num_tensors": len(tensors)}


def _call(engine: SGLangClient, endpoint: str, payload: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``engine.call`` with a hint when the server cannot take adapters at all."""
    try:
        return engine.call(endpoint, payload, what=f"{endpoint.lstrip('/')}({name})")
    except RolloutError as e:
        if "LoRA is not enabled" in str(e) or "enable-lora" in str(e):
            raise RolloutError(
                f"{e} -- a server run elsewhere (--rollout-external-engine-addrs) must be started with --enable-lora, "
                "--max-lora-rank >= --lora-rank and --lora-target-modules covering the trained modules"
            ) from e
        raise


class ServedAdapters:
    """The adapters one engine holds (oldest first) and which one its requests name.

    :meth:`serve` makes a loaded adapter (or one it loads from a PEFT folder) the served one: the engine reports
    ``version`` (``/get_model_info``'s ``weight_version``, and every sample's), every ``/generate`` of ``clients``
    names the adapter, and the adapters before the previous one are unloaded. After the server restarted (it holds
    none), :meth:`forget` empties the list.
    """

    def __init__(self, engine: SGLangClient, *, keep: int = KEEP) -> None:
        """Track ``engine``'s adapters; at most ``keep`` (>= 1) stay loaded."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.engine, self.keep = engine, keep
        self.names: list[str] = []

    def serve(
        self, name: str, version: str, *, path: str | None = None, clients: Sequence[SGLangClient] = ()
    ) -> dict[str, Any]:
        """Serve adapter ``name`` as weight version ``version`` (``path``: load it from that PEFT folder first).

        Returns the engine's ``/load_lora_adapter`` answer ({} when the adapter came as tensors).

        Raises:
            RolloutError: The server refused the load, the version or an unload.
        """
        answer: dict[str, Any] = {}
        if path is not None:
            answer = _call(self.engine, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, name)
        payload = {"new_version": str(version), "abort_all_requests": False}
        self.engine.call("/update_weight_version", payload, what=f"update_weight_version({version})")
        for client in (self.engine, *clients):
            client.lora_name = name
        if name not in self.names:
            self.names.append(name)
        while len(self.names) > self.keep:
            old = self.names.pop(0)
            self.engine.call("/unload_lora_adapter", {"lora_name": old}, what=f"unload_lora_adapter({old})")
        return answer

    def forget(self) -> None:
        """The server restarted: it holds no adapter any more."""
        self.names.clear()

    def loaded(self) -> list[str]:
        """The adapters the server reports (``/v1/models`` lists each loaded one beside the base)."""
        response = self.engine.request("GET", "/v1/models")
        if response.status_code != 200:
            raise RolloutError(f"/v1/models at {self.engine.url} answered {response.status_code}")
        return [m["id"] for m in response.json().get("data", []) if m.get("id", "").startswith(ADAPTER_PREFIX)]
