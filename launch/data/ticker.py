"""The progress line of long work on data (``loco tokenizer train``, ``loco data prepare``, a large text encoded
at a run's start): rewritten in place once a second on a terminal, said as a line every 10 s elsewhere (a log
file gains six lines a minute, not a line per update)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional


class Ticker:
    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.live = sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def due(self) -> Optional[float]:
        """The seconds since the start, when a line is due now (else None)."""
        now = time.perf_counter()
        if now - self.last < (1.0 if self.live else 10.0):
            return None
        self.last = now
        return now - self.start

    def show(self, line: str) -> None:
        if self.live:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        else:
            self.say(line)

    def close(self) -> float:
        """Ends the line in place; the seconds since the start."""
        if self.live:
            print(file=sys.stderr)
        return time.perf_counter() - self.start
