"""DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870) as a ``torch.optim.Optimizer`` over a loco transport.

Per parameter, every step::

    p     *= 1 - lr * weight_decay                      (decoupled weight decay, optional)
    delta  = decay * delta + lr * grad                   (momentum with lr folded in)
    C      = DCT(delta) per chunk; keep the top-k |C| of each chunk: what this worker sends
    delta -= IDCT(kept)                                  (what was sent leaves the momentum)
    agg    = per coefficient, the mean over the workers that sent it (0 if nobody did)
    p     -= lr * sign(IDCT(agg))

The momentum of a parameter whose blocks are whole (no padding) is kept as C itself
(``state["coeffs"]``, ``(num_chunks, s1*s2)``, with the block sides in ``state["block"]``): the DCT
is linear, so ``C = decay * C + DCT(lr * grad)``, and what was sent leaves it by zeroing those
coefficients, with no inverse DCT. A padded parameter keeps ``state["delta"]`` in its own shape.
A state of either kind (or of other block sides) is converted on load.

A step is one collective: every worker's payload of every parameter (:mod:`demo_optim.payload`) in one
``Transport.all_gather_payload``, then the mean of the gathered payloads (:mod:`demo_optim.aggregation`),
the same on every worker, so every worker applies the same update. A worker whose gradients are not finite
sends nothing that step (``nonfinite="skip"``) or raises (``"raise"``) and still applies the others' update,
so the replicas stay equal. In loco's loop on a GPU that decision is taken on the device (``found_inf``, see
:meth:`DeMo.step`): nothing is read back for it.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Optional

import torch

from diloco.algorithm import SkipCount
from diloco.tensors import all_finite
from diloco.comm.base import Transport
from diloco.comm.local import LocalTransport
from diloco.compress import RULES, ChunkPlan, SharedResult, end_to_end, from_chunks, plan_for, to_chunks
from demo_optim import kernels
from demo_optim.aggregation import Aggregation
from demo_optim.payload import Layout, chain_of

log = logging.getLogger("demo_optim")


class DeMo(torch.optim.Optimizer):
    #: set for one step by loco's algorithm (as torch's GradScaler sets it): a 0-d device tensor, nonzero where the
    #: gradients are not finite; None where the step decides on the host
    found_inf: Optional[torch.Tensor] = None

    def __init__(self, params: Iterable, lr: float = 1e-3, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64, weight_decay: float = 0.0,
                 transport: Optional[Transport] = None, *, chunk_rule: str = "auto", sign_values: bool = False,
                 nonfinite: str = "skip", max_payload_bytes: int = 1 << 31) -> None:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"DeMo: lr must be a positive number, got {lr!r}")
        if not 0.0 <= compression_decay < 1.0:
            raise ValueError(f"DeMo: compression_decay must be in [0, 1), got {compression_decay}")
        if not isinstance(compression_topk, int) or compression_topk <= 0:
            raise ValueError(f"DeMo: compression_topk must be a positive integer, got {compression_topk!r}")
        if not isinstance(compression_chunk, int) or compression_chunk <= 0:
            raise ValueError(f"DeMo: compression_chunk must be a positive integer, got {compression_chunk!r}")
        if weight_decay < 0:
            raise ValueError(f"DeMo: weight_decay must be >= 0, got {weight_decay}")
        if chunk_rule not in RULES:
            raise ValueError(f"DeMo: chunk_rule must be one of {', '.join(RULES)}, got {chunk_rule!r}")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"DeMo: nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        defaults = dict(lr=lr, compression_decay=compression_decay, compression_topk=compression_topk,
                        compression_chunk=compression_chunk, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.transport = transport or LocalTransport()
        self.chunk_rule, self.sign_values, self.nonfinite = chunk_rule, sign_values, nonfinite
        self.aggregation = Aggregation(self.transport, max_payload_bytes)  # validates and sums the payloads
        self.skips = SkipCount()  # steps this worker sent nothing (non-finite gradients), on the host or the device
        self.contribute = True  # the trainer clears it for one step when it found non-finite gradients
        self.grads_checked = False  # the trainer sets it when it already checked the gradients this step
        self._layouts: dict[tuple[str, torch.device], Layout] = {}

    skipped_steps = SkipCount.steps  # steps this worker sent nothing for non-finite gradients

    @property
    def rejected_payloads(self) -> int:
        """Peer payloads left out of the mean, over the run."""
        return self.aggregation.rejected_payloads

    @rejected_payloads.setter
    def rejected_payloads(self, value: int) -> None:
        self.aggregation.rejected_payloads = value

    @property
    def last_contributors(self) -> int:
        """Payloads in the latest step's mean."""
        return self.aggregation.last_contributors

    # ---- layout ---------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[torch.Tensor, dict[str, Any], ChunkPlan]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    plan = plan_for(p.shape, group["compression_chunk"], group["compression_topk"], self.chunk_rule)
                    out.append((p, group, plan))
        return out

    def _chain(self, plans: list[ChunkPlan]) -> str:
        return chain_of(plans, self.sign_values)

    def _layout(self, plans: list[ChunkPlan], chain: str, device: torch.device) -> Layout:
        """The layout of these plans, built once per layout and device (its index tensors live on the device)."""
        layouts = self.__dict__.setdefault("_layouts", {})
        key = (chain, torch.device(device))
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = Layout(plans, self.sign_values, device)
        return layout

    def _device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then every momentum put in the form and buffer a step works on (converted where the
        state kept it another way): a state that does not fit the parameters fails here, naming the parameter."""
        super().load_state_dict(state_dict)
        entries = self._entries()
        if entries:
            plans = [plan for _, _, plan in entries]
            self._stack_momenta(entries, self._layout(plans, self._chain(plans), self._device()))

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._entries()
        plans = [plan for _, _, plan in entries]
        chain = self._chain(plans)
        device = self._device() if entries else torch.device("cpu")
        layout = self._layout(plans, chain, device)  # built once, outside the per-step work
        # ``found_inf`` (set for this step by loco's trainer, as torch's GradScaler sets it): a 0-d device tensor,
        # nonzero where the gradients are not finite. The step then decides on the device and reads nothing back
        ok = None
        found_inf = self.found_inf
        if isinstance(found_inf, torch.Tensor) and self.contribute and entries:
            ok = found_inf.reshape(()) == 0
            contribute = True
            self.skips.add(found_inf)
        else:
            contribute = self.contribute and (self.grads_checked or self._grads_finite(entries))
            self.skips.host += not self.contribute  # the trainer found them not finite
        self.contribute, self.grads_checked = True, False

        def on_wire() -> bytes:
            return self._encode(entries, chain, ok) if contribute and entries else layout.silent_wire()

        def on_device() -> torch.Tensor:  # the payload stays where it is made
            if contribute:
                return layout.encode_device(*self._momentum_step(entries, layout, ok), ok)
            return layout.silent_device()

        # every worker's payload has one length (same settings, same model; a silent one is padded to it)
        payloads = self.transport.all_gather_payload(on_wire, on_device if entries else None, layout.wire_bound())
        self._apply_mean(payloads, entries, layout)
        return loss

    def _apply_mean(self, payloads: list, entries, layout: Layout) -> None:
        """``p -= lr * sign(IDCT(mean))`` for every parameter, the mean taken over the valid payloads per
        coefficient (0 where nobody sent).

        Workers that receive the very same payload list (:class:`SharedResult`) compute from it once: the first
        validates and sums it and works out the update's direction, ``sign(IDCT(mean))`` of every parameter
        (:func:`kernels.signs_many`, in the parameters' dtype); the others take that direction (the same values,
        as they would compute them), apply it with their own lr, and replay the rejections in their own counters
        and log. A worker alone with its list decodes and applies in one pass.
        """
        mean, mine = _SHARED_MEAN.once(self.transport, payloads, (layout.chain, layout.device),
                                       lambda shared: self._direction(payloads, entries, layout, shared))
        if not mine:
            _, contributors, rejected = mean
            self.aggregation.replay(contributors, rejected)
        if mean is not None and entries:
            self._apply_direction(mean[0], entries, layout)

    def _direction(self, payloads: list, entries, layout: Layout, shared: bool) -> Optional[tuple]:
        """The update of ``payloads``'s mean as (direction, contributors, rejections) for :meth:`_apply_mean`, or
        None where it was applied here in one pass (nobody else takes it)."""
        agg = self.aggregation.mean(payloads, layout)
        order, plans = layout.order, layout.plans
        if not (shared and len(payloads) > 1):  # no other worker takes this list: one pass
            if entries:
                kernels.decode_sign_many(agg, [entries[j][0] for j in order],
                                         [entries[j][1]["lr"] for j in order], [plans[j] for j in order])
            return None
        direction = None
        if entries:
            dtypes = {p.dtype for p, _, _ in entries}  # one dtype keeps the apply on foreach's fast path
            direction = torch.empty(layout.numel, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32,
                                    device=layout.device)
            kernels.signs_many(agg, layout.in_params(direction), [plans[j] for j in order])
        return direction, self.aggregation.last_contributors, self.aggregation.rejected_now

    def _apply_direction(self, direction: torch.Tensor, entries, layout: Layout) -> None:
        """``p -= lr * direction`` for every parameter (wire order, parameter-shaped pieces): one foreach call
        per lr."""
        by_lr: dict[float, tuple[list, list]] = {}
        for j, piece in zip(layout.order, layout.in_params(direction)):
            params, pieces = by_lr.setdefault(entries[j][1]["lr"], ([], []))
            params.append(entries[j][0])
            pieces.append(piece)
        for lr, (params, pieces) in by_lr.items():
            torch._foreach_add_(params, pieces, alpha=-lr)

    def _grads_finite(self, entries) -> bool:
        grads = [p.grad for p, _, _ in entries if p.grad is not None]
        finite = all_finite(grads)  # one host sync
        if not finite:
            if self.nonfinite == "raise":
                raise FloatingPointError("DeMo: non-finite gradients (set nonfinite='skip' to sit the step out)")
            self.skips.host += 1
            self._say_skipped()
        return finite

    def _say_skipped(self) -> None:
        log.warning("DeMo worker %d: non-finite gradients, sending nothing this step (the others' update still "
                    "applies)", self.transport.rank)

    def _encode(self, entries, chain: str, ok: Optional[torch.Tensor] = None) -> bytes:
        """The wire payload of this step's momenta (:meth:`Layout.encode_wire`). With ``ok`` (the gradients'
        finiteness, on the device) the silent payload goes out where it is 0."""
        layout = self._layout([plan for _, _, plan in entries], chain, self._device())
        payload = layout.encode_wire(*self._momentum_step(entries, layout, ok), ok)
        if payload is None:
            self._say_skipped()
            return layout.silent_wire()
        return payload

    def _momentum_step(self, entries, layout: Layout,
                       ok: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight decay, then the momentum step and DCT + top-k of every parameter
        (:func:`kernels.step_encode_many`): the (indices, values) to send, in wire order. With ``ok`` False (a 0-d
        device tensor) neither the parameters nor the momenta change, and what it returns is not to be sent."""
        self._stack_momenta(entries, layout)
        groups: dict[int, tuple[dict[str, Any], list[torch.Tensor]]] = {}
        for p, group, _ in entries:
            groups.setdefault(id(group), (group, []))[1].append(p)
        for group, params in groups.values():  # one op per group, not per parameter
            if group["weight_decay"]:
                factor = 1.0 - group["lr"] * group["weight_decay"]
                if ok is None:
                    torch._foreach_mul_(params, factor)
                    continue
                fp32 = [p for p in params if p.dtype == torch.float32]
                if fp32:  # the factor as an fp32 device tensor: the same product as the Python number gives
                    torch._foreach_mul_(fp32, torch.where(ok, factor, 1.0))
                for p in params:  # other dtypes would round such a factor to theirs: the product, then a choice
                    if p.dtype != torch.float32:
                        torch.where(ok, p * factor, p, out=p)
        order, plans = layout.order, layout.plans
        moms = [self.state[entries[j][0]][_momentum_key(plans[j])] for j in order]
        return kernels.step_encode_many([entries[j][0].grad for j in order], moms, [plans[j] for j in order],
                                        [entries[j][1]["compression_decay"] for j in order],
                                        [entries[j][1]["lr"] for j in order], ok=ok)

    def _stack_momenta(self, entries, layout: Layout) -> None:
        """Keep the momenta where a step works on them in place: every unpadded parameter's coefficients
        (``state["coeffs"]``, ``(num_chunks, chunk_size)``) back to back in one buffer, in wire order, and the
        momenta of each run of same-shaped padded parameters (``state["delta"]``, in the parameter's shape) in
        one buffer each. Done when they are created and again after a ``load_state_dict`` (which gives every
        parameter its own tensor, and may bring a momentum of the other kind or of other block sides: it is
        converted); otherwise a few pointer checks."""
        order, plans = layout.order, layout.plans
        coef = [j for j in order if not plans[j].padded]
        if coef:
            states = [self.state[entries[j][0]] for j in coef]
            have = [st.get("coeffs") for st in states]
            if (any(h is None or _block(st) != (plans[j].s1, plans[j].s2) for j, h, st in zip(coef, have, states))
                    or end_to_end(have) is None):
                sizes = [plans[j].num_chunks * plans[j].chunk_size for j in coef]
                buf = torch.zeros(sum(sizes), dtype=torch.float32, device=entries[coef[0]][0].device)
                for j, st, piece in zip(coef, states, buf.split(sizes)):
                    piece = piece.view(plans[j].num_chunks, plans[j].chunk_size)
                    delta = _saved_momentum(st, entries[j][0], plans[j])
                    if delta is not None:
                        piece.copy_(delta)
                    st["coeffs"], st["block"] = piece, (plans[j].s1, plans[j].s2)
        padded = [j for j in order if plans[j].padded]
        start = 0
        while start < len(padded):
            end = start + 1
            shape = plans[padded[start]].shape
            while end < len(padded) and plans[padded[end]].shape == shape:
                end += 1
            states = [self.state[entries[j][0]] for j in padded[start:end]]
            have = [st.get("delta") for st in states]
            if any(d is None or "coeffs" in st for d, st in zip(have, states)) or kernels.stacked_view(have) is None:
                p = entries[padded[start]][0]
                buf = torch.zeros((end - start, *p.shape), dtype=torch.float32, device=p.device)
                for i, (j, st) in enumerate(zip(padded[start:end], states)):
                    delta = _saved_momentum(st, entries[j][0], plans[j])
                    if delta is not None:
                        buf[i].copy_(delta)
                    st["delta"] = buf[i]
            start = end

    def bytes_per_step(self) -> int:
        """Exact payload bytes one worker sends per step (header included)."""
        plans = [plan for _, _, plan in self._entries()]
        return Layout(plans, self.sign_values, None).wire_size()


