"""DeMo's hot paths, each a Triton kernel beside a torch reference with the same signature.

* ``step_encode_many(grads, moms, plans, decays, lrs)``: one step of DeMo's momentum and its encode
  for every parameter, the (indices int32, values fp32) concatenated. Where a parameter's blocks
  are whole (no padding) its momentum is kept as its DCT coefficients, ``(num_chunks, s1*s2)``::

      C = decay * C + DCT(lr * grad)      (the DCT is linear: C stays the DCT of the momentum)
      send the top-k |C| of each chunk, then set them to 0 in C

  which is the published update (``delta = decay*delta + lr*grad``, send the top-k of
  ``DCT(delta)``, ``delta -= IDCT(sent)``) without its inverse DCT: what was sent leaves the
  momentum by zeroing its coefficients. A padded parameter keeps its momentum ``delta`` in the
  parameter's own shape (cropping after the inverse DCT drops what fell on the padding) and goes
  through ``encode``.
* ``encode(delta, plan)``: DCT of every chunk, top-k per chunk by magnitude (ties: lowest
  index), and ``delta -= IDCT(what was kept)`` in the same pass; returns (indices int32,
  values fp32), ``plan.k`` per chunk, indices ascending within their chunk.
* ``decode_sign_(agg, param, lr, plan)``: ``param -= lr * sign(IDCT(agg))``.
* ``encode_many`` / ``decode_sign_many``: the same for a list of parameters, as the optimizer
  calls them. Where the kernel runs it takes one launch per run of same-shaped parameters; the
  reference path batches every run of consecutive parameters with the same block (s1, s2, k):
  their blocks are stacked, so the DCT, the top-k and the IDCT are one call each for the run.
* ``signs_many``: ``sign(IDCT(agg))`` of every parameter into parameter-shaped outputs, the
  direction that ``decode_sign_many`` applies (simulated workers compute it once and share it).

The kernel handles one s1 x s2 block per program with two small matmuls each way
(``tl.dot`` at IEEE fp32 precision) and the same bit-pattern binary search for the k-th
largest magnitude as ``diloco.compress.kernels`` (``select_topk``). It runs for CUDA tensors whose block
sides are powers of two >= 16 (matrices; 64 x 64 by default); vectors and odd blocks use
the reference, as do blocks the device refuses for want of shared memory (after one warning:
:data:`REFUSED`). Tests run it with ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Optional

import torch

from diloco.compress import ChunkPlan, dct_basis, end_to_end, from_chunks, to_chunks
from diloco.compress.kernels import HAVE_TRITON, require_triton, topk_chunks_ref, use_triton

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - platform without Triton
    class OutOfResources(Exception):  # type: ignore[no-redef]
        """Never raised: there are no kernels to run."""


def kernel_fits(plan: ChunkPlan) -> bool:
    return all(s >= 16 and s & (s - 1) == 0 for s in (plan.s1, plan.s2)) and plan.s1 * plan.s2 <= 16384


# (kernel, device, s1, s2) that a device could not run: a 128 x 128 block's DCT operands need more shared memory
# than a consumer GPU gives a program (about 100 KB; an H100 gives 227 KB). Those blocks take the reference path.
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


# ---- torch reference --------------------------------------------------------------------------
def encode_ref(delta: torch.Tensor, plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
    coeffs = to_chunks(delta.float(), plan)
    idx, vals = topk_chunks_ref(coeffs.reshape(-1), plan.chunk_size, plan.k)
    sent = torch.zeros_like(coeffs).scatter_(1, idx.long().view(plan.num_chunks, plan.k), vals.view(plan.num_chunks, plan.k))
    delta.sub_(from_chunks(sent, plan).to(delta.dtype))
    return idx, vals


def decode_sign_ref(agg: torch.Tensor, param: torch.Tensor, lr: float, plan: ChunkPlan) -> None:
    update = from_chunks(agg, plan)
    param.add_(torch.sign(update).to(param.dtype), alpha=-lr)


def _to_blocks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``(num_chunks, s1, s2)``: x's blocks in chunk order (zero-padded to whole blocks), not yet transformed."""
    m = x.reshape(plan.lead, plan.rows, plan.cols)
    if plan.padded:
        m = torch.nn.functional.pad(m, (0, plan.cols_padded - plan.cols, 0, plan.rows_padded - plan.rows))
    nr, nc = plan.rows_padded // plan.s1, plan.cols_padded // plan.s2
    return m.view(plan.lead, nr, plan.s1, nc, plan.s2).transpose(2, 3).reshape(-1, plan.s1, plan.s2)


