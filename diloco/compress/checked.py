"""Checked arithmetic on received values: what a payload adds to an accumulator must be finite, and must not
overflow float32 on the way. Every check reads the extremes of a piece (one pass, no temporary of its size). And
the one checked copy on the way out: values into a payload, each piece tested finite as it is copied."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from diloco.compress import wire
from diloco.compress.wire import CorruptPayload

PIECE = 1 << 17  # values per piece where a copy, its check and its checksum run piece by piece, in cache


def magnitude(t: torch.Tensor) -> float:
    """The largest ``|value|`` of ``t`` (NaN or Inf when ``t`` holds one): one pass, no temporary of its size."""
    if not t.numel():
        return 0.0
    lo, hi = torch.stack(torch.aminmax(t.reshape(-1))).float().tolist()
    return max(abs(lo), abs(hi)) if not (math.isnan(lo) or math.isnan(hi)) else math.nan


def finite(t: torch.Tensor) -> bool:
    """All of ``t`` is finite (NaN and +-Inf show in the extremes)."""
    return math.isfinite(magnitude(t))


def cannot_overflow(weight: float, magnitude: float) -> bool:
    """``out + weight * v`` stays finite for every finite ``out`` when ``|v| <= magnitude``: the addend is below
    half an ulp of the largest float32 (2**103), so no sum of it and a finite float32 rounds to infinity."""
    return abs(weight) * magnitude < 1e30  # NaN compares False


def add_checked(values: torch.Tensor, out: torch.Tensor, weight: float) -> None:
    """``out += weight * values`` piece by piece, each piece checked finite while it is in cache (a NaN or Inf
    raises CorruptPayload, with the pieces before it added), and the sum checked where it could overflow.
    On a GPU in one piece: the values are checked before anything is added (one host sync)."""
    n = values.numel()
    piece = PIECE if values.device.type == "cpu" else max(n, 1)
    for a in range(0, n, piece):
        b = min(a + piece, n)
        src, dst = values[a:b], out[a:b]
        top = magnitude(src)
        if not math.isfinite(top):
            raise CorruptPayload("payload holds NaN or Inf values")
        dst.add_(src, alpha=weight)
        if not cannot_overflow(weight, top) and not finite(dst):
            raise CorruptPayload("decoded values overflow the accumulator")


def copy_checked(values: torch.Tensor, out: torch.Tensor, weight: float = 1.0) -> None:
    """``out <- weight * values`` piece by piece, each piece checked finite while it is in cache (on a GPU: at
    once)."""
    n = values.numel()
    piece = PIECE if values.device.type == "cpu" else max(n, 1)
    for a in range(0, n, piece):
        b = min(a + piece, n)
        dst = out[a:b]
        dst.copy_(values[a:b])
        if weight != 1.0:  # in fp32 (a product in the payload's own dtype would round to it)
            dst.mul_(weight)
        if not finite(dst):
            raise CorruptPayload("payload holds NaN or Inf values")


def chunk_indices_bad(rows: torch.Tensor, limit: int) -> torch.Tensor:
    """Whether a row (one chunk's received indices) leaves ``[0, limit)`` or fails to increase strictly: a 0-d
    bool tensor, so that callers checking several groups of chunks sync with the host once."""
    return (rows >= limit).any() | (rows[:, 1:] <= rows[:, :-1]).any()


def chunk_indices_ok(rows: torch.Tensor, limit: int) -> bool:
    """Each row (one chunk's received indices) lies in ``[0, limit)`` and is strictly increasing."""
    return not rows.numel() or not bool(chunk_indices_bad(rows, limit))


def put_floats(x: torch.Tensor, mem: memoryview, base: int, dtype: torch.dtype, limit: Optional[float],
               h: Any) -> None:
    """``x`` cast to ``dtype`` at ``mem[base:]``, piece by piece: each piece checked finite (values beyond
    ``limit`` clamped to it) and, with ``h``, hashed while it is in cache. A NaN or Inf raises ValueError."""
    size = torch.empty((), dtype=dtype).element_size()
    n = x.numel()
    for a in range(0, n, PIECE):
        b = min(a + PIECE, n)
        src = x[a:b]
        dst = wire.tensor_view(mem, base + size * a, base + size * b, dtype)
        if limit is None:
            dst.copy_(src)
            ok = finite(dst)
        else:
            ok = finite(src)
            dst.copy_(src.clamp(-limit, limit))
        if not ok:
            raise ValueError("cannot encode a tensor with NaN or Inf values")
        if h is not None:
            h.update(mem[base + size * a:base + size * b])