def _momentum_key(plan: ChunkPlan) -> str:
    """Where a parameter's momentum lives in its state: its DCT coefficients, or (padded blocks) itself."""
    return "delta" if plan.padded else "coeffs"


def _block(state: dict[str, Any]) -> Optional[tuple[int, ...]]:
    """The block sides ``(s1, s2)`` a state's coefficients were made with (a list once it went through a format
    without tuples)."""
    block = state.get("block")
    return tuple(block) if isinstance(block, (tuple, list)) else None


def _saved_momentum(state: dict[str, Any], p: torch.Tensor, plan: ChunkPlan) -> Optional[torch.Tensor]:
    """The momentum a state holds, in the form ``plan`` keeps it (coefficients ``(num_chunks, chunk_size)`` for
    an unpadded plan, else the parameter's shape), taken out of the state once it is checked; None when it holds
    none. A momentum kept the other way, or in blocks of other sides (a checkpoint of a run with other DeMo
    settings, or one that kept the momentum in the parameter's shape), is converted through the parameter's
    shape."""
    block, coeffs, delta = _block(state), state.get("coeffs"), state.get("delta")
    kept = (coeffs is not None and block == (plan.s1, plan.s2) and not plan.padded
            and coeffs.shape == (plan.num_chunks, plan.chunk_size))
    if coeffs is not None and not kept:
        s1, s2 = block if block is not None and len(block) == 2 else (0, 0)
        was = ChunkPlan(plan.shape, plan.lead, plan.rows, plan.cols, s1, s2, plan.rows, plan.cols, 1)
        if s1 < 1 or s2 < 1 or plan.rows % s1 or plan.cols % s2 or coeffs.numel() != math.prod(plan.shape):
            raise ValueError(f"DeMo: the saved momentum of parameter {tuple(plan.shape)} has {coeffs.numel()} "
                             f"coefficients in blocks {block!r}, which do not fit that shape")
        delta = from_chunks(coeffs.float(), was)
    if delta is not None and tuple(delta.shape) != tuple(p.shape):
        raise ValueError(f"DeMo: the saved momentum has shape {tuple(delta.shape)}, its parameter {tuple(p.shape)}")
    for key in ("coeffs", "block", "delta"):  # checked: now taken out
        state.pop(key, None)
    if kept:
        return coeffs
    if delta is None:
        return None
    return delta if plan.padded else to_chunks(delta.float(), plan)


_SHARED_MEAN = SharedResult()  # one step's update direction, for the other workers that received the same list
