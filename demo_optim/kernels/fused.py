"""DeMo's Triton kernels and their launchers: one ``s1 x s2`` block per program.

Each kernel does its block's DCT (or inverse DCT) as two small matmuls (``tl.dot`` at IEEE fp32 precision, so
it rounds as the torch reference in :mod:`demo_optim.kernels.reference` does) and picks the k largest
magnitudes with the same bit-pattern binary search as ``diloco.compress.kernels`` (``select_topk``): the
indices equal the reference's, ties going to the lowest index. The kernels run for blocks whose sides are
powers of two >= 16 (:func:`kernel_fits`; matrices, 64 x 64 by default); vectors and odd blocks take the
reference, as do blocks a device refuses for want of shared memory (after one warning: :data:`REFUSED`).
Tests run the kernels with ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from diloco.compress import ChunkPlan, dct_basis
from diloco.compress.kernels import HAVE_TRITON, require_triton
from demo_optim.kernels.reference import stacked_plan, stacked_view

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - platform without Triton
    class OutOfResources(Exception):  # type: ignore[no-redef]
        """Never raised: there are no kernels to run."""


def kernel_fits(plan: ChunkPlan) -> bool:
    """Whether the kernels take ``plan``'s blocks: sides that are powers of two >= 16, at most 16384 elements."""
    return all(s >= 16 and s & (s - 1) == 0 for s in (plan.s1, plan.s2)) and plan.s1 * plan.s2 <= 16384


# (kernel, device, s1, s2) that a device could not run: a large block's DCT operands may need more shared memory
# than the device gives one program, and Triton refuses the launch. Those blocks take the reference path.
REFUSED: set[tuple[str, str, int, int]] = set()


