"""DeMo's aggregation: every worker's payload of a step, validated and summed into one mean per coefficient.

The mean of a coefficient is taken over the workers that sent it (0 where nobody did). Every worker
aggregates the same payloads in rank order, so every worker computes the same mean and applies the same
update. The payloads are checked together, whatever their number and the number of parameters: their bodies
(all of one length) become the rows of one tensor, :meth:`Layout.check_rows` checks every row with a fixed
number of tensor ops, and one host sync reads back the verdicts of all of them. Each accepted payload is then
added with one ``scatter_add_`` for its values and one for its counts into flat buffers that hold every
parameter's chunks back to back (flat position = the chunk's offset + the index). A payload that fails is
left out of the mean and logged with its sender's rank; a silent one (its sender sat the step out) adds
nothing. Wire payloads have their headers checked on the host first; device payloads
(``Capabilities.device_gather``) have their size, flag and fingerprint checked with the rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from diloco.comm.base import Transport
from diloco.compress import CorruptPayload, wire
from demo_optim.payload import Layout

log = logging.getLogger("demo_optim")


class Aggregation:
    """The mean of each step's gathered payloads, and this worker's tally of the payloads it left out."""

    def __init__(self, transport: Transport, max_payload_bytes: int) -> None:
        self.transport = transport  # its rank names this worker in the log
        self.max_payload_bytes = max_payload_bytes
        self.rejected_payloads = 0  # peer payloads left out of the mean
        self.last_contributors = 0  # payloads in the latest mean
        self.rejected_now: list[tuple[int, Any]] = []  # (rank, reason) of the payloads the latest mean left out

    def mean(self, payloads: list, layout: Layout) -> torch.Tensor:
        """Per coefficient (flat, as the layout's buffers hold them), the mean over the valid payloads that sent
        it; 0 where nobody did."""
        if payloads and isinstance(payloads[0], torch.Tensor):
            sums, counts = self.sum_device(payloads, layout)
        else:
            sums, counts = self.sum_wire(payloads, layout)
        # 0 where nobody sent: the sum is 0 there (whole counts of any integer dtype divide to the bits that fp32
        # counts give)
        return sums.flat.div_(counts.flat.clamp_(min=1))

    def sum_wire(self, payloads: list[bytes], layout: Layout) -> tuple["Views", "Views"]:
        """Per coefficient, the sum of what the valid payloads sent and how many sent it, in two flat buffers
        (all parameters' chunks back to back); indexing the returned views gives parameter j's
        ``(num_chunks, chunk_size)`` block. Headers are checked on the host; the bodies go to the device as rows
        of one buffer and are checked together, then each valid one is summed in rank order."""
        device = layout.device
        self.rejected_now = []
        sums = torch.zeros(layout.total, device=device)
        counts = layout.counts(len(payloads))
        verdicts: list[Any] = []  # per rank: a CorruptPayload, None (nothing sent) or the body's row
        bodies: list[memoryview] = []
        for payload in payloads:
            try:
                body = layout.check_header(payload, self.max_payload_bytes)
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
            values, idx, bad, row_bad = layout.check_rows(rows)
            refused = row_bad.tolist()  # the one host sync
        contributors = 0
        for rank, verdict in enumerate(verdicts):  # rank order: the same sums on every worker
            if isinstance(verdict, int):
                if refused[verdict]:
                    verdict = layout.why(values[verdict], bad[verdict])
                else:
                    contributors += 1
                    _add_row(sums, counts, idx[verdict], values[verdict], layout)
            if isinstance(verdict, CorruptPayload):
                self.reject(rank, verdict)
        self.last_contributors = contributors
        return Views(sums, layout), Views(counts, layout)

    def sum_device(self, payloads: list[torch.Tensor], layout: Layout) -> tuple["Views", "Views"]:
        """:meth:`sum_wire` of device payloads: every payload unpacked and checked together (rows of one
        tensor), one host sync for all of them, then each valid one summed in rank order (the same sums as the
        wire payloads give)."""
        device = layout.device
        self.rejected_now = []
        sums = torch.zeros(layout.total, device=device)
        counts = layout.counts(len(payloads))
        head = wire.header_size(1, layout.chain)
        size = head + layout.body_bytes
        fits = [p.dtype == torch.uint8 and p.dim() == 1 and p.numel() == size for p in payloads]
        ranks = [r for r, ok in enumerate(fits) if ok]
        state: list[list[int]] = [[], [], []]
        if ranks:
            rows = torch.stack([payloads[r].to(device) for r in ranks])
            values, idx, bad, row_bad = layout.check_rows(rows[:, head:])
            mine = layout.prefix(sent=True)
            other = (rows[:, 1:head] != mine[1:]).any(dim=1)  # settings or model differ (or a forged prefix)
            state = torch.stack([rows[:, 0].to(torch.int64), row_bad.to(torch.int64),
                                 other.to(torch.int64)]).tolist()  # the one host sync
        contributors = 0
        row = {r: i for i, r in enumerate(ranks)}
        for rank in range(len(payloads)):  # rank order: the same sums on every worker
            i = row.get(rank)
            if i is None:
                self.reject(rank, CorruptPayload(f"settings or model differ: payload of {payloads[rank].numel()} "
                                                 f"elements of {payloads[rank].dtype}, expected {size} bytes"))
                continue
            flag, is_bad, other = state[0][i], state[1][i], state[2][i]
            if other:
                self.reject(rank, CorruptPayload("settings or model differ: the payload's fingerprint "
                                                 f"{bytes(rows[i, 4:8].tolist()).hex()} is not this worker's "
                                                 f"{layout.fingerprint().hex()}"))
                continue
            if flag == 0:  # this worker sent nothing (non-finite gradients)
                continue
            if flag != 1:
                self.reject(rank, CorruptPayload(f"payload flag {flag} (1: sent, 0: nothing sent)"))
                continue
            if is_bad:
                self.reject(rank, layout.why(values[i], bad[i]))
                continue
            contributors += 1
            _add_row(sums, counts, idx[i], values[i], layout)
        self.last_contributors = contributors
        return Views(sums, layout), Views(counts, layout)

    def reject(self, rank: int, reason: Any) -> None:
        """Leave worker ``rank``'s payload out of the mean: counted, kept for this step, and logged."""
        self.rejected_payloads += 1
        self.rejected_now.append((rank, reason))
        log.warning("DeMo worker %d: left worker %d's payload out of the mean: %s", self.transport.rank, rank, reason)

    def replay(self, contributors: int, rejected: list[tuple[int, Any]]) -> None:
        """Take the tally of a mean another worker computed from the very same payloads, as if computed here."""
        self.rejected_now = []
        self.last_contributors = contributors
        for rank, reason in rejected:
            self.reject(rank, reason)


def _add_row(sums: torch.Tensor, counts: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
             layout: Layout) -> None:
    """Add one accepted payload (its row of indices and values, in wire order) into the flat sums and counts: one
    ``scatter_add_`` each (flat position = the chunk's offset + the index)."""
    pos = layout.base + idx
    sums.scatter_add_(0, pos, values)
    counts.scatter_add_(0, pos, layout.ones.to(counts.dtype))  # the same tensor where the dtypes agree


class Views(Sequence):
    """A flat buffer over all parameters' chunks; item j is parameter j's ``(num_chunks, chunk_size)`` view."""

    def __init__(self, flat: torch.Tensor, layout: Layout) -> None:
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
