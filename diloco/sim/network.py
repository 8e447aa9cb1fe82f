"""Network-time model: bytes a collective really moved -> virtual seconds on a per-worker link.

Each worker has a link of ``bandwidth`` bytes/s and one-way ``latency``. A ring
all-reduce over W workers takes 2(W-1) latency-bound phases and puts
2(W-1)/W of the buffer on every link; an all-gather takes W-1 phases and moves
everyone else's payload. Collectives on one link run one after another.

With a link trace (:class:`diloco.sim.links.LinkTrace`) every worker has its own
link, read at the time a collective starts; a collective lasts as long as its
slowest participant needs (its latency-bound phases and its bytes on its link).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from diloco.sim.links import LinkTrace


@dataclass
class NetworkModel:
    bandwidth: Optional[float] = None  # bytes/s per worker link; None: infinitely fast
    latency: float = 0.0  # seconds, one way
    links: Optional[LinkTrace] = None  # per-worker links over time; when set, bandwidth and latency are unused

    def all_reduce_s(self, nbytes: int, world: int) -> float:
        if world <= 1:
            return 0.0
        wire = 2 * (world - 1) * nbytes / world
        return 2 * (world - 1) * self.latency + (wire / self.bandwidth if self.bandwidth else 0.0)

    def all_gather_s(self, received_bytes: int, world: int) -> float:
        if world <= 1:
            return 0.0
        return (world - 1) * self.latency + (received_bytes / self.bandwidth if self.bandwidth else 0.0)

    def all_to_all_s(self, sent_bytes: int, received_bytes: int, world: int) -> float:
        if world <= 1:
            return 0.0
        busiest = max(sent_bytes, received_bytes)  # a full-duplex link: the busier direction bounds it
        return (world - 1) * self.latency + (busiest / self.bandwidth if self.bandwidth else 0.0)

    def link(self, rank: int, at: float) -> tuple[Optional[float], float]:
        """(bandwidth, latency) of ``rank``'s link at virtual time ``at``."""
        if self.links is None:
            return self.bandwidth, self.latency
        return self.links.at(rank, at)

    @staticmethod
    def _on(bandwidth: Optional[float], latency: float, phases: int, nbytes: float) -> float:
        return phases * latency + (nbytes / bandwidth if bandwidth else 0.0)

    def all_reduce_at(self, nbytes: int, world: int, at: float) -> float:
        """:meth:`all_reduce_s` on the links at time ``at``: the ring waits for its slowest link."""
        if self.links is None or world <= 1:
            return self.all_reduce_s(nbytes, world)
        wire = 2 * (world - 1) * nbytes / world
        return max(self._on(*self.link(r, at), 2 * (world - 1), wire) for r in range(world))

    def all_gather_at(self, received: Sequence[int], at: float, ranks: Optional[Sequence[int]] = None) -> float:
        """An all-gather in which the i-th member receives ``received[i]`` bytes, on the links at time ``at``;
        ``ranks``: whose links those are (default: workers 0, 1, ...; fewer under churn)."""
        world = len(received)
        if world <= 1:
            return 0.0
        if self.links is None:
            return max(self.all_gather_s(n, world) for n in received)
        ranks = range(world) if ranks is None else ranks
        return max(self._on(*self.link(r, at), world - 1, n) for r, n in zip(ranks, received))

    def transfer_s(self, rank: int, nbytes: int, at: float) -> float:
        """One download of ``nbytes`` onto ``rank``'s link starting at ``at`` (a joiner fetching the run's state)."""
        return self._on(*self.link(rank, at), 1, nbytes)

    def all_to_all_at(self, sent: Sequence[int], received: Sequence[int], at: float) -> float:
        """An all-to-all in which worker r sends ``sent[r]`` and receives ``received[r]`` bytes."""
        world = len(sent)
        if world <= 1:
            return 0.0
        if self.links is None:
            return max(self.all_to_all_s(s, n, world) for s, n in zip(sent, received))
        return max(self._on(*self.link(r, at), world - 1, max(s, n)) for r, (s, n) in enumerate(zip(sent, received)))

    def describe(self) -> str:
        if self.links is not None:
            return self.links.describe()
        bw = "unlimited" if not self.bandwidth else f"{self.bandwidth * 8 / 1e9:g} Gbit/s"
        return f"{bw}, {self.latency * 1e3:g} ms latency"
