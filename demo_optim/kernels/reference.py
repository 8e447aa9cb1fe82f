"""DeMo's transforms in plain torch, and the block layout helpers the kernels and the dispatchers share.

Every Triton kernel of :mod:`demo_optim.kernels.fused` has its reference here, with the same signature and the
same results (to rounding; the indices exactly). A parameter ``(..., rows, cols)`` is ``lead`` matrices cut into
``s1 x s2`` blocks (:class:`ChunkPlan`); a block's coefficients are its 2-D DCT, one chunk of ``s1 * s2``. The
``*_batch_ref`` functions take a run of parameters that share ``(s1, s2, k)`` as one stack of blocks, so the DCT,
the top-k and the inverse DCT are one call each for the run whatever its number of parameters.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from diloco.compress import ChunkPlan, dct_basis, from_chunks, to_chunks
from diloco.compress.kernels import topk_chunks_ref


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


def stacked_view(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """Tensors of one shape that lie back to back in one buffer, as one ``(len, *shape)`` view; else None."""
    first = tensors[0]
    n, ptr, off = first.numel(), first.untyped_storage().data_ptr(), first.storage_offset()
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != off + i * n):
            return None
    return first.as_strided((len(tensors), *first.shape), (n, *first.stride()), off)


def stacked_plan(plan: ChunkPlan, count: int) -> ChunkPlan:
    """``plan`` for ``count`` parameters of its shape stacked along a new first dimension."""
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
    value, for each kept coefficient (r, c)): ``k * s1 * s2`` multiply-adds against the ``s1 * s2 * (s1 + s2)``
    of an inverse DCT of the mostly-zero block, so less work while k < s1 + s2, and the same result to
    rounding."""
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

