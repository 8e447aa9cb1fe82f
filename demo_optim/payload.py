"""DeMo's payload: one worker's momentum components of a step as one message, and the checks it must pass.

Every parameter travels in one payload per worker (chain ``demo:v3``): loco's wire header (magic, version,
settings + model layout fingerprint, length, CRC-32), then every kept value (fp32, or 1 bit each with
``sign_values``), then the indices in ``ceil(log2(s1*s2))`` bits (12 for 64 x 64). Parameters are laid out in
*wire order* (:class:`Layout`): grouped by index width (ascending); the values follow that order, and each
width's indices form one bit stream (padded to a whole byte once per width, not once per parameter). So a
payload is unpacked and checked with a fixed number of tensor ops whatever the number of parameters: one
``unpack_bits`` per width, and one vectorised expression for the range, the strict increase within every chunk
and the finiteness of the values (:meth:`Layout.check_rows`).

A worker that sends nothing this step (its gradients are not finite) sends the silent payload: no values
(shape (0,)) and zeros in place of a body, so it is as long as every other worker's payload and every
worker knows every payload's length beforehand.

Transports that move tensors where they lie (``Capabilities.device_gather``) take the device payload
instead: one uint8 tensor on the parameters' device, as long as the wire payload, whose first bytes (the wire
header's size) say whether a body follows (byte 0) and carry a fingerprint of the chain (bytes 4-7) in place of
the header: the members of such a group are trusted, and the transport checks its own transfer. The body is
the wire payload's, so the sums made from either form are the same.
"""

from __future__ import annotations

import math
import zlib
from itertools import accumulate
from typing import Optional

import torch

from diloco.comm.base import PayloadBound
from diloco.compress import (ChunkPlan, CorruptPayload, bits_for, pack_bits, packed_size, tensor_bytes,
                             unpack_bits, wire)


def chain_of(plans: list[ChunkPlan], sign_values: bool) -> str:
    """The payload's chain: its format, the value encoding and a fingerprint of the model layout, so that a
    payload of other settings or another model is told apart by its header (or its device prefix)."""
    layout = zlib.crc32(repr([(p.shape, p.s1, p.s2, p.rows_padded, p.cols_padded, p.k) for p in plans]).encode())
    return f"demo:v3,sign={int(sign_values)},layout={layout:08x}"


