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

All parameters travel in one payload per worker and one ``all_gather_bytes`` per step
(chain ``demo:v3``): loco's wire header (magic, version, settings + model layout fingerprint,
length, CRC-32), then every kept value (fp32, or 1 bit each with ``sign_values``), then the
indices in ``ceil(log2(s1*s2))`` bits (12 for 64 x 64). Parameters are laid out in *wire
order*: grouped by index width (ascending), in parameter order within a width; the values
follow that order, and each width's indices form one bit stream (padded to a whole byte
once per width, not once per parameter). So a payload is validated and accumulated with a
fixed number of tensor ops whatever the number of parameters: the index streams are unpacked
(one ``unpack_bits`` per width), the range, the strict increase within every chunk and the
finiteness of the values are checked in one vectorised expression (every payload's body a
row of one tensor), with one host sync to accept or reject them all, and one
``scatter_add_`` each adds the values and the counts into flat buffers that hold every
parameter's chunks back to back (flat position = the chunk's offset + the index). Every
worker aggregates the same payloads in rank order, so every worker applies the same update.
A payload that fails validation is left out of the mean and logged; a worker whose gradients
are not finite sends nothing that step (``nonfinite="skip"``) or raises (``"raise"``) and
still applies the others' update, so the replicas stay equal. In loco's loop on a GPU that
decision is taken on the device (``found_inf``, see :meth:`DeMo.step`): nothing is read back
for it.

Transports that move tensors where they lie (``Capabilities.device_gather``: the simulator, NCCL)
skip the host (``Transport.all_gather_payload`` picks the form): the payload is one uint8 tensor
on the parameters' device, the size of the wire payload, with a first byte that says whether a
body follows instead of the header (the members of such a group are trusted, and the transport
checks its own transfer); the payloads are unpacked and checked together, as rows, with one
host sync for all of them, and then summed in rank order as above. The sums are the same as
the byte path's.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence
from itertools import accumulate
from typing import Any, Callable, Iterable, Optional

import torch

from diloco.algorithm import SkipCount, all_finite
from diloco.comm.base import Transport
from diloco.comm.local import LocalTransport
from diloco.compress import (RULES, ChunkPlan, CorruptPayload, SharedResult, bits_for, end_to_end, from_chunks,
                             pack_bits, packed_size, plan_for, tensor_bytes, to_chunks, unpack_bits, wire)
from demo_optim import kernels

log = logging.getLogger("demo_optim")


