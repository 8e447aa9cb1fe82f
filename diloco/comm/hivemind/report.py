"""What a round produced: :class:`RoundResult` inside the transport (with the members' payloads, for the
collective), and :class:`RoundReport`, the typed account the application reads after the round."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping


@dataclass
class RoundResult:
    """What one exchange agreed on: members in canonical order with their payloads and announcements."""

    round: int
    group: str
    members: list  # PeerIDs that delivered and committed, sorted
    payloads: dict  # PeerID -> bytes (emptied once the transport hands them to the collective)
    meta: dict  # PeerID -> its announcement
    alone: bool = False
    seconds: float = 0.0
    matchmaking_s: float = 0.0
    notes: list = field(default_factory=list)
    sent_bytes: int = 0  # payload bytes this peer delivered to other members
    received_bytes: int = 0  # payload bytes it took from the members it kept
    exchange_s: float = 0.0  # seconds from the group's forming to the last payload delivered and received
    deadline_s: float = 0.0  # how long this peer waited at most for the members' payloads (exchange_timeout)

    def report(self, resync_from: list) -> "RoundReport":
        """This round's report, before the collective weighs the members' updates (see
        :meth:`RoundReport.weighed`) and the transport counts its bytes (``total_*``)."""
        return RoundReport(
            round=self.round, group=self.group, members=tuple(p.to_base58() for p in self.members),
            alone=self.alone, seconds=self.seconds, matchmaking_s=self.matchmaking_s, deadline_s=self.deadline_s,
            notes=tuple(self.notes), bytes_sent=self.sent_bytes, bytes_received=self.received_bytes,
            resync_from=tuple(p.to_base58() for p in resync_from))


@dataclass(frozen=True)
class RoundReport:
    """One round as this peer saw it. Peer ids are base58.

    ``members``: who took part (sorted), ``alone`` when only this peer did (``notes`` say why). ``accepted``:
    the weight each accepted update counted with; ``rejected``: why the others were left out; ``clipped`` /
    ``weights_clipped``: by what factor an update's norm or announced weight was above its bound.
    ``bytes_sent`` / ``bytes_received``: this round's payload bytes; ``total_*``: this peer's, over the run,
    this round's included. ``seconds``: the whole exchange, ``matchmaking_s`` of it until the group formed;
    ``deadline_s``: how long this peer waited at most for the members' payloads. ``resync_from``: the members
    holding the group's state when this peer's differs (it should download theirs), else empty.
    """

    round: int
    group: str = ""
    members: tuple = ()
    alone: bool = True
    accepted: Mapping[str, float] = field(default_factory=dict)
    rejected: Mapping[str, str] = field(default_factory=dict)
    clipped: Mapping[str, float] = field(default_factory=dict)
    weights_clipped: Mapping[str, float] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    total_sent: int = 0
    total_received: int = 0
    seconds: float = 0.0
    matchmaking_s: float = 0.0
    deadline_s: float = 0.0
    notes: tuple = ()
    resync_from: tuple = ()

    def weighed(self, accepted: Mapping[str, float], rejected: Mapping[str, str], clipped: Mapping[str, float],
                weights_clipped: Mapping[str, float]) -> "RoundReport":
        """This report with what the collective made of each member's update."""
        return replace(self, accepted=dict(accepted), rejected=dict(rejected), clipped=dict(clipped),
                       weights_clipped=dict(weights_clipped))

    def record(self) -> dict[str, Any]:
        """The round's line of ``rounds.jsonl``, as far as the swarm knows it. The file's keys are read by
        scripts and tests: ``epoch`` is the round, ``bytes_sent`` / ``bytes_received`` the run's totals."""
        return {"epoch": self.round, "group": self.group, "alone": self.alone, "members": list(self.members),
                "accepted": sorted(self.accepted), "rejected": dict(self.rejected), "clipped": dict(self.clipped),
                "weights_clipped": dict(self.weights_clipped),
                "seconds": round(self.seconds, 3), "matchmaking_s": round(self.matchmaking_s, 3),
                "bytes_sent": self.total_sent, "bytes_received": self.total_received, "notes": list(self.notes),
                "deadline_s": round(self.deadline_s, 1)}