class Layout:
    """Where each parameter's coefficients sit, on the wire and in the flat aggregation buffers, and how a payload
    of this layout is packed and checked.

    Wire order: parameters sorted by index width, then block (s1, s2, k), then position, so each
    width is one contiguous run, packed as one bit stream, and parameters with the same block sit
    together (the reference kernels batch them). Flat buffers: wire order too, parameter j's
    ``num_chunks x chunk_size`` block at ``offsets[j]``. The per-element tensors (built once per
    layout and device) map the i-th sent element of a payload to its chunk's flat offset (``base``),
    its chunk size (``limit``) and whether it follows another index of the same chunk (``inner``,
    for the strict-increase check).
    """

    def __init__(self, plans: list[ChunkPlan], sign_values: bool, device: Optional[torch.device]) -> None:
        self.plans, self.chain, self.sign_values = plans, chain_of(plans, sign_values), sign_values
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
        self.body_bytes = self.value_bytes + self.index_bytes
        sizes = [plans[j].num_chunks * plans[j].chunk_size for j in self.order]
        self.offsets = [0] * len(plans)
        for j, start in zip(self.order, [0, *accumulate(sizes)]):
            self.offsets[j] = start
        self.total = sum(sizes)
        numels = [math.prod(plans[j].shape) for j in self.order]
        self.param_starts = [0, *accumulate(numels)]  # parameter k of wire order: elements [k], [k+1]
        self.numel = self.param_starts[-1]
        self.wire_ends = list(accumulate(plans[j].sent for j in self.order))
        self._prefixes: dict[bool, torch.Tensor] = {}  # device payloads' prefixes, made at first use
        self._silent: Optional[torch.Tensor] = None  # the device payload of a worker that sends nothing
        self.device = None if device is None else torch.device(device)
        if self.device is not None:
            self._tensors(self.device)

    # ---- this worker's payload ------------------------------------------------------------------
    def body(self, idx: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """The body's sections (uint8 tensors, in order) of the indices and values a step kept, in wire order."""
        sections = [pack_bits((values > 0).to(torch.int32), 1) if self.sign_values else values.view(torch.uint8)]
        at = 0
        for width, count, _ in self.stream_sizes:  # one bit stream per index width
            sections.append(pack_bits(idx[at:at + count], width))
            at += count
        return sections

    def encode_wire(self, idx: torch.Tensor, values: torch.Tensor,
                    ok: Optional[torch.Tensor] = None) -> Optional[bytes]:
        """The wire payload (header + body). With ``ok`` (the gradients' finiteness, on the device) its byte
        travels behind the body in the one copy to the host; None where it is 0 (the silent payload goes out)."""
        sections = self.body(idx, values)
        if ok is not None:
            sections.append(ok.reshape(1).to(torch.uint8))
        raw = tensor_bytes(torch.cat(sections))
        if ok is not None:
            if not raw[-1]:
                return None
            raw = memoryview(raw)[:-1]
        return wire.pack(raw, torch.float32, (self.sent,), self.chain)

    def silent_wire(self) -> bytes:
        """The wire payload of a worker that sends nothing this step."""
        return wire.pack(bytes(self.body_bytes), torch.float32, (0,), self.chain)

    def wire_size(self) -> int:
        """The length of every wire payload of this layout (header included)."""
        return wire.header_size(1, self.chain) + self.body_bytes

    def wire_bound(self) -> PayloadBound:
        """The lengths another worker's wire payload may have, for a transport that checks them before reading
        one (hivemind): from the header alone to :meth:`wire_size`. Every payload sent has that length (a silent one
        is padded to it); a shorter one fails :meth:`check_header` and is counted as rejected there."""
        return PayloadBound(wire.header_size(1, self.chain), self.wire_size(), False)

    def encode_device(self, idx: torch.Tensor, values: torch.Tensor,
                      ok: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The device payload: the :meth:`prefix` that says "sent", then the body of :meth:`encode_wire`. With
        ``ok`` the first byte is that flag (0: nothing sent; the receivers skip the body unread)."""
        data = torch.cat([self.prefix(sent=True), *self.body(idx, values)])
        if ok is not None:
            data[:1].copy_(ok.reshape(1))
        return data

    def silent_device(self) -> torch.Tensor:
        """The device payload of a worker that sends nothing this step: the prefix says so, the body is zeros."""
        if self._silent is None:
            self._silent = torch.cat([self.prefix(sent=False),
                                      torch.zeros(self.body_bytes, dtype=torch.uint8, device=self.device)])
        return self._silent

    def prefix(self, sent: bool) -> torch.Tensor:
        """The device payload's first bytes (the wire header's size): byte 0 says whether a body follows, bytes 4-7
        are the :meth:`fingerprint` of the chain (settings and model layout), the rest zeros."""
        if sent not in self._prefixes:
            head = bytearray(wire.header_size(1, self.chain))
            head[0] = int(sent)
            head[4:8] = self.fingerprint()
            self._prefixes[sent] = torch.tensor(list(head), dtype=torch.uint8, device=self.device)
        return self._prefixes[sent]

    def fingerprint(self) -> bytes:
        """4 bytes of the device payload's prefix (bytes 4-7) that stand for the settings and the model layout."""
        return zlib.crc32(self.chain.encode()).to_bytes(4, "little")

    # ---- checks of a received payload -----------------------------------------------------------
    def check_header(self, payload: bytes, max_payload_bytes: int) -> Optional[memoryview]:
        """The payload's body, or None for "nothing sent"; CorruptPayload when the header does not fit."""
        header = wire.parse_header(payload, max_payload_bytes)
        if header.chain != self.chain:
            raise CorruptPayload(f"settings or model differ: payload {header.chain!r}, this worker {self.chain!r}")
        expected = self.body_bytes
        if header.numel == 0 and header.length in (0, expected):  # nothing sent (zeros in place of the body)
            return None
        if header.numel != self.sent or header.length != expected:
            raise CorruptPayload(f"{header.numel} values in {header.length} bytes, expected {self.sent} in "
                                 f"{expected}")
        return memoryview(payload)[header.offset:header.offset + header.length]

    def check_rows(self, body: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Bodies as rows (uint8, one payload each): (values, indices, bad index, bad row), a row bad when one
        of its indices leaves its chunk or does not increase strictly within it, or a value is not finite."""
        vb = self.value_bytes
        if self.sign_values:
            values = unpack_bits(body[:, :vb], 1, self.sent).float() * 2 - 1
        else:
            raw = body[:, :vb]
            if raw.stride(0) % 4 or raw.storage_offset() % 4:  # rows not aligned to fp32: one copy that is
                raw = raw.contiguous()
            values = raw.view(torch.float32)
        streams, b = [], vb
        for width, count, nbytes in self.stream_sizes:
            streams.append(unpack_bits(body[:, b:b + nbytes], width, count))
            b += nbytes
        idx = torch.cat(streams, dim=1) if len(streams) > 1 else streams[0]
        bad = idx >= self.limit
        bad[:, 1:] |= (idx[:, 1:] <= idx[:, :-1]) & self.inner
        row_bad = bad.any(dim=1)
        if not self.sign_values:
            row_bad |= ~torch.isfinite(values).all(dim=1)
        return values, idx, bad, row_bad

    def why(self, values: torch.Tensor, bad: torch.Tensor) -> CorruptPayload:
        """Why a payload's row failed :meth:`check_rows` (reading it back: only for a refused one)."""
        if not self.sign_values and not bool(torch.isfinite(values).all()):
            return CorruptPayload("payload holds NaN or Inf values")
        first = int(bad.nonzero()[0, 0])
        plan = self.plans[self.owner(first)]
        return CorruptPayload(f"indices of parameter {tuple(plan.shape)} out of range or not increasing")

    # ---- positions ------------------------------------------------------------------------------
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
        quarter of the memory of fp32 counts, and exact, as no count exceeds the payloads), else int32."""
        return torch.zeros(self.total, dtype=torch.uint8 if payloads < 256 else torch.int32, device=self.device)
