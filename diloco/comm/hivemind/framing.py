"""What the modules of the hivemind transport share: the logger, the stream framing, the DHT clock and the
deadlines a peer derives from what it measures.

A framed message is ``u64 len | msgpack header | u64 n | n bytes``. A receiver reads it in two steps: the
header (:func:`_read_header`, at most ``MAX_HEADER`` bytes), which it checks (who sent it, for which epoch and
group, its MAC, whether ``n`` is a size this run's payloads can have), and only then the body
(:func:`_read_body`). A refused header costs the receiver the header's bytes, never the body's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import deque
from typing import Any, Callable, Optional, Union

log = logging.getLogger("loco.hivemind")

OK, FAIL = b"\x01", b"\x00"
UNREACHED = b"\x02"  # a relaying member's answer when it could not reach the receiver (FAIL: it refused)
MAX_HEADER = 64 << 10
PIECE = 1 << 20  # bodies are written, read and relayed in pieces of at most this many bytes


def _write_head(writer, header: dict, n: int) -> None:
    """The start of a frame: ``u64 len | msgpack header | u64 n``; ``n`` body bytes follow."""
    head = pack(header)
    writer.write(len(head).to_bytes(8, "big") + head + n.to_bytes(8, "big"))


def pack(obj: Any) -> bytes:
    """``obj`` (dicts, lists, numbers, str, bytes) as msgpack, without extension types: what :func:`unpack` reads
    (the same bytes hivemind's MSGPackSerializer writes for these)."""
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def _no_extension(code: int, data: bytes) -> Any:
    raise ValueError(f"a msgpack extension (type {code}) where none is sent")


def unpack(buf: bytes | bytearray | memoryview) -> Any:
    """msgpack from a peer, refusing extension types (ValueError). hivemind's MSGPackSerializer decodes every
    nested tuple extension with another ``unpackb`` on the C stack: a 1 KB header nesting 250 of them overflows
    it, a segfault that no ``except`` catches, sent before any MAC is checked."""
    import msgpack

    try:
        return msgpack.unpackb(bytes(buf), raw=False, ext_hook=_no_extension, strict_map_key=False)
    except ValueError:
        raise
    except Exception as e:  # msgpack's ExtraData, FormatError, StackError (too deep), ...
        raise ValueError(f"not a message: {type(e).__name__}: {e}") from None


async def _write_framed(writer, header: dict, data: bytes) -> None:
    """``u64 len | msgpack header | u64 len | data``, the data in slices of :data:`PIECE` (what ``_read_framed``
    reads)."""
    _write_head(writer, header, len(data))
    view = memoryview(data)
    for off in range(0, len(view), PIECE):
        writer.write(view[off:off + PIECE])
        await writer.drain()
    await writer.drain()


async def _read_header(reader, max_header: int = MAX_HEADER, timeout: float = 10) -> tuple[dict, int]:
    """The header of one framed message and the body size it announces; the body is left unread."""
    hlen = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
    if hlen > max_header:
        raise ValueError(f"header of {hlen} bytes (at most {max_header})")
    header = unpack(await asyncio.wait_for(reader.readexactly(hlen), timeout))
    n = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
    if not isinstance(header, dict) or n != header.get("n"):
        raise ValueError(f"a header that does not announce the {n} bytes that follow it")
    return header, n


async def _read_body(reader, n: int, timeout: float) -> bytearray:
    """The ``n`` body bytes after a header :func:`_read_header` read (and the caller accepted), within
    ``timeout`` seconds in all.

    They are read in pieces (:data:`PIECE`) into one buffer of ``n`` bytes, so a body costs its own size while it arrives.
    ``readexactly(n)`` would let the stream's buffer grow to all ``n`` bytes and then copy them out: twice the
    body at once, for every push being received (three members pushing 1 GB payloads: 6 GB).
    """
    async def pieces() -> bytearray:
        body = bytearray(n)
        view, off = memoryview(body), 0
        while off < n:
            piece = await reader.read(min(n - off, PIECE))
            if not piece:
                raise ConnectionError(f"the stream ended after {off} of the {n} bytes its header announced")
            view[off:off + len(piece)] = piece
            off += len(piece)
        return body

    return await asyncio.wait_for(pieces(), timeout)


async def _read_framed(reader, limit: int, timeout: Union[float, Callable[[int], float]],
                       header_timeout: float = 10) -> tuple[dict, bytearray]:
    """One message that :func:`_write_framed` wrote: (header, data), the data at most ``limit`` bytes.

    ``timeout`` bounds the body's read; a function of the body's size (read from the header first) lets a
    large body take longer than a small one. ``header_timeout`` bounds each read of the header (a reply the
    sender may hold back while it waits for something has to allow for that wait)."""
    header, n = await _read_header(reader, timeout=header_timeout)
    if n > limit:
        raise ValueError(f"payload of {n} bytes (limit {limit})")
    return header, await _read_body(reader, n, timeout(n) if callable(timeout) else timeout)


def _now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()


# ---- deadlines ------------------------------------------------------------------------------------------------
# A peer measures how fast its exchanges move bytes and how long its groups take to form, and derives its
# deadlines from that: a fixed 60 s is too short for multi-GB payloads over home links and far too long to
# notice a dead member among fast ones. Every deadline is ``margin x`` what the measurements predict, clamped.
#
# The exchange: margin 3 lets a round run three times slower than the recent median (a congested link, a busy
# peer) before a member is left out. The floor, 10 s, is where stream set-up, the DHT and scheduling dominate,
# not bytes: a shorter deadline would drop healthy members of a fast group for a hiccup. The ceiling, 600 s,
# is where a member ten minutes late is far likelier gone than slow, and the whole group waits for it. Before
# any measurement, the deadline is 60 s, as when it was a constant.
EXCHANGE_MARGIN = 3.0
EXCHANGE_FLOOR_S = 10.0
EXCHANGE_CEILING_S = 600.0
EXCHANGE_DEFAULT_S = 60.0
LATENCY_PER_MEMBER_S = 0.5  # per other member: opening its stream, round trips (relays add some), its answer
# The state download (a new or out-of-step peer's only way in): a failed download costs a whole retry, so its
# floor is the 120 s it always had and its ceiling an hour. Before this peer has measured anything, a link of
# 1 MB/s is assumed: a 4 GB state then has the hour, where 120 s failed it on any home link.
STATE_MARGIN = 3.0
STATE_FLOOR_S = 120.0
STATE_CEILING_S = 3600.0
ASSUMED_BYTES_PER_S = 1e6
# The matchmaking window (--matchmaking-time auto): margin x how long recent complete groups took to form,
# at least the 5 s default (hivemind's matchmaking needs a few DHT round trips), at most a minute.
MATCHMAKING_MARGIN = 3.0
MATCHMAKING_FLOOR_S = 5.0
MATCHMAKING_CEILING_S = 60.0
# Measurements: the median of the last few, so that one slow round neither stretches nor one fast round
# shrinks the next deadline. A round that moved less than MIN_MEASURED_BYTES measures latency, not throughput
# (its rate would be far too low to predict a large payload's time), and is not counted.
PACE_WINDOW = 5
MIN_MEASURED_BYTES = 256 << 10

AUTO = "auto"


def seconds_or_auto(value: Union[float, int, str, None], name: str) -> Optional[float]:
    """A deadline setting: None for ``auto`` (or None), else positive seconds. ``name`` goes in the error."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds or {AUTO!r}, got {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a positive number of seconds or {AUTO!r}, got {value!r}")
    return seconds


def clamp(x: float, floor: float, ceiling: float) -> float:
    return min(ceiling, max(floor, x))


def exchange_deadline(expected_bytes: float, rate: Optional[float], others: int) -> float:
    """How long a peer waits for its group's payloads: ``expected_bytes`` (what it sends and receives) at the
    measured ``rate`` (bytes/s, both directions counted, as measured), plus a latency allowance per other
    member, times the margin, clamped. Without a measurement: the old constant."""
    if not rate or rate <= 0:
        return EXCHANGE_DEFAULT_S
    expected_s = expected_bytes / rate + LATENCY_PER_MEMBER_S * max(others, 1)
    return clamp(EXCHANGE_MARGIN * expected_s, EXCHANGE_FLOOR_S, EXCHANGE_CEILING_S)


def state_timeout(nbytes: float, rate: Optional[float]) -> float:
    """How long a state download of ``nbytes`` may take. ``rate`` is the exchange's measured rate, which counts
    both directions; a download moves bytes one way, so half of it is assumed (on a link that sends and
    receives at once, half is what one direction gets). Unknown: :data:`ASSUMED_BYTES_PER_S`."""
    one_way = rate / 2 if rate and rate > 0 else ASSUMED_BYTES_PER_S
    return clamp(STATE_MARGIN * nbytes / one_way, STATE_FLOOR_S, STATE_CEILING_S)


def matchmaking_window(forming_s: Optional[float]) -> float:
    """The matchmaking window from how long recent complete groups took to form (None: none yet)."""
    if forming_s is None:
        return MATCHMAKING_FLOOR_S
    return clamp(MATCHMAKING_MARGIN * forming_s, MATCHMAKING_FLOOR_S, MATCHMAKING_CEILING_S)


class Pace:
    """The last :data:`PACE_WINDOW` measurements of one quantity; their median is what deadlines follow."""

    def __init__(self, window: int = PACE_WINDOW) -> None:
        self.seen: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if value > 0 and math.isfinite(value):
            self.seen.append(float(value))

    def median(self) -> Optional[float]:
        return statistics.median(self.seen) if self.seen else None
