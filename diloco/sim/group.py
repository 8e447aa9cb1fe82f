"""N workers in one process: the group they meet in, taking turns on one device.

Each simulated worker is a greenlet running the ordinary training loop with its
own endpoint (:class:`~diloco.sim.transport.InProcessTransport`). All workers
share the main thread and take turns on the device: a worker computes until it
reaches a collective, then the next one runs (:func:`run_workers` is the
scheduler). A DiLoCo round thus runs worker after worker, each for its H inner
steps, and N simulated workers cost about N times one. (Greenlets rather than
threads: torch computes fastest on the thread that owns its OpenMP team, and
switching only at collectives makes the order deterministic.)

Collectives are rendezvous: every worker deposits its contribution; the last
to arrive combines them in rank order and wakes the others. When every live
worker waits and a collective still lacks someone (a worker that finished or
failed early), the group says who is missing at once, instead of hanging.

The group keeps every worker's virtual clock (:mod:`diloco.sim.clock`) and
where its time went. A collective starts when the last worker arrives (the
maximum of the clocks) and the link is free, and lasts what the
:class:`NetworkModel` says the bytes take.

Churn (a :class:`diloco.sim.churn.ChurnSchedule`) makes membership change. A
worker that leaves (checked after each of its steps) is dropped from the
group at once, as a killed peer would be: the collective in progress goes on
with the others, and its greenlet parks until it is admitted again at a round
boundary (:meth:`InProcessGroup.admit`). Collectives then combine the present
members only. Time away counts neither as compute nor as waiting.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

import greenlet
import torch

from diloco.comm.base import Transport, TransportError
from diloco.sim.clock import RunningMedian, VirtualTime
from diloco.sim.network import NetworkModel
from diloco.sim.transport import InProcessTransport

if TYPE_CHECKING:
    from diloco.sim.churn import ChurnSchedule


class InProcessGroup:
    """``world`` simulated workers: the rendezvous their collectives meet at, who is in the run, and each worker's
    virtual clock with where its time went. ``endpoints[r]`` is worker r's transport."""

    def __init__(self, world: int, speeds: Optional[Sequence[float]] = None, network: Optional[NetworkModel] = None,
                 step_time: Optional[float] = None, churn: Optional["ChurnSchedule"] = None) -> None:
        if world < 1:
            raise ValueError(f"the number of workers must be >= 1, got {world}")
        self.world = world
        self.speeds = list(speeds) if speeds is not None else [1.0] * world
        if len(self.speeds) != world:
            raise ValueError(f"{len(self.speeds)} speeds for {world} workers")
        self.network = network or NetworkModel()
        self.step_time = step_time
        self.on_release: Optional[Callable[[int], None]] = None  # e.g. move an idle worker's state off the GPU
        self.on_acquire: Optional[Callable[[int], None]] = None
        # an exchange of many collectives (a bucket each) releases a worker at its first wait and acquires it at
        # its end, not at every bucket (see :meth:`exchanging`)
        self._exchanges = [0] * world  # how deep in such exchanges each worker is
        self._released = [False] * world  # released inside the exchange it is in, acquired again when it ends
        self._values: list[Any] = [None] * world
        self._present = [False] * world
        self._result: Any = None
        self.runnable: deque[int] = deque()  # workers the scheduler may resume, in order
        self.hub: Optional[greenlet.greenlet] = None  # the scheduler, while run_workers runs
        self.clock = [VirtualTime()] * world
        self.compute_steps = [0.0] * world  # steps at speed 1: a step of a worker at speed s counts 1/s
        # where each worker's clock went besides compute: waiting for the others (or the link) before a
        # collective, and the collective's own time on the wire while the worker waited for it
        self.waited = [VirtualTime()] * world
        self.sending = [VirtualTime()] * world
        self.link_free_at = VirtualTime()
        self.measured = RunningMedian()  # every step's measured compute seconds, all workers
        self._clock_loaded = False  # a resumed run's clocks are taken back once (load_clock_state)
        # membership: who is in the run now; under churn, away workers park until admitted again
        self.churn = churn
        self.up = [True] * world
        self.away = [VirtualTime()] * world  # virtual time each worker spent out of the run
        self.steps_done = [0] * world  # steps each worker trained, over all the times it was in the run
        self.at_step = [0] * world  # the run's step each worker has reached (a joiner starts at the run's)
        self.leaves = [0] * world
        self.joins = [0] * world
        self.rounds = [0] * world  # the round each worker is in (its round boundaries so far; a joiner: worker 0's)
        self.left_now: list[int] = []  # workers that left since the last round boundary
        self.members_per_round: list[int] = []  # how many members each round had (worker 0's boundaries record it)
        self.run_over = False  # every member finished: parked workers are let go
        self.last_members: list[int] = list(range(world))  # whose values the latest collective combined
        self.contributions: Optional[dict[str, float]] = None  # the latest robust mean's weight per member
        self._combine: Optional[Callable[[list[Any]], Any]] = None
        self._comm_s: Optional[Callable[[list[Any], float], float]] = None
        self.endpoints = [InProcessTransport(self, r) for r in range(world)]

    # ---- the one rendezvous everything is built on -------------------------------------------
    def rendezvous(self, rank: int, value: Any, combine: Callable[[list[Any]], Any],
                   comm_s: Callable[[list[Any], float], float] | None = None) -> tuple[Any, VirtualTime, VirtualTime]:
        """Every worker brings ``value``; returns ``combine(values in rank order)`` and the virtual end and start
        times. ``comm_s(values, at)``: how long the collective takes if it starts at ``at`` virtual seconds.
        Under churn, "every worker" is every member present now (:attr:`last_members` says who)."""
        self._values[rank] = value
        self._present[rank] = True
        self._combine, self._comm_s = combine, comm_s
        if self._complete_if_ready(rank):
            return self._result
        self._yield(rank)
        return self._result  # valid: the next collective cannot complete before this worker joins it

    def _complete_if_ready(self, caller: int) -> bool:
        """Combine the values once every member has brought one; wake the members but ``caller``."""
        members = [r for r in range(self.world) if self.up[r]]
        if not members or not all(self._present[r] for r in members):
            return False
        self.last_members = members
        values = [self._values[r] for r in members]
        result = self._combine(values)
        start = self.latest(self.clock[r] for r in members)
        seconds = 0.0
        if self._comm_s:
            on_link = self.latest([start, self.link_free_at])  # when the link can take it
            seconds = self._comm_s(values, self.seconds(on_link))
            if seconds > 0:
                start = on_link
                self.link_free_at = start.plus(seconds)
        self._result = (result, start.plus(seconds), start)
        self._values = [None] * self.world
        self._present = [False] * self.world
        self.runnable.extend(r for r in members if r != caller)  # everyone else may go on
        return True

    # ---- churn ------------------------------------------------------------------------------
    def leave(self, rank: int) -> None:
        """``rank`` drops out now (it is computing, so it waits in no collective); a collective that only
        lacked it completes without it."""
        self.up[rank] = False
        self.leaves[rank] += 1
        self.left_now.append(rank)
        if any(self._present):
            self._complete_if_ready(rank)

    def wait_to_join(self, rank: int) -> bool:
        """Park the away worker ``rank`` until :meth:`admit` lets it in (True) or the run is over (False)."""
        self._yield(rank)
        return not self.run_over

    def admit(self, rank: int, at: VirtualTime, step: Optional[int] = None) -> None:
        """Let the away worker ``rank`` back in at virtual time ``at`` and the run's step ``step`` (default: worker
        0's), a round boundary on rank 0's clock."""
        self._back(rank, at, self.at_step[0] if step is None else step)
        self.joins[rank] += 1
        self.runnable.append(rank)

    def _back(self, rank: int, at: VirtualTime, step: int) -> None:
        if self.seconds(at) > self.seconds(self.clock[rank]):
            self.away[rank] = self.away[rank] + (at - self.clock[rank])
            self.clock[rank] = at
        self.up[rank] = True
        self.rounds[rank] = self.rounds[0]
        self.at_step[rank] = step

    def steps_trained(self, rank: int) -> int:
        """The steps all workers trained, as of ``rank``'s step: those lost with a worker that left included, and
        the steps of this point of the run that members who take their turn after ``rank`` have still to run
        (a round runs worker after worker; without them, the tokens between rounds would count one worker's)."""
        mine = self.at_step[rank]
        return sum(self.steps_done) + sum(mine - self.at_step[r] for r in range(self.world) if self.up[r])

    def parked(self) -> list[int]:
        return [r for r in range(self.world) if not self.up[r]]

    def download(self, rank: int, nbytes: int) -> float:
        """A joiner fetches ``nbytes`` of the run's state over its link: its clock moves on by the transfer, which
        counts as time on the wire (``sending``) and as bytes received."""
        seconds = self.network.transfer_s(rank, nbytes, self.seconds(self.clock[rank]))
        start = self.clock[rank]
        self.advance_to(rank, start, start.plus(seconds))
        self.endpoints[rank].stats.bytes_received += nbytes
        return seconds

    def _yield(self, rank: int) -> None:
        """Give the device to the next worker until this one is runnable again."""
        if self.hub is None:
            raise TransportError(f"worker {rank}: a collective outside run_workers() would wait forever")
        grad = torch.is_grad_enabled()  # thread-local torch state, shared by the greenlets of this thread
        if self.on_release is not None and not self._released[rank]:
            self.on_release(rank)
            self._released[rank] = self._exchanges[rank] > 0  # stays released until the exchange ends
        self.hub.switch()
        if self.on_acquire is not None and not self._released[rank]:
            self.on_acquire(rank)
        torch.set_grad_enabled(grad)

    @contextlib.contextmanager
    def exchanging(self, rank: int) -> Iterator[None]:
        """``rank`` runs an exchange of many collectives (one a bucket): released at its first wait, it is
        acquired again when the exchange ends, not after each wait. With ``sim.offload`` a worker's state thus
        leaves the GPU and comes back once an exchange instead of once a bucket (a large model's exchange has
        many). What the exchange reads and writes stays where it began (it holds DiLoCo's pseudo-gradients and
        DDP's gradients, which a move of the model leaves alone; a codec's residual visits the GPU for its
        bucket's encode and goes back, ``Codec.residuals.home``), so the exchange of a released worker runs on the GPU while
        its parameters, moments and residuals wait on the host. An exchange that fails moves nobody back."""
        self._exchanges[rank] += 1
        try:
            yield
        except BaseException:  # the run is failing (or unwinding): no worker is moved back to the GPU to die there
            self._exchanges[rank] = 0
            self._released[rank] = False
            raise
        self._exchanges[rank] -= 1
        if not self._exchanges[rank] and self._released[rank]:
            self._released[rank] = False
            if self.on_acquire is not None:
                self.on_acquire(rank)

    def waiting(self) -> list[int]:
        return [r for r, here in enumerate(self._present) if here]

    def end(self) -> None:
        """Every member finished: let the parked workers go (their :meth:`wait_to_join` returns False)."""
        self.run_over = True
        self.runnable.extend(self.parked())

    # ---- virtual time -----------------------------------------------------------------------
    def step_time_s(self) -> float:
        """Virtual compute seconds of one step at speed 1: ``step_time``, else the median measured so far."""
        if self.step_time is not None:
            return self.step_time
        return self.measured.median() or 0.0

    def seconds(self, t: VirtualTime) -> float:
        return t.seconds + t.steps * self.step_time_s()

    def latest(self, times: Iterable[VirtualTime]) -> VirtualTime:
        return max(times, key=self.seconds)

    @property
    def compute_s(self) -> list[float]:
        """Virtual compute seconds of each worker."""
        step = self.step_time_s()
        return [n * step for n in self.compute_steps]

    def advance_to(self, rank: int, start: VirtualTime, end: VirtualTime) -> None:
        """Move ``rank``'s clock to the end of a collective that ran from ``start`` to ``end``, if it is later;
        the time before ``start`` counts as waiting, the rest as sending."""
        clock = self.clock[rank]
        if self.seconds(end) <= self.seconds(clock):
            return
        begin = clock
        if self.seconds(start) > self.seconds(clock):
            self.waited[rank] = self.waited[rank] + (start - clock)
            begin = start
        self.sending[rank] = self.sending[rank] + (end - begin)
        self.clock[rank] = end

    # ---- a checkpoint of the clocks ---------------------------------------------------------
    _PER_WORKER = ("clock", "waited", "sending", "away")  # VirtualTime lists
    _COUNTS = ("compute_steps", "steps_done", "at_step", "leaves", "joins", "rounds", "up")

    def clock_state(self) -> dict[str, Any]:
        """Every worker's clock and where its time went, its bytes, the link's clock and every measured step: what
        a resumed run takes back (:meth:`load_clock_state`), so that its virtual times go on where they were.
        Read where every member waits in one collective (a worker between two collectives may be a step ahead)."""
        return {
            **{k: [(t.seconds, t.steps) for t in getattr(self, k)] for k in self._PER_WORKER},
            **{k: list(getattr(self, k)) for k in self._COUNTS},
            "bytes": [e.stats.as_dict() for e in self.endpoints],
            "link_free_at": (self.link_free_at.seconds, self.link_free_at.steps),
            "measured": torch.tensor(self.measured.values(), dtype=torch.float64),
            "members_per_round": list(self.members_per_round),
        }

    def load_clock_state(self, state: dict[str, Any], rank: int) -> None:
        """Take back :meth:`clock_state` as worker ``rank`` resumes: the whole group's at the first worker's call
        (before any worker has run a step), and each worker's bytes at its own (after its trainer has set them
        from its own part of the checkpoint, which a worker away when it was written has not). A worker away
        then, in a run resumed without churn, is back where worker 0 was."""
        if len(state["clock"]) != self.world:
            return
        if not self._clock_loaded:
            self._clock_loaded = True
            for k in self._PER_WORKER:
                setattr(self, k, [VirtualTime(*t) for t in state[k]])
            for k in self._COUNTS:
                setattr(self, k, list(state[k]))
            self.link_free_at = VirtualTime(*state["link_free_at"])
            self.measured = RunningMedian(state["measured"].tolist())
            self.members_per_round = list(state["members_per_round"])
            for r in range(self.world):
                if not self.up[r] and self.churn is None:
                    self._back(r, self.clock[0], self.at_step[0])
        stats, saved = self.endpoints[rank].stats, state["bytes"][rank]
        stats.bytes_sent, stats.bytes_received = int(saved["bytes_sent"]), int(saved["bytes_received"])
        stats.peak_bytes = int(saved.get("peak_bytes", stats.peak_bytes))

    # ---- reporting --------------------------------------------------------------------------
    def _tails(self) -> tuple[float, list[float], list[float]]:
        """The wall time, and each worker's away seconds and idle tail (from its clock to the wall) at the end;
        a worker away at the end spends its tail away."""
        wall = max(self.seconds(c) for c in self.clock)
        away = [self.seconds(a) for a in self.away]
        tail = [wall - self.seconds(c) for c in self.clock]
        for r in range(self.world):
            if not self.up[r]:
                away[r] += tail[r]
                tail[r] = 0.0
        return wall, away, tail

    def time_split(self) -> dict[str, list[float]]:
        """Virtual seconds of each worker computing, waiting (for the others at a collective, for the link, and
        at the end for the last worker to finish), sending (a collective's time on the wire that the
        worker waited for; what Streaming DiLoCo overlaps with compute is not counted) and away (churn)."""
        _, away, tail = self._tails()
        waited = [self.seconds(w) + t for w, t in zip(self.waited, tail)]
        return {"compute": self.compute_s, "waiting": waited, "sending": [self.seconds(s) for s in self.sending],
                "away": away}

    def summary(self) -> dict[str, Any]:
        wall, away, _ = self._tails()
        compute = self.compute_s
        measured = self.measured.median()
        split = self.time_split()
        present = self.world * wall - sum(away)  # worker-seconds in the run: what compute could have filled
        out = {
            "virtual_wall_s": wall,
            "compute_utilization": (sum(compute) / present) if present > 0 else None,
            "bytes_sent_per_worker": [e.stats.bytes_sent for e in self.endpoints],
            "bytes_received_per_worker": [e.stats.bytes_received for e in self.endpoints],
            "virtual_compute_s_per_worker": compute,
            "virtual_wait_s_per_worker": split["waiting"],
            "virtual_send_s_per_worker": split["sending"],
            # what one step at speed 1 costs in virtual time, and where that figure comes from
            "virtual_step_time_s": self.step_time_s(),
            "virtual_step_time_source": "sim.step_time" if self.step_time is not None else "median of measured steps",
            "measured_step_time_s": measured,  # the median of the steps this run measured (None: none ran)
            "measured_steps": len(self.measured),
            # the lowest and highest median of eighths of the run's measured steps: how far the host moved them
            "measured_step_time_range_s": self.measured.drift(),
            "speeds": list(self.speeds),
            "network": self.network.describe(),
        }
        if self.churn is not None:
            n = self.members_per_round
            out.update({"churn": self.churn.source, "virtual_away_s_per_worker": away,
                        "steps_per_worker": list(self.steps_done), "leaves_per_worker": list(self.leaves),
                        "joins_per_worker": list(self.joins),
                        "membership": {"rounds": len(n), "mean_members": sum(n) / len(n) if n else None,
                                       "fewest_members": min(n) if n else None}})
        return out


