"""N workers in one process: an in-process transport, a shared device, virtual clocks.

Each simulated worker is a thread running the ordinary training loop with its
own :class:`InProcessTransport` endpoint, so the simulator runs the very
algorithm objects that real runs use. Workers take turns on the device: a
worker holds the *device lock* while it computes and gives it up only while it
waits at a collective, so a DiLoCo round runs worker after worker, each for
its H inner steps, and N simulated workers cost about N times one.

Collectives are rendezvous: every worker deposits its contribution; the last
to arrive combines them in rank order (so results do not depend on thread
timing) and wakes the others.

Time is virtual. Each worker has a clock that its compute advances (the
measured seconds of a step, or ``step_time``, divided by its speed). A
collective starts when the last worker arrives (the maximum of the clocks) and
the link is free, and lasts what the :class:`NetworkModel` says the bytes take.
A synchronous collective moves the clocks to its end; an asynchronous one
(Streaming DiLoCo's overlap) moves a worker's clock only when it waits for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch

from diloco.comm.base import Handle, Transport, TransportError
from diloco.sim.network import NetworkModel


class InProcessGroup:
    def __init__(self, world: int, speeds: Optional[Sequence[float]] = None, network: Optional[NetworkModel] = None,
                 step_time: Optional[float] = None, timeout: float = 300.0) -> None:
        if world < 1:
            raise ValueError(f"the number of workers must be >= 1, got {world}")
        self.world = world
        self.speeds = list(speeds) if speeds is not None else [1.0] * world
        if len(self.speeds) != world:
            raise ValueError(f"{len(self.speeds)} speeds for {world} workers")
        self.network = network or NetworkModel()
        self.step_time = step_time
        self.timeout = timeout
        self.device = threading.Lock()
        self.on_release: Optional[Callable[[int], None]] = None  # e.g. move an idle worker's state off the GPU
        self.on_acquire: Optional[Callable[[int], None]] = None
        self._cond = threading.Condition()
        self._values: list[Any] = [None] * world
        self._present = [False] * world
        self._generation = 0
        self._result: Any = None
        self._error: Optional[str] = None
        self.clock = [0.0] * world
        self.compute_s = [0.0] * world
        self.link_free_at = 0.0
        self.endpoints = [InProcessTransport(self, r) for r in range(world)]

    # ---- the device -------------------------------------------------------------------------
    def acquire(self, rank: int) -> None:
        self.device.acquire()
        if self.on_acquire is not None:
            self.on_acquire(rank)

    def release(self, rank: int) -> None:
        if self.on_release is not None:
            self.on_release(rank)
        self.device.release()

    # ---- failure ----------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Wake every waiting worker with an error (a worker failed, or the user pressed Ctrl-C)."""
        with self._cond:
            if self._error is None:
                self._error = reason
            self._cond.notify_all()

    def check(self, rank: int) -> None:
        if self._error is not None:
            raise TransportError(f"worker {rank}: the simulation stopped: {self._error}")

    # ---- the one rendezvous everything is built on -------------------------------------------
    def rendezvous(self, rank: int, value: Any, combine: Callable[[list[Any]], Any],
                   comm_s: Callable[[list[Any]], float] | None = None) -> tuple[Any, float]:
        """Every worker brings ``value``; returns ``combine(values in rank order)`` and the virtual end time."""
        self.release(rank)
        try:
            with self._cond:
                self.check(rank)
                generation = self._generation
                self._values[rank] = value
                self._present[rank] = True
                if all(self._present):
                    values = self._values
                    try:
                        result = combine(values)
                        seconds = comm_s(values) if comm_s else 0.0
                    except Exception as e:
                        self._error = f"worker {rank}: combining a collective failed: {e}"
                        self._cond.notify_all()
                        raise
                    start = max(self.clock)
                    if seconds > 0:
                        start = max(start, self.link_free_at)
                        self.link_free_at = start + seconds
                    self._result = (result, start + seconds)
                    self._values = [None] * self.world
                    self._present = [False] * self.world
                    self._generation += 1
                    self._cond.notify_all()
                else:
                    deadline = time.monotonic() + self.timeout
                    while self._generation == generation and self._error is None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            missing = [r for r, here in enumerate(self._present) if not here]
                            self._error = f"workers {missing} did not reach a collective within {self.timeout:g}s"
                            self._cond.notify_all()
                            break
                        self._cond.wait(left)
                    if self._generation == generation:
                        self.check(rank)
                return self._result
        finally:
            self.acquire(rank)

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
    def __init__(self, transport: "InProcessTransport", done: float) -> None:
        self.transport, self.done = transport, done

    def wait(self) -> None:
        g, r = self.transport.group, self.transport.rank
        g.clock[r] = max(g.clock[r], self.done)


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

    def all_reduce_async_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> Handle:
        self._deferred = []
        try:
            self.all_reduce_(tensors, op)
            done = max(self._deferred, default=self.now())
        finally:
            self._deferred = None
        return _VirtualHandle(self, done)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        result, _ = self.group.rendezvous(self.rank, tensor, lambda values: values[src].clone())
        tensor.copy_(result)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.group.rendezvous(self.rank, obj, lambda values: values[src])[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.group.rendezvous(self.rank, obj, list)[0]

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        net, w = self.group.network, self.world_size
        result, done = self.group.rendezvous(
            self.rank, bytes(payload), list,
            lambda values: max(net.all_gather_s(sum(len(v) for v in values) - len(v), w) for v in values))
        self.stats.bytes_sent += len(payload) * (w - 1)
        self.stats.bytes_received += sum(len(v) for v in result) - len(payload)
        self.stats.collectives += 1
        self._finish(done)
        return result

    def now(self) -> float:
        return self.group.clock[self.rank]

    def advance_compute(self, seconds: float) -> None:
        g = self.group
        g.check(self.rank)
        virtual = (g.step_time if g.step_time is not None else seconds) / g.speeds[self.rank]
        g.clock[self.rank] += virtual
        g.compute_s[self.rank] += virtual

    def metrics(self) -> dict[str, Any]:
        return {"virtual_s": self.now()}

    def summary(self) -> dict[str, Any]:
        return self.group.summary()


def run_workers(group: InProcessGroup, fn: Callable[[int, Transport], Any]) -> list[Any]:
    """Run ``fn(rank, transport)`` for every worker in its own thread; return their results in rank order.

    A worker that fails stops the others (they get a TransportError at their next collective or step)
    and its error is raised here; Ctrl-C stops all of them the same way.
    """
    results: list[Any] = [None] * group.world
    errors: list[tuple[int, Exception]] = []

    def body(rank: int) -> None:
        group.acquire(rank)
        try:
            results[rank] = fn(rank, group.endpoints[rank])
        except Exception as e:  # reported to the caller below; never swallowed
            errors.append((rank, e))
            group.abort(f"worker {rank} failed: {type(e).__name__}: {e}")
        finally:
            group.release(rank)

    threads = [threading.Thread(target=body, args=(r,), name=f"loco-worker-{r}", daemon=True)
               for r in range(group.world)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        group.abort("interrupted by the user")
        for t in threads:
            t.join(30)
        raise
    if errors:
        # the root cause is the first error that is not another worker's "the simulation stopped"
        root = next((e for _, e in errors if not isinstance(e, TransportError)), errors[0][1])
        raise root
    return results
