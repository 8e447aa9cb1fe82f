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

from diloco.compress.kernels import HAVE_TRITON, require_triton, use_triton

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
_PIECE = 1 << 16
_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _byte_lut(fmt: str, device: torch.device) -> torch.Tensor:
    """(256, values per byte) fp32: the unscaled values each byte holds (fp4: +-2**(e-7), or zero)."""
    key = (fmt, device)
    lut = _LUTS.get(key)
    if lut is None:
        _, bits, per = FORMATS[fmt]
        shifts = torch.arange(0, bits * per, bits, dtype=torch.int32)
        c = (torch.arange(256, dtype=torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
        if fmt == "int8":
            v = c.to(torch.int8).float()
        elif fmt == "int4":
            v = (c - 8).float()
        elif fmt == "fp4":
            e = c & 7
            mag = torch.where(e > 0, ((e + 120) << 23).view(torch.float32), torch.zeros(()))
            v = torch.where(c >= 8, -mag, mag)
        else:
            v = c.float() - 1.5
        lut = _LUTS[key] = v.contiguous().to(device)
    return lut


def _quantize_rows(xb: torch.Tensor, fmt: str, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Whole blocks ``xb`` (rows of one block each) -> their codes in ``packed`` and scales in ``scales``."""
    _, bits, per = FORMATS[fmt]
    amax = xb.abs().amax(dim=1)
    if fmt in _QMAX:
        qmax = _QMAX[fmt]
        scale = torch.div(amax, qmax, out=scales)
        safe = torch.where(scale > 0, scale, 1.0)[:, None]
        t = torch.div(xb, safe)
        t.add_(0.5).floor_().clamp_(-qmax, qmax)
        if fmt == "int8":
            packed.view(torch.int8).view_as(t).copy_(t)
            return
        t = t.view(-1, 2)
        codes = torch.add(t[:, 0], t[:, 1], alpha=16.0).add_(136.0)  # (lo + 8) | (hi + 8) << 4
    elif fmt == "fp4":
        scale = scales.copy_(amax)
        a = xb.abs()
        e = torch.zeros(xb.shape, dtype=torch.uint8, device=xb.device)
        hit = torch.empty(xb.shape, dtype=torch.bool, device=xb.device)
        for th in _FP4_T:
            e.add_(torch.ge(a, scale[:, None] * th, out=hit))
        e.add_((xb < 0).logical_and_(e > 0), alpha=8)
        e = e.view(-1, 2)
        codes = torch.add(e[:, 0], e[:, 1], alpha=16)
    else:  # 2bit
        scale = torch.div(amax, 1.5, out=scales)
        safe = torch.where(scale > 0, scale, 1.0)[:, None]
        t = torch.div(xb, safe).floor_().add_(2.0).clamp_(0.0, 3.0).view(-1, 4)
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
    for r in range(0, full, rows):
        e = min(r + rows, full)
        _quantize_rows(x[r * block:e * block].view(e - r, block), fmt, packed[r * step:e * step], scales[r:e])
    if full < nb:  # the last block, padded with zeros
        tail = x.new_zeros(1, block)
        tail[0, :n - full * block] = x[full * block:]
        codes = torch.empty(step, dtype=torch.uint8, device=x.device)
        _quantize_rows(tail, fmt, codes, scales[full:])
        packed[full * step:].copy_(codes[:packed.numel() - full * step])
    return packed, scales


def _dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, fmt: str, count: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``count`` fp32 values of whole blocks (``codes``: their bytes, ``scale``: one per block);
    written into ``out`` (of ``count`` values) when given and ``count`` fills the blocks."""
    rows = scale.numel()
    whole = out is not None and count == codes.numel() * FORMATS[fmt][2]
    if fmt == "int8":
        c = codes.view(torch.int8).view(rows, -1)
        if whole:
            return torch.mul(c, scale[:, None], out=out.view(rows, -1)).view(-1)
        return torch.mul(c, scale[:, None]).view(-1)[:count]
    values = _byte_lut(fmt, codes.device)[codes.long()].view(rows, -1)
    if whole:
        return torch.mul(values, scale[:, None], out=out.view(rows, -1)).view(-1)
    return values.mul_(scale[:, None]).view(-1)[:count]


def dequantize_ref(packed: torch.Tensor, scales: torch.Tensor, n: int, block: int, fmt: str,
                   out: torch.Tensor | None = None, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Codes -> fp32 values; with ``accumulate``, ``out += weight * values`` instead (``out`` given)."""
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

    def put(a: int, b: int, values: torch.Tensor) -> None:
        if accumulate:
            flat[a:b].add_(values, alpha=weight)
        else:
            flat[a:b].copy_(values)

    for r in range(0, full, rows):
        e = min(r + rows, full)
        a, b = r * block, e * block
        if accumulate or not flat.is_contiguous():
            put(a, b, _dequantize_rows(packed[r * step:e * step], scales[r:e], fmt, b - a))
        else:  # written in place
            _dequantize_rows(packed[r * step:e * step], scales[r:e], fmt, b - a, out=flat[a:b])
    if full < nb:  # the last block, its codes padded to a whole block
        codes = packed.new_zeros(step)
        rest = packed[full * step:]
        codes[:rest.numel()] = rest
        put(full * block, n, _dequantize_rows(codes, scales[full:full + 1], fmt, n - full * block))
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
