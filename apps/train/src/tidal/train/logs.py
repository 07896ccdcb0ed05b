"""Logging of every tidal process: one format naming its role, a log file in the run folder, a quiet terminal.

Each process (``train``, each actor rank, each engine's worker) logs at INFO into ``OUT/logs/<role>.log`` and
writes to stderr only what a person watching needs: warnings and errors, plus, in the driver, the records a
caller marks with ``extra=TERMINAL`` (the start-up block, one line per rollout, evaluations, the summary).
``--verbose`` puts every INFO record on stderr too. Ray forwards the workers' stderr to the driver's terminal.

Third-party notices a user cannot act on (:data:`NOTICES`) are logged once, at INFO, with what they mean; every
other third-party warning passes. Importable without Ray or torch.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

LOG_FORMAT = "[tidal {role}] %(asctime)s %(levelname)s %(name)s: %(message)s"

TERMINAL = {"terminal": True}
"""``extra=`` of an INFO record that the driver's terminal shows without ``--verbose``."""

NOTICES: tuple[tuple[str, str, str], ...] = (
    (
        "ray._private.authentication.authentication_token_setup",
        r"Token authentication is enabled",
        "the local Ray cluster accepts only this job's token; nothing to do",
    ),
    ("torch.utils.cpp_extension", r"No CUDA runtime is found", "CPU mode: no CUDA here, as expected"),
    (
        "megatron.core.models.gpt.gpt_model",
        r"GPTModel IS DEPRECATED",
        "tidal builds GPTModel, which megatron-core still supports; nothing to do",
    ),
    (
        "megatron.core.dist_checkpointing.strategies.torch",
        r"async save is deprecated",
        "megatron-core's save strategy says so on every save; tidal's checkpoints are unaffected",
    ),
)
"""``(logger name, message pattern, what it means)`` of each third-party notice moved from WARNING to INFO."""


@dataclass(frozen=True, slots=True)
class LogPlan:
    """Where a process logs: the run folder's log directory and whether INFO reaches the terminal."""

    log_dir: str | None = None
    """The run folder's ``logs/``: each process writes ``<role>.log`` there; None: no file."""
    verbose: bool = False
    """--verbose: every INFO record on stderr too (else warnings and errors, and the driver's marked lines)."""

    @classmethod
    def of_run(cls, output_dir: str, verbose: bool) -> LogPlan:
        """The plan of every process of the run whose folder is ``output_dir`` (logs in its ``logs/``)."""
        return cls(log_dir=str(Path(output_dir) / "logs"), verbose=verbose)


class _Stderr(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a record is written (a live progress bar swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _TerminalFilter(logging.Filter):
    """Passes warnings and errors, records marked :data:`TERMINAL`, and with ``verbose`` everything."""

    def __init__(self, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        return self.verbose or record.levelno >= logging.WARNING or getattr(record, "terminal", False)


class _Notice(logging.Filter):
    """On one third-party logger: a matching warning becomes one INFO record saying what it means."""

    def __init__(self, pattern: str, meaning: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)
        self.meaning = meaning
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not self.pattern.search(record.getMessage()):
            return True
        if not self.said:
            self.said = True
            logging.getLogger("tidal.notices").info("%s: %s (%s)", record.name, record.getMessage(), self.meaning)
        return False


def setup_logging(role: str, plan: LogPlan | None = None, *, terminal_marks: bool = False) -> None:
    """One log format per process, naming its role; the run folder's log file; quiet third-party chatter.

    Args:
        role: The process's name in each line (``train``, ``actor r0``) and its log file's (``actor_r0.log``).
        plan: The log directory and verbosity; None: no file, not verbose.
        terminal_marks: stderr also shows INFO records marked :data:`TERMINAL` (the driver's lines).
    """
    plan = plan or LogPlan()
    formatter = logging.Formatter(LOG_FORMAT.format(role=role), datefmt="%H:%M:%S")
    terminal = _Stderr()
    if terminal_marks:
        terminal.addFilter(_TerminalFilter(plan.verbose))
    else:
        terminal.setLevel(logging.INFO if plan.verbose else logging.WARNING)
    handlers: list[logging.Handler] = [terminal]
    if plan.log_dir:
        Path(plan.log_dir).mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^\w.-]+", "_", role)  # "engine http://host:port" -> engine_http_host_port.log
        handlers.append(logging.FileHandler(Path(plan.log_dir) / f"{name}.log", encoding="utf-8"))
    for handler in handlers:
        handler.setFormatter(formatter)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    for name, pattern, meaning in NOTICES:
        notices = logging.getLogger(name)
        if not any(isinstance(f, _Notice) for f in notices.filters):
            notices.addFilter(_Notice(pattern, meaning))
    # megatron-core announces at import every optional accelerator library it did not find; tidal needs none.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl).*", category=UserWarning)
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    for noisy in ("urllib3", "filelock", "httpx", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def forward_ray_logs() -> None:
    """Ray's worker output reaches the terminal as the workers wrote it, without Ray's coloured ``(pid=...)``.

    Call before Ray is imported: Ray reads the switch once. Every tidal worker line names its role already.
    """
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")


def adopt_ray_logger() -> None:
    """The driver's ``ray`` logger writes through this process's handlers (Ray installs its own at import)."""
    ray_logger = logging.getLogger("ray")
    ray_logger.handlers.clear()
    ray_logger.propagate = True
