"""The contribution ledger: who contributed what to which round, as this peer saw it, published in the DHT
(``<run>.ledger``, one entry per observer) and merged by ``loco status`` over every observer's.

Every member of a round accounts the round from data every member saw alike (the agreed members, the collective's
verdict on each update), so honest observers agree; the merge takes each count's median over the observers,
which one liar cannot move.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields
from typing import Mapping, Sequence

from diloco.comm.hivemind.framing import dht_now, log
from diloco.comm.hivemind.node import Node

LEDGER_TTL_S = 7 * 86400  # a published ledger outlives its peer by a week: `loco status` credits peers gone


@dataclass
class PeerRecord:
    """One peer's column of the contribution ledger. ``epochs``: the rounds it took part in (the name is the
    ledger's key in the DHT, in ``ledger.json`` and in ``loco status --json``)."""

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


class Ledger:
    """This peer's ledger (``records``: peer id -> :class:`PeerRecord`) and its entry in the DHT (``key``: one
    subkey per observer)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.key = f"{node.run}.ledger"
        self.records: dict[str, PeerRecord] = {}

    def warn(self, round: int, accepted: Mapping[str, float], rejected: Mapping[str, str],
             clipped: Mapping[str, float], weights_clipped: Mapping[str, float]) -> None:
        """Log what the collective left out or bounded of the members' updates in ``round``."""
        tag = self.node.tag
        for name, why in rejected.items():
            log.warning("peer %s | round %d: left peer %s's update out: %s", tag, round, name[-8:], why)
        for name, factor in clipped.items():
            log.warning("peer %s | round %d: clipped peer %s's update (its norm was %.3gx the bound)", tag, round,
                        name[-8:], factor)
        for name, factor in weights_clipped.items():
            log.warning("peer %s | round %d: counted peer %s's update at %.6g tokens (it announced %.3gx that bound: "
                        "--weight-clip x the others' median)", tag, round, name[-8:], accepted.get(name, 0.0), factor)

    def account(self, accepted: Mapping[str, float], rejected: Mapping[str, str], clipped: Mapping[str, float],
                weights_clipped: Mapping[str, float]) -> None:
        """One round's verdicts: the tokens each accepted update counted with, and which were left out or
        bounded."""
        for name, w in accepted.items():
            rec = self.records.setdefault(name, PeerRecord())
            rec.tokens += w
            rec.epochs += 1
            rec.accepted += 1
            rec.clipped += int(name in clipped or name in weights_clipped)
        for name in rejected:
            rec = self.records.setdefault(name, PeerRecord())
            rec.epochs += 1
            rec.rejected += 1

    def table(self) -> dict[str, dict[str, float]]:
        """The ledger by peer id (sorted), each peer's counts by name."""
        return {pid: rec.as_dict() for pid, rec in sorted(self.records.items())}

    async def publish(self) -> None:
        value = {pid: rec.as_list() for pid, rec in self.records.items()}
        await self.node.dht.store(self.key, subkey=self.node.me, value=value, expiration_time=dht_now() + LEDGER_TTL_S,
                                  return_future=True)


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
