"""Large host byte buffers reused once nobody holds them: the byte collectives' send and receive buffers
(torch_dist) and the codecs' output buffers are taken from such pools."""

from __future__ import annotations

import sys
import threading


class BufferPool:
    """Large byte buffers, written again once nobody holds them: pages of a buffer this large come fresh from
    the OS each time otherwise, and faulting them in cost more than the copy into them.

    ``take(n)`` gives ``n`` bytes: a released buffer of exactly that size, or a view of the first ``n`` bytes
    of a released one up to twice as large, or a new ``bytearray`` (kept in place of a released one when the
    pool is full). A buffer counts as held while any variable, view or tensor refers to it, which its
    reference count tells; below ``min_bytes`` every take is a new ``bytearray``.
    """

    def __init__(self, min_bytes: int = 1 << 20, keep: int = 4) -> None:
        self.min_bytes, self.keep = min_bytes, keep
        self._bufs: list[bytearray] = []
        self._lock = threading.Lock()

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._bufs[i]) == 2  # the list's reference and getrefcount's argument

    def take(self, n: int) -> bytearray | memoryview:
        if n < self.min_bytes:
            return bytearray(n)
        with self._lock:
            free = [i for i in range(len(self._bufs)) if self._free(i)]
            fits = sorted((len(self._bufs[i]), i) for i in free if n <= len(self._bufs[i]) <= 2 * n)
            if fits:
                buf = self._bufs[fits[0][1]]
                return buf if len(buf) == n else memoryview(buf)[:n]
            buf = bytearray(n)
            if len(self._bufs) >= self.keep and free:
                del self._bufs[min(free, key=lambda i: len(self._bufs[i]))]
            if len(self._bufs) < self.keep:
                self._bufs.append(buf)
            return buf
