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

Time is virtual. Each worker has a clock that its compute advances (the
measured seconds of a step, or ``step_time``, divided by its speed). A
collective starts when the last worker arrives (the maximum of the clocks) and
the link is free, and lasts what the :class:`NetworkModel` says the bytes take.
A synchronous collective moves the clocks to its end; an asynchronous one
(Streaming DiLoCo's overlap) moves a worker's clock only when it waits for it.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional, Sequence

import greenlet
import torch

from diloco.comm.base import Handle, Transport, TransportError
from diloco.sim.network import NetworkModel


class InProcessGroup:
    def __init__(self, world: int, speeds: Optional[Sequence[float]] = None, network: Optional[NetworkModel] = None,
                 step_time: Optional[float] = None) -> None:
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
        self._values: list[Any] = [None] * world
        self._present = [False] * world
        self._result: Any = None
        self.runnable: deque[int] = deque()  # workers the scheduler may resume, in order
        self.hub: Optional[greenlet.greenlet] = None  # the scheduler, while run_workers runs
        self.clock = [0.0] * world
        self.compute_s = [0.0] * world
        self.link_free_at = 0.0
        self.endpoints = [InProcessTransport(self, r) for r in range(world)]

    # ---- the one rendezvous everything is built on -------------------------------------------
    def rendezvous(self, rank: int, value: Any, combine: Callable[[list[Any]], Any],
                   comm_s: Callable[[list[Any]], float] | None = None) -> tuple[Any, float]:
        """Every worker brings ``value``; returns ``combine(values in rank order)`` and the virtual end time."""
        self._values[rank] = value
        self._present[rank] = True
        if all(self._present):
            values = self._values
            result = combine(values)
            seconds = comm_s(values) if comm_s else 0.0
            start = max(self.clock)
            if seconds > 0:
                start = max(start, self.link_free_at)
                self.link_free_at = start + seconds
            self._result = (result, start + seconds)
            self._values = [None] * self.world
            self._present = [False] * self.world
            self.runnable.extend(r for r in range(self.world) if r != rank)  # everyone else may go on
            return self._result
        self._yield(rank)
        return self._result  # valid: the next collective cannot complete before this worker joins it

    def _yield(self, rank: int) -> None:
        """Give the device to the next worker until this one is runnable again."""
        if self.hub is None:
            raise TransportError(f"worker {rank}: a collective outside run_workers() would wait forever")
        grad = torch.is_grad_enabled()  # thread-local torch state, shared by the greenlets of this thread
        if self.on_release is not None:
            self.on_release(rank)
        self.hub.switch()
        if self.on_acquire is not None:
            self.on_acquire(rank)
        torch.set_grad_enabled(grad)

    def waiting(self) -> list[int]:
        return [r for r, here in enumerate(self._present) if here]

    # ---- reporting --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        wall = max(self.clock)
        return {
            "virtual_wall_s": wall,
            "compute_utilization": (sum(self.compute_s) / (self.world * wall)) if wall > 0 else None,
            "bytes_sent_per_worker": [e.stats.bytes_sent for e in self.endpoints],
            "bytes_received_per_worker": [e.stats.bytes_received for e in self.endpoints],
            "virtual_compute_s_per_worker": list(self.compute_s),
            "speeds": list(self.speeds),
            "network": self.network.describe(),
        }


class _VirtualHandle(Handle):
    def __init__(self, transport: "InProcessTransport", done: float, result: Any = None) -> None:
        super().__init__(result)
        self.transport, self.done = transport, done

    def wait(self) -> Any:
        g, r = self.transport.group, self.transport.rank
        g.clock[r] = max(g.clock[r], self.done)
        return self.result


class InProcessTransport(Transport):
    """Rank ``rank`` of an :class:`InProcessGroup`."""

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        super().__init__()
        self.group, self.rank, self.world_size = group, rank, group.world
        self._deferred: Optional[list[float]] = None

    def _finish(self, done: float) -> None:
        if self._deferred is not None:
            self._deferred.append(done)
        else:
            self.group.clock[self.rank] = max(self.group.clock[self.rank], done)

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        def total(values: list[torch.Tensor]) -> torch.Tensor:
            out = values[0].clone()
            for v in values[1:]:
                out.add_(v)
            return out

        nbytes = flat.numel() * flat.element_size()
        result, done = self.group.rendezvous(self.rank, flat, total,
                                             lambda _: self.group.network.all_reduce_s(nbytes, self.world_size))
        flat.copy_(result)
        self._finish(done)

    def _start(self, fn: Callable[[], Any]) -> Handle:
        """Run the collectives now, but move this worker's clock to their end only when it waits."""
        self._deferred = []
        try:
            result = fn()
            done = max(self._deferred, default=self.now())
        finally:
            self._deferred = None
        return _VirtualHandle(self, done, result)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        result, _ = self.group.rendezvous(self.rank, tensor, lambda values: values[src].clone())
        tensor.copy_(result)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.group.rendezvous(self.rank, obj, lambda values: values[src])[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.group.rendezvous(self.rank, obj, list)[0]

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        net, w = self.group.network, self.world_size
        result, done = self.group.rendezvous(
            self.rank, bytes(payload), list,
            lambda values: max(net.all_gather_s(sum(len(v) for v in values) - len(v), w) for v in values))
        self._finish(done)
        return result

    def _all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        net, w, me = self.group.network, self.world_size, self.rank

        def seconds(values: list[list[bytes]]) -> float:
            return max(net.all_to_all_s(sum(len(p) for j, p in enumerate(values[r]) if j != r),
                                        sum(len(values[i][r]) for i in range(w) if i != r), w) for r in range(w))

        result, done = self.group.rendezvous(me, [bytes(p) for p in payloads], list, seconds)
        received = [result[i][me] for i in range(w)]
        self._finish(done)
        return received

    def now(self) -> float:
        return self.group.clock[self.rank]

    def advance_compute(self, seconds: float) -> None:
        g = self.group
        virtual = (g.step_time if g.step_time is not None else seconds) / g.speeds[self.rank]
        g.clock[self.rank] += virtual
        g.compute_s[self.rank] += virtual

    def metrics(self) -> dict[str, Any]:
        return {"virtual_s": self.now()}

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
            if not group.runnable:
                waiting = group.waiting()
                missing = [r for r in range(group.world) if r not in waiting]
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
