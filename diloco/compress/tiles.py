"""Top-k chunks cut per tensor (``topk:...,tile=S``), as the published SparseLoCo cuts them.

A flat vector that is several tensors laid end to end (``shapes``, in order) is chunked tensor by tensor:

* a tensor is seen as a matrix of ``rows = prod(shape[:-1])`` by ``cols = shape[-1]`` (a vector is one row, a
  scalar one value) and cut into tiles of ``s1 x s2``, each side the largest divisor of its dimension that is at
  most ``S`` (the reference's rule: 64 x 64 tiles for a matrix whose sides are multiples of 64, chunks of 64 for
  such a vector, 50-wide tiles for a side of 100, 1-wide ones for a prime side);
* a tile of ``L`` values keeps ``k_L = clamp(floor(k L / chunk + 1/2), 1, L)`` values, the chain's k scaled to
  its length (``chunk = S x S``), so every tensor sends about the same share.

Values are sent class by class, a class being the tensors whose tiles have the same ``(L, k_L)`` (classes in
the order their first tensor comes, a class's tensors in order), each tensor tile by tile (tiles in row-major
order, a tile's values row-major inside it), each tile's indices relative to it and ascending; an index takes
``bits_for(largest L)`` bits (12 for 4096).

The selection works on the vector permuted into that order (strided copies, tensor by tensor), where each class
is one :class:`Segment` of equal chunks: the flat top-k of :mod:`diloco.compress.kernels.topk` runs on it
unchanged. The codec keeps a key's error-feedback residual in the tiles' order between encodes, and hands it out in
the vector's own layout (so checkpoints and resharding do not see the tiles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from diloco.compress.bits import bits_for
from diloco.compress.checked import chunk_indices_bad
from diloco.compress.chunks import largest_divisor_at_most
from diloco.compress.kernels import topk as tk


@dataclass(frozen=True)
class Segment:
    start: int  # in the permuted vector
    chunks: int
    length: int  # values a chunk
    k: int  # values kept a chunk

    @property
    def end(self) -> int:
        return self.start + self.chunks * self.length

    @property
    def count(self) -> int:
        return self.chunks * self.k


def kept(k: int, length: int, chunk: int) -> int:
    """Values kept of a tile of ``length`` values: k per ``chunk`` scaled to it, rounded half up, at least 1."""
    return min(length, max(1, (2 * k * length + chunk) // (2 * chunk)))


def tile_of(shape: Sequence[int], side: int) -> tuple[int, int, int, int]:
    """(rows, cols, s1, s2) of a tensor of ``shape`` cut into tiles of at most ``side`` a side."""
    rows = math.prod(shape[:-1]) if len(shape) else 1
    cols = shape[-1] if len(shape) else 1
    return rows, cols, largest_divisor_at_most(rows, side), largest_divisor_at_most(cols, side)


class Tiling:
    """The chunks of one flat vector of tensors of ``shapes``: its segments, and per kept value where its tile lies
    (built once, on first use on a device)."""

    def __init__(self, shapes: Sequence[Sequence[int]], side: int, chunk: int, k: int) -> None:
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.numel = sum(math.prod(s) for s in self.shapes)
        classes: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}  # (L, k_L) -> tensors, in order
        offset = 0
        for shape in self.shapes:
            n = math.prod(shape)
            if n:
                rows, cols, s1, s2 = tile_of(shape, side)
                classes.setdefault((s1 * s2, kept(k, s1 * s2, chunk)), []).append((offset, rows, cols, s1, s2))
            offset += n
        # the permuted vector: class by class, each class's tensors in model order, each tensor tile by tile
        self._cuts: list[tuple[int, int, int, int, int, int]] = []  # (offset, its start permuted, rows, cols, s1, s2)
        self.segments: list[Segment] = []
        start = 0
        for (length, kk), tensors in classes.items():
            size = sum(rows * cols for _, rows, cols, _, _ in tensors)
            self.segments.append(Segment(start, size // length, length, kk))
            for offset, rows, cols, s1, s2 in tensors:
                self._cuts.append((offset, start, rows, cols, s1, s2))
                start += rows * cols
        self.count = sum(s.count for s in self.segments)
        # nothing moves where every tensor's tiles are whole rows read in order and the classes keep model order
        self.in_order = all(offset == start and (s1 == 1 or s2 == cols)
                            for offset, start, _, cols, s1, s2 in self._cuts)
        self.index_bits = bits_for(max((s.length for s in self.segments), default=1))
        self.pow2_widths = all(not s2 & (s2 - 1) for *_, s2 in self._cuts)  # a shift, not a division, finds a row
        self._tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _moves(self, flat: torch.Tensor, permuted: torch.Tensor):
        """Per tensor, (its values in ``flat`` as tiles, the same tiles in ``permuted``): views of equal shape."""
        for offset, start, rows, cols, s1, s2 in self._cuts:
            n = rows * cols
            yield (flat[offset:offset + n].view(rows // s1, s1, cols // s2, s2).permute(0, 2, 1, 3),
                   permuted[start:start + n].view(rows // s1, cols // s2, s1, s2))

    def permuted(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` in the tiles' order (a new tensor; ``flat`` itself where that order is its own)."""
        if self.in_order:
            return flat
        out = torch.empty_like(flat)
        for a, b in self._moves(flat, out):
            b.copy_(a)
        return out

    def unpermuted(self, permuted: torch.Tensor) -> torch.Tensor:
        """A vector in the tiles' order back in its own (a new tensor)."""
        out = torch.empty_like(permuted)
        for a, b in self._moves(out, permuted):
            a.copy_(b)
        return out

    def topk(self, x: torch.Tensor, residual: Optional[torch.Tensor],
             decay: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices relative to their tiles, values) of ``x`` (flat fp32), as the flat top-k
        (:func:`~diloco.compress.kernels.topk.topk_chunks`) selects from each segment of the tiles' order.

        With a ``residual`` (kept in the tiles' order) the sum ``decay * residual + x`` is made in the residual
        itself, reading ``x`` through strided views of its tiles, so nothing else is copied; the kept values
        then leave it. Without one, ``x`` is permuted into a copy first."""
        if residual is not None:
            for a, b in self._moves(x, residual):
                if decay != 1.0:
                    b.mul_(decay)
                b.add_(a)  # two roundings, as the flat top-k's accumulate
            acc = residual
        else:
            acc = self.permuted(x)
        idx, values = [], []
        for seg in self.segments:
            pow2 = seg.length >= 2 and not seg.length & (seg.length - 1)  # the kernel's chunks; others: the reference
            select = tk.topk_chunks if pow2 else tk.topk_chunks_ref
            i, v = select(acc[seg.start:seg.end], seg.length, seg.k)
            idx.append(i)
            values.append(v)
        if not idx:
            return torch.zeros(0, dtype=torch.int32, device=x.device), x.new_zeros(0)
        idx, values = torch.cat(idx), torch.cat(values)
        if residual is not None:
            residual[self.permuted_positions(idx)] = 0.0  # what was sent leaves the residual; the rest waits there
        return idx, values

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per kept value: the position of its tile's first value in the vector, how much farther apart its tile's
        rows lie there than in the tile (``cols - s2``), the tile's width (its log2 where every width is a power
        of two, so that a shift finds the row), and where its tile starts in the tiles' order."""
        if device not in self._tables:
            origin, gap, width, base = [], [], [], []
            for offset, start, rows, cols, s1, s2 in self._cuts:
                seg = next(s for s in self.segments if s.start <= start < s.end)
                tiles = torch.arange((rows // s1) * (cols // s2))
                at = offset + tiles // (cols // s2) * s1 * cols + tiles % (cols // s2) * s2
                n = tiles.numel() * seg.k
                origin.append(at.repeat_interleave(seg.k))
                gap.append(torch.full((n,), cols - s2, dtype=torch.int64))
                width.append(torch.full((n,), s2.bit_length() - 1 if self.pow2_widths else s2, dtype=torch.int64))
                base.append((start + tiles * seg.length).repeat_interleave(seg.k))
            empty = torch.zeros(0, dtype=torch.int64)
            self._tables[device] = tuple(torch.cat(t).to(device) if t else empty.to(device)
                                         for t in (origin, gap, width, base))
        return self._tables[device]

    def bad(self, idx: torch.Tensor) -> bool:
        """Whether received indices ``idx`` (relative to their tiles) leave a tile or fail to increase inside it
        (one host sync). A segment's indices are a matrix of a row per tile."""
        flags, at = [], 0
        for seg in self.segments:
            rows = idx[at:at + seg.count].view(seg.chunks, seg.k)
            at += seg.count
            flags.append(chunk_indices_bad(rows, seg.length))
        return bool(torch.stack(flags).any().item()) if flags else False

    def positions(self, idx: torch.Tensor) -> torch.Tensor:
        """The vector positions (int64) of the kept values whose indices, relative to their tile, are ``idx``:
        a value in row ``i`` of its tile lies ``i x (cols - s2)`` past where the tile's own order would put it."""
        origin, gap, width, _ = self._tables_on(idx.device)
        row = idx >> width if self.pow2_widths else torch.div(idx, width, rounding_mode="floor")  # int64
        return row.mul_(gap).add_(idx).add_(origin)  # in place: each fresh tensor of this size costs page faults

    def permuted_positions(self, idx: torch.Tensor) -> torch.Tensor:
        """The same kept values' positions in the tiles' order (int64)."""
        return self._tables_on(idx.device)[-1] + idx  # int64, whatever the indices' integer type
