"""``python -m tidal.rollout.router_launcher ARGS``: sglang-router's own launcher, without its slow import.

``python -m sglang_router.launch_router`` imports ``sglang_router.mini_lb`` (a Python debugging balancer),
which imports all of ``sglang`` and ``transformers``: about 50 s on two shared cores before the Rust router
starts (measured with ``-X importtime``). This module parses the same arguments with sglang-router's
``RouterArgs`` and starts the same Rust ``Router``; it imports in under a second.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``launch_router`` arguments and run the Rust router until it is told to stop."""
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="tidal.rollout.router_launcher", description=__doc__)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    router_args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    router_args._validate_router_args()  # what launch_router does before starting
    Router.from_args(router_args).start()


if __name__ == "__main__":
    main(sys.argv[1:])
