"""A simulated worker's transport: rank ``rank`` of an :class:`~diloco.sim.group.InProcessGroup`.

Each simulated worker runs the ordinary training loop with its own
:class:`InProcessTransport` endpoint, so the simulator runs the very algorithm
objects that real runs use. Every collective is one rendezvous of the group:
the endpoint brings its value, and the group combines the values and says when,
in virtual time, the collective started and ended (the
:class:`~diloco.sim.network.NetworkModel`'s time for the bytes it moved). A
synchronous collective moves the worker's clock to its end; an asynchronous one
(Streaming DiLoCo's overlap) moves it only when the worker waits for it.

Under churn the members change, and the endpoints behave like ``loco join``
peers: no fixed ranks, so averages travel with their weights and are validated
(``caps.fixed_ranks`` is False). A worker that leaves learns it from
:meth:`InProcessTransport.advance_compute` (:class:`WorkerLeft`).

The group builds its endpoints, so this module knows the group only by what an
endpoint calls on it.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from diloco.comm.base import DeviceSpan, Handle, PayloadBound, Transport, TransportError
from diloco.comm.caps import Capabilities
from diloco.sim.clock import VirtualTime


class _VirtualHandle(Handle):
    """Collectives that ran from ``start`` to ``done`` in virtual time: waiting moves the worker's clock there."""

    def __init__(self, transport: "InProcessTransport", start: VirtualTime, done: VirtualTime, result: Any) -> None:
        super().__init__(result)
        self.transport, self.start, self.done = transport, start, done

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

    # a signal reaches every worker of this process at once, and they stop at one sync; every worker's
    # all_gather_bytes returns the one list rendezvous combined; all_gather_tensor hands the workers each other's
    # tensors, where they lie; every simulated worker runs the one config; advance_compute turns each step's
    # measured compute into virtual time; every worker builds its model here, on the one device, from the run's seed
    caps = Capabilities(shared_stop=True, shared_results=True, device_gather=True, settings_agreed=True,
                        measures_compute=True, seeded_alike=True)

    def __init__(self, group: "InProcessGroup", rank: int) -> None:
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
        return _VirtualHandle(self, start, done, result)

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

    def _start_all_gather_bytes(self, payload: bytes, sizes: Optional[Sequence[int]] = None,
                                bound: Optional[PayloadBound] = None) -> Callable[[], list[bytes]]:
        if sizes is None:  # the simulated workers always agree: stated sizes need no exchange
            self._size_exchange("all_gather")
        return super()._start_all_gather_bytes(payload, sizes, bound)

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
            raise TransportError("a simulation with churn has no fixed ranks: it averages with weighted_mean and "
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
        return self.group.seconds(self.group.clock[self.rank] - mark)

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
        g.at_step[self.rank] += 1
        if g.churn is not None and g.churn.leaves_now(self.rank, self.now(), g.rounds[self.rank]):
            g.leave(self.rank)
            raise WorkerLeft(self.rank)

    def steps_trained(self) -> Optional[int]:
        """Under churn, the steps all workers computed as of this worker's step, those lost with a worker that left
        included (``world x step`` would count the time away too); else None."""
        return self.group.steps_trained(self.rank) if self.group.churn is not None else None

    def my_steps_trained(self) -> Optional[int]:
        return self.group.steps_done[self.rank] if self.group.churn is not None else None

    def clock_state(self) -> dict[str, Any]:
        """The group's clocks, read once every member has come here (a rendezvous: every worker saves)."""
        return self.group.rendezvous(self.rank, None, lambda _: self.group.clock_state())[0]

    def load_clock_state(self, state: dict[str, Any]) -> None:
        self.group.load_clock_state(state, self.rank)

    def metrics(self) -> dict[str, Any]:
        """``virtual_s``: this worker's clock with the step time known so far; ``virtual_net_s`` and
        ``virtual_steps`` are the clock's parts, so a report can price the steps at the run's final step time."""
        t = self.group.clock[self.rank]
        return {"virtual_s": self.now(), "virtual_net_s": t.seconds, "virtual_steps": t.steps}

    def summary(self) -> dict[str, Any]:
        return self.group.summary()
