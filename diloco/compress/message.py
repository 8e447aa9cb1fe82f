"""One message of the weighted mean: the sender's weight (``<d``, 8 bytes) followed by the codec's self-describing
payload, in one buffer (the codec writes its payload behind the prefix it is given); and the sizes such messages
have, which the transport is handed as plain numbers (it knows bytes, not codecs)."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Optional, Sequence

from diloco.comm.base import PayloadBound
from diloco.compress import wire
from diloco.compress.wire import CorruptPayload

if TYPE_CHECKING:
    from diloco.compress.codec import Codec

WEIGHT = struct.Struct("<d")


def pack_weight(weight: float) -> bytes:
    return WEIGHT.pack(weight)


def _valid_weight(w: float) -> bool:
    return w >= 0 and w < float("inf")


def check_weight(weight: float) -> None:
    if not _valid_weight(weight):
        raise ValueError(f"the weight of a compressed all-reduce must be finite and >= 0, got {weight}")


def split_weight(msg: bytes | memoryview) -> tuple[float, memoryview]:
    """(weight, codec payload) of one message; a missing or invalid weight raises :class:`CorruptPayload`."""
    if len(msg) < WEIGHT.size:
        raise CorruptPayload(f"message of {len(msg)} bytes has no weight")
    (w,) = WEIGHT.unpack_from(msg, 0)
    if not _valid_weight(w):
        raise CorruptPayload(f"weight {w} is not finite and >= 0")
    return w, memoryview(msg)[WEIGHT.size:]


def message_size(codec: "Codec", numel: int, shapes: Optional[Sequence[Sequence[int]]] = None) -> int:
    """Bytes of the message of a 1-D piece of ``numel`` values (tensors of ``shapes`` end to end, for a chain
    with tiles): the weight, the wire header and the payload (with a zstd stage: the payload before zstd, which
    the values then shrink)."""
    return WEIGHT.size + wire.header_size(1, codec.chain) + codec.payload_bytes(numel, shapes)


def known_sizes(codec: "Codec", numels: Sequence[int],
                shapes: Optional[Sequence[Sequence[int]]] = None) -> Optional[list[int]]:
    """The message lengths of 1-D pieces of ``numels`` values, where the codec's sizes do not depend on the values
    (no zstd): every worker then knows what it will receive, and the transport needs no size exchange."""
    if codec.wire_size(1) is None:
        return None
    return [message_size(codec, n, shapes) for n in numels]


def zstd_bound(n: int) -> int:
    """The most bytes zstd turns ``n`` bytes into (``ZSTD_COMPRESSBOUND``), plus room for a frame header."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 32


def message_bound(codec: "Codec", numel: int, weighted: bool,
                  shapes: Optional[Sequence[Sequence[int]]] = None) -> PayloadBound:
    """The lengths every member's message of a 1-D piece of ``numel`` values has, where the members share the
    codec and the tensors (``shapes``, for a chain with tiles): members of one run share model and codec, so this
    member's own message says what the others' must be. ``weighted``: the weight in front of each.

    Without a zstd stage the length is exact; with one it varies with the values, from the header alone up to
    the uncompressed sections plus zstd's worst case (a chain with tiles: at most 8 bytes a value, a bound on any
    chain's sections)."""
    head = (WEIGHT.size if weighted else 0) + wire.header_size(1, codec.chain)
    if codec.spec.zstd_level is None:
        exact = head + codec.payload_bytes(numel, shapes)
        return PayloadBound(exact, exact, True)
    raw = 8 * numel if codec.spec.topk_tile else codec.payload_bytes(numel)
    return PayloadBound(head, head + zstd_bound(raw), False)
