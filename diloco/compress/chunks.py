"""DeMo's 2-D chunk plan and the chunked DCT both ways (``to_chunks`` / ``from_chunks``).

A parameter of shape ``(..., r, c)`` is seen as ``L = prod(...)`` matrices of r x c
(a vector is 1 x n, a scalar 1 x 1) and cut into s1 x s2 blocks; each block becomes
``D1 B D2^T`` with the orthonormal DCT-II matrices of :mod:`diloco.compress.dct`.

Block sides come from ``compression_chunk`` and the rule:

* ``divisor`` (published DeMo): the largest divisor of the dimension that is <= chunk.
* ``pad``: side = min(chunk, dim); the dimension is zero-padded to a multiple of it.
* ``auto`` (default): the divisor when it is at least half of min(chunk, dim), else pad,
  so a prime like 131 gets 64-wide chunks (padded to 192) instead of chunks of 1.

For dimensions that are multiples of the chunk all three rules agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from einops import rearrange

from diloco.compress.dct import dct_blocks, idct_blocks

RULES = ("auto", "divisor", "pad")


def largest_divisor_at_most(n: int, limit: int) -> int:
    for d in range(min(n, limit), 0, -1):
        if n % d == 0:
            return d
    return 1


def block_side(dim: int, chunk: int, rule: str) -> tuple[int, int]:
    """(side, padded dim) for one dimension."""
    if rule not in RULES:
        raise ValueError(f"chunk rule must be one of {', '.join(RULES)}, got {rule!r}")
    div = largest_divisor_at_most(dim, chunk)
    if rule == "divisor" or (rule == "auto" and 2 * div >= min(dim, chunk)):
        return div, dim
    side = min(chunk, dim)
    return side, -(-dim // side) * side


@dataclass(frozen=True)
class ChunkPlan:
    shape: tuple[int, ...]
    lead: int  # matrices of r x c
    rows: int
    cols: int
    s1: int
    s2: int
    rows_padded: int
    cols_padded: int
    k: int  # kept coefficients per chunk

    @property
    def chunk_size(self) -> int:
        return self.s1 * self.s2

    @property
    def num_chunks(self) -> int:
        return self.lead * (self.rows_padded // self.s1) * (self.cols_padded // self.s2)

    @property
    def padded(self) -> bool:
        return (self.rows_padded, self.cols_padded) != (self.rows, self.cols)

    @property
    def sent(self) -> int:
        return self.num_chunks * self.k


def plan_for(shape: tuple[int, ...] | torch.Size, chunk: int, topk: int, rule: str = "auto") -> ChunkPlan:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        lead, r, c = 1, 1, 1
    elif len(shape) == 1:
        lead, r, c = 1, 1, shape[0]
    else:
        lead, r, c = math.prod(shape[:-2]), shape[-2], shape[-1]
    if min(lead, r, c) == 0:
        raise ValueError(f"DeMo cannot chunk an empty parameter of shape {shape}")
    s1, rp = block_side(r, chunk, rule)
    s2, cp = block_side(c, chunk, rule)
    return ChunkPlan(shape, lead, r, c, s1, s2, rp, cp, min(topk, s1 * s2))


def to_chunks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Parameter-shaped tensor -> DCT coefficients, one row per chunk: ``(num_chunks, s1*s2)``."""
    m = x.reshape(plan.lead, plan.rows, plan.cols)
    if plan.padded:
        m = torch.nn.functional.pad(m, (0, plan.cols_padded - plan.cols, 0, plan.rows_padded - plan.rows))
    return rearrange(dct_blocks(m, plan.s1, plan.s2), "l nr nc s1 s2 -> (l nr nc) (s1 s2)")


def from_chunks(coeffs: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Inverse of :func:`to_chunks` (padding cropped), in the parameter's shape."""
    c = rearrange(coeffs.reshape(-1), "(l nr nc s1 s2) -> l nr nc s1 s2", l=plan.lead,
                  nr=plan.rows_padded // plan.s1, s1=plan.s1, s2=plan.s2)
    m = idct_blocks(c)
    if plan.padded:
        m = m[:, :plan.rows, :plan.cols]
    return m.reshape(plan.shape)
