"""Codec chains: ``make_codec("topk:0.02+2bit+zstd")`` -> an object with ``encode`` / ``decode``.

The chain grammar (stages, options, order) is :mod:`diloco.compress.chain`.

``encode(tensor, key)`` returns the wire bytes (header + payload, see ``wire.py``) in one buffer; their
length is exactly what crosses the network. Top-k's error feedback keeps one residual
per ``key`` (one per buffer the caller encodes repeatedly); the quantization error of the
values that were sent goes into the residual too. ``decode`` validates the header, the
exact section sizes, indices and values before it returns, and raises
:class:`CorruptPayload` for anything wrong; it never returns NaN or Inf.

Decompression bombs: the sections a header's shape needs (``payload_bytes``) are known
before anything is inflated. Without zstd they must all be present, byte for byte. With
zstd, when the caller has not vouched for the size (``decode`` without ``expect_numel``),
a payload whose sections would inflate to more than ``ZSTD_FREE_BYTES`` and more than
``ZSTD_MAX_RATIO`` times the compressed bytes present (:mod:`diloco.compress.zstd`) is refused before anything is
allocated; a tensor that really compresses better (all zeros, say) then needs
``decode(payload, expect_numel=n)``, and ``decode_accumulate_`` (whose ``out`` fixes the
size) and the transports always check the exact size instead. Nothing is padded: the
bytes on the wire are the compressed bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import torch

from diloco.comm.pool import BufferPool
from diloco.compress import stat2, wire
from diloco.compress.bits import bits_for, pack_bits, unpack_bits
from diloco.compress.chain import CodecSpecError, parse_chain
from diloco.compress.checked import (add_checked, cannot_overflow, chunk_indices_ok, copy_checked, finite,
                                     magnitude, put_floats)
from diloco.compress.dct import dct_chunks, idct_chunks
from diloco.compress.kernels import quant as q
from diloco.compress.kernels import topk as tk
from diloco.compress.kernels.backend import one_host_thread
from diloco.compress.layout import ChainLayout
from diloco.compress.residuals import Residuals
from diloco.compress.senders import add_support
from diloco.compress.tiles import Tiling
from diloco.compress.wire import CorruptPayload
from diloco.compress.zstd import Zstd

MAX_SCALE = 1e36  # a received scale above this could overflow once multiplied and summed
_FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FLOAT_MAX = {"fp16": 65504.0, "bf16": float(torch.finfo(torch.bfloat16).max)}
_CODE_MAX = {"int8": 128.0, "int4": 8.0, "fp4": 1.0, "2bit": 1.5}  # the largest |value| of a code, in scales
POOL_MIN = 1 << 20  # encode reuses released output buffers of at least this many bytes ...
POOL_KEEP = 4  # ... and keeps at most this many of them


def _staged(body: bytes | memoryview, device: torch.device) -> torch.Tensor:
    """``body`` on ``device`` as uint8: copied once into pinned host memory (torch's copy runs on several
    threads), from there by one asynchronous transfer. A transfer from pageable memory would be staged through
    a small pinned buffer by the driver, at a fraction of the bus's speed."""
    src = wire.tensor_view(body, 0, len(body))
    if device.type != "cuda" or len(body) < POOL_MIN:
        return src.to(device)
    host = torch.empty(len(body), dtype=torch.uint8, pin_memory=True)
    host.copy_(src)
    return host.to(device, non_blocking=True)  # the caching host allocator keeps ``host`` until the copy is done


class _Buffers(BufferPool):
    """Encode's output buffers (:class:`~diloco.comm.pool.BufferPool`), sized by ``POOL_MIN`` / ``POOL_KEEP``."""

    def __init__(self) -> None:
        super().__init__(POOL_MIN, POOL_KEEP)

    def take(self, n: int) -> bytearray | memoryview:
        self.min_bytes, self.keep = POOL_MIN, POOL_KEEP  # read when used (tests lower them)
        return super().take(n)


@dataclass
class CodecStats:
    tensors: int = 0
    raw_bytes: int = 0  # fp32 bytes of what was encoded
    wire_bytes: int = 0  # bytes encode returned

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else float("nan")


