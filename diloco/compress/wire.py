"""The wire format: a self-describing header in front of every encoded payload.

Layout (little-endian)::

    magic      4 bytes  b"LOCO"
    version    u8       FORMAT_VERSION
    dtype      u8       the tensor's dtype (what decode returns)
    ndim       u8       at most MAX_NDIM
    chain_len  u16      length of the codec chain string, at most MAX_CHAIN
    shape      ndim x u64
    chain      chain_len bytes, ASCII, the canonical chain (e.g. "topk:chunk=4096,k=82,ef=1+2bit:block=128+zstd:level=3")
    length     u64      payload bytes that follow the header
    checksum   u32      CRC-32 of everything before it and of the payload
    payload    length bytes

``parse_header`` checks all of it before anything the size of the tensor is
allocated, and raises :class:`CorruptPayload` (the one error a bad payload
raises) with what was wrong. ``tensor_bytes`` turns a payload section (a tensor)
into the bytes that go after the header.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"LOCO"
FORMAT_VERSION = 1
MAX_NDIM = 8
MAX_CHAIN = 512

DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.float64}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

_FIXED = struct.Struct("<4sBBBH")
_TAIL = struct.Struct("<QI")


class CorruptPayload(ValueError):
    """A payload that cannot be decoded: truncated, wrong magic/version/codec, bad sizes, checksum, indices or values."""


@dataclass(frozen=True)
class Header:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chain: str
    length: int
    offset: int  # where the payload starts

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (contiguous, on the CPU, in its own dtype); ``b""`` for an empty tensor."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def pack(payload: bytes, dtype: torch.dtype, shape: tuple[int, ...], chain: str) -> bytes:
    """Header + payload."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"cannot encode tensors of dtype {dtype} (supported: float32, float16, bfloat16, float64)")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"cannot encode a {len(shape)}-d tensor (at most {MAX_NDIM} dimensions)")
    chain_b = chain.encode("ascii")
    if len(chain_b) > MAX_CHAIN:
        raise ValueError(f"codec chain longer than {MAX_CHAIN} characters")
    head = (_FIXED.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), len(chain_b))
            + struct.pack(f"<{len(shape)}Q", *shape) + chain_b)
    length = struct.pack("<Q", len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head + length))
    return b"".join((head, length, struct.pack("<I", crc), payload))


def parse_header(data: bytes | bytearray | memoryview, max_numel: int) -> Header:
    """Validate the header, the length and the checksum of ``data``; nothing large is allocated."""
    view = memoryview(data)
    if len(view) < _FIXED.size:
        raise CorruptPayload(f"truncated payload: {len(view)} bytes is shorter than the {_FIXED.size}-byte header")
    magic, version, dtype_code, ndim, chain_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptPayload(f"wrong magic {bytes(magic)!r} (expected {MAGIC!r}): not a loco payload")
    if version != FORMAT_VERSION:
        raise CorruptPayload(f"wire format version {version}, this build reads version {FORMAT_VERSION}")
    if dtype_code not in DTYPES:
        raise CorruptPayload(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise CorruptPayload(f"{ndim} dimensions (at most {MAX_NDIM})")
    if chain_len > MAX_CHAIN:
        raise CorruptPayload(f"codec chain of {chain_len} bytes (at most {MAX_CHAIN})")
    pos = _FIXED.size
    need = pos + 8 * ndim + chain_len + _TAIL.size
    if len(view) < need:
        raise CorruptPayload(f"truncated payload: {len(view)} bytes, the header alone needs {need}")
    shape = struct.unpack_from(f"<{ndim}Q", view, pos)
    pos += 8 * ndim
    try:
        chain = bytes(view[pos:pos + chain_len]).decode("ascii")
    except UnicodeDecodeError:
        raise CorruptPayload("codec chain is not ASCII") from None
    pos += chain_len
    length, crc = _TAIL.unpack_from(view, pos)
    numel = 1
    for s in shape:
        numel *= s
        if numel > max_numel:
            raise CorruptPayload(f"shape {tuple(shape)} is above the limit of {max_numel} elements")
    payload_at = pos + _TAIL.size
    if len(view) - payload_at != length:
        raise CorruptPayload(f"payload length: the header declares {length} bytes, {len(view) - payload_at} follow it")
    expect = zlib.crc32(view[payload_at:], zlib.crc32(view[:pos + 8]))
    if expect != crc:
        raise CorruptPayload("checksum mismatch: the payload was altered or truncated in transit")
    return Header(DTYPES[dtype_code], tuple(int(s) for s in shape), chain, int(length), payload_at)
