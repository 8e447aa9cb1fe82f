"""The Transport interface: who takes part in a round, and moving data among them.

Algorithm code talks only to this interface; ``torch.distributed`` and
``hivemind`` are imported by the concrete transports in this package alone.
That is what lets the simulator run the very same algorithm objects.

Byte counting lives here, in one place: every collective adds what this
worker would put on and take off the wire. For a dense all-reduce that is the
ring algorithm's ``2 (W - 1) / W`` times the buffer, each way; for byte
collectives it is the exact payload lengths.

The compressed all-reduce is written here once, on ``all_to_all_bytes`` and
``all_gather_bytes``, so every codec runs on every transport:

1. cut the flat buffer into one shard per worker (at multiples of the codec's
   chunk/block size), encode shard j and send it to worker j (all-to-all);
2. worker j decodes every worker's copy of its shard and accumulates the
   weighted sum (``w_i x_i``, the weight travels exactly beside the payload),
   divides by the total weight, re-encodes the mean;
3. all-gather the encoded means; everyone decodes every shard.

Each worker sends about ``2 (W - 1) / W`` of the compressed size. Both encodes
keep their own error-feedback residual (the sender's per destination shard, the
shard owner's for the mean), so what one round drops is sent in a later one,
and every worker ends with the same bytes, hence the same result.
"""

from __future__ import annotations

import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Optional, Sequence

import torch

if TYPE_CHECKING:
    from diloco.compress.codec import Codec

_WEIGHT = struct.Struct("<d")


class TransportError(RuntimeError):
    """A collective failed or timed out. The message names the rank or peer when known."""


@dataclass
class CommStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    seconds: float = 0.0
    peak_bytes: int = 0  # the most bytes one exchange (one all_reduce_ call) put on the wire

    def as_dict(self) -> dict[str, float]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "collectives": self.collectives, "comm_s": self.seconds, "peak_bytes": self.peak_bytes}


class Handle:
    """A collective that may still be in flight; ``wait()`` returns its result once it may be used."""

    def __init__(self, result: Any = None) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result


