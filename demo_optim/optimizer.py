"""DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870) as a ``torch.optim.Optimizer`` over a loco transport.

Per parameter, every step::

    p     *= 1 - lr * weight_decay                      (decoupled weight decay, optional)
    delta  = decay * delta + lr * grad                   (momentum with lr folded in)
    C      = DCT(delta) per chunk; keep the top-k |C| of each chunk: what this worker sends
    delta -= IDCT(kept)                                  (what was sent leaves the momentum)
    agg    = per coefficient, the mean over the workers that sent it (0 if nobody did)
    p     -= lr * sign(IDCT(agg))

All parameters travel in one payload per worker and one ``all_gather_bytes`` per step:
loco's wire header (magic, version, settings + model layout fingerprint, length, CRC-32),
then every kept value (fp32, or 1 bit each with ``sign_values``), then each parameter's
indices in ``ceil(log2(s1*s2))`` bits (12 for 64 x 64). Every worker aggregates the same
payloads in rank order, so every worker applies the same update. A payload that fails
validation is left out of the mean and logged; a worker whose gradients are not finite
sends nothing that step (``nonfinite="skip"``) or raises (``"raise"``) and still applies
the others' update, so the replicas stay equal.
"""

from __future__ import annotations

import logging
import math
import zlib
from typing import Any, Callable, Iterable, Optional

import torch

from diloco.comm.base import Transport
from diloco.comm.local import LocalTransport
from diloco.compress import (RULES, ChunkPlan, CorruptPayload, bits_for, chunk_indices_ok, pack_bits, packed_size,
                             plan_for, tensor_bytes, unpack_bits, wire)
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
        self.skipped_steps = 0  # steps this worker sent nothing (non-finite gradients)
        self.rejected_payloads = 0  # peer payloads left out of the mean
        self.last_contributors = 0
        self.contribute = True  # the trainer clears it for one step when it found non-finite gradients
        self.grads_checked = False  # the trainer sets it when it already checked the gradients this step

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
        return f"demo:v1,sign={int(self.sign_values)},layout={layout:08x}"

    def _sizes(self, plans: list[ChunkPlan]) -> tuple[int, int, list[int]]:
        sent = sum(p.sent for p in plans)
        value_bytes = packed_size(sent, 1) if self.sign_values else 4 * sent
        index_bytes = [packed_size(p.sent, bits_for(p.chunk_size)) for p in plans]
        return sent, value_bytes, index_bytes

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
        contribute = self.contribute and (self.grads_checked or self._grads_finite(entries))
        self.contribute, self.grads_checked = True, False
        payload = self._encode(entries, chain) if contribute else wire.pack(b"", torch.float32, (0,), chain)
        payloads = self.transport.all_gather_bytes(payload)
        sums, counts = self._aggregate(payloads, plans, chain)
        for (p, group, plan), s, c in zip(entries, sums, counts):
            agg = torch.where(c > 0, s / c.clamp(min=1), torch.zeros_like(s))
            kernels.decode_sign_(agg, p, group["lr"], plan)
        return loss

    def _grads_finite(self, entries) -> bool:
        finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p, _, _ in entries)
        if not finite:
            if self.nonfinite == "raise":
                raise FloatingPointError("DeMo: non-finite gradients (set nonfinite='skip' to sit the step out)")
            self.skipped_steps += 1
            log.warning("DeMo worker %d: non-finite gradients, sending nothing this step (the others' update "
                        "still applies)", self.transport.rank)
        return finite

    def _encode(self, entries, chain: str) -> bytes:
        values, indices = [], []
        for p, group, plan in entries:
            state = self.state[p]
            if "delta" not in state:
                state["delta"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            delta = state["delta"]
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                p.mul_(1.0 - lr * wd)
            delta.mul_(group["compression_decay"])
            if p.grad is not None:
                delta.add_(p.grad.float(), alpha=lr)
            idx, vals = kernels.encode(delta, plan)
            values.append(vals)
            indices.append(tensor_bytes(pack_bits(idx, bits_for(plan.chunk_size))))
        flat = torch.cat(values) if values else torch.zeros(0)
        value_section = tensor_bytes(pack_bits((flat > 0).to(torch.int32), 1) if self.sign_values else flat)
        body = value_section + b"".join(indices)
        return wire.pack(body, torch.float32, (flat.numel(),), chain)

    def _aggregate(self, payloads: list[bytes], plans: list[ChunkPlan],
                   chain: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        device = self.param_groups[0]["params"][0].device
        sums = [torch.zeros(p.num_chunks, p.chunk_size, device=device) for p in plans]
        counts = [torch.zeros(p.num_chunks, p.chunk_size, device=device) for p in plans]
        sent, value_bytes, index_bytes = self._sizes(plans)
        contributors = 0
        for rank, payload in enumerate(payloads):  # rank order: the same sums on every worker
            try:
                decoded = self._decode(payload, chain, sent, value_bytes, index_bytes, plans, device)
            except CorruptPayload as e:
                self.rejected_payloads += 1
                log.warning("DeMo worker %d: left worker %d's payload out of the mean: %s", self.transport.rank, rank, e)
                continue
            if decoded is None:
                continue
            contributors += 1
            for (idx, vals), s, c in zip(decoded, sums, counts):
                s.scatter_add_(1, idx, vals)
                c.scatter_add_(1, idx, torch.ones_like(vals))
        self.last_contributors = contributors
        return sums, counts

    def _decode(self, payload: bytes, chain: str, sent: int, value_bytes: int, index_bytes: list[int],
                plans: list[ChunkPlan], device: torch.device):
        """[(indices (chunks, k) int64, values (chunks, k))] per parameter, or None for "nothing sent"."""
        header = wire.parse_header(payload, self.max_payload_bytes)
        if header.chain != chain:
            raise CorruptPayload(f"settings or model differ: payload {header.chain!r}, this worker {chain!r}")
        if header.numel == 0 and header.length == 0:
            return None
        if header.numel != sent or header.length != value_bytes + sum(index_bytes):
            raise CorruptPayload(f"{header.numel} values in {header.length} bytes, expected {sent} in "
                                 f"{value_bytes + sum(index_bytes)}")
        data = torch.frombuffer(bytearray(memoryview(payload)[header.offset:]), dtype=torch.uint8).to(device)
        if self.sign_values:
            values = unpack_bits(data[:value_bytes], 1, sent).float() * 2 - 1
        else:
            values = data[:value_bytes].view(torch.float32)
            if not bool(torch.isfinite(values).all()):
                raise CorruptPayload("payload holds NaN or Inf values")
        out, v, b = [], 0, value_bytes
        for plan, nb in zip(plans, index_bytes):
            idx = unpack_bits(data[b:b + nb], bits_for(plan.chunk_size), plan.sent).view(plan.num_chunks, plan.k)
            if not chunk_indices_ok(idx, plan.chunk_size):
                raise CorruptPayload(f"indices of parameter {tuple(plan.shape)} out of range or not increasing")
            out.append((idx, values[v:v + plan.sent].view(plan.num_chunks, plan.k)))
            v += plan.sent
            b += nb
        return out

    def bytes_per_step(self) -> int:
        """Exact payload bytes one worker sends per step (header included)."""
        plans = [plan for _, _, plan in self._entries()]
        sent, value_bytes, index_bytes = self._sizes(plans)
        return len(wire.pack(bytes(value_bytes + sum(index_bytes)), torch.float32, (sent,), self._chain(plans)))
