"""Blockwise quantization: quantize + pack, and unpack + dequantize (+ weighted accumulate).

Formats (``fmt``), each with one fp32 scale per block of ``block`` values:

* ``int8``: scale = absmax / 127, q = clamp(floor(x / scale + 0.5), -127, 127), one byte each.
* ``int4``: scale = absmax / 7, q in [-7, 7] stored as q + 8, two values a byte.
* ``fp4``: E3M0, sign + 3-bit exponent e: value = sign * scale * 2**(e - 7) for e in 1..7,
  e = 0 is zero; scale = absmax; rounds to the nearest level. Two values a byte.
* ``2bit``: four levels (q - 1.5) * scale, q in 0..3, scale = absmax / 1.5 (no zero level:
  meant for top-k values, which are all large). Four values a byte.

Value i of a byte sits at bits ``[i*b, (i+1)*b)``, low bits first. Integer outputs (codes and
their packing) are byte-identical between the kernel and the reference; scales are computed
with correctly rounded division in both.
"""

from __future__ import annotations

import torch

from diloco.compress.kernels.backend import HAVE_TRITON, require_triton, use_triton

# fmt -> (format id, bits per value, values per byte)
FORMATS = {"int8": (0, 8, 1), "int4": (1, 4, 2), "fp4": (2, 4, 2), "2bit": (3, 2, 4)}
_QMAX = {"int8": 127.0, "int4": 7.0}
# fp4 decision thresholds, as fractions of the scale: e >= j when |x| >= scale * _FP4_T[j-1]
_FP4_T = (2.0**-7, 0.75 * 2.0**-5, 0.75 * 2.0**-4, 0.75 * 2.0**-3, 0.75 * 2.0**-2, 0.75 * 2.0**-1, 0.75)


