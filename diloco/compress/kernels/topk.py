"""Chunked top-k by magnitude with the error-feedback update in the same pass.

For chunk c (``chunk`` values; the last chunk may be shorter, L values):

    acc  = x + decay * residual          (x alone without a residual)
    keep = the min(k, L) entries of acc with the largest |acc|; among equal
           magnitudes the lowest index wins
    indices (int32, ascending within the chunk, relative to it), values = acc[keep]
    residual <- acc with the kept entries set to 0   (what was not sent waits for the next round)

Indices and the selection are byte-identical between the kernel and the reference:
both pick by the exact bit pattern of |acc|, and the kernel finds the k-th largest by a
binary search over those bits (no sort), so selection costs 31 passes over registers.
"""

from __future__ import annotations

from typing import Optional

import torch

from diloco.compress.bits import bits_for
from diloco.compress.kernels.backend import HAVE_TRITON, require_triton, use_triton


def check_chunk(chunk: int, k: Optional[int] = None) -> None:
    """The bounds the kernel supports: ``chunk`` a power of two in [2, 65536] and (when given) 1 <= k <= chunk."""
    if chunk < 2 or chunk > 65536 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two in [2, 65536], got {chunk}")
    if k is not None and not 1 <= k <= chunk:
        raise ValueError(f"k must be in [1, chunk={chunk}], got {k}")


def selected_count(n: int, chunk: int, k: int) -> int:
    full, last = divmod(n, chunk)
    return full * k + min(k, last)


PIECE = 1 << 20  # the reference selects in pieces of about this many values: its temporaries stay this size


def _accumulate_(x: torch.Tensor, residual: Optional[torch.Tensor], decay: float) -> torch.Tensor:
    """``x + decay * residual``, made in ``residual`` itself (no temporary of x's size); ``x`` without one."""
    if residual is None:
        return x.float()  # read only: the values are gathered out of it
    if decay == 1.0:
        return residual.add_(x.float())  # r + x is x + r, to the bit
    return residual.mul_(decay).add_(x.float())  # two roundings, as in the kernel (no FMA)


def _top_by_bits(acc: torch.Tensor, nchunks: int, chunk: int, kk: int) -> torch.Tensor:
    """``(nchunks, kk)`` indices (int64, ascending) of the selection, by the rule itself: each entry's key is the
    bit pattern of |acc| with the reversed index below it, so the keys are distinct and ties go to the lowest
    index. ``acc`` holds ``nchunks`` chunks, the last one possibly short (its missing entries rank last)."""
    ib = bits_for(chunk)
    keys = acc.abs().view(torch.int32).to(torch.int64)
    pad = nchunks * chunk - acc.numel()
    if pad:
        keys = torch.cat([keys, keys.new_full((pad,), -1)])
    j = torch.arange(chunk, device=acc.device, dtype=torch.int64)
    keys = (keys.view(nchunks, chunk) << ib) | (chunk - 1 - j)
    return torch.topk(keys, kk, dim=1, sorted=False).indices.sort(dim=1).values


GROUP = 8  # values per group in the CPU prefilter of :func:`_top_indices`


def _top_indices(acc: torch.Tensor, nchunks: int, chunk: int, kk: int) -> torch.Tensor:
    """:func:`_top_by_bits`, faster on the CPU: a top-(kk+1) of the magnitudes themselves, less its least, picks
    the same entries wherever that least is unique among the kk+1 (then the kk-th largest is strictly above
    the rest, and nothing was left to a tie). Chunks with a tie there (such as runs of zeros) or a NaN (ranked
    first, so it would make the least NaN) go by the bits, as does a short last chunk. On other devices the bits
    alone: the check would cost a host sync there.

    Where the chunk is large against kk, the top-(kk+1) looks at a few candidates only: each chunk is cut into
    groups of :data:`GROUP` values (a stride apart), and the candidates are the groups whose largest magnitude is
    among the kk+1 largest group maxima. Every entry above the (kk+1)-th largest magnitude lies in such a group
    (otherwise kk+1 chosen groups would each hold an entry at least as large), and the candidates hold at least
    kk+1 entries at or above it, so the candidates' top-(kk+1) has the same magnitudes as the chunk's."""
    full = acc.numel() // chunk
    if acc.device.type != "cpu" or full == 0 or kk == chunk:
        return _top_by_bits(acc, nchunks, chunk, kk)
    rows = acc[:full * chunk].view(full, chunk)
    groups = chunk // GROUP
    if chunk % GROUP == 0 and 4 * (kk + 1) <= groups:  # it pays: a quarter of the chunk or less is looked at
        mags = rows.abs().view(full, GROUP, groups)  # group g: entries g, g + groups, g + 2 groups, ...
        best = torch.topk(mags.amax(dim=1), kk + 1, dim=1, sorted=False).indices  # (full, kk+1) groups
        cand = mags.gather(2, best[:, None, :].expand(full, GROUP, kk + 1)).view(full, -1)
        where = (best[:, None, :] + torch.arange(0, chunk, groups, device=acc.device)[None, :, None]).view(full, -1)
    else:
        cand, where = rows.abs(), None
    top = torch.topk(cand, kk + 1, dim=1, sorted=False)
    least = top.values.amin(dim=1, keepdim=True)
    loose = ((top.values == least).sum(dim=1) > 1) | least[:, 0].isnan()
    idx = top.indices.gather(1, torch.topk(top.values, kk, dim=1, sorted=False).indices)
    if where is not None:
        idx = where.gather(1, idx)
    redo = loose.nonzero()[:, 0]
    if redo.numel():
        idx[redo] = _top_by_bits(rows[redo].reshape(-1), redo.numel(), chunk, kk)
    idx = idx.sort(dim=1).values
    if nchunks > full:
        idx = torch.cat([idx, _top_by_bits(acc[full * chunk:], 1, chunk, kk)])
    return idx


