"""Churn: when simulated workers leave the run and come back.

A churn schedule is a list of events ``(worker, leave | join)`` keyed either by virtual time or by round:

* ``time`` (a duration: ``90s``, ``30m``, ``2h``): a worker *leaves* at the end of its first step that ends after
  that time, as a killed peer would, losing the round it was in; it *joins* at the first round boundary at or
  after that time, taking the run's current state, and takes part from the next round on.
* ``round`` (an integer): a worker leaves after its first step of that round (its part of the round is lost);
  it joins at the start of that round (it takes part in it).

A file holds one event per row: CSV with a header naming ``worker``, ``event`` and either ``time`` or ``round``
(``#`` starts a comment), or YAML (a list of mappings with those keys, or a mapping whose ``churn`` key holds the
list). A distribution draws the events instead: ``poisson:mtbf=2h,rejoin=10m`` gives every worker but worker 0
up-times drawn from an exponential distribution of mean ``mtbf`` and down-times of mean ``rejoin`` (seeded by
``run.seed``). Worker 0 keeps the run's log, evaluations and checkpoints, so it never leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from diloco.sim.links import read_rows
from diloco.sim.units import parse_duration


class ChurnError(ValueError):
    """A churn schedule that cannot be used; the message names the file (and row) or the spec."""


@dataclass(frozen=True)
class ChurnEvent:
    worker: int
    kind: str  # "leave" or "join"
    time: Optional[float] = None  # virtual seconds, or
    round: Optional[int] = None  # a round number

    def describe(self) -> str:
        at = f"round {self.round}" if self.round is not None else f"{self.time:g}s"
        return f"worker {self.worker} {self.kind}s at {at}"


class ChurnSchedule:
    """The events of each worker in order; :meth:`leaves_now` and :meth:`joins_now` consume them as the run goes."""

    def __init__(self, events: list[ChurnEvent], source: str = "churn") -> None:
        self.source = source
        self.events = list(events)
        self._pending: dict[int, list[ChurnEvent]] = {}
        for e in events:
            self._pending.setdefault(e.worker, []).append(e)
        self._draw: Optional[tuple[float, float]] = None  # (mtbf, rejoin) of a distribution
        self._seed = 0
        self._rngs: dict[int, np.random.Generator] = {}
        self._last_time: dict[int, float] = {}  # when each worker's latest event happened
        self._away: dict[int, bool] = {}

    # ---- reading ------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str, workers: int, seed: int = 0) -> "ChurnSchedule":
        """A file path or a ``poisson:...`` distribution; checked against ``workers``."""
        spec = str(spec).strip()
        if spec.startswith("poisson:"):
            sched = cls.poisson(spec, workers, seed)
        else:
            sched = cls.load(spec)
        sched.check(workers)
        return sched

    @classmethod
    def poisson(cls, spec: str, workers: int, seed: int = 0) -> "ChurnSchedule":
        keys: dict[str, float] = {}
        for part in spec.partition(":")[2].split(","):
            name, eq, value = part.strip().partition("=")
            if not eq or name not in ("mtbf", "rejoin"):
                raise ChurnError(f"churn {spec!r}: expected poisson:mtbf=DURATION,rejoin=DURATION, "
                                 f"e.g. poisson:mtbf=2h,rejoin=10m")
            try:
                keys[name] = parse_duration(value)
            except ValueError as e:
                raise ChurnError(f"churn {spec!r}: {name}: {e}") from None
        if "mtbf" not in keys or not keys["mtbf"] > 0:
            raise ChurnError(f"churn {spec!r}: mtbf (the mean up-time of a worker) must be given and > 0")
        sched = cls([], spec)
        sched._draw, sched._seed = (keys["mtbf"], keys.get("rejoin", 0.0)), int(seed)
        for w in range(1, workers):  # worker 0 keeps the log and never leaves
            sched._pending[w] = []
        return sched

    def _draw_next(self, worker: int) -> None:
        """A distribution's next event for ``worker``, drawn from when its last one really happened (a join waits
        for a round boundary, so its up-time starts there)."""
        mtbf, rejoin = self._draw
        rng = self._rngs.get(worker)
        if rng is None:  # one stream per worker: its events do not depend on when the others' are drawn
            rng = self._rngs[worker] = np.random.default_rng([self._seed, 104729, worker])
        last = self._last_time.get(worker, 0.0)
        if self._away.get(worker, False):
            e = ChurnEvent(worker, "join", time=last + (float(rng.exponential(rejoin)) if rejoin > 0 else 0.0))
        else:
            e = ChurnEvent(worker, "leave", time=last + float(rng.exponential(mtbf)))
        self._pending[worker].append(e)
        self.events.append(e)

    @classmethod
    def load(cls, path: str | Path) -> "ChurnSchedule":
        path = Path(path)
        if not path.is_file():
            raise ChurnError(f"churn: {path}: no such file (expected a CSV or YAML trace, or "
                             f"poisson:mtbf=DURATION,rejoin=DURATION)")
        def header(fields: set[str]) -> None:
            if {"worker", "event"} - fields or not ({"time", "round"} & fields):
                raise ChurnError(f"{path}: the header must name worker, event and time or round "
                                 f"(e.g. round,worker,event), it has {', '.join(sorted(fields)) or 'nothing'}")

        records = read_rows(path, "churn", ChurnError, "worker, event and time or round", header)
        events = [cls._row(path, line, r) for line, r in records]
        if not events:
            raise ChurnError(f"{path}: no events")
        return cls(events, str(path))

    @staticmethod
    def _row(path: Path, line: int, r: dict[str, Any]) -> ChurnEvent:
        where = f"{path}, row {line}"
        try:
            worker = int(str(r.get("worker")).strip())
        except ValueError:
            raise ChurnError(f"{where}: worker {r.get('worker')!r} is not a worker number") from None
        kind = str(r.get("event", "")).strip().lower()
        if kind not in ("leave", "join"):
            raise ChurnError(f"{where}: event {r.get('event')!r} must be leave or join")
        t, rnd = r.get("time"), r.get("round")
        t = None if t is None or str(t).strip() == "" else t
        rnd = None if rnd is None or str(rnd).strip() == "" else rnd
        if (t is None) == (rnd is None):
            raise ChurnError(f"{where}: give either a time or a round")
        try:
            if rnd is not None:
                value = int(str(rnd).strip())
                if value < 0:
                    raise ValueError
                return ChurnEvent(worker, kind, round=value)
            return ChurnEvent(worker, kind, time=parse_duration(t))
        except ValueError as e:
            what = f"round {rnd!r} must be an integer >= 0" if rnd is not None else f"time: {e}"
            raise ChurnError(f"{where}: {what}") from None

    def check(self, workers: int) -> None:
        """No event names a worker beyond ``workers`` or worker 0, and each worker alternates leave and join."""
        for w, mine in sorted(self._pending.items()):
            if not 0 <= w < workers:
                raise ChurnError(f"{self.source}: an event for worker {w}, but there are {workers} workers "
                                 f"(0 to {workers - 1})")
            if w == 0 and mine:
                raise ChurnError(f"{self.source}: worker 0 keeps the run's log, evaluations and checkpoints and "
                                 f"cannot leave; script the churn of workers 1 to {workers - 1}")
            if len({e.round is None for e in mine}) > 1:
                raise ChurnError(f"{self.source}: worker {w}'s events mix times and rounds; key one worker's "
                                 f"events one way")
            mine.sort(key=lambda e: e.round if e.round is not None else e.time)
            up = True
            for e in mine:
                if (e.kind == "leave") != up:
                    raise ChurnError(f"{self.source}: {e.describe()}, but it is "
                                     f"{'already away' if not up else 'already in the run'} then")
                up = not up

    # ---- replaying ----------------------------------------------------------------------------------
    def _take(self, worker: int, kind: str, t: float, round_: int) -> bool:
        """Consume ``worker``'s next event if it is a ``kind`` that is due at virtual time ``t`` in ``round_``."""
        mine = self._pending.get(worker)
        if mine is None:
            return False
        if not mine and self._draw is not None:
            self._draw_next(worker)
        e = mine[0] if mine else None
        if e is None or e.kind != kind:
            return False
        if not ((e.round is not None and round_ >= e.round) or (e.time is not None and t >= e.time)):
            return False
        mine.pop(0)
        self._last_time[worker] = t
        self._away[worker] = kind == "leave"
        return True

    def leaves_now(self, worker: int, t: float, round_: int) -> bool:
        """Whether ``worker``, having just ended a step at virtual time ``t`` in round ``round_``, leaves now."""
        return self._take(worker, "leave", t, round_)

    def joins_now(self, worker: int, t: float, round_: int) -> bool:
        """Whether the away ``worker`` joins at a round boundary at virtual time ``t`` before round ``round_``."""
        return self._take(worker, "join", t, round_)

    def describe(self) -> str:
        if self._draw is not None:
            return f"churn {self.source}"
        return f"churn from {self.source} ({len(self.events)} events)"
