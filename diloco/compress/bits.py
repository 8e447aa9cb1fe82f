"""Pack unsigned integers into the fewest bits they need, and back (plain torch, any device).

Value i occupies bits ``[i*width, (i+1)*width)`` of the stream, least significant bit
first; the stream is padded with zero bits to a whole byte. ``ceil(n * width / 8)``
bytes hold n values (12-bit indices of a 4096 chunk: 1.5 bytes each).
"""

from __future__ import annotations

import torch


def packed_size(count: int, width: int) -> int:
    return (count * width + 7) // 8


def bits_for(n: int) -> int:
    """Bits that index ``range(n)``: 12 for 4096, 0 for 1."""
    return max(int(n - 1).bit_length(), 0)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 tensor of ``packed_size(values.numel(), width)`` bytes; values must lie in ``[0, 2**width)``."""
    v = values.reshape(-1)
    n = v.numel()
    if width == 0 or n == 0:
        return torch.zeros(packed_size(n, width), dtype=torch.uint8, device=v.device)
    if width == 8:
        return v.to(torch.uint8)
    if width in (1, 2, 4):  # whole values in a byte: 8 / width of them, the first in the lowest bits
        per = 8 // width
        v = torch.nn.functional.pad(v.to(torch.uint8), (0, -n % per)).view(-1, per)
        out = v[:, 0].clone()
        for j in range(1, per):
            out |= v[:, j] << (j * width)
        return out
    v = v.to(torch.int32)
    if width == 16:
        return torch.stack([v & 0xFF, v >> 8], dim=1).to(torch.uint8).reshape(-1)
    if width == 12:  # two values in three bytes
        if n % 2:
            v = torch.cat([v, v.new_zeros(1)])
        a, b = v[0::2], v[1::2]
        out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).to(torch.uint8).reshape(-1)
        return out[:packed_size(n, width)]
    shifts = torch.arange(width, device=v.device, dtype=torch.int32)
    bits = ((v[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=v.device, dtype=torch.int32)).to(torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` values (int64) packed in ``data`` (uint8) by :func:`pack_bits`; a 2-D ``data`` holds one
    packed stream per row and gives one row of values each."""
    lead = tuple(data.shape[:-1])
    if data.dim() not in (1, 2) or data.shape[-1] != packed_size(count, width):
        raise ValueError(f"{data.shape[-1] if data.dim() else 0} bytes cannot hold exactly {count} values of "
                         f"{width} bits")
    if width == 0 or count == 0:
        return torch.zeros(*lead, count, dtype=torch.int64, device=data.device)
    if width == 8:
        return data.to(torch.int64)
    if width in (1, 2, 4):
        shifts = torch.arange(0, 8, width, device=data.device, dtype=torch.uint8)
        return ((data[..., None] >> shifts) & ((1 << width) - 1)).reshape(*lead, -1)[..., :count].to(torch.int64)
    d = data.to(torch.int64)
    if width == 16:
        d = d.view(*lead, -1, 2)
        return d[..., 0] | (d[..., 1] << 8)
    if width == 12:
        if count % 2:
            d = torch.cat([d, d.new_zeros(*lead, 1)], dim=-1)
        d = d.view(*lead, -1, 3)
        a = d[..., 0] | ((d[..., 1] & 0xF) << 8)
        b = (d[..., 1] >> 4) | (d[..., 2] << 4)
        return torch.stack([a, b], dim=-1).reshape(*lead, -1)[..., :count]
    shifts = torch.arange(8, device=data.device, dtype=torch.int64)
    bits = ((d[..., None] >> shifts) & 1).reshape(*lead, -1)[..., : count * width].reshape(*lead, count, width)
    return (bits << torch.arange(width, device=data.device, dtype=torch.int64)).sum(dim=-1)
