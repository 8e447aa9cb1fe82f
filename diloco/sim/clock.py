"""Virtual time: the clocks of simulated workers, and the step time that prices their compute.

Time is virtual. Each worker has a clock that its compute advances by one
virtual step time per step, divided by the worker's speed. The virtual step
time is ``step_time`` when given; otherwise it is the median of every step's
measured compute time in the run (all workers share one device, so they are
measured alike; on a GPU by CUDA events around the compute, see
:class:`~diloco.comm.base.DeviceSpan`), which a busy machine's slow or fast moments do not move.

A clock is held as :class:`VirtualTime`, network seconds plus a number of steps,
so the reported times use the median of the whole run. While the run goes,
decisions that read a clock (which worker arrives last, a time-budgeted round's
end) use the median of the steps measured so far. With ``step_time`` given,
the virtual times depend on the bytes and step counts only: the same settings
give the same times on any machine, however loaded.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional


class RunningMedian:
    """The median of a growing sample, O(log n) per value: a max-heap holds the lower half, a min-heap the upper.

    A value may come later (:meth:`add_later`: a :class:`~diloco.comm.base.DeviceSpan`, or anything with
    ``done()`` and ``seconds()``): it joins the sample once it is done, in the order given; the median waits for
    the oldest only when nothing is in the sample yet, and the length waits for all of them."""

    def __init__(self, values: Any = ()) -> None:
        self._lo: list[float] = []  # negated
        self._hi: list[float] = []
        self._later: deque = deque()
        self._order = array("d")  # every value, in the order it came (a checkpoint keeps them; spread() reads them)
        for x in values:
            self.add(float(x))

    def __len__(self) -> int:
        self._harvest(everything=True)
        return len(self._lo) + len(self._hi)

    def add_later(self, value: Any) -> None:
        self._later.append(value)
        self._harvest(wait=False)  # those done already join now: a run that never asks for the median keeps few

    def _harvest(self, everything: bool = False, wait: bool = True) -> None:
        while self._later and (everything or self._later[0].done() or (wait and not self._lo)):
            self.add(self._later.popleft().seconds())

    def add(self, x: float) -> None:
        self._order.append(x)
        if self._lo and x > -self._lo[0]:
            heapq.heappush(self._hi, x)
        else:
            heapq.heappush(self._lo, -x)
        if len(self._lo) > len(self._hi) + 1:
            heapq.heappush(self._hi, -heapq.heappop(self._lo))
        elif len(self._hi) > len(self._lo):
            heapq.heappush(self._lo, -heapq.heappop(self._hi))

    def median(self) -> Optional[float]:
        self._harvest()
        if not self._lo:
            return None
        if len(self._lo) > len(self._hi):
            return -self._lo[0]
        return (self._hi[0] - self._lo[0]) / 2

    def values(self) -> list[float]:
        """Every value so far, in the order it came."""
        self._harvest(everything=True)
        return self._order.tolist()

    def drift(self, parts: int = 8) -> Optional[tuple[float, float]]:
        """How far the sample moved over time: the lowest and the highest median of ``parts`` runs of consecutive
        values (None for fewer than 4 values a part). A step time that a busy host stretched for a while shows as
        a high part, where one slow step among many does not."""
        values = self.values()
        n = len(values) // parts
        if n < 4:
            return None
        medians = [sorted(values[i * n:(i + 1) * n])[n // 2] for i in range(parts)]
        return min(medians), max(medians)


@dataclass(frozen=True)
class VirtualTime:
    """A point on a virtual clock: ``seconds`` of network time plus ``steps`` steps of compute at speed 1, each
    as long as the group's virtual step time (see :meth:`~diloco.sim.group.InProcessGroup.seconds`)."""

    seconds: float = 0.0
    steps: float = 0.0

    def plus(self, seconds: float = 0.0, steps: float = 0.0) -> "VirtualTime":
        return VirtualTime(self.seconds + seconds, self.steps + steps)

    def __add__(self, span: "VirtualTime") -> "VirtualTime":
        return self.plus(span.seconds, span.steps)

    def __sub__(self, begin: "VirtualTime") -> "VirtualTime":
        """The span from ``begin`` to this point, in both parts: its steps are priced when it is read, so a
        moving step time prices all of them alike."""
        return VirtualTime(self.seconds - begin.seconds, self.steps - begin.steps)
