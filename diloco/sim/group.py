"""N workers in one process: an in-process transport, a shared device, virtual clocks.

Each simulated worker is a greenlet running the ordinary training loop with its
own :class:`InProcessTransport` endpoint, so the simulator runs the very
algorithm objects that real runs use. All workers share the main thread and
take turns on the device: a worker computes until it reaches a collective,
then the next one runs. A DiLoCo round thus runs worker after worker, each for
its H inner steps, and N simulated workers cost about N times one. (Greenlets
rather than threads: torch computes fastest on the thread that owns its
OpenMP team, and switching only at collectives makes the order deterministic.)

Collectives are rendezvous: every worker deposits its contribution; the last
to arrive combines them in rank order and wakes the others. When every live
worker waits and a collective still lacks someone (a worker that finished or
failed early), the group says who is missing at once, instead of hanging.

Time is virtual. Each worker has a clock that its compute advances by one
virtual step time per step, divided by the worker's speed. The virtual step
time is ``step_time`` when given; otherwise it is the median of every step's
measured compute time in the run (all workers share one device, so they are
measured alike; on a GPU by CUDA events around the compute, see
:class:`~diloco.comm.base.DeviceSpan`), which a busy machine's slow or fast moments do not move. A
collective starts when the last worker arrives (the maximum of the clocks) and
the link is free, and lasts what the :class:`NetworkModel` says the bytes take.
A synchronous collective moves the clocks to its end; an asynchronous one
(Streaming DiLoCo's overlap) moves a worker's clock only when it waits for it.

A clock is held as :class:`VirtualTime`, network seconds plus a number of steps,
so the reported times use the median of the whole run. While the run goes,
decisions that read a clock (which worker arrives last, a time-budgeted round's
end) use the median of the steps measured so far. With ``step_time`` given,
the virtual times depend on the bytes and step counts only: the same settings
give the same times on any machine, however loaded.

Churn (a :class:`diloco.sim.churn.ChurnSchedule`) makes membership change. A
worker that leaves (checked after each of its steps) is dropped from the
group at once, as a killed peer would be: the collective in progress goes on
with the others, and its greenlet parks until it is admitted again at a round
boundary (:meth:`InProcessGroup.admit`). Collectives then combine the present
members only, and the endpoints behave like ``loco join`` peers: no fixed
ranks, so averages travel with their weights and are validated
(``fixed_ranks = False``). Time away counts neither as compute nor as waiting.
"""

from __future__ import annotations

import contextlib
import heapq
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

import greenlet
import torch

from diloco.comm.base import DeviceSpan, Handle, Transport, TransportError
from diloco.comm.caps import Capabilities
from diloco.sim.network import NetworkModel

if TYPE_CHECKING:
    from diloco.sim.churn import ChurnSchedule


class RunningMedian:
    """The median of a growing sample, O(log n) per value: a max-heap holds the lower half, a min-heap the upper.

    A value may come later (:meth:`add_later`: a :class:`~diloco.comm.base.DeviceSpan`, or anything with
    ``done()`` and ``seconds()``): it joins the sample once it is done, in the order given; the median waits for
    the oldest only when nothing is in the sample yet, and the length waits for all of them."""

    def __init__(self) -> None:
        self._lo: list[float] = []  # negated
        self._hi: list[float] = []
        self._later: deque = deque()

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


@dataclass(frozen=True)
class VirtualTime:
    """A point on a virtual clock: ``seconds`` of network time plus ``steps`` steps of compute at speed 1, each
    as long as the group's virtual step time (see :meth:`InProcessGroup.seconds`)."""

    seconds: float = 0.0
    steps: float = 0.0

    def plus(self, seconds: float = 0.0, steps: float = 0.0) -> "VirtualTime":
        return VirtualTime(self.seconds + seconds, self.steps + steps)


