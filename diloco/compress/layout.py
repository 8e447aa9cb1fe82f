"""What a payload of a chain holds, before any value is seen: how many values it sends, its sections' bytes,
and the tiles of a chain with ``topk:...,tile=S`` (:mod:`diloco.compress.tiles`), which follow the shapes of the
tensors a vector is."""

from __future__ import annotations

from typing import Optional, Sequence

from diloco.compress import stat2, wire
from diloco.compress.bits import bits_for, packed_size
from diloco.compress.chain import parse_chain
from diloco.compress.dct import padded_length
from diloco.compress.kernels import quant as q
from diloco.compress.kernels import topk as tk
from diloco.compress.tiles import Tiling
from diloco.compress.wire import CorruptPayload

FLOAT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class ChainLayout:
    """A parsed chain (``spec``, its canonical ``chain``) and the sizes of its payloads."""

    def __init__(self, chain: str) -> None:
        self.spec = parse_chain(chain)
        self.chain = self.spec.canonical()
        self._tilings: dict[tuple, Tiling] = {}

    def tiling(self, shapes: Sequence[Sequence[int]], numel: int) -> Optional[Tiling]:
        """The tiles of a vector of ``numel`` values that is tensors of ``shapes`` end to end, for a chain with
        ``topk:...,tile=S`` (None for any other)."""
        s = self.spec
        if not s.topk_tile:
            return None
        key = tuple(tuple(int(d) for d in shape) for shape in shapes)
        t = self._tilings.get(key)
        if t is None:
            t = Tiling(key, s.topk_tile, s.topk_chunk, s.topk_k)
            if len(self._tilings) > 256:  # bucket layouts of a run are few; a bound for callers that vary them
                self._tilings.clear()
            self._tilings[key] = t
        if t.numel != numel:
            raise ValueError(f"tensors of shapes {list(key)} hold {t.numel} values, the vector {numel}")
        return t

    def _tiles(self, numel: int, shapes: Optional[Sequence[Sequence[int]]]) -> Optional[Tiling]:
        """:meth:`tiling` of ``shapes``, or of one vector of ``numel`` values."""
        if not self.spec.topk_tile:
            return None
        return self.tiling(((numel,),) if shapes is None else shapes, numel)

    # ---- sizes ------------------------------------------------------------------------------
    def _layout(self, numel: int, tiling: Optional[Tiling] = None) -> tuple[int, int, int, int]:
        """(dense length, values sent, index bytes, value bytes) for a tensor of ``numel`` elements (in the tiles
        of ``tiling`` where the chain has them)."""
        s = self.spec
        dense = padded_length(numel, s.dct_chunk) if s.dct_chunk else numel
        if tiling is not None:
            count, index_bytes = tiling.count, packed_size(tiling.count, tiling.index_bits)
        elif s.topk_chunk:
            count = tk.selected_count(dense, s.topk_chunk, s.topk_k)
            index_bytes = packed_size(count, bits_for(s.topk_chunk))
        else:
            count, index_bytes = dense, 0
        if s.value in q.FORMATS:
            value_bytes = 4 * q.num_blocks(count, s.block) + q.packed_bytes(count, s.value)
        elif s.value == "stat2":
            value_bytes = sum(stat2.section_bytes(count, s.block))
        else:
            value_bytes = FLOAT_BYTES[s.value] * count
        return dense, count, index_bytes, value_bytes

    def values_held(self, numel: int, shapes: Optional[Sequence[Sequence[int]]] = None) -> int:
        """How many positions a payload of ``numel`` values holds: a top-k chain's k per chunk; else all.
        ``shapes``: the tensors the vector is, for a chain with tiles (else it is one vector)."""
        s = self.spec
        return self._layout(numel, self._tiles(numel, shapes))[1] if s.topk_chunk and not s.dct_chunk else numel

    def payload_bytes(self, numel: int, shapes: Optional[Sequence[Sequence[int]]] = None) -> int:
        """Bytes of the payload before zstd (the exact wire size when the chain has no zstd stage)."""
        _, _, ib, vb = self._layout(numel, self._tiles(numel, shapes))
        return ib + vb

    def wire_size(self, numel: int, ndim: int = 1, shapes: Optional[Sequence[Sequence[int]]] = None) -> Optional[int]:
        """The exact length of :meth:`encode` (without a prefix) of a tensor of ``numel`` elements in ``ndim``
        dimensions (for a chain with tiles: tensors of ``shapes``, by default one vector), where it does not depend
        on the values: every chain without zstd. None with zstd."""
        if self.spec.zstd_level is not None:
            return None
        return wire.header_size(ndim, self.chain) + self.payload_bytes(numel, shapes)

    def _header_tiles(self, header: wire.Header, shapes: Optional[Sequence[Sequence[int]]]) -> Optional[Tiling]:
        """The tiles of a received payload: of ``shapes`` (the receiver's own, which a sender of other shapes
        fails by the sizes or the index checks), else of the header's shape."""
        try:
            return self._tiles(header.numel, (header.shape,) if shapes is None else shapes)
        except ValueError as e:
            raise CorruptPayload(str(e)) from None
