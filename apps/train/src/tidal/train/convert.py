"""``train convert``: a Hugging Face checkpoint to a Megatron torch_dist checkpoint and back, at any TP size.

HF -> Megatron: ``train convert --hf-checkpoint HF --save OUT [--tensor-model-parallel-size N]`` builds the actor's
GPTModel from HF (tidal.actor's mapping, TP-sharded over N ranks) and saves it model-only with tidal.ckpt at
iteration 0, with a common state naming the source. Megatron -> HF: ``train convert --load DIR [--ckpt-step N]
--hf-checkpoint HF --save-hf OUT`` builds the model from HF's config.json, loads the checkpoint (at any TP size it
was saved with) and writes HF safetensors with HF's config and tokenizer files. The round trip is bit-exact.

Flags are checked here, before anything heavy is imported. The work runs in N fresh worker processes (one per TP
rank, gloo on CPU: ``CUDA_VISIBLE_DEVICES`` is emptied), so the calling process never initialises
torch.distributed; when one worker fails the others are stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tidal.ckpt import CheckpointError, CheckpointMismatchError, read_hf_config_json
from tidal.train.logs import LogPlan, setup_logging

logger = logging.getLogger("tidal.train.convert")

PROG = "train convert"
_WORKER_ARG = "_worker"
_HF_DTYPES = ("float32", "bfloat16", "float16")
_DIST_TIMEOUT_S = 1800.0
_PORT_TAKEN = 75
"""Worker exit code: rank 0 could not listen on the port picked for it (taken since); the parent retries."""
_PORT_ATTEMPTS = 3


class _UsageError(ValueError):
    """A bad command line; the message names the flag."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvertJob:
    """One validated conversion (the flags of ``train convert``)."""

    hf_checkpoint: str
    """HF model dir: converted (with ``save``) or source of config.json/tokenizer (with ``save_hf``)."""
    tensor_model_parallel_size: int = 1
    """Ranks (and TP size) the conversion runs with (``--tensor-model-parallel-size``)."""
    save: str | None = None
    """Megatron checkpoint dir to write (``--save``): HF -> Megatron."""
    load: str | None = None
    """Megatron checkpoint dir to read (``--load``): Megatron -> HF."""
    ckpt_step: int | None = None
    """Iteration of ``load`` instead of the tracker's (``--ckpt-step``)."""
    save_hf: str | None = None
    """HF dir to write (``--save-hf``)."""
    lora_adapter: str | None = None
    """PEFT LoRA adapter folder to merge into ``hf_checkpoint`` (``--lora-adapter``), written to ``save_hf``."""


