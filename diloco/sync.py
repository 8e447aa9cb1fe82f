"""When a round ends: after a fixed number of inner steps, or when a time budget runs out.

``steps``: every worker does H inner steps per round, so all reach the
collective together. ``time``: every worker trains until its clock has spent
the round's budget (real time, or the simulator's virtual time), so a fast
worker does more steps than a slow one; the average is weighted by the tokens
each one processed, which is what ``round_weight`` returns.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

MODES = ("steps", "time")


class SyncPolicy:
    def __init__(self, mode: str = "steps", inner_steps: int = 100, time_budget_s: Optional[float] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"sync.mode must be one of {', '.join(MODES)}, got {mode!r}")
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if mode == "time" and not (time_budget_s and time_budget_s > 0):
            raise ValueError("sync.mode=time needs sync.time_budget_s > 0")
        self.mode, self.inner_steps, self.time_budget_s = mode, inner_steps, time_budget_s
        self.round_start: Any = 0.0

    # the clock is read in time mode only: a worker's clock may be a collective (a node of a torchrun mesh agrees
    # on its first process's), which a round of fixed steps should not pay at every step. ``mark()`` is a point
    # on it and ``since(point)`` the seconds from there (Transport.mark / seconds_since: the simulator's points
    # keep their steps apart from their network seconds, priced when compared)
    def start_round(self, mark: Callable[[], Any]) -> None:
        if self.mode == "time":
            self.round_start = mark()

    def round_done(self, steps_in_round: int, since: Callable[[Any], float]) -> bool:
        if self.mode == "steps":
            return steps_in_round >= self.inner_steps
        return steps_in_round >= 1 and since(self.round_start) >= self.time_budget_s

    @staticmethod
    def round_weight(steps_in_round: int, tokens_per_step: int) -> float:
        return float(steps_in_round * tokens_per_step)
