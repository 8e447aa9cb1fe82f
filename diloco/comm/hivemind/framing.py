"""What the phases of a swarm peer share: the logger, the stream framing and the DHT clock.

A framed message is ``u64 len | msgpack header | u64 n | n bytes``. A receiver reads it in two steps: the
header (:func:`read_header`, at most ``MAX_HEADER`` bytes), which it checks (who sent it, for which round and
group, its MAC, whether ``n`` is a size this run's payloads can have), and only then the body
(:func:`read_body`). A refused header costs the receiver the header's bytes, never the body's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Union

log = logging.getLogger("loco.hivemind")

OK, FAIL = b"\x01", b"\x00"
UNREACHED = b"\x02"  # a relaying member's answer when it could not reach the receiver (FAIL: it refused)
MAX_HEADER = 64 << 10
PIECE = 1 << 20  # bodies are written, read and relayed in pieces of at most this many bytes


def write_head(writer, header: dict, n: int) -> None:
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


async def write_framed(writer, header: dict, data: bytes) -> None:
    """``u64 len | msgpack header | u64 len | data``, the data in slices of :data:`PIECE` (what ``read_framed``
    reads)."""
    write_head(writer, header, len(data))
    view = memoryview(data)
    for off in range(0, len(view), PIECE):
        writer.write(view[off:off + PIECE])
        await writer.drain()
    await writer.drain()


async def read_header(reader, max_header: int = MAX_HEADER, timeout: float = 10) -> tuple[dict, int]:
    """The header of one framed message and the body size it announces; the body is left unread."""
    hlen = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
    if hlen > max_header:
        raise ValueError(f"header of {hlen} bytes (at most {max_header})")
    header = unpack(await asyncio.wait_for(reader.readexactly(hlen), timeout))
    n = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
    if not isinstance(header, dict) or n != header.get("n"):
        raise ValueError(f"a header that does not announce the {n} bytes that follow it")
    return header, n


async def read_body(reader, n: int, timeout: float) -> bytearray:
    """The ``n`` body bytes after a header :func:`read_header` read (and the caller accepted), within
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


async def read_framed(reader, limit: int, timeout: Union[float, Callable[[int], float]],
                       header_timeout: float = 10) -> tuple[dict, bytearray]:
    """One message that :func:`write_framed` wrote: (header, data), the data at most ``limit`` bytes.

    ``timeout`` bounds the body's read; a function of the body's size (read from the header first) lets a
    large body take longer than a small one. ``header_timeout`` bounds each read of the header (a reply the
    sender may hold back while it waits for something has to allow for that wait)."""
    header, n = await read_header(reader, timeout=header_timeout)
    if n > limit:
        raise ValueError(f"payload of {n} bytes (limit {limit})")
    return header, await read_body(reader, n, timeout(n) if callable(timeout) else timeout)


def dht_now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()
