"""What the modules of the hivemind transport share: the logger, the stream framing and the DHT clock.

A framed message is ``u64 len | msgpack header | u64 n | n bytes``. A receiver reads it in two steps: the
header (:func:`_read_header`, at most ``MAX_HEADER`` bytes), which it checks (who sent it, for which epoch and
group, its MAC, whether ``n`` is a size this run's payloads can have), and only then the body
(:func:`_read_body`). A refused header costs the receiver the header's bytes, never the body's.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("loco.hivemind")

OK, FAIL = b"\x01", b"\x00"
MAX_HEADER = 64 << 10


async def _write_framed(writer, header: dict, data: bytes) -> None:
    """``u64 len | msgpack header | u64 len | data``, the data in 1 MiB slices (what ``_read_framed`` reads)."""
    from hivemind.utils.serializer import MSGPackSerializer

    head = MSGPackSerializer.dumps(header)
    writer.write(len(head).to_bytes(8, "big") + head + len(data).to_bytes(8, "big"))
    view = memoryview(data)
    for off in range(0, len(view), 1 << 20):
        writer.write(view[off:off + (1 << 20)])
        await writer.drain()
    await writer.drain()


async def _read_header(reader, max_header: int = MAX_HEADER, timeout: float = 10) -> tuple[dict, int]:
    """The header of one framed message and the body size it announces; the body is left unread."""
    from hivemind.utils.serializer import MSGPackSerializer

    hlen = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
    if hlen > max_header:
        raise ValueError(f"header of {hlen} bytes (at most {max_header})")
    header = MSGPackSerializer.loads(await asyncio.wait_for(reader.readexactly(hlen), timeout))
    n = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), timeout), "big")
    if not isinstance(header, dict) or n != header.get("n"):
        raise ValueError(f"a header that does not announce the {n} bytes that follow it")
    return header, n


async def _read_body(reader, n: int, timeout: float) -> bytes:
    """The ``n`` body bytes after a header :func:`_read_header` read (and the caller accepted)."""
    return await asyncio.wait_for(reader.readexactly(n), timeout)


async def _read_framed(reader, limit: int, timeout: float) -> tuple[dict, bytes]:
    """One message that :func:`_write_framed` wrote: (header, data), the data at most ``limit`` bytes."""
    header, n = await _read_header(reader)
    if n > limit:
        raise ValueError(f"payload of {n} bytes (limit {limit})")
    return header, await _read_body(reader, n, timeout)


def _now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()
