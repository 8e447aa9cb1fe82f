"""The wire format: a self-describing header in front of every encoded payload.

Layout (little-endian)::

    magic      4 bytes  b"LOCO"
    version    u8       FORMAT_VERSION
    dtype      u8       the tensor's dtype (what decode returns)
    ndim       u8       at most MAX_NDIM
    chain_len  u16      length of the codec chain string, at most MAX_CHAIN
    shape      ndim x u64
    chain      chain_len bytes, ASCII, the canonical chain (e.g. "topk:chunk=4096,k=82,ef=1+2bit:block=128+zstd:level=3")
    pad        zero bytes up to a multiple of 8, so the payload starts 8-byte aligned
    length     u64      payload bytes that follow the header
    checksum   u64      XXH3-64 (seed 0) of everything before it, then of the payload's piece digests
    payload    length bytes

The payload is hashed in pieces of :data:`HASH_PIECE` bytes (4 MiB; the last may be
shorter, an empty payload has none): each piece's XXH3-64 in its canonical 8-byte
form, those digests in order after the header bytes. Pieces hash independently, so
a large payload is checked on several cores at once (``xxhash`` releases the GIL).

``parse_header`` checks all of it before anything the size of the tensor is
allocated, and raises :class:`CorruptPayload` (the one error a bad payload
raises) with what was wrong. The checksum is XXH3 (the ``xxhash`` package), fed
views of the header and the payload, so neither is copied to be hashed; one core
runs it at 7 to 8 GB/s, so payloads of several pieces spread it over threads.

Encoders that build a payload in place (the codecs) reserve :func:`header_size`
bytes, write the payload after them, then call :func:`write_header`, which
fills in the header and the checksum. :func:`pack` does the same for a payload
that already exists as bytes. ``tensor_bytes`` turns a payload section (a
tensor) into the bytes that go after the header.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

MAGIC = b"LOCO"
FORMAT_VERSION = 3  # 3: the payload hashed in pieces
MAX_NDIM = 8
MAX_CHAIN = 512
ALIGN = 8  # the payload starts at a multiple of this from the start of the header
HASH_PIECE = 1 << 22  # the checksum hashes the payload in pieces of this many bytes
HASH_THREADS = 8  # at most this many threads hash the pieces of one large payload

DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16, 3: torch.float64}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

_FIXED = struct.Struct("<4sBBBH")
_TAIL = struct.Struct("<QQ")  # length, checksum


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


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_size(ndim: int, chain: str) -> int:
    """Bytes of the header in front of a payload (a multiple of :data:`ALIGN`)."""
    return _padded(_FIXED.size + 8 * ndim + len(chain)) + _TAIL.size


_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """The threads that hash pieces, made at first use (and again in a forked child, whose copy has none)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(min(HASH_THREADS, os.cpu_count() or 1), "loco-hash"))
        return _pool[1]


class Checksum:
    """The running checksum of one payload: built with the header's bytes, fed the payload in order, in views of
    any size (as it is written, while it is in cache); :meth:`intdigest` at any point.

    Whole pieces that arrive together (two or more) are hashed on the pool's threads.
    """

    def __init__(self, head: bytes | bytearray | memoryview) -> None:
        self._head = bytes(head)
        self._digests = bytearray()
        self._piece = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if self._fill:  # finish the piece under way
            take = min(len(view), HASH_PIECE - self._fill)
            self._piece.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == HASH_PIECE:
                self._digests += self._piece.digest()
                self._piece, self._fill = xxhash.xxh3_64(), 0
        whole = len(view) // HASH_PIECE
        if whole:
            pieces = [view[i * HASH_PIECE:(i + 1) * HASH_PIECE] for i in range(whole)]
            digest = xxhash.xxh3_64_digest
            digests = _hash_pool().map(digest, pieces) if whole > 1 else map(digest, pieces)
            for d in digests:
                self._digests += d
            view = view[whole * HASH_PIECE:]
        if len(view):
            self._piece.update(view)
            self._fill += len(view)

    def intdigest(self) -> int:
        h = xxhash.xxh3_64(self._head)
        h.update(self._digests)
        if self._fill:
            h.update(self._piece.digest())
        return h.intdigest()


def checksum(head: memoryview, payload: memoryview) -> int:
    """The checksum of the header bytes ``head`` and ``payload`` (see the module's docstring)."""
    h = Checksum(head)
    if len(payload):
        h.update(payload)
    return h.intdigest()


