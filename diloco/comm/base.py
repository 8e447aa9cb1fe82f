"""The Transport interface: who takes part in a round, and moving data among them.

Algorithm code talks only to this interface; ``torch.distributed`` and
``hivemind`` are imported by the concrete transports in this package alone.
That is what lets the simulator run the very same algorithm objects.

Byte counting lives here, in one place: every collective adds what this
worker would put on and take off the wire. For a dense all-reduce that is the
ring algorithm's ``2 (W - 1) / W`` times the buffer, each way.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch


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
    """A collective that may still be in flight; ``wait()`` returns once its result may be used."""

    def wait(self) -> None:
        pass


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
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Control plane (run folder, stop flags, summaries): not counted as algorithm traffic."""

    def barrier(self) -> None:
        self.broadcast_object(None)

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
        before = self.stats.bytes_sent
        for bucket in _buckets(tensors, self.bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
            self._all_reduce_sum_(flat)
            self.count_all_reduce(flat.numel() * flat.element_size())
            if op == "mean":
                flat.div_(self.world_size)
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_sent - before)

    def all_reduce_async_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> Handle:
        """Start ``all_reduce_``; the tensors hold the result once the handle's ``wait()`` returns.

        This base version completes before returning. The simulator overlaps the communication time
        with the compute that follows, as Streaming DiLoCo's overlap needs.
        """
        self.all_reduce_(tensors, op)
        return Handle()

    def broadcast_tensors_(self, tensors: Iterable[torch.Tensor], src: int = 0) -> None:
        if self.world_size == 1:
            return
        for t in tensors:
            self.broadcast_(t, src)


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
