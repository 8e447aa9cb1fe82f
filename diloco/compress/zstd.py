"""The zstd stage of a codec chain: sections compressed (on all cores once they are large) and inflated, never
past what the chain needs for the header's shape, nor past the bomb bound where the caller did not fix the size."""

from __future__ import annotations

from typing import Optional

import zstandard

from diloco.compress.wire import CorruptPayload

ZSTD_MAX_RATIO = 256  # a zstd section of unvouched size may inflate at most this many times ...
ZSTD_FREE_BYTES = 1 << 20  # ... once it inflates to more than this
ZSTD_THREADS_ABOVE = 2 << 20  # zstd compresses sections larger than this on all cores (its multithreaded mode),
ZSTD_JOB_BYTES = 1 << 20  # in jobs of this size (zstd's default job is larger than most sections)


def threaded_zstd(level: int) -> zstandard.ZstdCompressor:
    """zstd on all cores, in jobs of ZSTD_JOB_BYTES (one frame, its size declared, as single-threaded)."""
    params = zstandard.ZstdCompressionParameters.from_level(level, threads=-1, job_size=ZSTD_JOB_BYTES)
    return zstandard.ZstdCompressor(compression_params=params)


def zstd_min_bytes(inflated: int) -> int:
    """Fewest compressed bytes that may carry ``inflated`` section bytes when the decoder is not told the size."""
    return 0 if inflated <= ZSTD_FREE_BYTES else -(-inflated // ZSTD_MAX_RATIO)


class Zstd:
    """One codec's zstd stage at ``level``."""

    def __init__(self, level: int) -> None:
        self.level = level
        self._single = zstandard.ZstdCompressor(level=level)
        self.threads: Optional[zstandard.ZstdCompressor] = None  # made at the first large section
        self._inflate = zstandard.ZstdDecompressor()

    def compress(self, data: memoryview) -> bytes:
        """``data`` as one frame that declares its size: on all cores above ``ZSTD_THREADS_ABOVE`` bytes."""
        zc = self._single
        if len(data) > ZSTD_THREADS_ABOVE:
            if self.threads is None:
                self.threads = threaded_zstd(self.level)
            zc = self.threads
        return zc.compress(data)

    def inflate(self, body: memoryview, expected: int, numel: int, vouched: bool) -> bytes:
        """The ``expected`` bytes of sections that ``body`` holds for ``numel`` values. ``vouched``: the caller
        fixed the number of values; otherwise ``body`` must be within the bomb bound."""
        if not vouched and len(body) < zstd_min_bytes(expected):
            raise CorruptPayload(
                f"zstd bomb: {numel} values need {expected} bytes from {len(body)} compressed bytes, more "
                f"than {ZSTD_MAX_RATIO}x (a decompression bomb, or a tensor that compresses that well: pass "
                f"expect_numel= to decode a tensor whose size you know)")
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as e:
            raise CorruptPayload(f"zstd frame: {e}") from None
        if declared not in (-1, expected):
            raise CorruptPayload(f"zstd frame declares {declared} bytes, the chain needs {expected}")
        try:
            raw = self._inflate.decompress(body, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise CorruptPayload(f"zstd: {e}") from None
        return raw
