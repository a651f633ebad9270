"""The `loraplex` console script: for `loraplex serve`, stop signals are handled from its first instruction.

``service.cli`` imports settings, logging and the client helpers before its ``main`` runs; a SIGTERM in that time
would end the process by the default handler. Here the handlers come first (``service.api.signals``), then the CLI.
Everything else is ``service.cli.main``.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> int:
    if sys.argv[1:2] != ["serve"]:
        from service.cli import main as cli_main

        return cli_main()
    from service.api.signals import StopRequested, log_early_stop, raise_on_stop

    raise_on_stop()
    try:
        from service.cli import main as cli_main
    except StopRequested as stop:
        log_early_stop(stop, None)
        return 0
    return cli_main()
