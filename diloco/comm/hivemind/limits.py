"""What a member's payload may weigh, and the accounting that keeps a peer's inbox bounded.

Every member of a round encodes the same tensors with the same codec (peers of one run share model and codec:
the schema), so this peer's own payload says what the others' must be. Its wire header names the chain and
the shape; the codec computes the payload size for that many values (``Codec.payload_bytes``). Without a zstd
stage that size is exact; with one it varies, and the bound is the uncompressed size plus zstd's worst case.
Anything announcing another size is refused before a byte of its body is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from diloco.comm.hivemind.framing import MAX_HEADER
from diloco.compress import Codec, CodecSpecError, wire

WEIGHT_PREFIX = 8  # the collective's weight (``<d``) in front of a weighted payload
ACK_MAX = 64 << 10  # an ack lists peer ids (about 40 bytes each): room for groups of over a thousand
PUSH_HEADER_MAX = min(4 << 10, MAX_HEADER)  # a push header: group id, kind, round, size, hash and MAC


def zstd_bound(n: int) -> int:
    """The most bytes zstd turns ``n`` bytes into (``ZSTD_COMPRESSBOUND``), plus room for a frame header."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 32


def payload_sizes(payload, largest: int) -> tuple[int, int, bool]:
    """(least, most, exact) bytes of a payload of the same tensor and codec as ``payload``.

    ``payload``: this peer's own payload for the round (a loco wire payload, possibly behind the collective's
    8-byte weight). A codec chain without zstd gives one exact size; with zstd, the header and at most the
    uncompressed sections plus zstd's worst case. A wire payload of another format (an optimizer's own chain)
    is bounded by its own size when it carries values (the same layout on every peer). Anything else: up to
    ``largest`` (no size can be derived).
    """
    view = memoryview(payload).cast("B") if not isinstance(payload, (bytes, bytearray)) else memoryview(payload)
    for prefix in (0, WEIGHT_PREFIX):
        if bytes(view[prefix:prefix + len(wire.MAGIC)]) != wire.MAGIC:
            continue
        try:
            header = wire.parse_header(view[prefix:], max_numel=1 << 62)
        except wire.CorruptPayload:
            continue
        head = prefix + header.offset
        try:
            codec = Codec(header.chain, max_numel=max(1, header.numel))
        except (CodecSpecError, ValueError):
            if header.numel > 0:
                return head, len(view), False
            break
        if codec.spec.topk_tile:  # its sizes follow the tensors' shapes, which every member shares: as this one's
            if codec.spec.zstd_level is None:
                return len(view), len(view), True
            return head, head + zstd_bound(8 * header.numel), False  # 8 bytes a value bound any chain's sections
        raw = codec.payload_bytes(header.numel)
        if codec.spec.zstd_level is None:
            return head + raw, head + raw, True
        return head, head + zstd_bound(raw), False
    return 0, largest, False


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
