"""DeMo's batched entry points, as the optimizer calls them: every parameter of a step in one call each.

Each takes its parameters in the given order (DeMo's wire order) and picks, per run of consecutive parameters,
the Triton kernel (:mod:`demo_optim.kernels.fused`; CUDA tensors, or ``triton=True`` under the interpreter) or
the torch reference (:mod:`demo_optim.kernels.reference`), so the number of launches and torch calls follows
the number of distinct blocks and shapes, not the number of parameters. On the reference path a run is every
consecutive parameter with the same block (s1, s2, k): their blocks are stacked, and the DCT, the top-k and the
inverse DCT are one call each. On the kernel path a run is every consecutive parameter of one shape: one launch
over them, read in place where they lie back to back in one buffer (DeMo keeps its momenta so), else through a
stacked copy that is written back, or, above :data:`STACK_BYTES`, a launch per parameter rather than that copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from diloco.compress import ChunkPlan, end_to_end
from diloco.compress.kernels import use_triton
from demo_optim.kernels.fused import decode_sign_triton, encode_triton, kernel_fits, step_encode_triton
from demo_optim.kernels.reference import (decode_sign_batch_ref, encode_batch_ref, stacked_plan, stacked_view,
                                          step_encode_batch_ref)

# same-shaped gradients (and parameters, to decode) up to this size are stacked for one launch; larger ones launch
# each (unless they lie back to back in one buffer already): stacking copies all of them in, and back out
STACK_BYTES = 64 << 20


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


def step_encode_many(grads: list[Optional[torch.Tensor]], moms: list[torch.Tensor], plans: list[ChunkPlan],
                     decays: list[float], lrs: list[float], triton: Optional[bool] = None,
                     ok: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of DeMo's momentum and its encode for every parameter, in the given order; the (indices,
    values) concatenated. ``moms[j]``: for an unpadded plan the momentum's coefficients ``(num_chunks,
    chunk_size)`` (see :mod:`demo_optim.kernels`), for a padded one the momentum in the parameter's shape.

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
                done = _step_encode_launches(gs[a:b], c, ps[a:b], decay, lr, flag) if kernel[a] else None
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


def _step_encode_launches(grads: list[Optional[torch.Tensor]], coeffs: torch.Tensor, plans: list[ChunkPlan],
                          decay: float, lr: float, flag: Optional[torch.Tensor]
                          ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`step_encode_triton` of a run of same-shaped parameters: one launch, or a launch per parameter where
    their gradients would need a stacked copy of more than :data:`STACK_BYTES`. None, with ``coeffs`` untouched,
    where the device cannot run the block."""
    have = [g for g in grads if g is not None]
    if (have and len(grads) > 1 and (len(have) != len(grads) or stacked_view(grads) is None)
            and sum(x.numel() * x.element_size() for x in have) > STACK_BYTES):
        n = plans[0].num_chunks * plans[0].chunk_size
        pieces = []
        for i, x in enumerate(grads):
            piece = step_encode_triton([x], coeffs[i * n:(i + 1) * n], plans[:1], decay, lr, flag)
            if piece is None:  # at the first launch: the later ones would run the same compiled kernel
                return None
            pieces.append(piece)
        return torch.cat([i for i, _ in pieces]), torch.cat([v for _, v in pieces])
    return step_encode_triton(grads, coeffs, plans, decay, lr, flag)


def _keep(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, copy) pairs of what a guarded step changes: one pair when they lie end to end (one copy, not one
    each)."""
    flat = end_to_end(tensors)
    return [(flat, flat.clone())] if flat is not None else [(t, t.clone()) for t in tensors]


def _put_back(kept: list[tuple[torch.Tensor, torch.Tensor]], ok: torch.Tensor) -> None:
    """Where ``ok`` is False, the tensors :func:`_keep` copied become their copies (bit for bit); else they stay."""
    for t, k in kept:
        torch.where(ok, t, k, out=t)


def _encode_fits(delta: torch.Tensor, plan: ChunkPlan, triton: Optional[bool] = None) -> bool:
    wanted = use_triton(delta) if triton is None else triton
    return wanted and kernel_fits(plan) and delta.dtype == torch.float32 and delta.is_contiguous()


def encode_many(deltas: list[torch.Tensor], plans: list[ChunkPlan],
                triton: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_ref` of every parameter (the kernel where it fits), the (indices, values) concatenated in
    the given order.

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
            done = encode_triton(x, stacked_plan(plans[a], b - a))
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
    """:func:`decode_sign_ref` of every parameter (the kernel where it fits); ``agg`` holds their
    ``(num_chunks, chunk_size)`` blocks back to back, in the given order. With ``lrs`` None,
    :func:`signs_many`."""
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
            # a launch a parameter: large ones apart rather than stacked (a copy of them all, in and back out)
            for j in range(a, b):
                one = agg[starts[j]:starts[j + 1]]
                if not decode_sign_triton(one.view(plans[j].num_chunks, plans[j].chunk_size), params[j], lr, plans[j]):
                    decode_sign_batch_ref(one, params[j:j + 1], None if lrs is None else lrs[j:j + 1], plans[j:j + 1])
            continue
        # one launch over the run's parameters stacked (a copy, written back, unless they are one buffer)
        x = torch.stack(params[a:b]) if view is None else view
        plan = stacked_plan(plans[a], b - a)
        if not decode_sign_triton(piece.view(plan.num_chunks, plan.chunk_size), x, lr, plan):
            decode_sign_batch_ref(piece, params[a:b], None if lrs is None else lrs[a:b], plans[a:b])
        elif view is None:
            torch._foreach_copy_(params[a:b], list(x.unbind(0)))


def signs_many(agg: torch.Tensor, outs: list[torch.Tensor], plans: list[ChunkPlan],
               triton: Optional[bool] = None) -> None:
    """``sign(IDCT(agg))`` of every parameter, written into ``outs`` (parameter-shaped, any dtype): the
    update direction :func:`decode_sign_many` applies, for callers that apply one direction to several
    replicas (workers that share one mean)."""
    decode_sign_many(agg, outs, None, plans, triton)