def _launch(kernel: object, name: str, device: torch.device, plan: ChunkPlan, *args: object, **meta: object) -> bool:
    """Launch ``kernel`` over ``plan``'s blocks; False, with nothing written, where the device lacks the resources
    for its block (Triton refuses it before it runs): remembered in :data:`REFUSED`, and said once."""
    key = (name, str(device), plan.s1, plan.s2)
    if key in REFUSED:
        return False
    try:
        kernel[(plan.num_chunks,)](*args, **meta)
    except OutOfResources as e:
        REFUSED.add(key)
        warnings.warn(f"DeMo: {device} cannot run the {name} kernel on {plan.s1} x {plan.s2} blocks ({e}); "
                      f"those blocks take the slower torch path (a smaller optim.compression_chunk fits)",
                      stacklevel=2)
        return False
    return True


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from diloco.compress.kernels import select_topk

    @triton.jit
    def _block(pid, R, C, NBR, NBC, S1: tl.constexpr, S2: tl.constexpr):
        per = NBR * NBC
        lead = pid // per
        rem = pid % per
        rr = (rem // NBC) * S1 + tl.arange(0, S1)
        cc = (rem % NBC) * S2 + tl.arange(0, S2)
        offs = lead.to(tl.int64) * R * C + rr[:, None].to(tl.int64) * C + cc[None, :]  # no int32 overflow
        mask = (rr < R)[:, None] & (cc < C)[None, :]
        return offs, mask

    @triton.jit
    def _encode_kernel(delta_ptr, d1_ptr, d2_ptr, idx_ptr, val_ptr, R, C, NBR, NBC,
                       S1: tl.constexpr, S2: tl.constexpr, K: tl.constexpr):
        pid = tl.program_id(0)
        offs, mask = _block(pid, R, C, NBR, NBC, S1, S2)
        b = tl.load(delta_ptr + offs, mask=mask, other=0.0)
        i1 = tl.arange(0, S1)
        i2 = tl.arange(0, S2)
        d1 = tl.load(d1_ptr + i1[:, None] * S1 + i1[None, :])
        d2 = tl.load(d2_ptr + i2[:, None] * S2 + i2[None, :])
        x = tl.dot(tl.dot(d1, b, input_precision="ieee"), tl.trans(d2), input_precision="ieee")
        flat = tl.reshape(x, (S1 * S2,))
        sel, rank = select_topk(tl.abs(flat).to(tl.int32, bitcast=True), K)
        pos = pid.to(tl.int64) * K + rank
        tl.store(idx_ptr + pos, tl.arange(0, S1 * S2), mask=sel)
        tl.store(val_ptr + pos, flat, mask=sel)
        kept = tl.reshape(tl.where(sel, flat, 0.0), (S1, S2))
        rec = tl.dot(tl.dot(tl.trans(d1), kept, input_precision="ieee"), d2, input_precision="ieee")
        tl.store(delta_ptr + offs, b - rec, mask=mask)

    @triton.jit
    def _step_encode_kernel(g_ptr, c_ptr, d1_ptr, d2_ptr, idx_ptr, val_ptr, ok_ptr, decay, R, C, NBR, NBC,
                            S1: tl.constexpr, S2: tl.constexpr, K: tl.constexpr, HAS_GRAD: tl.constexpr):
        """One block: ``c = decay * c + d1 @ g @ d2^T`` (lr folded into d2), top-k of |c| out, zeroed in c.
        Where the flag at ``ok_ptr`` is 0, c stays as it was (the top-k is taken of it, and its selected entries
        are not zeroed) and what goes out is not to be sent. Every step runs this
        one compiled kernel, flagged or not, so a step decided on the device rounds as one decided on the host."""
        pid = tl.program_id(0)
        i1 = tl.arange(0, S1)
        i2 = tl.arange(0, S2)
        coffs = pid.to(tl.int64) * (S1 * S2) + i1[:, None] * S2 + i2[None, :]
        was = tl.load(c_ptr + coffs)
        c = was * decay
        if HAS_GRAD:
            offs, mask = _block(pid, R, C, NBR, NBC, S1, S2)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            d1 = tl.load(d1_ptr + i1[:, None] * S1 + i1[None, :])
            d2 = tl.load(d2_ptr + i2[:, None] * S2 + i2[None, :])
            c = c + tl.dot(tl.dot(d1, g, input_precision="ieee"), tl.trans(d2), input_precision="ieee")
        go = tl.load(ok_ptr) != 0
        c = tl.where(go, c, was)
        flat = tl.reshape(c, (S1 * S2,))
        sel, rank = select_topk(tl.abs(flat).to(tl.int32, bitcast=True), K)
        pos = pid.to(tl.int64) * K + rank
        tl.store(idx_ptr + pos, tl.arange(0, S1 * S2), mask=sel)
        tl.store(val_ptr + pos, flat, mask=sel)
        tl.store(c_ptr + coffs, tl.reshape(tl.where(sel & go, 0.0, flat), (S1, S2)))

    @triton.jit
    def _decode_sign_kernel(agg_ptr, p_ptr, d1_ptr, d2_ptr, lr, R, C, NBR, NBC,
                            S1: tl.constexpr, S2: tl.constexpr, APPLY: tl.constexpr):
        pid = tl.program_id(0)
        offs, mask = _block(pid, R, C, NBR, NBC, S1, S2)
        i1 = tl.arange(0, S1)
        i2 = tl.arange(0, S2)
        a = tl.load(agg_ptr + pid.to(tl.int64) * S1 * S2 + i1[:, None] * S2 + i2[None, :])
        d1 = tl.load(d1_ptr + i1[:, None] * S1 + i1[None, :])
        d2 = tl.load(d2_ptr + i2[:, None] * S2 + i2[None, :])
        u = tl.dot(tl.dot(tl.trans(d1), a, input_precision="ieee"), d2, input_precision="ieee")
        s = tl.where(u > 0, 1.0, tl.where(u < 0, -1.0, 0.0))
        if APPLY:  # p -= lr * s
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(p_ptr + offs, (p - lr * s).to(p_ptr.dtype.element_ty), mask=mask)
        else:  # the signs themselves, into a parameter-shaped output
            tl.store(p_ptr + offs, s.to(p_ptr.dtype.element_ty), mask=mask)


def _grid(plan: ChunkPlan) -> tuple[int, int, int]:
    return plan.num_chunks, plan.rows_padded // plan.s1, plan.cols_padded // plan.s2


def encode_triton(delta: torch.Tensor, plan: ChunkPlan) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`encode_ref` in one launch; None, with ``delta`` untouched, where the device cannot run the block."""
    require_triton(delta)
    if not kernel_fits(plan) or delta.dtype != torch.float32 or not delta.is_contiguous():
        raise ValueError("the DeMo kernel needs a contiguous fp32 tensor with power-of-two blocks >= 16")
    n, nbr, nbc = _grid(plan)
    idx = torch.empty(n * plan.k, dtype=torch.int32, device=delta.device)
    vals = torch.empty(n * plan.k, dtype=torch.float32, device=delta.device)
    d1, d2 = dct_basis(plan.s1, delta.device), dct_basis(plan.s2, delta.device)
    if not _launch(_encode_kernel, "encode", delta.device, plan, delta, d1, d2, idx, vals, plan.rows, plan.cols,
                   nbr, nbc, S1=plan.s1, S2=plan.s2, K=plan.k):
        return None
    return idx, vals


def decode_sign_triton(agg: torch.Tensor, param: torch.Tensor, lr: Optional[float], plan: ChunkPlan) -> bool:
    """``param -= lr * sign(IDCT(agg))``; with ``lr`` None, ``param = sign(IDCT(agg))``. False, with ``param``
    untouched, where the device cannot run the block."""
    require_triton(param)
    if not kernel_fits(plan) or not param.is_contiguous():
        raise ValueError("the DeMo kernel needs a contiguous tensor with power-of-two blocks >= 16")
    n, nbr, nbc = _grid(plan)
    d1, d2 = dct_basis(plan.s1, param.device), dct_basis(plan.s2, param.device)
    return _launch(_decode_sign_kernel, "decode", param.device, plan, agg.float().contiguous(), param, d1, d2,
                   float(lr or 0.0), plan.rows, plan.cols, nbr, nbc, S1=plan.s1, S2=plan.s2, APPLY=lr is not None)


def step_encode_triton(grads: list[Optional[torch.Tensor]], coeffs: torch.Tensor, plans: list[ChunkPlan],
                       decay: float, lr: float, ok: Optional[torch.Tensor] = None
                       ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`step_encode_batch_ref` of same-shaped parameters in one launch: their gradients read in place when
    they lie back to back in one buffer, else stacked (a copy). ``ok``: as in
    :func:`~demo_optim.kernels.dispatch.step_encode_many` (or already as one uint8), read by the kernel. None,
    with ``coeffs`` untouched, where the device cannot run the block (it says so at the first launch)."""
    require_triton(coeffs)
    plan = stacked_plan(plans[0], len(plans))
    if not kernel_fits(plan) or plan.padded or coeffs.dtype != torch.float32 or not coeffs.is_contiguous():
        raise ValueError("the DeMo step kernel needs unpadded power-of-two blocks >= 16 and fp32 coefficients")
    have = [g for g in grads if g is not None]
    g = None
    if have:
        g = stacked_view(grads) if len(have) == len(grads) else None
        if g is None:
            g = torch.stack([x if x is not None else torch.zeros_like(have[0]) for x in grads])
        g = g.contiguous()
    n, nbr, nbc = _grid(plan)
    idx = torch.empty(n * plan.k, dtype=torch.int32, device=coeffs.device)
    vals = torch.empty(n * plan.k, dtype=torch.float32, device=coeffs.device)
    d1, d2 = dct_basis(plan.s1, coeffs.device), dct_basis(plan.s2, coeffs.device) * lr
    flag = _go(coeffs.device) if ok is None else ok if ok.dtype == torch.uint8 else ok.reshape(1).to(torch.uint8)
    if not _launch(_step_encode_kernel, "step", coeffs.device, plan, g if g is not None else coeffs, coeffs, d1, d2,
                   idx, vals, flag, float(decay), plan.rows, plan.cols, nbr, nbc, S1=plan.s1, S2=plan.s2, K=plan.k,
                   HAS_GRAD=g is not None):
        return None
    return idx, vals


_GO: dict[torch.device, torch.Tensor] = {}


def _go(device: torch.device) -> torch.Tensor:
    """The step kernel's flag for a step nobody flagged: a 1, one per device, made once."""
    flag = _GO.get(device)
    if flag is None:
        flag = _GO[device] = torch.ones(1, dtype=torch.uint8, device=device)
    return flag
