"""One log format per process, naming its role (``[tidal actor r0] ...``); importable without Ray or torch."""

from __future__ import annotations

import logging
import warnings

LOG_FORMAT = "[tidal {role}] %(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(role: str, level: int = logging.INFO) -> None:
    """One log format per process, naming its role; quiet third-party chatter."""
    logging.basicConfig(level=level, format=LOG_FORMAT.format(role=role), datefmt="%H:%M:%S", force=True)
    # megatron-core announces at import every optional accelerator library it did not find; tidal needs none.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex|absl).*", category=UserWarning)
    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
    for noisy in ("urllib3", "filelock", "httpx", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