class Codec(ChainLayout):
    """One worker's codec: a parsed chain plus its error-feedback residuals (state)."""

    def __init__(self, chain: str = "fp32", max_numel: int = 1 << 31) -> None:
        super().__init__(chain)
        self.max_numel = max_numel
        self.residuals = Residuals()
        self.stats = CodecStats()
        s = self.spec
        self.is_identity = self.chain == "fp32"
        self.error_feedback = s.topk_chunk is not None and s.ef_decay > 0
        align = 1
        for a in (s.dct_chunk, s.topk_chunk, s.block or None):
            if a:
                align = align * a // math.gcd(align, a)
        self.align = align  # shard boundaries at multiples of this keep chunks and blocks whole
        self.zstd = Zstd(s.zstd_level) if s.zstd_level is not None else None
        self._buffers = _Buffers()
        self._tiled: dict[Hashable, Tiling] = {}  # the keys whose residuals wait in these tiles' order

    def __repr__(self) -> str:
        return f"Codec({self.chain!r})"

    # ---- encode -----------------------------------------------------------------------------
    @one_host_thread
    def encode(self, tensor: torch.Tensor, key: Hashable = None, *, prefix: bytes = b"",
               feedback: bool = True, shapes: Optional[Sequence[Sequence[int]]] = None) -> bytearray | memoryview:
        """The wire bytes of ``tensor`` (header + payload), written once into one buffer of exactly their size.

        ``feedback=False``: the error feedback of ``key`` is neither added nor changed (a payload sent with
        weight 0, which every worker discards: its residual would be spent on nothing).

        Returns a ``bytearray``; for a CUDA tensor a ``memoryview`` of pinned host memory, filled by one
        asynchronous device-to-host copy per section and a single synchronize. ``prefix``: bytes the caller
        wants in front of the payload in the same buffer (a message header), so that sending both copies
        nothing; the codec's payload then starts at ``len(prefix)``. ``shapes``: for a chain with tiles, the
        tensors ``tensor`` is, end to end (by default it is one tensor of its own shape); a decode must be given
        the same.
        """
        if tensor.dtype not in wire.DTYPE_CODES:
            raise ValueError(f"cannot encode a tensor of dtype {tensor.dtype}")
        if tensor.numel() > self.max_numel:
            raise ValueError(f"tensor of {tensor.numel()} elements is above this codec's limit of {self.max_numel}")
        x = tensor.detach().reshape(-1)
        if x.dtype != torch.float32:
            x = x.float()
        s = self.spec
        numel = x.numel()
        shape = tuple(tensor.shape)
        tiling = self._tiles(numel, (shape,) if shapes is None else shapes)
        _, _, index_bytes, value_bytes = self._layout(numel, tiling)
        wire.check_encodable(tensor.dtype, shape, self.chain)
        head = wire.header_size(len(shape), self.chain)
        pre = len(prefix)
        direct = not x.is_cuda and self.zstd is None
        raw = value_bytes + index_bytes
        if direct:
            buf = self._buffers.take(pre + head + raw)
            base = pre + head
        elif x.is_cuda:
            buf = torch.empty(pre + head + raw if self.zstd is None else raw, dtype=torch.uint8, pin_memory=True)
            base = pre + head if self.zstd is None else 0
        else:  # zstd: the raw sections in a scratch buffer, compressed below
            buf = self._buffers.take(raw)
            base = 0
        mem = memoryview(buf.numpy()) if isinstance(buf, torch.Tensor) else memoryview(buf)
        h = None
        if not s.dct_chunk and not s.topk_chunk and s.value in _FLOAT_DTYPES and direct:
            h = wire.begin_header(mem, pre, tensor.dtype, shape, self.chain, raw)  # the values hashed as copied
            put_floats(x, mem, base, _FLOAT_DTYPES[s.value], _FLOAT_MAX.get(s.value), h)
        else:
            self._sections(x, key, mem, base, feedback, tiling)
        if self.zstd is not None:  # compress the sections, then header + compressed bytes in the output
            comp = self.zstd.compress(mem[:raw])
            del mem, buf  # a pooled scratch buffer is free again
            buf = self._buffers.take(pre + head + len(comp))
            mem = memoryview(buf)
            mem[pre + head:] = comp
            raw = len(comp)
        if pre:
            mem[:pre] = prefix
        if h is None:
            h = wire.begin_header(mem, pre, tensor.dtype, shape, self.chain, raw)
            if raw:
                h.update(mem[pre + head:])
        wire.seal(mem, pre, len(shape), self.chain, h)
        self.stats.tensors += 1
        self.stats.raw_bytes += 4 * numel
        self.stats.wire_bytes += len(mem) - pre
        return mem if isinstance(buf, torch.Tensor) else buf

    def _sections(self, x: torch.Tensor, key: Hashable, mem: memoryview, base: int, feedback: bool = True,
                  tiling: Optional[Tiling] = None) -> None:
        """Write the payload's sections (scales, values, packed indices) of ``x`` (fp32, flat) at ``mem[base:]``.

        On the CPU the quantizer and the float copy write straight into ``mem``; on CUDA the sections are made
        on the device and copied to ``mem`` (pinned) asynchronously, with one synchronize at the end.
        """
        s = self.spec
        dense, count, _, value_bytes = self._layout(x.numel(), tiling)
        plain = not s.dct_chunk and not s.topk_chunk
        late: list[tuple[int, torch.Tensor]] = []  # (offset in the payload, a section made elsewhere)
        if not (plain and (s.value in q.FORMATS or s.value == "stat2" or not x.is_cuda)) and not finite(x):
            raise ValueError("cannot encode a tensor with NaN or Inf values")  # else: checked on the way
        if s.dct_chunk:
            x = dct_chunks(x, s.dct_chunk)
            if not finite(x):
                raise ValueError("values too large to encode: the DCT overflows float32")
        residual = parked = None
        flat_idx = None
        if s.topk_chunk:
            if self.error_feedback and feedback:
                residual, parked = self.residuals.take(key, dense, x.device)
            if tiling is None:
                idx, values = tk.topk_chunks(x, s.topk_chunk, s.topk_k, residual, s.ef_decay)
                late.append((value_bytes, pack_bits(idx, bits_for(s.topk_chunk))))
                if residual is not None:
                    flat_idx = _flat_positions(idx.long(), s.topk_k, s.topk_chunk)
            else:
                if residual is not None:
                    residual = self._in_tiles(key, residual, tiling)
                idx, values = tiling.topk(x, residual, s.ef_decay)
                late.append((value_bytes, pack_bits(idx, tiling.index_bits)))
                if residual is not None:
                    flat_idx = tiling.permuted_positions(idx)
        else:
            values = x
        if s.value in q.FORMATS:
            nb = q.num_blocks(count, s.block)
            if x.is_cuda:
                packed, scales = q.quantize(values, s.block, s.value)
                late += [(0, scales), (4 * nb, packed)]
            else:  # the reference writes codes and scales into the output
                scales = wire.tensor_view(mem, base, base + 4 * nb, torch.float32)
                packed = wire.tensor_view(mem, base + 4 * nb, base + value_bytes)
                q.quantize_ref(values, s.block, s.value, packed=packed, scales=scales)
            if nb:
                top = float(scales.max())
                if not math.isfinite(top):
                    raise ValueError("cannot encode a tensor with NaN or Inf values")
                if top > MAX_SCALE:
                    raise ValueError(f"values too large to encode with {s.value} (a block scale above {MAX_SCALE:g})")
            if flat_idx is not None:  # what quantization lost also waits in the residual
                sent = q.dequantize(packed, scales, count, s.block, s.value)
                residual.index_add_(0, flat_idx, values - sent)
        elif s.value == "stat2":
            tables, codes, sent = stat2.encode(values, s.block)
            if not finite(tables):
                raise ValueError("cannot encode a tensor with NaN or Inf values")
            late += [(0, tables), (stat2.section_bytes(count, s.block)[0], codes)]
            if flat_idx is not None:
                residual.index_add_(0, flat_idx, values - sent)
        elif plain and not x.is_cuda:
            put_floats(values, mem, base, _FLOAT_DTYPES[s.value], _FLOAT_MAX.get(s.value), None)
        else:
            if s.value in _FLOAT_MAX:
                values = values.clamp(-_FLOAT_MAX[s.value], _FLOAT_MAX[s.value])
            cast = values.to(_FLOAT_DTYPES[s.value])
            late.append((0, cast))
            if flat_idx is not None and s.value != "fp32":
                residual.index_add_(0, flat_idx, values - cast.float())
        if parked is not None:  # back where it waits (behind the sections, in the one synchronize below)
            parked.copy_(residual, non_blocking=x.is_cuda and parked.is_pinned())
        if x.is_cuda:
            if late:
                host = torch.frombuffer(mem, dtype=torch.uint8)
                for at, t in late:
                    if t.numel():
                        src = t.reshape(-1).view(torch.uint8)
                        host[base + at:base + at + src.numel()].copy_(src, non_blocking=True)
            torch.cuda.current_stream(x.device).synchronize()  # once, for every section
        else:
            for at, t in late:
                if t.numel():
                    dst = wire.tensor_view(mem, base + at, base + at + t.numel() * t.element_size())
                    dst.copy_(t.reshape(-1).view(torch.uint8))

    # ---- decode -----------------------------------------------------------------------------
    @one_host_thread
    def decode(self, payload: bytes | bytearray | memoryview, *, expect_numel: Optional[int] = None,
               device: torch.device | str = "cpu", shapes: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
        """The tensor (its shape and dtype from the header); raises CorruptPayload for any bad input.

        ``expect_numel``: the number of values the caller expects; anything else is refused. Without it a zstd
        payload may not inflate past the bomb bound (``ZSTD_MAX_RATIO`` once past ``ZSTD_FREE_BYTES``): a tensor
        that compresses better than that (all zeros, say) decodes only with ``expect_numel``.
        """
        header = self.check(payload, expect_numel)
        tiling = self._header_tiles(header, shapes)
        body = self._body(payload, header, vouched=expect_numel is not None, tiling=tiling)  # sizes checked first
        out = torch.empty(header.numel, dtype=torch.float32, device=device)
        self._accumulate(body, header, out, 1.0, fresh=True, tiling=tiling)
        result = out.view(header.shape).to(header.dtype)
        if header.dtype != torch.float32 and not finite(result):
            raise CorruptPayload(f"decoded values overflow {header.dtype}")
        return result

    def decode_accumulate_(self, payload: bytes | bytearray | memoryview, out: torch.Tensor, weight: float = 1.0,
                           support: Optional[torch.Tensor] = None, support_weight: float = 1.0,
                           shapes: Optional[Sequence[Sequence[int]]] = None) -> None:
        """``out += weight * decode(payload)`` (``out``: fp32, flat, of the payload's size), fused where a kernel is;
        ``support += support_weight`` where the payload holds a value (the mean over senders counts them): the sent
        positions of a top-k chain, every position of a dense one (a DCT top-k sends coefficients: dense too)."""
        header = self.check(payload, out.numel())
        tiling = self._header_tiles(header, shapes)
        flat = self._accumulate(self._body(payload, header, True, tiling), header, out, weight, tiling=tiling)
        add_support(support, support_weight, flat, self.spec.dct_chunk)

    def decode_into_(self, payload: bytes | bytearray | memoryview, out: torch.Tensor, weight: float = 1.0,
                     support: Optional[torch.Tensor] = None, support_weight: float = 1.0,
                     shapes: Optional[Sequence[Sequence[int]]] = None) -> None:
        """``out <- weight * decode(payload)`` without a temporary: ``out.zero_()`` and ``decode_accumulate_`` in one
        pass over ``out``."""
        header = self.check(payload, out.numel())
        tiling = self._header_tiles(header, shapes)
        flat = self._accumulate(self._body(payload, header, True, tiling), header, out, weight, fresh=True,
                                tiling=tiling)
        add_support(support, support_weight, flat, self.spec.dct_chunk)

    def check(self, payload: bytes | bytearray | memoryview, expect_numel: Optional[int] = None) -> wire.Header:
        header = wire.parse_header(payload, self.max_numel)
        if header.chain != self.chain:
            raise CorruptPayload(f"codec mismatch: the payload was encoded with {header.chain!r}, this worker uses "
                                 f"{self.chain!r}")
        if expect_numel is not None and header.numel != expect_numel:
            raise CorruptPayload(f"shape mismatch: the payload holds {header.numel} values ({header.shape}), "
                                 f"expected {expect_numel}")
        return header

    def _body(self, payload: bytes | bytearray | memoryview, header: wire.Header,
              vouched: bool, tiling: Optional[Tiling] = None) -> bytes | memoryview:
        """The payload after the header (decompressed), of exactly the size the chain needs for its shape.

        ``vouched``: the caller fixed the number of values; otherwise a zstd body must be within the bomb bound.
        A view of ``payload`` without zstd (nothing is copied).
        """
        _, _, index_bytes, value_bytes = self._layout(header.numel, tiling)
        body = memoryview(payload).cast("B")[header.offset:]
        expected = index_bytes + value_bytes
        if self.zstd is not None:
            body = self.zstd.inflate(body, expected, header.numel, vouched)
        if len(body) != expected:
            raise CorruptPayload(f"payload of {len(body)} bytes, the chain {self.chain!r} needs {expected} for "
                                 f"{header.numel} values")
        return body

    @one_host_thread
    def _accumulate(self, body: bytes | memoryview, header: wire.Header, out: torch.Tensor, weight: float,
                    fresh: bool = False, tiling: Optional[Tiling] = None) -> Optional[torch.Tensor]:
        """``out += weight * values`` of ``body``; ``fresh``: ``out`` holds nothing yet, write the values into it.
        Returns the flat positions of a top-k payload's values (None for a dense one).

        Sections are read through views of ``body``, moved to ``out``'s device when that is not the CPU.
        """
        s = self.spec
        numel = header.numel
        dense, count, index_bytes, value_bytes = self._layout(numel, tiling)

        staged = _staged(body, out.device) if out.device.type != "cpu" else None

        def section(a: int, b: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            return wire.tensor_view(body, a, b, dtype) if staged is None else staged[a:b].view(dtype)

        flat = None
        if s.topk_chunk:
            flat = self._indices(section(value_bytes, value_bytes + index_bytes), dense, count, tiling)
        direct = flat is None and not s.dct_chunk
        if s.value in q.FORMATS:
            nb = q.num_blocks(count, s.block)
            scales = section(0, 4 * nb, torch.float32)
            hi = 0.0
            if nb:
                lo, hi = torch.stack(torch.aminmax(scales)).tolist()
                if not (lo >= 0 and hi <= MAX_SCALE):  # NaN fails both
                    raise CorruptPayload("quantization scales out of range (negative, non-finite or above 1e36)")
            packed = section(4 * nb, value_bytes)
            if direct:  # unpack + dequantize (+ weighted accumulate) in one kernel
                q.dequantize(packed, scales, count, s.block, s.value, out=out, weight=weight, accumulate=not fresh)
                # fresh: |weight x code x scale| <= |weight| x 127 x 1e36, finite unless the weight is huge
                if not cannot_overflow(weight, _CODE_MAX[s.value] * hi) and not finite(out):
                    raise CorruptPayload("decoded values overflow the accumulator")
                return flat
            values = q.dequantize(packed, scales, count, s.block, s.value)
        else:
            hi = None
            if s.value == "stat2":  # every value is one of its block's table: the tables bound them all
                table_bytes = stat2.section_bytes(count, s.block)[0]
                tables = section(0, table_bytes, torch.float32)
                hi = magnitude(tables)
                if not hi <= MAX_SCALE:  # NaN fails too
                    raise CorruptPayload("stat2 tables out of range (non-finite or above 1e36)")
                values = stat2.decode(tables, section(table_bytes, value_bytes), count, s.block)
            else:
                values = section(0, value_bytes, _FLOAT_DTYPES[s.value])
            if direct and fresh:
                copy_checked(values, out, weight)
                return flat
            if direct:
                add_checked(values, out, weight)
                return flat
            if hi is None:
                hi = magnitude(values)
                if not math.isfinite(hi):
                    raise CorruptPayload("payload holds NaN or Inf values")
            values = values.float()
        if flat is not None and not s.dct_chunk:  # the sent values straight to their places: no dense temporary
            top = hi if s.value not in q.FORMATS else _CODE_MAX[s.value] * hi  # bounds |values|
            if fresh:
                scaled = values * weight if weight != 1.0 else values
                if not abs(weight) <= 1.0 and not cannot_overflow(weight, top) and not finite(scaled):
                    raise CorruptPayload("decoded values overflow")
                out.zero_()
                out.index_put_((flat,), scaled.to(out.dtype))  # computed in fp32, as for a dense ``out``
            else:  # indices strictly increase within a chunk (checked): no position is written twice
                summed = torch.add(out[flat], values, alpha=weight).to(out.dtype)
                if not cannot_overflow(weight, top) and not finite(summed):
                    raise CorruptPayload("decoded values overflow the accumulator")
                out.index_put_((flat,), summed)
            return flat
        if flat is not None:
            coeffs = torch.zeros(dense, dtype=torch.float32, device=out.device)
            coeffs[flat] = values
        else:
            coeffs = values
        x = idct_chunks(coeffs, s.dct_chunk, numel) if s.dct_chunk else coeffs
        if not finite(x):
            raise CorruptPayload("decoded values overflow")
        if fresh:
            if weight != 1.0:
                torch.mul(x, weight, out=out)
            else:
                out.copy_(x)
            if not abs(weight) <= 1.0 and not finite(out):  # x is finite: only a weight above 1 can overflow
                raise CorruptPayload("decoded values overflow")
        else:
            out.add_(x, alpha=weight)
            if not finite(out):  # two finite sums can overflow float32: the others' paths check as they add
                raise CorruptPayload("decoded values overflow when added")
        return flat

    def _indices(self, data: torch.Tensor, dense: int, count: int, tiling: Optional[Tiling] = None) -> torch.Tensor:
        """Flat positions of the sent values; each chunk's indices must be in range and strictly increasing."""
        s = self.spec
        if tiling is not None:
            idx = unpack_bits(data, tiling.index_bits, count)
            if tiling.bad(idx):
                raise CorruptPayload("top-k indices out of range or not strictly increasing within a tile")
            return tiling.positions(idx)
        chunk, k = s.topk_chunk, s.topk_k
        idx = unpack_bits(data, bits_for(chunk), count)
        full, last = divmod(dense, chunk)
        rows = [idx[: full * k].view(full, k)] if full else []
        if last:
            rows.append(idx[full * k:].view(1, -1))
        for r, limit in zip(rows, [chunk] * bool(full) + [last] * bool(last)):
            if not chunk_indices_ok(r, limit):
                raise CorruptPayload("top-k indices out of range or not strictly increasing within a chunk")
        return _flat_positions(idx, k, chunk)

    # ---- state ------------------------------------------------------------------------------
    def _in_tiles(self, key: Hashable, residual: torch.Tensor, tiling: Tiling) -> torch.Tensor:
        """``residual`` (of ``key``, as taken) in the order of ``tiling``, in place: a residual waits in the order
        of the tiles it was last encoded in, so that an encode neither permutes it nor copies it back."""
        held = self._tiled.get(key)
        if held is not tiling:
            if held is None or held.numel == residual.numel():  # else it was started afresh, of the new length
                flat = residual if held is None else held.unpermuted(residual)
                residual.copy_(tiling.permuted(flat))
            self._tiled[key] = tiling
        return residual

    def state_dict(self) -> dict[str, Any]:
        """The chain and the live residuals (:meth:`Residuals.state`), each in its vector's own order."""
        residuals = self.residuals.state()
        for key, tiling in self._tiled.items():
            if key in residuals and residuals[key].numel() == tiling.numel:
                residuals[key] = tiling.unpermuted(residuals[key])
        return {"chain": self.chain, "residuals": residuals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the residuals of a state saved by this chain, or by another whose residuals mean the same here:
        what error feedback held back is a vector in the domain the top-k selects from, whatever k, value
        format, decay or zstd sent it, so those may change (a resume with another ``algo.topk_density``; a top-k
        chunk that pads the vector to another length starts that residual afresh). A state of another transform
        (DCT chunk), or with residuals where this codec keeps none, is refused."""
        saved, residuals = state.get("chain"), state.get("residuals") or {}
        if saved != self.chain and residuals:
            try:
                other = parse_chain(saved)
            except (CodecSpecError, AttributeError):
                other = None
            if other is None or not self.error_feedback or other.dct_chunk != self.spec.dct_chunk:
                raise ValueError(f"codec state is for {saved!r}, this codec is {self.chain!r}: its error-feedback "
                                 f"residuals mean nothing here")
        self.residuals.load(residuals)
        self._tiled.clear()  # loaded in their own order


def _flat_positions(idx: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    """Positions in the whole vector of indices relative to their chunk (k per chunk, in chunk order)."""
    return idx + torch.arange(idx.numel(), device=idx.device) // k * chunk


def make_codec(chain: str = "fp32", max_numel: int = 1 << 31) -> Codec:
    """A codec for the chain string (the config value ``compress.codec``)."""
    return Codec(chain, max_numel)

