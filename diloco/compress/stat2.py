"""``stat2``: two bits a value, decoded through a table of four bin means per block (plain torch, any device).

SparseLoCo's published value format, per block of ``block`` values instead of per tensor: the block's mean m and
standard deviation s place four bins of width 1.5 s across m +- 3 s (the outer two open-ended); a value's code is
its bin, and the block's table holds the mean of the values that fell in each bin (the bin's middle where none
did). A value decodes to its bin's mean, so a block's decoded values keep its sum: where absmax levels overshoot
the many small values of a top-k selection, these shrink toward the mean of their bin.

A payload section is the tables (``4`` fp32 per block, block order) then the codes, four to a byte, least
significant bits first.
"""

from __future__ import annotations

import torch

from diloco.compress.bits import pack_bits, packed_size, unpack_bits
from diloco.compress.kernels.quant import num_blocks

TABLE = 4  # fp32 bin means per block
DEFAULT_BLOCK = 1024
WIDTH = 1.5  # a bin's width, in standard deviations


def section_bytes(count: int, block: int) -> tuple[int, int]:
    """(table bytes, code bytes) of ``count`` values."""
    return 4 * TABLE * num_blocks(count, block), packed_size(count, 2)


def check_block(block: int) -> None:
    if not 2 <= block <= 1 << 20:
        raise ValueError(f"block must be in [2, 1048576] values, got {block}")


def encode(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tables [blocks, 4] fp32, packed codes uint8, the decoded values) of flat ``values``; a NaN or Inf
    value makes a non-finite table (the caller refuses it)."""
    count = values.numel()
    nb = num_blocks(count, block)
    v = torch.nn.functional.pad(values.float().reshape(-1), (0, nb * block - count)).view(nb, block)
    size = torch.full((nb, 1), float(block), device=v.device)
    if nb and count % block:
        size[-1] = count % block
    real = (torch.arange(block, device=v.device) < size).float()  # the last block's padding counts for nothing
    # the statistics of each block divided by its largest |value|: squares of values near 1e20 overflow fp32
    scale = v.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    u = v / scale
    mean = (u * real).sum(1, keepdim=True) / size
    std = (((u - mean) * real).square().sum(1, keepdim=True) / size).sqrt()
    width = (WIDTH * std).clamp_min(torch.finfo(torch.float32).eps)
    low = mean - 2 * WIDTH * std
    # a NaN takes code 0 here and makes its block's table NaN, which the caller refuses
    codes = ((u - low) / width).floor().nan_to_num_(0.0).clamp_(0, TABLE - 1).to(torch.int64)
    sums = torch.zeros(nb, TABLE, device=v.device).scatter_add_(1, codes, u * real)
    counts = torch.zeros(nb, TABLE, device=v.device).scatter_add_(1, codes, real)
    middles = (low + (torch.arange(TABLE, device=v.device) + 0.5) * width).clamp(-1.0, 1.0)
    tables = torch.where(counts > 0, sums / counts.clamp_min(1), middles) * scale
    flat = codes.reshape(-1)[:count]
    return tables, pack_bits(flat, 2), tables.gather(1, codes).reshape(-1)[:count]


def decode(tables: torch.Tensor, packed: torch.Tensor, count: int, block: int) -> torch.Tensor:
    """The ``count`` values (fp32) of ``tables`` [blocks, 4] and ``packed`` codes."""
    codes = unpack_bits(packed, 2, count)
    rows = torch.arange(count, device=packed.device) // block
    return tables.reshape(-1)[rows * TABLE + codes]