def run_workers(group: InProcessGroup, fn: Callable[[int, Transport], Any]) -> list[Any]:
    """Run ``fn(rank, transport)`` for every worker, taking turns at collectives; results in rank order.

    A worker that fails stops the others (each gets a TransportError where it waits) and its error is
    raised here. A collective that can never complete (a worker finished or failed without joining it)
    raises TransportError naming who is missing. Ctrl-C unwinds every worker and propagates.
    """
    results: list[Any] = [None] * group.world
    done = [False] * group.world
    hub = greenlet.getcurrent()
    grad = torch.is_grad_enabled()  # every worker starts in the caller's grad mode, whatever the others left set

    def start(rank: int) -> Any:
        torch.set_grad_enabled(grad)
        return fn(rank, group.endpoints[rank])

    workers = [greenlet.greenlet(lambda r=r: start(r), parent=hub) for r in range(group.world)]
    group.hub = hub
    group.runnable = deque(range(group.world))
    failure: Optional[tuple[int, Exception]] = None
    try:
        while not all(done):
            if not group.runnable and group.churn is not None and not group.run_over and \
                    all(done[r] or not group.up[r] for r in range(group.world)):
                group.end()  # every member finished: the workers still away are let go
            if not group.runnable:
                waiting = group.waiting()
                missing = [r for r in range(group.world) if r not in waiting and group.up[r]]
                raise TransportError(f"workers {missing} did not reach a collective that workers {waiting} wait in "
                                     f"(they finished or failed first)")
            rank = group.runnable.popleft()
            try:
                value = workers[rank].switch()
            except Exception as e:  # a worker failed: stop the others where they wait
                done[rank] = True
                failure = failure or (rank, e)
                for other in range(group.world):
                    if not done[other] and workers[other]:  # started and waiting in a collective
                        try:
                            workers[other].throw(TransportError(f"worker {other}: the simulation stopped: worker "
                                                                f"{rank} failed: {type(e).__name__}: {e}"))
                        except Exception:
                            pass
                    done[other] = True
                group.runnable.clear()
                continue
            if workers[rank].dead:
                results[rank], done[rank] = value, True
    finally:
        group.hub = None
        torch.set_grad_enabled(grad)
        for g in workers:
            if g and not g.dead:
                g.throw(greenlet.GreenletExit)  # unwind (Ctrl-C or an error above)
    if failure is not None:
        raise failure[1]
    return results