class InProcessGroup:
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
        # membership: who is in the run now; under churn, away workers park until admitted again
        self.churn = churn
        self.up = [True] * world
        self.away = [VirtualTime()] * world  # virtual time each worker spent out of the run
        self.steps_done = [0] * world  # steps each worker trained, over all the times it was in the run
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

    def admit(self, rank: int, at: VirtualTime) -> None:
        """Let the away worker ``rank`` back in at virtual time ``at`` (a round boundary on rank 0's clock)."""
        if self.seconds(at) > self.seconds(self.clock[rank]):
            self.away[rank] = _add(self.away[rank], at, self.clock[rank])
            self.clock[rank] = at
        self.up[rank] = True
        self.rounds[rank] = self.rounds[0]
        self.joins[rank] += 1
        self.runnable.append(rank)

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
        leaves the GPU and comes back once an exchange instead of once a bucket (a 1B model's exchange has over a
        hundred). What the exchange reads and writes stays where it began (it holds DiLoCo's pseudo-gradients and
        DDP's gradients, which a move of the model leaves alone; a codec's residual visits the GPU for its
        bucket's encode and goes back, ``Codec.home``), so the exchange of a released worker runs on the GPU while
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
            self.waited[rank] = _add(self.waited[rank], start, clock)
            begin = start
        self.sending[rank] = _add(self.sending[rank], end, begin)
        self.clock[rank] = end

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


def _add(total: VirtualTime, end: VirtualTime, begin: VirtualTime) -> VirtualTime:
    """``total`` plus the span from ``begin`` to ``end``."""
    return total.plus(end.seconds - begin.seconds, end.steps - begin.steps)


class _VirtualHandle(Handle):
    def __init__(self, transport: "InProcessTransport", done: VirtualTime, result: Any = None,
                 start: Optional[VirtualTime] = None) -> None:
        super().__init__(result)
        self.transport, self.done = transport, done
        self.start = start if start is not None else done

    def wait(self) -> Any:
        g, r = self.transport.group, self.transport.rank
        g.advance_to(r, self.start, self.done)
        return self.result


class WorkerLeft(Exception):
    """Raised in a simulated worker's loop when the churn schedule takes it out of the run."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"worker {rank} left the run")
        self.rank = rank


class InProcessTransport(Transport):
    """Rank ``rank`` of an :class:`InProcessGroup`."""

    # every worker's all_gather_bytes returns the one list rendezvous combined; all_gather_tensor hands the workers
    # each other's tensors, where they lie; every simulated worker runs the one config; advance_compute turns each
    # step's measured compute into virtual time; every worker builds its model here, on the one device, from the
    # run's seed
    caps = Capabilities(shared_results=True, device_gather=True, settings_agreed=True, measures_compute=True,
                        seeded_alike=True)

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        super().__init__()
        self.group, self.rank, self.world_size = group, rank, group.world
        # under churn the members change: averages go the way of peers without fixed ranks (loco join's)
        self.caps = replace(self.caps, fixed_ranks=group.churn is None)
        self._deferred: Optional[list[tuple[VirtualTime, VirtualTime]]] = None

    @contextlib.contextmanager
    def exchange_scope(self, barrier: bool = True) -> Iterator[None]:
        """An exchange of many collectives (``barrier``) keeps a worker that waits in it released until it ends
        (:meth:`InProcessGroup.exchanging`); an exchange of one collective (DeMo's all-gather, whose scope also
        holds the update that follows it) is released and acquired around its one wait."""
        with super().exchange_scope(barrier), (self.group.exchanging(self.rank) if barrier
                                               else contextlib.nullcontext()):
            yield

    def _finish(self, done: VirtualTime, start: VirtualTime) -> None:
        if self._deferred is not None:
            self._deferred.append((start, done))
        else:
            self.group.advance_to(self.rank, start, done)

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        def total(values: list[torch.Tensor]) -> torch.Tensor:
            out = values[0].clone()
            for v in values[1:]:
                out.add_(v)
            return out

        nbytes = flat.numel() * flat.element_size()
        result, done, start = self.group.rendezvous(
            self.rank, flat, total, lambda _, at: self.group.network.all_reduce_at(nbytes, self.world_size, at))
        flat.copy_(result)
        self._finish(done, start)

    def _start(self, fn: Callable[[], Any]) -> Handle:
        """Run the collectives now, but move this worker's clock to their end only when it waits."""
        self._deferred = []
        try:
            result = fn()
            if self._deferred:
                done = self.group.latest(end for _, end in self._deferred)
                start = min((begin for begin, _ in self._deferred), key=self.group.seconds)
            else:
                done = start = self.group.clock[self.rank]
        finally:
            self._deferred = None
        return _VirtualHandle(self, done, result, start)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        result = self.group.rendezvous(self.rank, tensor, lambda values: values[src].clone())[0]
        tensor.copy_(result)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.group.rendezvous(self.rank, obj, lambda values: values[src])[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.group.rendezvous(self.rank, obj, list)[0]

    def _gather(self, value: Any, size: Callable[[Any], int]) -> list[Any]:
        """Every member's ``value``, in the time the network model gives an all-gather of their sizes."""
        g = self.group

        def seconds(values: list[Any], at: float) -> float:
            total = sum(size(v) for v in values)
            return g.network.all_gather_at([total - size(v) for v in values], at, g.last_members)

        result, done, start = g.rendezvous(self.rank, value, list, seconds)
        self._finish(done, start)
        return result

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return self._gather(bytes(payload), len)

    def _all_gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._gather(t, torch.Tensor.numel)

    def member_names(self) -> list[str]:
        return [str(r) for r in self.group.last_members]

    def record_contributions(self, accepted: dict[str, float], rejected: dict[str, str],
                             clipped: dict[str, float], weights_clipped: Optional[dict[str, float]] = None) -> None:
        self.group.contributions = dict(accepted)  # every member computes the same; rounds.jsonl reads it

    def _start_all_gather_bytes(self, payload: bytes, sizes: Optional[Sequence[int]] = None
                                ) -> Callable[[], list[bytes]]:
        if sizes is None:  # the simulated workers always agree: stated sizes need no exchange
            self._size_exchange("all_gather")
        return super()._start_all_gather_bytes(payload, sizes)

    def _start_all_to_all_bytes(self, payloads: Sequence[bytes], sizes: Optional[Sequence[int]] = None
                                ) -> Callable[[], list[bytes]]:
        if sizes is None:  # the simulated workers always agree: stated sizes need no exchange
            self._size_exchange("all_to_all")
        return super()._start_all_to_all_bytes(payloads, sizes)

    def _size_exchange(self, kind: str) -> None:
        """The virtual time of the size exchange a torchrun process runs before a byte collective whose payload
        sizes nobody knew beforehand (a zstd stage): a collective of its own, W-1 latency-bound phases for 8 bytes
        per peer (not counted in the bytes sent, as torch_dist does not count it). Peers without fixed ranks
        (loco join's) send their sizes with the payloads: nothing to charge there."""
        if not self.caps.fixed_ranks or self.world_size == 1:
            return
        net, w = self.group.network, self.world_size
        small = [8 * (w - 1)] * w

        def seconds(_: list, at: float) -> float:
            return net.all_gather_at(small, at) if kind == "all_gather" else net.all_to_all_at(small, small, at)

        _, done, start = self.group.rendezvous(self.rank, None, lambda values: None, seconds)
        self._finish(done, start)

    def _all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        if not self.caps.fixed_ranks:
            raise TransportError("a simulation with churn has no fixed ranks: it averages with all_reduce_* and "
                                 "all_gather_bytes")
        net, w, me = self.group.network, self.world_size, self.rank

        def seconds(values: list[list[bytes]], at: float) -> float:
            sent = [sum(len(p) for j, p in enumerate(values[r]) if j != r) for r in range(w)]
            received = [sum(len(values[i][r]) for i in range(w) if i != r) for r in range(w)]
            return net.all_to_all_at(sent, received, at)

        result, done, start = self.group.rendezvous(me, [bytes(p) for p in payloads], list, seconds)
        received = [result[i][me] for i in range(w)]
        self._finish(done, start)
        return received

    def now(self) -> float:
        return self.group.seconds(self.group.clock[self.rank])

    def mark(self) -> VirtualTime:
        return self.group.clock[self.rank]

    def seconds_since(self, mark: Any) -> float:
        """The virtual seconds since ``mark``, its steps priced at today's step time: ``now() - mark`` would price
        the steps before the mark at today's and those after at the mark's, and a moving median would stretch or
        shrink a time-budgeted round by every step of the run since its start."""
        if not isinstance(mark, VirtualTime):
            return self.now() - float(mark)
        t = self.group.clock[self.rank]
        return self.group.seconds(VirtualTime(t.seconds - mark.seconds, t.steps - mark.steps))

    def advance_compute(self, seconds: "float | DeviceSpan") -> None:
        """One step done: ``seconds`` is what its compute measured (on a GPU a :class:`DeviceSpan`, read when the
        device has passed it); the clock advances by one virtual step."""
        g = self.group
        if isinstance(seconds, (int, float)):
            g.measured.add(seconds)
        else:
            g.measured.add_later(seconds)
        steps = 1.0 / g.speeds[self.rank]
        g.clock[self.rank] = g.clock[self.rank].plus(steps=steps)
        g.compute_steps[self.rank] += steps
        g.steps_done[self.rank] += 1
        if g.churn is not None and g.churn.leaves_now(self.rank, self.now(), g.rounds[self.rank]):
            g.leave(self.rank)
            raise WorkerLeft(self.rank)

    def steps_trained(self) -> Optional[int]:
        """Under churn, the steps all workers computed, those lost with a worker that left included (``world x
        step`` would count the time away too); else None."""
        return sum(self.group.steps_done) if self.group.churn is not None else None

    def my_steps_trained(self) -> Optional[int]:
        return self.group.steps_done[self.rank] if self.group.churn is not None else None

    def metrics(self) -> dict[str, Any]:
        """``virtual_s``: this worker's clock with the step time known so far; ``virtual_net_s`` and
        ``virtual_steps`` are the clock's parts, so a report can price the steps at the run's final step time."""
        t = self.group.clock[self.rank]
        return {"virtual_s": self.now(), "virtual_net_s": t.seconds, "virtual_steps": t.steps}

    def summary(self) -> dict[str, Any]:
        return self.group.summary()


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