def topk_chunks_ref(x: torch.Tensor, chunk: int, k: int, residual: Optional[torch.Tensor] = None,
                    decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int32, values fp32) of ``selected_count(n, chunk, k)`` entries; updates ``residual`` in place."""
    x = x.reshape(-1)
    n = x.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int32, device=x.device), x.new_zeros(0, dtype=torch.float32)
    acc = _accumulate_(x, residual, decay)  # with a residual: the residual itself
    nchunks = -(-n // chunk)
    per = max(1, PIECE // chunk)  # chunks a piece
    idx = torch.cat([_top_indices(acc[a * chunk:(a + per) * chunk], min(per, nchunks - a), chunk, min(k, chunk))
                     for a in range(0, nchunks, per)])
    flat = (idx + torch.arange(nchunks, device=x.device)[:, None] * chunk).reshape(-1)
    count = selected_count(n, chunk, k)
    idx, flat = idx.reshape(-1)[:count], flat[:count]
    values = acc[flat]
    if residual is not None:
        acc[flat] = 0.0  # what was sent leaves the residual; the rest waits there
    return idx.to(torch.int32), values


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def select_topk(bits, k):
        """Mask of the k largest of ``bits`` (|x| as int32 bit patterns; -1 for padding; ties: lowest index)
        and each kept entry's position among the kept ones. Binary search for the k-th largest: no sort. The
        search spans every non-negative pattern, NaN's above Inf's included (as in the reference's ranking), so
        exactly k are kept whatever the values: a NaN cannot make it keep more and write past its k slots."""
        lo = tl.zeros((), tl.int32)
        hi = tl.full((), 0x7FFFFFFF, tl.int32)
        for _ in range(31):
            gap = hi - lo  # hi - lo + 1 would overflow int32 on the first pass
            mid = lo + (gap >> 1) + (gap & 1)
            ok = tl.sum((bits >= mid).to(tl.int32), axis=0) >= k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        gt = bits > lo
        eq = bits == lo
        need = k - tl.sum(gt.to(tl.int32), axis=0)
        sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))
        return sel, tl.cumsum(sel.to(tl.int32), axis=0) - 1

    @triton.jit
    def _topk_kernel(x_ptr, res_ptr, idx_ptr, val_ptr, n, decay, CHUNK: tl.constexpr, K: tl.constexpr,
                     HAS_RES: tl.constexpr, DECAY_ONE: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * CHUNK
        offs = tl.arange(0, CHUNK)
        m = base + offs < n
        acc = tl.load(x_ptr + base + offs, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + base + offs, mask=m, other=0.0)
            if DECAY_ONE:
                acc = acc + r
            else:
                acc = r * decay + acc
        bits = tl.where(m, tl.abs(acc).to(tl.int32, bitcast=True), -1)
        length = tl.minimum(n - base, CHUNK).to(tl.int32)
        sel, pos = select_topk(bits, tl.minimum(length, K))
        out = pid.to(tl.int64) * K + pos
        tl.store(idx_ptr + out, offs, mask=sel)
        tl.store(val_ptr + out, acc, mask=sel)
        if HAS_RES:
            tl.store(res_ptr + base + offs, tl.where(sel, 0.0, acc), mask=m)


TOPK_WARPS = 2  # warps per chunk's program: 2 was the fastest of 1-32 on an H100 (benchmarks/results/codecs_gpu.md)


def topk_chunks_triton(x: torch.Tensor, chunk: int, k: int, residual: Optional[torch.Tensor] = None,
                       decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x)
    x = x.reshape(-1).float().contiguous()
    n = x.numel()
    count = selected_count(n, chunk, k)
    idx = torch.empty(count, dtype=torch.int32, device=x.device)
    values = torch.empty(count, dtype=torch.float32, device=x.device)
    if n:
        if residual is not None and not residual.is_contiguous():
            raise ValueError("the residual must be contiguous")
        _topk_kernel[(-(-n // chunk),)](x, residual if residual is not None else x, idx, values, n, float(decay),
                                        CHUNK=chunk, K=min(k, chunk), HAS_RES=residual is not None,
                                        DECAY_ONE=decay == 1.0, enable_fp_fusion=False, num_warps=TOPK_WARPS)
    return idx, values


def topk_chunks(x: torch.Tensor, chunk: int, k: int, residual: Optional[torch.Tensor] = None,
                decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA tensors, the torch reference elsewhere."""
    fn = topk_chunks_triton if use_triton(x) else topk_chunks_ref
    return fn(x, chunk, k, residual, decay)
