"""What the modules of the hivemind transport share: the logger, the stream framing and the DHT clock."""

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


async def _read_framed(reader, limit: int, timeout: float) -> tuple[dict, bytes]:
    """One message that :func:`_write_framed` wrote: (header, data), the data at most ``limit`` bytes."""
    from hivemind.utils.serializer import MSGPackSerializer

    hlen = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 10), "big")
    if hlen > MAX_HEADER:
        raise ValueError(f"header of {hlen} bytes")
    header = MSGPackSerializer.loads(await asyncio.wait_for(reader.readexactly(hlen), 10))
    n = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 10), "big")
    if not isinstance(header, dict) or n != header.get("n") or n > limit:
        raise ValueError(f"payload of {n} bytes (limit {limit})")
    return header, await asyncio.wait_for(reader.readexactly(n), timeout)


def _now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()
