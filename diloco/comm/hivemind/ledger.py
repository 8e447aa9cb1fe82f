"""The contribution ledger: who contributed what to which epoch, published in the DHT and merged by observers."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Optional, Sequence

from diloco.comm.hivemind.framing import _now, log

if TYPE_CHECKING:
    from diloco.comm.hivemind.epoch import EpochResult
    from diloco.comm.hivemind.transport import HivemindTransport


@dataclass
class PeerRecord:
    """One peer's column of the contribution ledger."""

    tokens: float = 0.0
    epochs: int = 0
    accepted: int = 0
    rejected: int = 0
    clipped: int = 0

    def as_list(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_list(cls, v: Sequence) -> "PeerRecord":
        return cls(float(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]) if len(v) > 4 else 0)


class LedgerMixin:
    """Contribution accounting of :class:`~diloco.comm.hivemind.HivemindTransport`."""

    def record_contributions(self, accepted: dict[str, float], rejected: dict[str, str],
                             clipped: dict[str, float], weights_clipped: Optional[dict[str, float]] = None) -> None:
        epoch = self.last.epoch if self.last is not None else self.epoch
        weights_clipped = weights_clipped or {}
        for name, why in rejected.items():
            log.warning("peer %s | epoch %d: left peer %s's update out: %s", self.me[-8:], epoch, name[-8:], why)
        for name, factor in clipped.items():
            log.warning("peer %s | epoch %d: clipped peer %s's update (its norm was %.3gx the bound)",
                        self.me[-8:], epoch, name[-8:], factor)
        for name, factor in weights_clipped.items():
            log.warning("peer %s | epoch %d: counted peer %s's update at %.6g tokens (it announced %.3gx that bound: "
                        "--weight-clip x the others' median)", self.me[-8:], epoch, name[-8:],
                        accepted.get(name, 0.0), factor)
        if self.last is not None:
            self._account(self.last, accepted, rejected, clipped, weights_clipped)

    def _account(self, result: EpochResult, accepted: dict, rejected: dict, clipped: dict,
                 weights_clipped: Optional[dict] = None) -> None:
        weights_clipped = weights_clipped or {}
        for name, w in accepted.items():
            rec = self.ledger.setdefault(name, PeerRecord())
            rec.tokens += w
            rec.epochs += 1
            rec.accepted += 1
            rec.clipped += int(name in clipped or name in weights_clipped)
        for name in rejected:
            rec = self.ledger.setdefault(name, PeerRecord())
            rec.epochs += 1
            rec.rejected += 1
        self.history.append({
            "epoch": result.epoch, "group": result.group, "alone": result.alone,
            "members": [p.to_base58() for p in result.members], "accepted": sorted(accepted),
            "rejected": rejected, "clipped": clipped, "weights_clipped": weights_clipped,
            "total_weight": sum(accepted.values()),
            "seconds": round(result.seconds, 3), "matchmaking_s": round(result.matchmaking_s, 3),
            "bytes_sent": self.stats.bytes_sent, "bytes_received": self.stats.bytes_received, "notes": result.notes})
        try:
            self._call(self._publish_ledger(), 30)
        except Exception as e:
            log.info("peer %s: could not publish the ledger: %s", self.me[-8:], e)

    async def _publish_ledger(self) -> None:
        value = {pid: rec.as_list() for pid, rec in self.ledger.items()}
        await self.dht.store(f"{self.run}.ledger", subkey=self.me, value=value,
                             expiration_time=_now() + 7 * 86400, return_future=True)


def read_swarm(transport: HivemindTransport) -> dict[str, Any]:
    """The run's registry and every peer's published ledger, as seen from the DHT."""
    async def go():
        return await transport._registry(), await transport._subkeys(f"{transport.run}.ledger")

    peers, ledgers = transport._call(go(), 60)
    return {"peers": peers, "ledgers": ledgers}


def merge_ledgers(ledgers: dict[str, dict]) -> dict[str, PeerRecord]:
    """One ledger from every observer's: per peer, the median of the observers' counts (robust to one liar)."""
    seen: dict[str, list[PeerRecord]] = {}
    for view in ledgers.values():
        for pid, row in view.items():
            try:
                seen.setdefault(pid, []).append(PeerRecord.from_list(row))
            except (TypeError, ValueError, IndexError):
                continue
    out = {}
    for pid, rows in seen.items():
        tokens, *counts = (statistics.median(getattr(r, f.name) for r in rows) for f in fields(PeerRecord))
        out[pid] = PeerRecord(tokens, *map(int, counts))
    return out
