"""The Transport interface: who takes part in a round, and moving data among them.

Algorithm code talks only to this interface; ``torch.distributed`` and
``hivemind`` are imported by the concrete transports in this package alone.
That is what lets the simulator run the very same algorithm objects.

A transport moves tensors (the sum of one flat buffer, broadcast) and bytes
(``all_gather_bytes``, ``all_to_all_bytes``); it knows bytes, not codecs. What it
can do beyond that is one :class:`Capabilities` object (``transport.caps``). The
weighted mean that fp32 and every codec run through is written once over these
primitives, in ``diloco.compress.collective``, which picks its aggregation from
the capabilities.

Byte counting lives here, in one place: every collective adds what this
worker would put on and take off the wire (``_count``). For a dense all-reduce
that is the ring algorithm's ``2 (W - 1) / W`` times the buffer, each way; for
byte collectives it is the exact payload lengths (a transport that knows
better, like hivemind's partial deliveries, says so through ``_moved``).
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from diloco.comm.caps import Capabilities, RobustBounds


class TransportError(RuntimeError):
    """A collective failed or timed out. The message names the rank or peer when known."""


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    seconds: float = 0.0
    peak_bytes: int = 0  # the most bytes one exchange (one exchange_scope) put on the wire

    def as_dict(self) -> dict[str, float]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "collectives": self.collectives, "comm_s": self.seconds, "peak_bytes": self.peak_bytes}


@dataclass(frozen=True)
class PayloadBound:
    """The lengths the other members' payloads of one all-gather may have, as the sender's own codec and tensors
    make them (``diloco.compress.message.message_bound``): from ``least`` to ``most`` bytes, every one of them
    ``most`` where ``exact``. A transport whose members need not trust each other refuses a payload of another
    length before reading it (hivemind); the others ignore it."""

    least: int
    most: int
    exact: bool


class Handle:
    """A collective that may still be in flight; ``wait()`` returns its result once it may be used."""

    def __init__(self, result: Any = None) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result


class _Later(Handle):
    """A collective that may be in flight: ``wait()`` finishes it once and returns its result."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        super().__init__()
        self._finish: Optional[Callable[[], Any]] = finish

    def wait(self) -> Any:
        if self._finish is not None:
            self.result, self._finish = self._finish(), None
        return self.result