class Transport(ABC):
    """A group of workers: ``rank`` in ``[0, world_size)``; rank 0 leads (logs, writes files)."""

    rank: int = 0
    world_size: int = 1
    bucket_bytes: int = 32 << 20

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
    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every worker's payload, indexed by rank."""

    @abstractmethod
    def all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        """Send ``payloads[j]`` to worker j; returns what each worker sent this one, indexed by rank."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Control plane (run folder, stop flags, summaries): not counted as algorithm traffic."""

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        """Every worker's object on worker ``dst`` (None elsewhere): checkpoints gather here, not everywhere."""
        everyone = self.all_gather_object(obj)
        return everyone if self.rank == dst else None

    def barrier(self) -> None:
        self.broadcast_object(None)

    def _before_exchange(self) -> None:
        """Called once at the start of every exchange (torch_dist: a monitored barrier on gloo)."""

    # ---- time: real here, virtual in the simulator ------------------------------------------
    def now(self) -> float:
        """Seconds on this worker's clock (sync.mode=time measures rounds with it)."""
        return time.monotonic()

    def advance_compute(self, seconds: float) -> None:
        """The loop reports each step's compute time; the simulator turns it into virtual time."""

    def metrics(self) -> dict[str, Any]:
        """Extra per-log-line metrics of this transport (virtual time in the simulator)."""
        return {}

    def summary(self) -> dict[str, Any]:
        """Extra end-of-run summary of this transport."""
        return {}

    def close(self) -> None:
        pass

    # ---- written once on top ----------------------------------------------------------------
    def count_all_reduce(self, nbytes: int) -> None:
        w = self.world_size
        if w > 1:
            wire = 2 * (w - 1) * nbytes // w
            self.stats.bytes_sent += wire
            self.stats.bytes_received += wire
        self.stats.collectives += 1

    def all_reduce_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        """Sum or average a list of tensors over the workers, in place, in flat buckets."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if self.world_size == 1 or not tensors:
            return
        self._before_exchange()
        before = self.stats.bytes_sent
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
            self._all_reduce_sum_(flat)
            self.count_all_reduce(flat.numel() * flat.element_size())
            if op == "mean":
                flat.div_(self.world_size)
            _unflatten_into(bucket, flat)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_sent - before)

    def all_reduce_async_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> Handle:
        """Start ``all_reduce_``; the tensors hold the result once the handle's ``wait()`` returns."""
        return self._start(lambda: self.all_reduce_(tensors, op))

    def _start(self, fn: Callable[[], Any]) -> Handle:
        """Run a collective that the caller will ``wait()`` for later.

        This base version completes before returning. The simulator overlaps the communication time
        with the compute that follows, as Streaming DiLoCo's overlap needs.
        """
        return Handle(fn())

    def all_reduce_compressed_(self, tensors: Sequence[torch.Tensor], codec: "Codec", weight: float = 1.0,
                               key: Hashable = "") -> float:
        """Weighted mean over the workers through ``codec``, in place: ``x <- sum_i w_i x_i / sum_i w_i``.

        Returns the total weight (0: every worker sent weight 0, the tensors are then zero). ``key``
        names this list of tensors for the codec's error feedback (use one key per list that is
        reduced repeatedly). With one worker the codec still runs, so compression acts alike at any scale.
        """
        if not (weight >= 0 and weight < float("inf")):
            raise ValueError(f"the weight of a compressed all-reduce must be finite and >= 0, got {weight}")
        if not tensors:
            return 0.0
        self._before_exchange()
        before = self.stats.bytes_sent
        totals = []
        for b, bucket in enumerate(_buckets(tensors, self.bucket_bytes)):
            flat = torch.cat([t.detach().reshape(-1).float() for t in bucket])
            totals.append(self._reduce_bucket(flat, codec, float(weight), (key, b)))
            _unflatten_into(bucket, flat)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_sent - before)
        return max(totals)

    def all_reduce_compressed_async_(self, tensors: Sequence[torch.Tensor], codec: "Codec", weight: float = 1.0,
                                     key: Hashable = "") -> Handle:
        """Start ``all_reduce_compressed_``; ``wait()`` returns the total weight."""
        return self._start(lambda: self.all_reduce_compressed_(tensors, codec, weight, key))

    def _reduce_bucket(self, flat: torch.Tensor, codec: "Codec", weight: float, key: Hashable) -> float:
        from diloco.compress.wire import CorruptPayload

        w = self.world_size
        bounds = shard_bounds(flat.numel(), w, codec.align)
        sends = [_WEIGHT.pack(weight) + codec.encode(flat[a:b], key=(key, "shard", j)) for j, (a, b) in enumerate(bounds)]
        received = self.all_to_all_bytes(sends)
        a, b = bounds[self.rank]
        acc = torch.zeros(b - a, dtype=torch.float32, device=flat.device)
        total = 0.0
        for src, msg in enumerate(received):
            try:
                wi = _read_weight(msg)
                codec.decode_accumulate_(memoryview(msg)[_WEIGHT.size:], acc, wi)
            except CorruptPayload as e:
                raise TransportError(f"rank {self.rank}: worker {src} sent a corrupt payload for shard "
                                     f"{self.rank}: {e}") from None
            total += wi
        if total > 0:
            acc.div_(total)
        else:
            acc.zero_()
        gathered = self.all_gather_bytes(_WEIGHT.pack(total) + codec.encode(acc, key=(key, "mean")))
        totals = []
        for src, msg in enumerate(gathered):
            a, b = bounds[src]
            out = flat[a:b]
            out.zero_()
            try:
                totals.append(_read_weight(msg))
                codec.decode_accumulate_(memoryview(msg)[_WEIGHT.size:], out, 1.0)
            except CorruptPayload as e:
                raise TransportError(f"rank {self.rank}: worker {src} sent a corrupt mean of shard {src}: {e}") from None
        return max(totals)

    def broadcast_tensors_(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        if self.world_size == 1:
            return
        for t in tensors:
            self.broadcast_(t, src)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so no child (a worker, a DHT process and its
    p2pd) outlives a killed run. Call it in the child (``preexec_fn``, or first thing in a forked process)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: a clean exit still shuts everything down
        pass


def _read_weight(msg: bytes) -> float:
    from diloco.compress.wire import CorruptPayload

    if len(msg) < _WEIGHT.size:
        raise CorruptPayload(f"message of {len(msg)} bytes has no weight")
    (w,) = _WEIGHT.unpack_from(msg, 0)
    if not (w >= 0 and w < float("inf")):
        raise CorruptPayload(f"weight {w} is not finite and >= 0")
    return w


def shard_bounds(n: int, world: int, align: int = 1) -> list[tuple[int, int]]:
    """``world`` contiguous shards covering ``range(n)``, cut at multiples of ``align`` (the last ones may be empty)."""
    units = -(-n // align)
    per = -(-units // world) * align
    return [(min(j * per, n), min((j + 1) * per, n)) for j in range(world)]


def _unflatten_into(bucket: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` back into the tensors it was concatenated from."""
    offset = 0
    for t in bucket:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Group tensors of one dtype and device into buckets of at most ``limit`` bytes (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if out and size + nbytes <= limit and out[-1][0].dtype == t.dtype and out[-1][0].device == t.device:
            out[-1].append(t)
            size += nbytes
        else:
            out.append([t])
            size = nbytes
    return out
