"""The job's Weights & Biases run: its options from the job, its start, and where it is.

``--use-wandb`` starts one W&B run per ``train`` (before any Ray, SGLang or Megatron process, so a missing key or an
unreachable server stops the job at once), logs each rollout's record to it stepped by rollout id, and records where
the run is in ``summary.json``: its URL online, its folder under the run folder's ``wandb/`` offline (``wandb sync
FOLDER`` uploads it later). The key is W&B's own business (``WANDB_API_KEY`` or ``wandb login``): no option carries
it, so it never reaches ``config.yaml``, the logs or the process list.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tidal.train.logs import TERMINAL

logger = logging.getLogger(__name__)


def wandb_options(job, out: Path) -> dict[str, Any] | None:
    """The W&B run's options for ``job`` writing into the run folder ``out``; None without ``--use-wandb``."""
    log = job.logging
    if not log.use_wandb:
        return None
    values = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    config = {name: dataclasses.asdict(value) for name, value in values.items() if value is not None}
    return {
        "project": log.wandb_project,
        "group": log.wandb_group,
        "mode": log.wandb_mode,
        "host": log.wandb_host,
        "dir": str(out),
        "config": config,
    }


class WandbStartError(RuntimeError):
    """W&B could not start the run (no key online, server unreachable, ...)."""


def start_wandb(options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Start the W&B run; return it and where it is (``mode``, ``project``, ``group``, ``id``, ``url``, ``dir``).

    Raises:
        WandbStartError: One line: what W&B said, and the ways on (a key, another host, offline).
    """
    import wandb

    settings = wandb.Settings(silent=True, **({"base_url": options["host"]} if options["host"] else {}))
    kwargs = {k: options[k] for k in ("project", "group", "dir", "config")}
    if options["mode"] is not None:
        kwargs["mode"] = options["mode"]  # else W&B's own: $WANDB_MODE, or online
    try:
        run = wandb.init(settings=settings, **kwargs)
    except wandb.errors.Error as e:
        said = " ".join(str(e).split())
        host = options["host"] or "W&B's default server"
        raise WandbStartError(
            f"--use-wandb: W&B did not start an {options['mode'] or 'online'} run at {host} ({said}); set "
            "WANDB_API_KEY or run `wandb login`, point --wandb-host at your server, or pass --wandb-mode offline "
            "(upload later with `wandb sync`)"
        ) from e
    mode = run.settings.mode
    where: dict[str, Any] = {"mode": mode, "project": options["project"], "group": options["group"]}
    if mode == "disabled":
        logger.info("W&B: disabled (--wandb-mode disabled or WANDB_MODE): nothing is logged there", extra=TERMINAL)
        return run, where
    where |= {"id": run.id, "url": run.url if mode == "online" else None, "dir": str(run.settings.sync_dir)}
    if mode == "online":
        logger.info("W&B run %s", where["url"], extra=TERMINAL)
    else:
        folder = where["dir"]
        logger.info("W&B run (offline) in %s; upload it with `wandb sync %s`", folder, folder, extra=TERMINAL)
    return run, where