def check_encodable(dtype: torch.dtype, shape: tuple[int, ...], chain: str) -> bytes:
    """The chain as ASCII bytes; ValueError for a dtype, a number of dimensions or a chain the header cannot hold."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"cannot encode tensors of dtype {dtype} (supported: float32, float16, bfloat16, float64)")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"cannot encode a {len(shape)}-d tensor (at most {MAX_NDIM} dimensions)")
    chain_b = chain.encode("ascii")
    if len(chain_b) > MAX_CHAIN:
        raise ValueError(f"codec chain longer than {MAX_CHAIN} characters")
    return chain_b


def begin_header(buf: bytearray | memoryview, start: int, dtype: torch.dtype, shape: tuple[int, ...], chain: str,
                 length: int) -> Checksum:
    """Write the header at ``buf[start:]`` for the ``length`` payload bytes that follow it, all but the checksum.

    Returns the checksum's running hash, already fed with the header: feed it the payload, in order (as it is
    written, while it is in cache), then :func:`seal` the header with it.
    """
    chain_b = check_encodable(dtype, shape, chain)
    view = memoryview(buf)
    size = header_size(len(shape), chain)
    if len(view) - start - size != length:
        raise ValueError(f"buffer of {len(view)} bytes does not hold a {size}-byte header at {start} and {length} "
                         "payload bytes")
    _FIXED.pack_into(view, start, MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], len(shape), len(chain_b))
    pos = start + _FIXED.size
    struct.pack_into(f"<{len(shape)}Q", view, pos, *shape)
    pos += 8 * len(shape)
    view[pos:pos + len(chain_b)] = chain_b
    pos += len(chain_b)
    tail = start + size - _TAIL.size
    view[pos:tail] = bytes(tail - pos)
    struct.pack_into("<Q", view, tail, length)
    return Checksum(view[start:tail + 8])


def seal(buf: bytearray | memoryview, start: int, ndim: int, chain: str, h: Checksum) -> None:
    """Write the checksum ``h`` (see :func:`begin_header`) into the header at ``buf[start:]``."""
    struct.pack_into("<Q", buf, start + header_size(ndim, chain) - 8, h.intdigest())


def write_header(buf: bytearray | memoryview, start: int, dtype: torch.dtype, shape: tuple[int, ...], chain: str,
                 length: int) -> int:
    """Write the header at ``buf[start:]`` for the ``length`` payload bytes that follow it there, checksum included.

    The payload must already be in place (it is hashed). Returns the header's size.
    """
    h = begin_header(buf, start, dtype, shape, chain, length)
    size = header_size(len(shape), chain)
    if length:
        h.update(memoryview(buf)[start + size:])
    seal(buf, start, len(shape), chain, h)
    return size


def pack(payload: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...], chain: str) -> bytearray:
    """Header + payload, in one buffer (the payload is copied once, into place)."""
    check_encodable(dtype, shape, chain)
    body = memoryview(payload).cast("B") if not isinstance(payload, (bytes, bytearray)) else payload
    size = header_size(len(shape), chain)
    out = bytearray(size + len(body))
    out[size:] = body
    write_header(out, 0, dtype, shape, chain, len(body))
    return out


def tensor_view(buf: bytes | bytearray | memoryview, start: int = 0, stop: int | None = None,
                dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``buf[start:stop]`` as a CPU tensor of ``dtype`` over the same memory (no copy; read-only buffers too, which
    must then only be read)."""
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    mv = mv[start:stop]
    if not len(mv):
        return torch.empty(0, dtype=dtype)
    if mv.readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` (contiguous, on the CPU, in its own dtype); ``b""`` for an empty tensor."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def parse_header(data: bytes | bytearray | memoryview, max_numel: int) -> Header:
    """Validate the header, the length and the checksum of ``data``; nothing large is allocated."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
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
    tail = _padded(pos + 8 * ndim + chain_len)
    payload_at = tail + _TAIL.size
    if len(view) < payload_at:
        raise CorruptPayload(f"truncated payload: {len(view)} bytes, the header alone needs {payload_at}")
    shape = struct.unpack_from(f"<{ndim}Q", view, pos)
    pos += 8 * ndim
    try:
        chain = bytes(view[pos:pos + chain_len]).decode("ascii")
    except UnicodeDecodeError:
        raise CorruptPayload("codec chain is not ASCII") from None
    pos += chain_len
    if any(view[pos:tail]):
        raise CorruptPayload("header padding is not zero")
    length, crc = _TAIL.unpack_from(view, tail)
    numel = 1
    for s in shape:
        if s > max_numel:  # each dimension too: (0, 2**63) has no elements but is no shape a tensor takes
            raise CorruptPayload(f"shape {tuple(shape)}: a dimension above the limit of {max_numel} elements")
        numel *= s
        if numel > max_numel:
            raise CorruptPayload(f"shape {tuple(shape)} is above the limit of {max_numel} elements")
    if len(view) - payload_at != length:
        raise CorruptPayload(f"payload length: the header declares {length} bytes, {len(view) - payload_at} follow it")
    if checksum(view[:tail + 8], view[payload_at:]) != crc:
        raise CorruptPayload("checksum mismatch: the payload was altered or truncated in transit")
    return Header(DTYPES[dtype_code], tuple(int(s) for s in shape), chain, int(length), payload_at)