class DeviceSpan:
    """A step's compute on a GPU: the device time between two events recorded on the current stream, read once the
    device has passed the second. The host's clock would measure the launches only (nothing waits for the device
    inside a step), and a queue that filled up would lend a step the other workers' kernels."""

    def __init__(self, device: torch.device) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record(torch.cuda.current_stream(device))
        self.device = device

    def stop(self) -> "DeviceSpan":
        self.end.record(torch.cuda.current_stream(self.device))
        return self

    def done(self) -> bool:
        return self.end.query()

    def seconds(self) -> float:
        """The span's seconds, waiting for the device if it has not passed the end yet."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class Transport(ABC):
    """A group of workers: ``rank`` in ``[0, world_size)``; rank 0 leads (logs, writes files)."""

    rank: int = 0
    world_size: int = 1
    bucket_bytes: int = 32 << 20
    caps: Capabilities = Capabilities()  # what it can do beyond moving bytes (each transport states its own)
    bounds: RobustBounds = RobustBounds()  # what one member's update may weigh in a robust mean

    def __init__(self) -> None:
        self.stats = CommStats()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---- primitives each transport provides -------------------------------------------------
    @abstractmethod
    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        """Sum a contiguous 1-D tensor over all workers, in place."""

    @abstractmethod
    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every worker with rank ``src``'s copy."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable object on every worker (control plane, not counted)."""

    @abstractmethod
    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every worker's payload, indexed by rank (counted by :meth:`all_gather_bytes`)."""

    @abstractmethod
    def _all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        """What each worker sent this one, indexed by rank (counted by :meth:`all_to_all_bytes`)."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Control plane (run folder, stop flags, summaries): not counted as algorithm traffic."""

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        """Every worker's object on worker ``dst`` (None elsewhere): checkpoints gather here, not everywhere."""
        everyone = self.all_gather_object(obj)
        return everyone if self.rank == dst else None

    def barrier(self) -> None:
        self.broadcast_object(None)

    def before_exchange(self) -> None:
        """Called once at the start of every exchange (torch_dist: a monitored barrier on gloo)."""

    def _start(self, fn: Callable[[], Any]) -> Handle:
        """Run a collective that the caller will ``wait()`` for later (see :meth:`start`).

        This base version completes before returning. The simulator overlaps the communication time
        with the compute that follows, as Streaming DiLoCo's overlap needs; torch_dist on gloo runs
        it in a background thread.
        """
        return Handle(fn())

    def on_my_share(self, flat: torch.Tensor, align: int, key: Hashable,
                    reduce: Callable[[torch.Tensor, Hashable], Any]) -> Any:
        """Run ``reduce(part, key)`` on the part of ``flat`` this process exchanges with the other workers,
        in place, and return its result. A worker of one process exchanges all of it; a node of a torchrun
        mesh cuts it into one share per process (at multiples of ``align``) and shares the results inside."""
        return reduce(flat, key)

    def member_names(self) -> list[str]:
        """Who sent the payloads of the latest ``all_gather_bytes``, in its order (peers: their ids)."""
        return [str(r) for r in range(self.world_size)]

    def record_contributions(self, accepted: dict[str, float], rejected: dict[str, str],
                             clipped: dict[str, float], weights_clipped: Optional[dict[str, float]] = None) -> None:
        """What a robust mean made of each member's update (hivemind keeps a ledger of it): the weight each accepted
        one counted with, why others were left out, the factor by which a norm or an announced weight was above
        its bound."""

    # ---- time: real here, virtual in the simulator ------------------------------------------
    def now(self) -> float:
        """Seconds on this worker's clock (sync.mode=time measures rounds with it)."""
        return time.monotonic()

    def mark(self) -> Any:
        """A point on this worker's clock, for :meth:`seconds_since` (a time-budgeted round's start)."""
        return self.now()

    def seconds_since(self, mark: Any) -> float:
        """Seconds on this worker's clock since ``mark`` (from :meth:`mark`)."""
        return self.now() - mark

    # ---- a worker of several processes (a node of a torchrun mesh) --------------------------------
    #: this process's place among the processes of its worker (a node of a torchrun mesh); 0 where a worker is one
    local_rank: int = 0
    #: the transport among the processes of this worker, which average their gradients every step (the node
    #: mesh's); None where a worker is one process
    inner: Optional[Transport] = None
    #: True where this worker's processes hold a slice of its model each (``run.shard: fsdp``): :meth:`shard` cuts
    #: the model, and a checkpoint keeps every process's slices (:meth:`save_slices`, :meth:`load_slices`)
    shards_model: bool = False

    def gather_in_worker(self, obj: Any) -> Optional[list[Any]]:
        """``obj`` of every process of this worker, in local-rank order, at its first process (None at the others);
        ``[obj]`` where a worker is one process."""
        return [obj]

    def shard(self, model: nn.Module, bf16: bool) -> nn.Module:
        """``model`` cut among this worker's processes, in place (``bf16``: computed in bf16 over fp32 weights);
        only where :attr:`shards_model`: a worker of one process has nothing to cut it among."""
        raise TransportError("run.shard=fsdp shards a worker among the processes of a node started by torchrun; here "
                             "each worker is one process (loco simulate, loco join): leave run.shard at none")

    def save_slices(self, folder: Path, state: dict[str, Any]) -> None:
        """Every process's own ``state`` (its slices) into ``folder``, where :attr:`shards_model`."""
        raise NotImplementedError(self._holds_whole("keeps no slices to save"))

    def load_slices(self, folder: Path) -> dict[str, Any]:
        """This process's part of a :meth:`save_slices` folder, where :attr:`shards_model`."""
        raise NotImplementedError(self._holds_whole("has no slices to load"))

    def whole_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The sharded ``model``'s weights whole at the leader, where :attr:`shards_model`."""
        raise NotImplementedError(self._holds_whole("has the model whole: its state_dict() is its whole state"))

    def _holds_whole(self, what: str) -> str:
        return (f"{type(self).__name__} holds each worker's model whole in one process (shards_model is False), "
                f"so it {what}")

    @contextlib.contextmanager
    def computing(self, device: torch.device) -> Iterator[None]:
        """Around one step's compute. Where the transport keeps a clock of its own (``caps.measures_compute``)
        the compute is measured, on a GPU by two events on the device (:class:`DeviceSpan`: no host wait), else
        by the host's clock, and handed to :meth:`advance_compute` once it ends without an error."""
        if not self.caps.measures_compute:
            yield
            return
        span = DeviceSpan(device) if torch.device(device).type == "cuda" else None
        start = time.perf_counter()
        yield
        self.advance_compute(span.stop() if span is not None else time.perf_counter() - start)

    def advance_compute(self, seconds: Any) -> None:
        """One step's compute took ``seconds`` (a :class:`DeviceSpan` on a GPU); the simulator turns it into
        virtual time."""

    def steps_trained(self) -> Optional[int]:
        """Steps all workers trained together, where the members change (the simulator under churn); None where
        every worker trains every step (then it is ``world_size x step``)."""
        return None

    def my_steps_trained(self) -> Optional[int]:
        """Steps this worker trained, where it may have been away for some of the run's (the simulator under
        churn: a worker that comes back takes the run's step count); None where that is its step count."""
        return None

    def clock_state(self) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of this transport's own clock (the simulator's virtual time), taken where every
        worker saves (a collective where there is one); None where time is the wall's."""
        return None

    def load_clock_state(self, state: dict[str, Any]) -> None:
        """Take back :meth:`clock_state` on a resume, once this worker has loaded its own part of the checkpoint."""

    def metrics(self) -> dict[str, Any]:
        """Extra per-log-line metrics of this transport (virtual time in the simulator)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Extra end-of-run summary of this transport."""
        return {}

    def close(self) -> None:
        pass

    def abort(self) -> None:
        """Close after a failure: release what can be released without waiting for exchanges in flight or
        for other workers (a process that is failing must end promptly, with its own error)."""
        self.close()

    # ---- byte counting: here and nowhere else -----------------------------------------------
    def _count(self, sent: int, received: int, collectives: int = 1) -> None:
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.collectives += collectives

    def count_all_reduce(self, nbytes: int) -> None:
        w = self.world_size
        wire = 2 * (w - 1) * nbytes // w if w > 1 else 0
        self._count(wire, wire)

    def _moved(self, kind: str, sent: Sequence[int], received: Sequence[int]) -> tuple[int, int]:
        """(bytes put on, bytes taken off the wire) by a byte collective, from the lengths of the payloads sent and
        received: every payload but this worker's own."""
        me = self.rank
        if kind == "all_gather":
            return sent[0] * (len(received) - 1), sum(received) - sent[0]
        return sum(n for j, n in enumerate(sent) if j != me), sum(n for i, n in enumerate(received) if i != me)

    @contextlib.contextmanager
    def exchange_scope(self, barrier: bool = True) -> Iterator[None]:
        """One exchange: starts with :meth:`before_exchange` (unless ``barrier`` is False: an exchange of one
        collective, which is its own rendezvous) and records its bytes as a peak candidate."""
        if barrier:
            self.before_exchange()
        before = self.stats.bytes_sent
        yield
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_sent - before)

    # ---- written once on top ----------------------------------------------------------------
    def _counted(self, kind: str, sent: Sequence[int], out: list) -> list:
        """``out``, the result of a byte collective that sent payloads of ``sent`` bytes, once counted."""
        self._count(*self._moved(kind, sent, [len(p) for p in out]))
        return out

    def all_gather_bytes(self, payload: bytes, sizes: Optional[Sequence[int]] = None,
                         bound: Optional[PayloadBound] = None) -> list[bytes]:
        """Every worker's payload, indexed by rank. ``sizes``, ``bound``: see :meth:`all_gather_bytes_start`."""
        return self.all_gather_bytes_start(payload, sizes, bound).wait()

    def all_gather_bytes_start(self, payload: bytes, sizes: Optional[Sequence[int]] = None,
                               bound: Optional[PayloadBound] = None) -> Handle:
        """Start :meth:`all_gather_bytes`; the handle's ``wait()`` returns its result. See
        :meth:`all_to_all_bytes_start` (``sizes`` here: every worker's payload length, by rank). ``bound``: the
        lengths the others' payloads may have (None: any length up to what the transport takes at all)."""
        sent = [len(payload)]
        if sizes is not None:
            self._check_sizes(sizes, len(payload))
        finish = self._start_all_gather_bytes(payload, sizes, bound)
        return _Later(lambda: self._counted("all_gather", sent, finish()))

    def _check_sizes(self, sizes: Sequence[int], mine: int) -> None:
        """Stated payload lengths must hold one per worker, this worker's own among them (a transport that skips
        its size exchange on their word would otherwise receive what it did not expect)."""
        if len(sizes) != self.world_size or sizes[self.rank] != mine:
            raise ValueError(f"worker {self.rank}: stated payload sizes {list(sizes)} do not fit {self.world_size} "
                             f"workers and this worker's own payload of {mine} bytes")

    def _start_all_gather_bytes(self, payload: bytes, sizes: Optional[Sequence[int]] = None,
                                bound: Optional[PayloadBound] = None) -> Callable[[], list[bytes]]:
        """Start :meth:`_all_gather_bytes`; the callable returned waits for it and returns its result. Here it is
        done before this returns; a transport that ``caps.overlaps_exchange`` leaves it in flight. ``sizes``: the
        payloads' lengths, known to every worker beforehand (a transport may then skip exchanging them); ``bound``:
        the lengths the others' payloads may have, which a transport among trusted members leaves unchecked."""
        out = self._all_gather_bytes(payload)
        return lambda: out

    def all_gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's 1-D uint8 tensor of ``t``'s size, indexed by rank, on ``t``'s device (counted as the
        same bytes by :meth:`all_gather_bytes`). Without ``caps.device_gather`` it goes through host bytes."""
        if not self.caps.device_gather:
            got = self.all_gather_bytes(t.detach().cpu().numpy().tobytes())
            return [torch.frombuffer(bytearray(p), dtype=torch.uint8).to(t.device) for p in got]
        out = self._all_gather_tensor(t)
        self._count(*self._moved("all_gather", [t.numel()], [o.numel() for o in out]))  # 1-D uint8: its bytes
        return out

    def _all_gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no device all-gather")

    def all_gather_payload(self, wire: Callable[[], bytes], device: Optional[Callable[[], torch.Tensor]] = None,
                           bound: Optional[PayloadBound] = None) -> list:
        """Every worker's payload of an exchange whose payloads all have one length, in the form this transport
        moves best: where it moves tensors where they lie (``caps.device_gather``) the 1-D uint8 tensors
        ``device()`` makes (no header between trusted members), else the self-describing bytes ``wire()`` makes.
        Where the ranks are fixed every worker knows the length beforehand, so the transport may skip exchanging
        it (see :meth:`all_to_all_bytes_start`); ``bound``: the lengths the wire payloads may have."""
        if device is not None and self.caps.device_gather:
            return self.all_gather_tensor(device())
        payload = wire()
        return self.all_gather_bytes(payload, [len(payload)] * self.world_size if self.caps.fixed_ranks else None,
                                     bound)

    def all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        """Send ``payloads[j]`` to worker j; returns what each worker sent this one, indexed by rank."""
        return self.all_to_all_bytes_start(payloads).wait()

    def _check_all_to_all(self, payloads: Sequence[bytes]) -> None:
        if len(payloads) != self.world_size:
            raise ValueError(f"all_to_all_bytes needs {self.world_size} payloads, got {len(payloads)}")

    def all_to_all_bytes_start(self, payloads: Sequence[bytes], sizes: Optional[Sequence[int]] = None) -> Handle:
        """Start :meth:`all_to_all_bytes`; the handle's ``wait()`` returns its result (counted then). Every worker
        starts and waits for the same collectives in the same order; the payloads may be released once this
        returns. The collective is done before it returns, except where ``caps.overlaps_exchange`` is set: there
        the transfer is left in flight, so the caller can compute meanwhile.

        ``sizes``: the length of what each worker sends this one, by rank, where every worker knows them
        beforehand (fixed-size codecs). Where the workers' settings were agreed (``caps.settings_agreed``),
        torch_dist then skips the size exchange that precedes each transfer, a round trip that a link's latency
        makes dear; elsewhere the sizes are exchanged, so a worker with another codec is named, not misread."""
        self._check_all_to_all(payloads)
        sent = [len(p) for p in payloads]
        if sizes is not None:
            self._check_sizes(sizes, sent[self.rank])
        finish = self._start_all_to_all_bytes(payloads, sizes)
        return _Later(lambda: self._counted("all_to_all", sent, finish()))

    def _start_all_to_all_bytes(self, payloads: Sequence[bytes], sizes: Optional[Sequence[int]] = None
                                ) -> Callable[[], list[bytes]]:
        """Start :meth:`_all_to_all_bytes`, as :meth:`_start_all_gather_bytes` does :meth:`_all_gather_bytes`."""
        out = self._all_to_all_bytes(payloads)
        return lambda: out

    def all_reduce_sum_(self, flat: torch.Tensor) -> None:
        """Sum a contiguous 1-D tensor over the workers, in place (counted as the ring all-reduce moves it)."""
        self._all_reduce_sum_(flat)
        self.count_all_reduce(flat.numel() * flat.element_size())

    def start(self, fn: Callable[[], Any]) -> Handle:
        """Start the collectives ``fn`` runs; the handle's ``wait()`` returns ``fn``'s result once it may be used."""
        return self._start(fn)

    def broadcast_tensors_(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        if self.world_size == 1:
            return
        for t in tensors:
            self.broadcast_(t, src)

    def share_initial_(self, tensors: Iterable[torch.Tensor], seeded: bool) -> None:
        """Every worker starts from the leader's ``tensors``: they are broadcast, unless ``seeded`` (built from
        the run's seed) where every worker builds them alike (``caps.seeded_alike``)."""
        if not (seeded and self.caps.seeded_alike):
            self.broadcast_tensors_(tensors, 0)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so no child (a worker, a DHT process and its
    p2pd) outlives a killed run. Call it in the child (``preexec_fn``, or first thing in a forked process)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: a clean exit still shuts everything down
        pass


def shard_bounds(n: int, world: int, align: int = 1) -> list[tuple[int, int]]:
    """``world`` contiguous shards covering ``range(n)``, cut at multiples of ``align`` (the last ones may be empty)."""
    units = -(-n // align)
    per = -(-units // world) * align
    return [(min(j * per, n), min((j + 1) * per, n)) for j in range(world)]