def packed_bytes(n: int, fmt: str) -> int:
    per = FORMATS[fmt][2]
    return -(-n // per)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def check_block(block: int, fmt: str) -> None:
    if block < 4 or block > 65536 or block & (block - 1):
        raise ValueError(f"{fmt} block size must be a power of two in [4, 65536], got {block}")


# ---------------------------------------------------------------------------------------------
# torch reference (also the CPU path): row blocks of about _PIECE values at a time, so every
# temporary stays in cache and the codes and scales go straight into the caller's buffers
# ---------------------------------------------------------------------------------------------
_PIECE = 1 << 19  # 2 MiB of fp32: per-op overheads fall below a tenth of the work, in L2/L3


class _Work:
    """Temporaries of one quantize / dequantize call, made once and reused by each of its pieces: a few MiB
    allocated and freed per piece can go back to the OS each time (glibc returns large blocks), and faulting
    their pages in again cost several times the arithmetic."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.bufs[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]


def _quantize_rows(xb: torch.Tensor, fmt: str, packed: torch.Tensor, scales: torch.Tensor,
                   work: _Work | None = None) -> None:
    """Whole blocks ``xb`` (rows of one block each) -> their codes in ``packed`` and scales in ``scales``.

    ``work``: the call's temporaries (see :class:`_Work`), shared by its pieces.
    """
    _, bits, per = FORMATS[fmt]
    # max |x| of each row as max(max x, -min x): two reads and no |x| temporary (the same value, bit for bit;
    # the + 0.0 turns the -0.0 of a row of zeros into the +0.0 that |x| gives; NaN propagates)
    amax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()).add_(0.0)
    work = work or _Work(xb.device)
    t = work.get("f32", xb.numel(), torch.float32).view_as(xb)
    if fmt in _QMAX:
        qmax = _QMAX[fmt]
        scale = torch.div(amax, qmax, out=scales)
        safe = torch.where(scale > 0, scale, 1.0)[:, None]
        torch.div(xb, safe, out=t)
        t.add_(0.5).floor_().clamp_(-qmax, qmax)
        if fmt == "int8":
            packed.view(torch.int8).view_as(t).copy_(t)
            return
        t = t.view(-1, 2)
        codes = torch.add(t[:, 0], t[:, 1], alpha=16.0).add_(136.0)  # (lo + 8) | (hi + 8) << 4
    elif fmt == "fp4":
        scale = scales.copy_(amax)
        a = torch.abs(xb, out=t)
        e = work.get("u8", xb.numel(), torch.uint8).view_as(xb).zero_()
        hit = work.get("b", xb.numel(), torch.bool).view_as(xb)
        for th in _FP4_T:
            e.add_(torch.ge(a, scale[:, None] * th, out=hit))
        e.add_((xb < 0).logical_and_(e > 0), alpha=8)
        e = e.view(-1, 2)
        codes = torch.add(e[:, 0], e[:, 1], alpha=16)
    else:  # 2bit
        scale = torch.div(amax, 1.5, out=scales)
        safe = torch.where(scale > 0, scale, 1.0)[:, None]
        t = torch.div(xb, safe, out=t).floor_().add_(2.0).clamp_(0.0, 3.0).view(-1, 4)
        codes = torch.add(t[:, 0], t[:, 1], alpha=4.0)
        codes.add_(t[:, 2], alpha=16.0).add_(t[:, 3], alpha=64.0)
    packed.copy_(codes)


def quantize_ref(x: torch.Tensor, block: int, fmt: str, packed: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32, 1-D) -> (packed codes uint8 of ``packed_bytes(n, fmt)``, scales fp32 of ``num_blocks``).

    ``packed`` / ``scales``: where to write them (e.g. views into a payload buffer); new tensors if None.
    """
    _, bits, per = FORMATS[fmt]
    x = x.reshape(-1)
    if x.dtype != torch.float32:
        x = x.float()
    n = x.numel()
    nb = num_blocks(n, block)
    if packed is None:
        packed = torch.empty(packed_bytes(n, fmt), dtype=torch.uint8, device=x.device)
    if scales is None:
        scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if packed.numel() != packed_bytes(n, fmt) or scales.numel() != nb:
        raise ValueError(f"{n} values need {packed_bytes(n, fmt)} code bytes and {nb} scales")
    full = n // block
    rows = max(1, _PIECE // block)
    step = block // per  # code bytes of one block
    work = _Work(x.device)  # temporaries made once, reused by every piece
    for r in range(0, full, rows):
        e = min(r + rows, full)
        _quantize_rows(x[r * block:e * block].view(e - r, block), fmt, packed[r * step:e * step], scales[r:e],
                       work)
    if full < nb:  # the last block, padded with zeros
        tail = x.new_zeros(1, block)
        tail[0, :n - full * block] = x[full * block:]
        codes = torch.empty(step, dtype=torch.uint8, device=x.device)
        _quantize_rows(tail, fmt, codes, scales[full:])
        packed[full * step:].copy_(codes[:packed.numel() - full * step])
    return packed, scales


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(fmt: str, device: torch.device) -> torch.Tensor:
    """fp4: the 16 values of a nibble, (16,); 2bit: the 4 values of each byte, (256, 4); unscaled, exact."""
    key = (fmt, device)
    table = _TABLES.get(key)
    if table is None:
        if fmt == "fp4":  # sign s (bit 3), exponent e (bits 0-2): (-1)^s 2^(e - 7), or a zero of sign s at e = 0
            e = torch.arange(16) & 7
            mag = torch.where(e > 0, torch.exp2((e - 7).double()), torch.zeros(()))
            table = torch.where(torch.arange(16) >= 8, -mag, mag).float()
        else:  # 2bit: level q - 1.5 for q = bits [2i, 2i + 2) of the byte
            q = (torch.arange(256)[:, None] >> torch.arange(0, 8, 2)) & 3
            table = q.float() - 1.5
        table = _TABLES[key] = table.contiguous().to(device)
    return table


def _unscaled(codes: torch.Tensor, fmt: str, work: _Work) -> torch.Tensor:
    """The values the bytes ``codes`` of an int4, fp4 or 2bit payload hold, before their scale, in value order,
    as a tensor whose product with an fp32 scale rounds once, as the kernel's does (int8 for int4; fp32 for
    fp4's signed powers of two and zeros and 2bit's levels). Bit operations and ``index_select`` with int32
    indices into small tables, which run several times faster than a gather with int64 indices
    (``table[codes.long()]``)."""
    m = codes.numel()
    if fmt == "2bit":
        idx = work.get("i32", m, torch.int32).copy_(codes)
        out = work.get("f32", 4 * m, torch.float32).view(m, 4)
        return torch.index_select(_table(fmt, codes.device), 0, idx, out=out)
    nib = work.get("u8", 2 * m, torch.uint8).view(m, 2)  # value 0 in the low bits
    torch.bitwise_and(codes, 15, out=nib[:, 0])
    torch.bitwise_right_shift(codes, 4, out=nib[:, 1])
    nib = nib.view(-1)
    if fmt == "int4":
        return nib.view(torch.int8).sub_(8)
    idx = work.get("i32", 2 * m, torch.int32).copy_(nib)
    return torch.index_select(_table(fmt, codes.device), 0, idx, out=work.get("f32", 2 * m, torch.float32))


def _dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, fmt: str, count: int,
                     out: torch.Tensor | None = None, work: _Work | None = None) -> torch.Tensor:
    """The first ``count`` fp32 values of whole blocks (``codes``: their bytes, ``scale``: one per block);
    written into ``out`` (of ``count`` values) when given and ``count`` fills the blocks, else into a
    temporary of ``work``."""
    rows = scale.numel()
    total = codes.numel() * FORMATS[fmt][2]
    work = work or _Work(codes.device)
    if fmt == "int8":
        values = codes.view(torch.int8).view(rows, -1)
    else:
        values = _unscaled(codes, fmt, work).view(rows, -1)
    whole = out is not None and count == total
    target = out if whole else work.get("out", total, torch.float32)
    return torch.mul(values, scale[:, None], out=target.view(rows, -1)).view(-1)[:count]


def dequantize_ref(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int, fmt: str,
                   out: torch.Tensor | None = None, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Codes -> ``weight *`` fp32 values; with ``accumulate``, ``out += weight * values`` instead (``out`` given)."""
    _, bits, per = FORMATS[fmt]
    if accumulate and out is None:
        raise ValueError("accumulate needs an output tensor")
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    flat = out.view(-1)
    scales = scales.reshape(-1)
    if scales.dtype != torch.float32:
        scales = scales.float()
    full, nb = n // block, num_blocks(n, block)
    rows = max(1, _PIECE // block)
    step = block // per
    work = _Work(packed.device)

    def put(a: int, b: int, values: torch.Tensor) -> None:
        if accumulate:
            flat[a:b].add_(values, alpha=weight)
        elif weight != 1.0:
            torch.mul(values, weight, out=flat[a:b])
        else:
            flat[a:b].copy_(values)

    for r in range(0, full, rows):
        e = min(r + rows, full)
        a, b = r * block, e * block
        if accumulate or not flat.is_contiguous():
            put(a, b, _dequantize_rows(packed[r * step:e * step], scales[r:e], fmt, b - a, work=work))
        else:  # written in place (and weighted there, while in cache)
            _dequantize_rows(packed[r * step:e * step], scales[r:e], fmt, b - a, out=flat[a:b], work=work)
            if weight != 1.0:
                flat[a:b].mul_(weight)
    if full < nb:  # the last block, its codes padded to a whole block
        codes = packed.new_zeros(step)
        rest = packed[full * step:]
        codes[:rest.numel()] = rest
        put(full * block, n, _dequantize_rows(codes, scales[full:full + 1], fmt, n - full * block, work=work))
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _encode_value(x, scale, FMT: tl.constexpr):
        if FMT == 0:
            safe = tl.where(scale > 0, scale, 1.0)
            q = tl.floor(tl.div_rn(x, safe) + 0.5)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            c = q.to(tl.int32) & 0xFF
        elif FMT == 1:
            safe = tl.where(scale > 0, scale, 1.0)
            q = tl.floor(tl.div_rn(x, safe) + 0.5)
            q = tl.minimum(tl.maximum(q, -7.0), 7.0)
            c = q.to(tl.int32) + 8
        elif FMT == 2:
            a = tl.abs(x)
            e = (a >= scale * 0.0078125).to(tl.int32)
            e += (a >= scale * 0.0234375).to(tl.int32)
            e += (a >= scale * 0.046875).to(tl.int32)
            e += (a >= scale * 0.09375).to(tl.int32)
            e += (a >= scale * 0.1875).to(tl.int32)
            e += (a >= scale * 0.375).to(tl.int32)
            e += (a >= scale * 0.75).to(tl.int32)
            c = tl.where((x < 0) & (e > 0), e + 8, e)
        else:
            safe = tl.where(scale > 0, scale, 1.0)
            q = tl.floor(tl.div_rn(x, safe)) + 2.0
            q = tl.minimum(tl.maximum(q, 0.0), 3.0)
            c = q.to(tl.int32)
        return c

    @triton.jit
    def _decode_value(c, scale, FMT: tl.constexpr):
        if FMT == 0:
            v = tl.where(c >= 128, c - 256, c).to(tl.float32) * scale
        elif FMT == 1:
            v = (c - 8).to(tl.float32) * scale
        elif FMT == 2:
            e = c & 7
            pow2 = ((e + 120) << 23).to(tl.float32, bitcast=True)
            mag = tl.where(e > 0, scale * pow2, 0.0)
            v = tl.where(c >= 8, -mag, mag)
        else:
            v = (c.to(tl.float32) - 1.5) * scale
        return v

    @triton.jit
    def _quant_kernel(x_ptr, packed_ptr, scale_ptr, n, nblocks, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                      FMT: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK // PER)
        elem = rows[:, None] * BLOCK + cols[None, :] * PER
        x0 = tl.load(x_ptr + elem, mask=elem < n, other=0.0)
        amax = tl.max(tl.abs(x0), axis=1)
        if PER >= 2:
            x1 = tl.load(x_ptr + elem + 1, mask=elem + 1 < n, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=1))
        if PER == 4:
            x2 = tl.load(x_ptr + elem + 2, mask=elem + 2 < n, other=0.0)
            x3 = tl.load(x_ptr + elem + 3, mask=elem + 3 < n, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x2), axis=1))
            amax = tl.maximum(amax, tl.max(tl.abs(x3), axis=1))
        if FMT == 0:
            scale = tl.div_rn(amax, 127.0)
        elif FMT == 1:
            scale = tl.div_rn(amax, 7.0)
        elif FMT == 2:
            scale = amax
        else:
            scale = tl.div_rn(amax, 1.5)
        tl.store(scale_ptr + rows, scale, mask=rows < nblocks)
        s = scale[:, None]
        byte = _encode_value(x0, s, FMT)
        if PER >= 2:
            byte = byte | (_encode_value(x1, s, FMT) << BITS)
        if PER == 4:
            byte = byte | (_encode_value(x2, s, FMT) << (2 * BITS))
            byte = byte | (_encode_value(x3, s, FMT) << (3 * BITS))
        out = rows[:, None] * (BLOCK // PER) + cols[None, :]
        tl.store(packed_ptr + out, byte.to(tl.uint8), mask=elem < n)

    @triton.jit
    def _dequant_kernel(packed_ptr, scale_ptr, out_ptr, n, weight, BLOCK: tl.constexpr, SPAN: tl.constexpr,
                        FMT: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, ACC: tl.constexpr):
        """SPAN consecutive values per program, each thread on consecutive output words (coalesced, vector
        loads and stores); the code bytes and block scales are read again by neighbours, from cache."""
        elem = tl.program_id(0).to(tl.int64) * SPAN + tl.arange(0, SPAN)
        m = elem < n
        byte = tl.load(packed_ptr + elem // PER, mask=m, other=0).to(tl.int32)
        if PER > 1:
            byte = byte >> ((elem % PER).to(tl.int32) * BITS)
        c = byte & ((1 << BITS) - 1)
        scale = tl.load(scale_ptr + elem // BLOCK, mask=m, other=0.0)
        v = _decode_value(c, scale, FMT)
        if ACC:
            o = tl.load(out_ptr + elem, mask=m, other=0.0)
            v = o + weight * v
        else:
            v = weight * v
        tl.store(out_ptr + elem, v, mask=m)


# values per program and warps of the dequantize kernel: 85-93% of the copy bandwidth for int8, int4 and fp4 on
# an H100 (spans of 1024-8192 and 4-16 warps tried, benchmarks/results/codecs_gpu.md)
DEQUANT_SPAN = 4096
DEQUANT_WARPS = 8


def _rows(block: int) -> int:
    return max(1, 2048 // block)


def quantize_triton(x: torch.Tensor, block: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x)
    fid, bits, per = FORMATS[fmt]
    x = x.reshape(-1).float().contiguous()
    n = x.numel()
    nb = num_blocks(n, block)
    packed = torch.empty(packed_bytes(n, fmt), dtype=torch.uint8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n:
        rows = _rows(block)
        _quant_kernel[(-(-nb // rows),)](x, packed, scales, n, nb, BLOCK=block, ROWS=rows, FMT=fid, BITS=bits, PER=per)
    return packed, scales


def dequantize_triton(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int, fmt: str,
                      out: torch.Tensor | None = None, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    require_triton(packed)
    fid, bits, per = FORMATS[fmt]
    if accumulate and out is None:
        raise ValueError("accumulate needs an output tensor")
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    if n:
        _dequant_kernel[(-(-n // DEQUANT_SPAN),)](packed.contiguous(), scales.float().contiguous(), out, n,
                                                  float(weight), BLOCK=block, SPAN=DEQUANT_SPAN, FMT=fid, BITS=bits,
                                                  PER=per, ACC=accumulate, num_warps=DEQUANT_WARPS)
    return out


def quantize(x: torch.Tensor, block: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA tensors, the torch reference elsewhere."""
    return quantize_triton(x, block, fmt) if use_triton(x) else quantize_ref(x, block, fmt)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int, fmt: str,
               out: torch.Tensor | None = None, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    fn = dequantize_triton if use_triton(packed) else dequantize_ref
    return fn(packed, scales, n, block, fmt, out=out, weight=weight, accumulate=accumulate)