def _from_blocks(b: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Inverse of :func:`_to_blocks` (padding cropped), in the parameter's shape."""
    nr, nc = plan.rows_padded // plan.s1, plan.cols_padded // plan.s2
    m = b.view(plan.lead, nr, nc, plan.s1, plan.s2).transpose(2, 3).reshape(plan.lead, plan.rows_padded,
                                                                            plan.cols_padded)
    if plan.padded:
        m = m[:, :plan.rows, :plan.cols]
    return m.reshape(plan.shape)


def _runs(plans: list[ChunkPlan], kernel: list[bool], lrs: Optional[list[float]] = None) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive parameters done in one pass: on the reference path those that share
    (s1, s2, k); on the kernel path those of one shape (one launch over them stacked), and one lr if given."""
    runs: list[tuple[int, int]] = []
    for j, plan in enumerate(plans):
        prev = plans[j - 1] if j else None
        same = runs and runs[-1][1] == j and kernel[j] == kernel[j - 1] and \
            (plan.s1, plan.s2, plan.k) == (prev.s1, prev.s2, prev.k)
        if same and kernel[j]:
            same = plan.shape == prev.shape and (lrs is None or lrs[j] == lrs[j - 1])
        if same:
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


def stacked_view(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """Tensors of one shape that lie back to back in one buffer, as one ``(len, *shape)`` view; else None."""
    first = tensors[0]
    n, ptr, off = first.numel(), first.untyped_storage().data_ptr(), first.storage_offset()
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != off + i * n):
            return None
    return first.as_strided((len(tensors), *first.shape), (n, *first.stride()), off)


def _stacked_plan(plan: ChunkPlan, count: int) -> ChunkPlan:
    return replace(plan, shape=(count, *plan.shape), lead=plan.lead * count)


def _blockwise(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """A parameter-shaped tensor of an unpadded plan as ``(lead, nr, nc, s1, s2)``: a view of its blocks in chunk
    order, for in-place updates without a copy."""
    nr, nc = plan.rows // plan.s1, plan.cols // plan.s2
    return x.view(plan.lead, nr, plan.s1, nc, plan.s2).transpose(2, 3)


def _put_blocks_(x: torch.Tensor, blocks: torch.Tensor, plan: ChunkPlan, alpha: Optional[float]) -> None:
    """``x += alpha * blocks`` (blocks in chunk order, as :func:`_to_blocks` gives them), in place; ``x = blocks``
    when ``alpha`` is None."""
    if plan.padded or not x.is_contiguous():
        b = _from_blocks(blocks, plan).to(x.dtype)
        target = x
    else:
        nr, nc = plan.rows // plan.s1, plan.cols // plan.s2
        b = blocks.view(plan.lead, nr, nc, plan.s1, plan.s2).to(x.dtype)
        target = _blockwise(x, plan)
    if alpha is None:
        target.copy_(b)
    else:
        target.add_(b, alpha=alpha)


def _stacked_blocks(xs: list[Optional[torch.Tensor]], plans: list[ChunkPlan]) -> torch.Tensor:
    """``(num_chunks, s1, s2)`` fp32: the blocks of parameter-shaped tensors that share (s1, s2), in chunk order,
    each copied once into its place (zeros for a missing one, such as a parameter without a gradient)."""
    plan = plans[0]
    ref = next(x for x in xs if x is not None)
    blocks = torch.empty(sum(p.num_chunks for p in plans), plan.s1, plan.s2, dtype=torch.float32, device=ref.device)
    at = 0
    for x, p in zip(xs, plans):
        part = blocks[at:at + p.num_chunks]
        if x is None:
            part.zero_()
        elif p.padded or not x.is_contiguous():
            part.copy_(_to_blocks(x.float(), p))
        else:
            part.view(p.lead, p.rows // p.s1, p.cols // p.s2, p.s1, p.s2).copy_(_blockwise(x, p))
        at += p.num_chunks
    return blocks


def encode_batch_ref(deltas: list[torch.Tensor], plans: list[ChunkPlan]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_ref` of parameters that share (s1, s2, k), as one stacked pass; the results concatenated.

    What was sent leaves the momentum as a sum of k outer products per block (``D1[r]^T D2[c]`` times the
    value, for each kept coefficient (r, c)): a quarter of the work of an inverse DCT of the mostly-zero block
    at k = 32 of 64 x 64, and the same result to rounding."""
    plan = plans[0]
    blocks = _stacked_blocks(deltas, plans)
    d1, d2 = dct_basis(plan.s1, blocks.device), dct_basis(plan.s2, blocks.device)
    coeffs = (d1 @ blocks @ d2.T).reshape(-1, plan.chunk_size)
    idx, vals = topk_chunks_ref(coeffs.reshape(-1), plan.chunk_size, plan.k)
    n = coeffs.shape[0]
    where = idx.view(n, plan.k).long()
    rows = d1[where // plan.s2] * vals.view(n, plan.k, 1)  # (n, k, s1)
    rec = rows.transpose(1, 2) @ d2[where % plan.s2]  # (n, s1, s2)
    pieces = rec.split([p.num_chunks for p in plans]) if len(plans) > 1 else (rec,)
    for d, p, r in zip(deltas, plans, pieces):
        _put_blocks_(d, r, p, -1.0)
    return idx, vals


def step_encode_batch_ref(grads: list[Optional[torch.Tensor]], coeffs: torch.Tensor, plans: list[ChunkPlan],
                          decay: float, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One momentum step and encode of unpadded parameters that share (s1, s2, k), their coefficients back to
    back in ``coeffs`` (flat): ``C = decay * C + DCT(lr * grad)``, the top-k of each chunk returned and zeroed
    in C. The DCT of every block is two matmuls, with lr folded into the column basis."""
    plan = plans[0]
    if all(g is None for g in grads):
        x = torch.zeros_like(coeffs)
    else:
        d1, d2 = dct_basis(plan.s1, coeffs.device), dct_basis(plan.s2, coeffs.device)
        x = (d1 @ _stacked_blocks(grads, plans) @ (d2.T * lr)).view(-1)
    return topk_chunks_ref(x, plan.chunk_size, plan.k, residual=coeffs, decay=decay)


def decode_sign_batch_ref(agg: torch.Tensor, params: list[torch.Tensor], lrs: Optional[list[float]],
                          plans: list[ChunkPlan]) -> None:
    """:func:`decode_sign_ref` of parameters that share (s1, s2), their chunks back to back in ``agg``; with
    ``lrs`` None, the signs are written into ``params`` instead (:func:`signs_many`)."""
    plan = plans[0]
    d1, d2 = dct_basis(plan.s1, agg.device), dct_basis(plan.s2, agg.device)
    signs = torch.sign(d1.T @ agg.reshape(-1, plan.s1, plan.s2).float() @ d2)
    pieces = signs.split([p.num_chunks for p in plans]) if len(plans) > 1 else (signs,)
    for j, (param, p, s) in enumerate(zip(params, plans, pieces)):
        _put_blocks_(param, s, p, None if lrs is None else -lrs[j])


# ---- Triton -----------------------------------------------------------------------------------
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


# same-shaped gradients (and parameters, to decode) up to this size are stacked for one launch; larger ones launch
# each (unless they lie back to back in one buffer already)
STACK_BYTES = 64 << 20


def step_encode_triton(grads: list[Optional[torch.Tensor]], coeffs: torch.Tensor, plans: list[ChunkPlan],
                       decay: float, lr: float, ok: Optional[torch.Tensor] = None
                       ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`step_encode_batch_ref` of same-shaped parameters in one launch: their gradients read in place when
    they lie back to back in one buffer, else stacked (a copy), or, above :data:`STACK_BYTES` of them, a launch
    per parameter. ``ok``: as in :func:`step_encode_many` (or already as one uint8), read by the kernel. None,
    with ``coeffs`` untouched, where the device cannot run the block (it says so at the first launch)."""
    require_triton(coeffs)
    plan = _stacked_plan(plans[0], len(plans))
    if not kernel_fits(plan) or plan.padded or coeffs.dtype != torch.float32 or not coeffs.is_contiguous():
        raise ValueError("the DeMo step kernel needs unpadded power-of-two blocks >= 16 and fp32 coefficients")
    have = [g for g in grads if g is not None]
    g = None
    if have:
        g = stacked_view(grads) if len(have) == len(grads) else None
        if g is None and len(grads) > 1 and sum(x.numel() * x.element_size() for x in have) > STACK_BYTES:
            n = plans[0].num_chunks * plans[0].chunk_size  # large gradients: a launch each rather than a copy
            pieces = []
            for i, x in enumerate(grads):
                piece = step_encode_triton([x], coeffs[i * n:(i + 1) * n], plans[:1], decay, lr, ok)
                if piece is None:  # at the first launch: the later ones would run the same compiled kernel
                    return None
                pieces.append(piece)
            return torch.cat([i for i, _ in pieces]), torch.cat([v for _, v in pieces])
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


def step_encode_many(grads: list[Optional[torch.Tensor]], moms: list[torch.Tensor], plans: list[ChunkPlan],
                     decays: list[float], lrs: list[float], triton: Optional[bool] = None,
                     ok: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of DeMo's momentum and its encode for every parameter, in the given order; the (indices,
    values) concatenated. ``moms[j]``: for an unpadded plan the momentum's coefficients ``(num_chunks,
    chunk_size)`` (see the module's docstring), for a padded one the momentum in the parameter's shape.

    Runs of consecutive parameters of one kind, decay and lr go together: the coefficients of a run are
    worked on in place when they lie back to back in one buffer (DeMo keeps them so), else through a copy
    that is written back; on the kernel path each run of one shape is one launch. ``triton`` as in
    :func:`encode_many`.

    ``ok``: a 0-d bool tensor on the device, decided there (the gradients are finite). Where it is False every
    momentum is left bit for bit as it was and the (indices, values) are not to be sent (indices still lie in
    their chunks); nothing is read back to the host. The kernel reads the flag; the reference paths keep a copy
    of what they change and put it back where the flag is False."""
    flag = None
    if ok is not None:
        ok = ok.reshape(()).to(torch.bool)
        flag = ok.reshape(1).to(torch.uint8)  # what the kernel reads: made once for every launch
    out_i, out_v = [], []
    start = 0
    while start < len(plans):
        end = start + 1
        key = (plans[start].padded, decays[start], lrs[start])
        while end < len(plans) and (plans[end].padded, decays[end], lrs[end]) == key:
            end += 1
        gs, ms, ps = grads[start:end], moms[start:end], plans[start:end]
        decay, lr = key[1:]
        if key[0]:  # the momentum in the parameters' shape: the published update, then encode
            kept = _keep(ms) if ok is not None else None
            torch._foreach_mul_(ms, decay)
            with_grad = [(m, g) for m, g in zip(ms, gs) if g is not None]
            if with_grad:
                torch._foreach_add_([m for m, _ in with_grad], [g.float() for _, g in with_grad], alpha=lr)
            i, v = encode_many(ms, ps, triton)  # NaN from a refused gradient is safe: select_topk keeps exactly k
            if kept is not None:
                _put_back(kept, ok)
            out_i.append(i)
            out_v.append(v)
        else:
            kernel = [(use_triton(m) if triton is None else triton) and kernel_fits(p) for m, p in zip(ms, ps)]
            for a, b in _runs(ps, kernel):
                flat = end_to_end(ms[a:b])
                c = torch.cat([m.reshape(-1) for m in ms[a:b]]) if flat is None else flat
                done = step_encode_triton(gs[a:b], c, ps[a:b], decay, lr, flag) if kernel[a] else None
                if done is not None:
                    i, v = done
                else:
                    kept = _keep([c]) if ok is not None else None
                    i, v = step_encode_batch_ref(gs[a:b], c, ps[a:b], decay, lr)
                    if kept is not None:
                        _put_back(kept, ok)
                if flat is None:
                    torch._foreach_copy_(ms[a:b], [x.view_as(m) for x, m in
                                                   zip(c.split([m.numel() for m in ms[a:b]]), ms[a:b])])
                out_i.append(i)
                out_v.append(v)
        start = end
    if len(out_i) == 1:
        return out_i[0], out_v[0]
    return torch.cat(out_i), torch.cat(out_v)


def _keep(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, copy) pairs of what a guarded step changes: one pair when they lie end to end (one copy, not one
    each)."""
    flat = end_to_end(tensors)
    return [(flat, flat.clone())] if flat is not None else [(t, t.clone()) for t in tensors]


def _put_back(kept: list[tuple[torch.Tensor, torch.Tensor]], ok: torch.Tensor) -> None:
    """Where ``ok`` is False, the tensors :func:`_keep` copied become their copies (bit for bit); else they stay."""
    for t, k in kept:
        torch.where(ok, t, k, out=t)


def encode(delta: torch.Tensor, plan: ChunkPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the fused kernel on CUDA when the plan fits it (and the device runs it), else the reference."""
    if use_triton(delta) and kernel_fits(plan) and delta.dtype == torch.float32 and delta.is_contiguous():
        done = encode_triton(delta, plan)
        if done is not None:
            return done
    return encode_ref(delta, plan)


def decode_sign_(agg: torch.Tensor, param: torch.Tensor, lr: float, plan: ChunkPlan) -> None:
    if not (use_triton(param) and kernel_fits(plan) and param.is_contiguous()
            and decode_sign_triton(agg, param, lr, plan)):
        decode_sign_ref(agg, param, lr, plan)


def _encode_fits(delta: torch.Tensor, plan: ChunkPlan, triton: Optional[bool] = None) -> bool:
    wanted = use_triton(delta) if triton is None else triton
    return wanted and kernel_fits(plan) and delta.dtype == torch.float32 and delta.is_contiguous()


def encode_many(deltas: list[torch.Tensor], plans: list[ChunkPlan],
                triton: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` of every parameter, the (indices, values) concatenated in the given order.

    Consecutive parameters of one shape take one kernel launch: in place when they lie back to back in one
    buffer (:func:`stacked_view`; DeMo keeps its momenta so), else through a stacked copy that is written back.
    ``triton``: None picks the kernel for CUDA tensors; True also runs it on CPU tensors (the interpreter).
    """
    kernel = [_encode_fits(d, p, triton) for d, p in zip(deltas, plans)]
    idx, vals = [], []
    for a, b in _runs(plans, kernel):
        done = None
        if kernel[a] and b - a == 1:
            done = encode_triton(deltas[a], plans[a])
        elif kernel[a]:
            view = stacked_view(deltas[a:b])
            x = torch.stack(deltas[a:b]) if view is None else view
            done = encode_triton(x, _stacked_plan(plans[a], b - a))
            if view is None and done is not None:
                torch._foreach_copy_(deltas[a:b], list(x.unbind(0)))
        i, v = done if done is not None else encode_batch_ref(deltas[a:b], plans[a:b])
        idx.append(i)
        vals.append(v)
    if len(idx) == 1:
        return idx[0], vals[0]
    return torch.cat(idx), torch.cat(vals)


def decode_sign_many(agg: torch.Tensor, params: list[torch.Tensor], lrs: Optional[list[float]],
                     plans: list[ChunkPlan], triton: Optional[bool] = None) -> None:
    """:func:`decode_sign_` of every parameter; ``agg`` holds their ``(num_chunks, chunk_size)`` blocks back to
    back, in the given order. With ``lrs`` None, :func:`signs_many`."""
    kernel = [(use_triton(p) if triton is None else triton) and kernel_fits(plan) and p.is_contiguous()
              for p, plan in zip(params, plans)]
    starts = [0]
    for plan in plans:
        starts.append(starts[-1] + plan.num_chunks * plan.chunk_size)
    for a, b in _runs(plans, kernel, lrs):
        piece = agg[starts[a]:starts[b]]
        lr = None if lrs is None else lrs[a]
        if not kernel[a]:
            decode_sign_batch_ref(piece, params[a:b], None if lrs is None else lrs[a:b], plans[a:b])
            continue
        view = stacked_view(params[a:b]) if b - a > 1 else None
        if b - a == 1 or (view is None and sum(p.numel() * p.element_size() for p in params[a:b]) > STACK_BYTES):
            # a launch a parameter: large ones apart rather than stacked (a copy: 2 GB a step of a 1B model's MLPs)
            for j in range(a, b):
                one = agg[starts[j]:starts[j + 1]]
                if not decode_sign_triton(one.view(plans[j].num_chunks, plans[j].chunk_size), params[j], lr, plans[j]):
                    decode_sign_batch_ref(one, params[j:j + 1], None if lrs is None else lrs[j:j + 1], plans[j:j + 1])
            continue
        # one launch over the run's parameters stacked (a copy, written back, unless they are one buffer)
        x = torch.stack(params[a:b]) if view is None else view
        plan = _stacked_plan(plans[a], b - a)
        if not decode_sign_triton(piece.view(plan.num_chunks, plan.chunk_size), x, lr, plan):
            decode_sign_batch_ref(piece, params[a:b], None if lrs is None else lrs[a:b], plans[a:b])
        elif view is None:
            torch._foreach_copy_(params[a:b], list(x.unbind(0)))


def signs_many(agg: torch.Tensor, outs: list[torch.Tensor], plans: list[ChunkPlan],
               triton: Optional[bool] = None) -> None:
    """``sign(IDCT(agg))`` of every parameter, written into ``outs`` (parameter-shaped, any dtype): the
    update direction :func:`decode_sign_many` applies, for callers that apply one direction to several
    replicas (the simulator's workers)."""
    decode_sign_many(agg, outs, None, plans, triton)
