"""What a member's payload may weigh, and the accounting that keeps a peer's inbox bounded.

Every member of a round encodes the same tensors with the same codec (peers of one run share model and codec:
the schema), so the lengths of this peer's own payload say what the others' must be. The collective, which
knows the codec, hands them to the transport with the payload (a :class:`~diloco.comm.base.PayloadBound`: exact
without a zstd stage, a range with one); a payload handed without them may be of any length up to the largest
the peer takes at all. Anything announcing another size is refused before a byte of its body is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from diloco.comm.base import PayloadBound
from diloco.comm.hivemind.framing import MAX_HEADER

ACK_MAX = 64 << 10  # an ack lists peer ids (about 40 bytes each): room for groups of over a thousand
PUSH_HEADER_MAX = min(4 << 10, MAX_HEADER)  # a push header: group id, kind, round, size, hash and MAC


def accepted(bound: Optional[PayloadBound], largest: int) -> PayloadBound:
    """The payload lengths a round takes: ``bound``, or any length up to ``largest`` where none was given."""
    return bound if bound is not None else PayloadBound(0, largest, False)


@dataclass
class Window:
    """What this peer accepts during one round: pushes for ``round`` whose size fits, within ``cap`` bytes.

    Before the group is known, any sender may push once per kind (a payload ``ag``, an ``ack``); once it is
    (``gid``, ``sizes``: every member's announced payload size), only members, each exactly its announced size.
    ``held``: bytes held or being read per (sender, kind); ``refused``: why a sender was turned away;
    ``hashes``: the hash each stored push was checked against, so that it is computed once.
    """

    round: int
    least: int
    most: int
    exact: bool
    cap: int
    gid: Optional[bytes] = None
    sizes: Optional[dict] = None  # PeerID -> announced payload bytes, once the group is known
    held: dict = field(default_factory=dict)  # (PeerID, kind) -> bytes
    reading: set = field(default_factory=set)  # (PeerID, kind) whose body is being read
    refused: dict = field(default_factory=dict)  # (PeerID, kind) -> why
    hashes: dict = field(default_factory=dict)  # (PeerID, kind) -> SHA-256 of the body stored, checked as it came

    def fits(self, n: int) -> bool:
        return self.least <= n <= self.most

    def expected(self) -> str:
        return f"{self.most}" if self.exact else f"{self.least}..{self.most}"

    def used(self) -> int:
        return sum(self.held.values())

    def refuse(self, sender, kind: str, why: str) -> None:
        if len(self.refused) < 1024:  # strangers with many identities cannot grow this without bound
            self.refused[(sender, kind)] = why


def inbox_cap(most: int, group: int) -> int:
    """Bytes the inbox may hold in a round of ``group`` members: each other member's payload and ack, and as
    much again for pushes that arrive before this peer knows its group."""
    return 2 * max(1, group - 1) * (most + ACK_MAX)
