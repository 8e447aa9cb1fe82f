"""The ``loco`` command and its subcommands; ``python -m launch.cli`` runs it (torchrun's ``-m launch.cli``).

Every entry point (``loco``, ``python -m launch``, ``python -m launch.cli``) imports this package first, so the
Ctrl-C handling below is in place before any command imports torch."""

import os
import signal
import sys
import threading


def _importing() -> bool:
    """Whether some module is part way through its import (the state Python calls "partially initialized")."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False) for m in list(sys.modules.values()))


def _interrupted(signum, frame) -> None:
    """Ctrl-C raises KeyboardInterrupt as Python's own handler does, except during an import: there it would leave
    a half-made module (torch, most often) that the error handling then imports and fails on, a traceback instead
    of one line. Nothing has been written while loco imports, so it stops at once."""
    if not _importing():
        raise KeyboardInterrupt
    command = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else None
    try:
        sys.stderr.write(f"loco{' ' + command if command else ''}: stopped by the user (Ctrl-C)\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signal.SIGINT)


# only where Ctrl-C still has Python's default meaning: a program embedding loco keeps its own handler
if threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted)

from launch.cli.commands import main  # noqa: E402  (after the handler: see the module's docstring)

__all__ = ["main"]