def build_parser() -> argparse.ArgumentParser:
    """The ``train convert`` argument parser; every default is None (validation is ``parse_convert``'s)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert HF -> Megatron torch_dist (--save) or Megatron -> HF (--load ... --save-hf), bit-exact.",
        exit_on_error=False,
    )
    parser.add_argument("--hf-checkpoint", help="HF model dir to convert, or (with --load) to take config from")
    parser.add_argument("--save", help="HF -> Megatron: checkpoint dir to write (iteration 0, model only)")
    parser.add_argument("--load", help="Megatron -> HF: checkpoint dir to read (a --save dir of train or convert)")
    parser.add_argument("--ckpt-step", type=int, help="with --load: iteration to read instead of the latest")
    parser.add_argument("--save-hf", help="Megatron -> HF: HF dir to write (config/tokenizer from --hf-checkpoint)")
    parser.add_argument("--tensor-model-parallel-size", type=int, help="ranks to shard the model over (default 1)")
    parser.add_argument(
        "--lora-adapter",
        help="merge this PEFT LoRA folder (a LoRA run's --save-hf) into --hf-checkpoint: --save-hf OUT",
    )
    return parser


def _check_tp(hf_dir: Path, tp: int) -> None:
    cfg = read_hf_config_json(hf_dir)
    heads = cfg.get("num_attention_heads", 1)
    for name in ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size"):
        value = cfg.get(name, heads if name == "num_key_value_heads" else 1)
        if isinstance(value, int) and value % tp:
            raise _UsageError(
                f"--tensor-model-parallel-size {tp} does not divide {name}={value} of {hf_dir / 'config.json'}"
            )


def _check_out_dir(path: Path, flag: str) -> None:
    if path.exists() and not path.is_dir():
        raise _UsageError(f"{flag} {path} is a file; give a directory to write")
    if flag == "--save" and path.is_dir():
        from tidal.ckpt import TRACKER_FILENAME, list_iterations

        found = list_iterations(path)
        if found or (path / TRACKER_FILENAME).exists():
            raise _UsageError(
                f"--save {path} already holds a Megatron checkpoint (iterations {found}); give an empty or new dir"
            )
    if flag == "--save-hf" and path.is_dir() and any(path.iterdir()) and not (path / "config.json").is_file():
        raise _UsageError(f"--save-hf {path} is a non-empty directory that is not an HF checkpoint; give a new dir")


def _check_combination(args: argparse.Namespace) -> None:
    """One direction of the three, with the flags it needs and none of another's."""
    if args.lora_adapter is not None and (args.save is not None or args.load is not None):
        raise _UsageError("--lora-adapter (merge into --hf-checkpoint) cannot be combined with --save or --load")
    if args.lora_adapter is not None and args.save_hf is None:
        raise _UsageError("--save-hf OUT is required with --lora-adapter (the merged HF dir to write)")
    if args.save is None and args.load is None and args.lora_adapter is None:
        raise _UsageError(
            "give --save OUT (HF -> Megatron), --load DIR --save-hf OUT (Megatron -> HF) or --lora-adapter DIR "
            "--save-hf OUT (merge a LoRA adapter into --hf-checkpoint)"
        )
    if args.save is not None and (args.load is not None or args.save_hf is not None):
        raise _UsageError("--save (HF -> Megatron) cannot be combined with --load/--save-hf (Megatron -> HF)")
    if args.load is not None and args.save_hf is None:
        raise _UsageError("--save-hf OUT is required with --load (the HF dir to write)")
    if args.ckpt_step is not None and args.load is None:
        raise _UsageError("--ckpt-step only applies with --load")


def _check_outputs(args: argparse.Namespace, hf: Path) -> None:
    """What the chosen direction reads exists, and what it writes is a new dir (or replaceable)."""
    if (args.save is not None or args.lora_adapter is not None) and not any(hf.glob("*.safetensors")):
        raise _UsageError(f"--hf-checkpoint {hf} holds no *.safetensors files to convert")
    if args.save is not None:
        _check_out_dir(Path(args.save), "--save")
        return
    if args.lora_adapter is not None:
        if not (Path(args.lora_adapter) / "adapter_config.json").is_file():
            raise _UsageError(f"--lora-adapter {args.lora_adapter} has no adapter_config.json: give a PEFT LoRA folder")
    else:
        from tidal.ckpt import resolve_checkpoint

        resolve_checkpoint(args.load, ckpt_step=args.ckpt_step, flag="--load")
    if Path(args.save_hf).resolve() == hf.resolve():
        raise _UsageError("--save-hf must differ from --hf-checkpoint (it would replace the model being read)")
    _check_out_dir(Path(args.save_hf), "--save-hf")