class DeMo(torch.optim.Optimizer):
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
        self.max_payload_bytes = max_payload_bytes
        self.skips = SkipCount()  # steps this worker sent nothing (non-finite gradients), on the host or the device
        self.rejected_payloads = 0  # peer payloads left out of the mean
        self.last_contributors = 0
        self._rejected_now: list[tuple[int, Any]] = []  # (rank, reason) of the payloads the last mean left out
        self.contribute = True  # the trainer clears it for one step when it found non-finite gradients
        self.grads_checked = False  # the trainer sets it when it already checked the gradients this step
        self._layouts: dict[tuple[str, torch.device], _Layout] = {}

    skipped_steps = SkipCount.steps  # steps this worker sent nothing for non-finite gradients

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
        layout = zlib.crc32(repr([(p.shape, p.s1, p.s2, p.rows_padded, p.cols_padded, p.k) for p in plans]).encode())
        return f"demo:v3,sign={int(self.sign_values)},layout={layout:08x}"

    def _layout(self, plans: list[ChunkPlan], chain: str, device: torch.device) -> "_Layout":
        """The layout of these plans, built once per layout and device (its index tensors live on the device)."""
        layouts = self.__dict__.setdefault("_layouts", {})
        key = (chain, torch.device(device))
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = _Layout(plans, self.sign_values, device)
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
        if entries:
            self._layout(plans, chain, self._device())  # built once, outside the per-step work
        # ``found_inf`` (set for this step by loco's trainer, as torch's GradScaler sets it): a 0-d device tensor,
        # nonzero where the gradients are not finite. The step then decides on the device and reads nothing back
        ok = None
        found_inf = getattr(self, "found_inf", None)
        if isinstance(found_inf, torch.Tensor) and self.contribute and entries:
            ok = found_inf.reshape(()) == 0
            contribute = True
            self.skips.add(found_inf)
        else:
            contribute = self.contribute and (self.grads_checked or self._grads_finite(entries))
            self.skips.host += not self.contribute  # the trainer found them not finite
        self.contribute, self.grads_checked = True, False

        def on_wire() -> bytes:
            return self._encode(entries, chain, ok) if contribute else self._silent_payload(entries, chain)

        def on_device() -> torch.Tensor:  # the payload stays where it is made
            layout = self._layout(plans, chain, self._device())
            return self._encode_device(entries, chain, layout, ok) if contribute else layout.silent(chain)

        # every worker's payload has one length (same settings, same model; a silent one is padded to it)
        payloads = self.transport.all_gather_payload(on_wire, on_device if entries else None)
        self._apply_mean(payloads, entries, plans, chain)
        return loss

    def _apply_mean(self, payloads: list, entries, plans: list[ChunkPlan], chain: str) -> None:
        """``p -= lr * sign(IDCT(mean))`` for every parameter, the mean taken over the valid payloads per
        coefficient (0 where nobody sent).

        Workers that receive the very same payload list (the simulator's: :class:`SharedResult`) compute from it
        once: the first validates and sums it and works out the update's direction, ``sign(IDCT(mean))`` of every
        parameter (:func:`kernels.signs_many`, in the parameters' dtype); the others take that direction (the same
        values, as they would compute them), apply it with their own lr, and replay the rejections in their own
        counters and log. A worker alone with its list decodes and applies in one pass.
        """
        device = self._device() if plans else torch.device("cpu")
        layout = self._layout(plans, chain, device) if entries else None
        mean, mine = _SHARED_MEAN.once(self.transport, payloads, (chain, device),
                                       lambda shared: self._mean(payloads, entries, plans, chain, layout, shared))
        if not mine:
            _, contributors, rejected = mean
            self._rejected_now = []
            self.last_contributors = contributors
            for rank, reason in rejected:
                self._reject(rank, reason)
        if mean is not None and layout is not None:
            self._apply_direction(mean[0], entries, layout)

    def _mean(self, payloads: list, entries, plans: list[ChunkPlan], chain: str, layout: Optional["_Layout"],
              shared: bool) -> Optional[tuple]:
        """The mean of ``payloads`` as (direction, contributors, rejections) for :meth:`_apply_mean`, or None where
        it was applied here in one pass (nobody else takes it)."""
        if payloads and isinstance(payloads[0], torch.Tensor):
            sums, counts = self._aggregate_device(payloads, plans, chain)
        else:
            sums, counts = self._aggregate(payloads, plans, chain)
        # 0 where nobody sent: the sum is 0 there (whole counts divide as the fp32 ones did: the same bits)
        agg = sums.flat.div_(counts.flat.clamp_(min=1))
        if not (shared and len(payloads) > 1):  # no other worker takes this list: one pass
            if layout is not None:
                order = layout.order
                kernels.decode_sign_many(agg, [entries[j][0] for j in order],
                                         [entries[j][1]["lr"] for j in order], [plans[j] for j in order])
            return None
        direction = None
        if layout is not None:
            dtypes = {p.dtype for p, _, _ in entries}  # one dtype keeps the apply on foreach's fast path
            direction = torch.empty(layout.numel, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32,
                                    device=layout.ones.device)
            kernels.signs_many(agg, layout.in_params(direction), [plans[j] for j in layout.order])
        return direction, self.last_contributors, self._rejected_now

    def _apply_direction(self, direction: torch.Tensor, entries, layout: "_Layout") -> None:
        """``p -= lr * direction`` for every parameter (wire order, parameter-shaped pieces): one foreach call
        per lr."""
        by_lr: dict[float, tuple[list, list]] = {}
        for j, piece in zip(layout.order, layout.in_params(direction)):
            params, pieces = by_lr.setdefault(entries[j][1]["lr"], ([], []))
            params.append(entries[j][0])
            pieces.append(piece)
        for lr, (params, pieces) in by_lr.items():
            torch._foreach_add_(params, pieces, alpha=-lr)

    def _reject(self, rank: int, reason: Any) -> None:
        self.rejected_payloads += 1
        self._rejected_now.append((rank, reason))
        log.warning("DeMo worker %d: left worker %d's payload out of the mean: %s", self.transport.rank, rank, reason)

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
        """The wire payload (header + body) of this step's momenta: see the module's docstring. With ``ok`` (the
        gradients' finiteness, on the device) its byte travels behind the body in the one copy to the host, and
        where it is 0 the silent payload goes out instead."""
        if not entries:
            return wire.pack(b"", torch.float32, (0,), chain)
        layout = self._layout([plan for _, _, plan in entries], chain, self._device())
        sections = self._sections(entries, layout, ok)
        if ok is not None:
            sections.append(ok.reshape(1).to(torch.uint8))
        raw = tensor_bytes(torch.cat(sections))
        if ok is not None:
            if not raw[-1]:
                self._say_skipped()
                return self._silent_payload(entries, chain)
            raw = memoryview(raw)[:-1]
        return wire.pack(raw, torch.float32, (layout.sent,), chain)

    def _silent_payload(self, entries, chain: str) -> bytes:
        """The wire payload of a worker that sends nothing this step: no values (shape (0,)), and zeros in place of
        a body, so that it is as long as every other worker's payload."""
        if not entries:
            return wire.pack(b"", torch.float32, (0,), chain)
        layout = self._layout([plan for _, _, plan in entries], chain, self._device())
        return wire.pack(bytes(layout.value_bytes + layout.index_bytes), torch.float32, (0,), chain)

    def _encode_device(self, entries, chain: str, layout: "_Layout",
                       ok: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The payload as one uint8 tensor on the parameters' device, for transports that move it there: a
        prefix of the wire header's size whose first byte says "sent" (1), then the body of :meth:`_encode`. The
        same bytes on the network as the wire payload; no header is needed between trusted members. With ``ok``
        the first byte is that flag (0: nothing sent; the receivers skip the body unread)."""
        data = torch.cat([layout.prefix(chain, sent=True), *self._sections(entries, layout, ok)])
        if ok is not None:
            data[:1].copy_(ok.reshape(1))
        return data

    def _sections(self, entries, layout: "_Layout", ok: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Weight decay, then the momentum step and DCT + top-k of every parameter
        (:func:`kernels.step_encode_many`): the body's sections (uint8 tensors, in order). With ``ok`` False (a 0-d
        device tensor) neither the parameters nor the momenta change, and the sections are not to be sent."""
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
        idx, flat = kernels.step_encode_many([entries[j][0].grad for j in order], moms, [plans[j] for j in order],
                                             [entries[j][1]["compression_decay"] for j in order],
                                             [entries[j][1]["lr"] for j in order], ok=ok)
        sections = [pack_bits((flat > 0).to(torch.int32), 1) if self.sign_values else flat.view(torch.uint8)]
        at = 0
        for width, count, _ in layout.stream_sizes:  # one bit stream per index width
            sections.append(pack_bits(idx[at:at + count], width))
            at += count
        return sections

    def _stack_momenta(self, entries, layout: "_Layout") -> None:
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

    def _aggregate(self, payloads: list[bytes], plans: list[ChunkPlan], chain: str) -> tuple["_Views", "_Views"]:
        """Per coefficient, the sum of what the valid payloads sent and how many sent it, in two flat buffers
        (all parameters' chunks back to back); indexing the returned views gives parameter j's
        ``(num_chunks, chunk_size)`` block. Headers are checked on the host; the bodies (all of one length) go to
        the device as rows of one buffer and are checked together: a fixed number of tensor ops and one host sync
        for all of them, then each valid one summed in rank order."""
        device = self._device() if plans else torch.device("cpu")
        layout = self._layout(plans, chain, device)
        self._rejected_now: list[tuple[int, Any]] = []
        sums = torch.zeros(layout.total, device=device)
        counts = layout.counts(len(payloads))
        verdicts: list[Any] = []  # per rank: a CorruptPayload, None (nothing sent) or the body's row
        bodies: list[memoryview] = []
        for payload in payloads:
            try:
                body = self._check_header(payload, chain, layout)
            except CorruptPayload as e:
                verdicts.append(e)
                continue
            verdicts.append(None if body is None else len(bodies))
            if body is not None:
                bodies.append(body)
        if bodies:  # every body has the length the layout gives (the header check): rows of one buffer
            size = len(bodies[0])
            stride = size + -size % 8  # each row starts aligned, so its fp32 values can be viewed in place
            host = torch.empty(len(bodies) * stride, dtype=torch.uint8, pin_memory=device.type == "cuda")
            for i, body in enumerate(bodies):  # copied once into (pinned, on CUDA) host memory, one transfer on
                host[i * stride:i * stride + size].copy_(wire.tensor_view(body))
            rows = host.to(device, non_blocking=True).view(len(bodies), stride)[:, :size]
            values, idx, bad, row_bad = self._check_rows(rows, layout)
            refused = row_bad.tolist()  # the one host sync
        contributors = 0
        for rank, verdict in enumerate(verdicts):  # rank order: the same sums on every worker
            if isinstance(verdict, int):
                if refused[verdict]:
                    verdict = self._why(values[verdict], bad[verdict], layout)
                else:
                    contributors += 1
                    _add_row(sums, counts, idx[verdict], values[verdict], layout)
            if isinstance(verdict, CorruptPayload):
                self._reject(rank, verdict)
        self.last_contributors = contributors
        return _Views(sums, layout), _Views(counts, layout)

    def _aggregate_device(self, payloads: list[torch.Tensor], plans: list[ChunkPlan],
                          chain: str) -> tuple["_Views", "_Views"]:
        """:meth:`_aggregate` of payloads made by :meth:`_encode_device`: every payload unpacked and checked
        together (rows of one tensor), one host sync for all of them, then each valid one summed in rank order
        (the same sums as the byte path gives)."""
        device = self._device()
        layout = self._layout(plans, chain, device)
        self._rejected_now = []
        sums = torch.zeros(layout.total, device=device)
        counts = layout.counts(len(payloads))
        head = wire.header_size(1, chain)
        size = head + layout.value_bytes + layout.index_bytes
        fits = [p.dtype == torch.uint8 and p.dim() == 1 and p.numel() == size for p in payloads]
        ranks = [r for r, ok in enumerate(fits) if ok]
        state: list[list[int]] = [[], [], []]
        if ranks:
            rows = torch.stack([payloads[r].to(device) for r in ranks])
            values, idx, bad, row_bad = self._check_rows(rows[:, head:], layout)
            mine = layout.prefix(chain, sent=True)
            other = (rows[:, 1:head] != mine[1:]).any(dim=1)  # settings or model differ (or a forged prefix)
            state = torch.stack([rows[:, 0].to(torch.int64), row_bad.to(torch.int64),
                                 other.to(torch.int64)]).tolist()  # the one host sync
        contributors = 0
        row = {r: i for i, r in enumerate(ranks)}
        for rank in range(len(payloads)):  # rank order: the same sums on every worker
            i = row.get(rank)
            if i is None:
                self._reject(rank, CorruptPayload(f"settings or model differ: payload of {payloads[rank].numel()} "
                                                  f"elements of {payloads[rank].dtype}, expected {size} bytes"))
                continue
            flag, is_bad, other = state[0][i], state[1][i], state[2][i]
            if other:
                self._reject(rank, CorruptPayload("settings or model differ: the payload's fingerprint "
                                                  f"{bytes(rows[i, 4:8].tolist()).hex()} is not this worker's "
                                                  f"{layout.fingerprint(chain).hex()}"))
                continue
            if flag == 0:  # this worker sent nothing (non-finite gradients)
                continue
            if flag != 1:
                self._reject(rank, CorruptPayload(f"payload flag {flag} (1: sent, 0: nothing sent)"))
                continue
            if is_bad:
                self._reject(rank, self._why(values[i], bad[i], layout))
                continue
            contributors += 1
            _add_row(sums, counts, idx[i], values[i], layout)
        self.last_contributors = contributors
        return _Views(sums, layout), _Views(counts, layout)

    def _check_header(self, payload: bytes, chain: str, layout: "_Layout") -> Optional[memoryview]:
        """The payload's body, or None for "nothing sent"; CorruptPayload when the header does not fit."""
        header = wire.parse_header(payload, self.max_payload_bytes)
        if header.chain != chain:
            raise CorruptPayload(f"settings or model differ: payload {header.chain!r}, this worker {chain!r}")
        expected = layout.value_bytes + layout.index_bytes
        if header.numel == 0 and header.length in (0, expected):  # nothing sent (zeros in place of the body)
            return None
        if header.numel != layout.sent or header.length != expected:
            raise CorruptPayload(f"{header.numel} values in {header.length} bytes, expected {layout.sent} in "
                                 f"{expected}")
        return memoryview(payload)[header.offset:header.offset + header.length]

    def _check_rows(self, body: torch.Tensor, layout: "_Layout") -> tuple[torch.Tensor, ...]:
        """Bodies as rows (uint8, one payload each): (values, indices, bad index, bad row), a row bad when one
        of its indices leaves its chunk or does not increase strictly within it, or a value is not finite."""
        vb = layout.value_bytes
        if self.sign_values:
            values = unpack_bits(body[:, :vb], 1, layout.sent).float() * 2 - 1
        else:
            raw = body[:, :vb]
            if raw.stride(0) % 4 or raw.storage_offset() % 4:  # rows not aligned to fp32: one copy that is
                raw = raw.contiguous()
            values = raw.view(torch.float32)
        streams, b = [], vb
        for width, count, nbytes in layout.stream_sizes:
            streams.append(unpack_bits(body[:, b:b + nbytes], width, count))
            b += nbytes
        idx = torch.cat(streams, dim=1) if len(streams) > 1 else streams[0]
        bad = idx >= layout.limit
        bad[:, 1:] |= (idx[:, 1:] <= idx[:, :-1]) & layout.inner
        row_bad = bad.any(dim=1)
        if not self.sign_values:
            row_bad |= ~torch.isfinite(values).all(dim=1)
        return values, idx, bad, row_bad

    def _why(self, values: torch.Tensor, bad: torch.Tensor, layout: "_Layout") -> CorruptPayload:
        """Why a payload's row failed :meth:`_check_rows` (reading it back: only for a refused one)."""
        if not self.sign_values and not bool(torch.isfinite(values).all()):
            return CorruptPayload("payload holds NaN or Inf values")
        first = int(bad.nonzero()[0, 0])
        plan = layout.plans[layout.owner(first)]
        return CorruptPayload(f"indices of parameter {tuple(plan.shape)} out of range or not increasing")

    def bytes_per_step(self) -> int:
        """Exact payload bytes one worker sends per step (header included)."""
        plans = [plan for _, _, plan in self._entries()]
        chain = self._chain(plans)
        layout = _Layout(plans, self.sign_values, None)
        return len(wire.pack(bytes(layout.value_bytes + layout.index_bytes), torch.float32, (layout.sent,), chain))


def _add_row(sums: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
             layout: "_Layout") -> None:
    """Add one accepted payload (its row of indices and values, in wire order) into the flat sums and counts: one
    ``scatter_add_`` each (flat position = the chunk's offset + the index)."""
    pos = layout.base + idx
    sums.scatter_add_(0, pos, values)
    counts.scatter_add_(0, pos, layout.ones.to(counts.dtype))  # the same tensor where the dtypes agree


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
    settings, or of a version that kept every momentum in the parameter's shape), is converted through the
    parameter's shape."""
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


class _Layout:
    """Where each parameter's coefficients sit, on the wire and in the flat aggregation buffers.

    Wire order: parameters sorted by index width, then block (s1, s2, k), then position, so each
    width is one contiguous run, packed as one bit stream, and parameters with the same block sit
    together (the reference kernels batch them). Flat buffers: wire order too, parameter j's
    ``num_chunks x chunk_size`` block at ``offsets[j]``. The per-element tensors (built once per
    layout and device) map the i-th sent element of a payload to its chunk's flat offset (``base``),
    its chunk size (``limit``) and whether it follows another index of the same chunk (``inner``,
    for the strict-increase check).
    """

    def __init__(self, plans: list[ChunkPlan], sign_values: bool, device: Optional[torch.device]) -> None:
        self.plans = plans
        widths = [bits_for(p.chunk_size) for p in plans]
        self.order = sorted(range(len(plans)), key=lambda j: (widths[j], plans[j].s1, plans[j].s2, plans[j].k,
                                                              plans[j].shape, j))
        self.streams: list[tuple[int, int, int]] = []  # (width, first, last) positions in wire order
        for pos, j in enumerate(self.order):
            if self.streams and self.streams[-1][0] == widths[j]:
                self.streams[-1] = (widths[j], self.streams[-1][1], pos + 1)
            else:
                self.streams.append((widths[j], pos, pos + 1))
        counts = [sum(plans[j].sent for j in self.order[a:b]) for _, a, b in self.streams]
        self.stream_sizes = [(w, n, packed_size(n, w)) for (w, _, _), n in zip(self.streams, counts)]
        self.sent = sum(p.sent for p in plans)
        self.value_bytes = packed_size(self.sent, 1) if sign_values else 4 * self.sent
        self.index_bytes = sum(nb for _, _, nb in self.stream_sizes)
        sizes = [plans[j].num_chunks * plans[j].chunk_size for j in self.order]
        self.offsets = [0] * len(plans)
        for j, start in zip(self.order, [0, *accumulate(sizes)]):
            self.offsets[j] = start
        self.total = sum(sizes)
        numels = [math.prod(plans[j].shape) for j in self.order]
        self.param_starts = [0, *accumulate(numels)]  # parameter k of wire order: elements [k], [k+1]
        self.numel = self.param_starts[-1]
        self.wire_ends = list(accumulate(plans[j].sent for j in self.order))
        self._prefixes: dict[tuple[str, bool], torch.Tensor] = {}  # device payloads' prefixes, made at first use
        self._silent: dict[str, torch.Tensor] = {}  # the device payload of a worker that sends nothing
        if device is not None:
            self._tensors(torch.device(device))

    def prefix(self, chain: str, sent: bool) -> torch.Tensor:
        """The device payload's first bytes (the wire header's size): byte 0 says whether a body follows, bytes 4-7
        are the :meth:`fingerprint` of the chain (settings and model layout), the rest zeros."""
        cache = self._prefixes
        key = (chain, sent)
        if key not in cache:
            head = bytearray(wire.header_size(1, chain))
            head[0] = int(sent)
            head[4:8] = self.fingerprint(chain)
            cache[key] = torch.tensor(list(head), dtype=torch.uint8, device=self.ones.device)
        return cache[key]

    @staticmethod
    def fingerprint(chain: str) -> bytes:
        """4 bytes of the device payload's prefix (bytes 4-7) that stand for the settings and the model layout."""
        return zlib.crc32(chain.encode()).to_bytes(4, "little")

    def silent(self, chain: str) -> torch.Tensor:
        """The device payload of a worker that sends nothing this step: the prefix says so, the body is zeros."""
        cache = self._silent
        if chain not in cache:
            cache[chain] = torch.cat([self.prefix(chain, sent=False),
                                      torch.zeros(self.value_bytes + self.index_bytes, dtype=torch.uint8,
                                                  device=self.ones.device)])
        return cache[chain]

    def in_params(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A buffer of :attr:`numel` elements as parameter-shaped views, in wire order (same-shaped neighbours
        back to back, so they stack without a copy)."""
        starts = self.param_starts
        return [flat[starts[k]:starts[k + 1]].view(self.plans[j].shape) for k, j in enumerate(self.order)]

    def owner(self, element: int) -> int:
        """The parameter (index in parameter order) of the element-th sent coefficient of a payload."""
        return self.order[next(n for n, end in enumerate(self.wire_ends) if element < end)]

    def _tensors(self, device: torch.device) -> None:
        base, limit, inner = [], [], []
        for j in self.order:
            p = self.plans[j]
            chunk_start = self.offsets[j] + torch.arange(p.num_chunks, dtype=torch.int64) * p.chunk_size
            base.append(chunk_start.repeat_interleave(p.k))
            limit.append(torch.full((p.sent,), p.chunk_size, dtype=torch.int64))
            follows = torch.ones(p.num_chunks, p.k, dtype=torch.bool)
            follows[:, 0] = False
            inner.append(follows.reshape(-1))
        empty = torch.zeros(0, dtype=torch.int64)
        self.base = (torch.cat(base) if base else empty).to(device)
        self.limit = (torch.cat(limit) if limit else empty).to(device)
        self.inner = (torch.cat(inner)[1:] if inner else empty.bool()).to(device)
        self.ones = torch.ones(self.sent, dtype=torch.uint8, device=device)  # what each payload adds to the counts

    def counts(self, payloads: int) -> torch.Tensor:
        """Zeroed per-coefficient counts of senders for ``payloads`` payloads: a byte each below 256 of them (a
        quarter of fp32 counts: 3.5 GB less a step for a 1B model), else int32."""
        return torch.zeros(self.total, dtype=torch.uint8 if payloads < 256 else torch.int32, device=self.ones.device)


_SHARED_MEAN = SharedResult()  # one step's mean, for the other simulated workers that received the same list


class _Views(Sequence):
    """A flat buffer over all parameters' chunks; item j is parameter j's ``(num_chunks, chunk_size)`` view."""

    def __init__(self, flat: torch.Tensor, layout: _Layout) -> None:
        self.flat, self.layout = flat, layout

    def __len__(self) -> int:
        return len(self.layout.plans)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[i] for i in range(len(self))[j]]
        j = range(len(self))[j]
        plan = self.layout.plans[j]
        start = self.layout.offsets[j]
        return self.flat[start:start + plan.num_chunks * plan.chunk_size].view(plan.num_chunks, plan.chunk_size)