def parse_convert(argv: list[str]) -> ConvertJob:
    """Parse and validate ``train convert`` flags; no heavy import.

    Raises:
        ValueError: a flag is missing, contradictory or points at the wrong thing (the message names it).
        tidal.ckpt.CheckpointError: ``--load``/``--ckpt-step`` name no loadable checkpoint.
    """
    try:
        args, unknown = build_parser().parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise _UsageError(str(e)) from e
    if unknown:
        raise _UsageError(f"unknown argument {unknown[0]}; see `{PROG} --help`")
    _check_combination(args)
    if args.hf_checkpoint is None:
        raise _UsageError(
            "--hf-checkpoint is required: the HF model dir to convert, or (with --load) to copy config from"
        )
    hf = Path(args.hf_checkpoint)
    if not (hf / "config.json").is_file():
        raise _UsageError(f"--hf-checkpoint {hf} has no config.json; point it at a Hugging Face model directory")
    tp = 1 if args.tensor_model_parallel_size is None else args.tensor_model_parallel_size
    if tp < 1:
        raise _UsageError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    _check_tp(hf, tp)
    _check_outputs(args, hf)
    return ConvertJob(
        hf_checkpoint=str(hf.resolve()),
        tensor_model_parallel_size=tp,
        save=None if args.save is None else str(Path(args.save).resolve()),
        load=None if args.load is None else str(Path(args.load).resolve()),
        ckpt_step=args.ckpt_step,
        save_hf=None if args.save_hf is None else str(Path(args.save_hf).resolve()),
        lora_adapter=None if args.lora_adapter is None else str(Path(args.lora_adapter).resolve()),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _run_workers(job: ConvertJob, timeout_s: float | None) -> int:
    """Run the workers; start again on a new port when another process took the rendezvous port first."""
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        code = _run_workers_once(job, timeout_s)
        if code != _PORT_TAKEN:
            return code
        logger.warning(
            "rendezvous port taken by another process; restarting the workers (%d/%d)", attempt, _PORT_ATTEMPTS
        )
    return 1


def _run_workers_once(job: ConvertJob, timeout_s: float | None) -> int:
    """Start one worker per rank and wait for all; stop the rest as soon as one fails. Returns the exit code."""
    world, port = job.tensor_model_parallel_size, _free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    spec = json.dumps(asdict(job))
    cmd = [sys.executable, "-m", "tidal.train.convert", _WORKER_ARG]
    procs = [subprocess.Popen([*cmd, str(rank), str(world), str(port), spec], env=env) for rank in range(world)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                logger.error("convert worker rank %d exited with code %d; stopping the others", rank, code)
                return next((c for c in (2, _PORT_TAKEN) if any(c == f for _, f in failed)), 1)
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                logger.error("conversion did not finish within %.0f s; stopping its workers", timeout_s)
                return 1
            with contextlib.suppress(subprocess.TimeoutExpired):  # wakes as soon as a worker exits
                next(p for p in procs if p.poll() is None).wait(timeout=0.5)
    finally:
        _stop(procs)


def convert_main(argv: list[str], *, timeout_s: float | None = None) -> int:
    """Entry point of ``train convert``; returns the process exit code (2 on a bad command line).

    Args:
        argv: the arguments after ``convert``.
        timeout_s: stop the workers and fail after this many seconds (None: no limit).
    """
    if not logging.getLogger().handlers:
        setup_logging("convert", LogPlan(verbose=True))
    try:
        job = parse_convert(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (ValueError, CheckpointError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)  # noqa: T201 - the one line a user error prints
        return 2
    if job.lora_adapter is not None:
        return _merge_lora(job)
    direction = (
        f"HF {job.hf_checkpoint} -> Megatron {job.save}" if job.save else f"Megatron {job.load} -> HF {job.save_hf}"
    )
    logger.info("converting %s with %d rank(s)", direction, job.tensor_model_parallel_size)
    start = time.monotonic()
    code = _run_workers(job, timeout_s)
    if code == 0:
        logger.info("converted %s in %.1f s", direction, time.monotonic() - start)
    return code


def _merge_lora(job: ConvertJob) -> int:
    """Fold the adapter into the base, tensor by tensor, in this process (no model is built)."""
    from tidal.actor import merged_hf_tensors
    from tidal.ckpt import HFCheckpointReader, save_hf_checkpoint

    start = time.monotonic()
    try:
        tensors = merged_hf_tensors(HFCheckpointReader(job.hf_checkpoint), job.lora_adapter)
    except ValueError as e:
        print(f"{PROG}: error: --lora-adapter: {e}", file=sys.stderr)  # noqa: T201 - the one line a user error prints
        return 2
    save_hf_checkpoint(job.save_hf, tensors, source_dir=job.hf_checkpoint)
    logger.info("merged %s into %s -> %s in %.1f s", job.lora_adapter, job.hf_checkpoint, job.save_hf,
                time.monotonic() - start)  # fmt: skip
    return 0


# ---- worker side (one process per TP rank) ----


def _hf_dtype(hf_dir: str):
    """The dtype config.json declares for the weights (float32 when absent or unusual)."""
    import torch

    cfg = read_hf_config_json(hf_dir)
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return getattr(torch, name if name in _HF_DTYPES else "float32")


def _build_model(hf_dir: str, tp: int):
    """The actor's GPTModel for ``hf_dir``'s config, in float32 (holds bf16/fp16 weights exactly), on CPU."""
    import torch
    from tidal.actor import build_gpt_model, read_hf_config, to_transformer_config

    spec = read_hf_config(hf_dir)
    config = to_transformer_config(
        spec, tensor_model_parallel_size=tp, params_dtype=torch.float32, use_cpu_initialization=True
    )
    return build_gpt_model(spec, config), spec


def _hf_to_megatron(job: ConvertJob, rank: int) -> None:
    from tidal.actor import load_hf_weights
    from tidal.ckpt import save_checkpoint

    model, spec = _build_model(job.hf_checkpoint, job.tensor_model_parallel_size)
    load_hf_weights(model, spec, job.hf_checkpoint)
    common = {
        "converted_from": job.hf_checkpoint,
        "source_format": "huggingface",
        "model_type": spec.model_type,
        "tensor_model_parallel_size": job.tensor_model_parallel_size,
    }
    assert job.save is not None
    save_checkpoint(job.save, 0, {"model": model.sharded_state_dict()}, common_state=common)
    if rank == 0:
        logger.info("wrote Megatron checkpoint %s (iteration 0, model only)", job.save)


def _megatron_to_hf(job: ConvertJob, rank: int) -> None:
    import torch.distributed as dist
    from tidal.actor import named_hf_tensors
    from tidal.ckpt import load_checkpoint, save_hf_checkpoint

    model, spec = _build_model(job.hf_checkpoint, job.tensor_model_parallel_size)
    assert job.load is not None and job.save_hf is not None
    loaded, common = load_checkpoint(job.load, {"model": model.sharded_state_dict()}, ckpt_step=job.ckpt_step)
    model.load_state_dict(loaded["model"], strict=True)
    dtype = _hf_dtype(job.hf_checkpoint)
    if rank == 0:
        logger.info("loaded %s (common state %s); writing HF tensors as %s", job.load, common, dtype)
    tensors = ((name, t.to(dtype)) for name, t in named_hf_tensors(model, spec))
    if rank == 0:
        save_hf_checkpoint(job.save_hf, tensors, source_dir=job.hf_checkpoint)
    else:
        for _ in tensors:  # the TP gathers are collective: every rank iterates
            pass
    dist.barrier()


def _worker_main(argv: list[str]) -> int:
    """One rank: ``python -m tidal.train.convert _worker RANK WORLD PORT JOB_JSON``."""
    rank, world, port = (int(x) for x in argv[:3])
    job = ConvertJob(**json.loads(argv[3]))
    setup_logging(f"convert r{rank}", LogPlan(verbose=rank == 0))  # rank 0 reports; the others only warn
    # megatron-core imports flashinfer and FA4's flash_attn.cute (sglang's, with the CUTLASS DSL) when installed,
    # only for GPU inference/MoE/attention kernels that a CPU conversion never runs: two thirds of this process's
    # import time. Every such import is guarded by `except ImportError`, which None in sys.modules raises.
    for module in ("flashinfer", "flash_attn.cute"):
        sys.modules.setdefault(module, None)
    from tidal.actor import destroy_distributed, init_distributed
    from torch.distributed import DistNetworkError

    try:
        init_distributed(
            rank=rank,
            world_size=world,
            master_addr="127.0.0.1",
            master_port=port,
            tensor_model_parallel_size=world,
            timeout_s=_DIST_TIMEOUT_S,
        )
    except DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        logger.warning("port %d was taken before rank %d could listen on it", port, rank)
        return _PORT_TAKEN
    try:
        (_hf_to_megatron if job.save else _megatron_to_hf)(job, rank)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        message = str(e)
        if isinstance(e, CheckpointMismatchError):
            message += (
                f"\n(train convert builds the model from --hf-checkpoint {job.hf_checkpoint}: pass the HF model the "
                "checkpoint was converted or trained from)"
            )
        print(f"{PROG}: error: {message}" if rank == 0 else f"{PROG}: error (rank {rank}): {message}", file=sys.stderr)  # noqa: T201
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] != [_WORKER_ARG]:
        sys.exit(convert_main(args))
    code = _worker_main(args[1:])
    # Everything the worker wrote is already fsynced and published; skip the interpreter's teardown of torch and
    # megatron-core (several seconds per worker on a busy machine).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
