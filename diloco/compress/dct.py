"""The orthonormal DCT-II, applied per chunk: one implementation for the ``dct`` codec stage and DeMo.

``dct_basis(n)`` is the n x n matrix D with ``D[k, j] = sqrt(2/n) c_k cos(pi (2j+1) k / 2n)``
(``c_0 = 1/sqrt 2``, else 1), so D is orthogonal: the inverse is its transpose.
A vector cut into chunks of length s becomes ``chunk @ D.T`` per chunk; a matrix
cut into s1 x s2 blocks becomes ``D1 @ B @ D2.T`` per block (DeMo's 2-D form; DeMo's
chunk plan over parameter shapes is in :mod:`diloco.compress.chunks`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from einops import rearrange


@lru_cache(maxsize=64)
def _basis_cpu(n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=torch.float64)
    k = j[:, None]
    d = torch.cos(math.pi * (2 * j[None, :] + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


_DEVICE_CACHE: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}


def dct_basis(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size n (computed in float64, cached per device and dtype)."""
    if n < 1:
        raise ValueError(f"DCT size must be >= 1, got {n}")
    key = (n, str(device), dtype)
    basis = _DEVICE_CACHE.get(key)
    if basis is None:
        basis = _DEVICE_CACHE[key] = _basis_cpu(n).to(device=device, dtype=dtype)
    return basis


def padded_length(n: int, chunk: int) -> int:
    return -(-n // chunk) * chunk


def dct_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """1-D: pad the flat tensor with zeros to a multiple of ``chunk`` and transform each chunk."""
    flat = x.reshape(-1)
    pad = padded_length(flat.numel(), chunk) - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    d = dct_basis(chunk, flat.device, flat.dtype)
    return (flat.view(-1, chunk) @ d.T).reshape(-1)


def idct_chunks(coeffs: torch.Tensor, chunk: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`dct_chunks`: the first ``numel`` values of the reconstructed vector."""
    d = dct_basis(chunk, coeffs.device, coeffs.dtype)
    return (coeffs.reshape(-1, chunk) @ d).reshape(-1)[:numel]


def dct_blocks(x: torch.Tensor, s1: int, s2: int) -> torch.Tensor:
    """2-D (or batched): the last two dims cut into s1 x s2 blocks, each ``D1 B D2^T``.

    Returns shape ``(..., rows/s1, cols/s2, s1, s2)``; the dims must be multiples of the block.
    """
    rows, cols = x.shape[-2:]
    if rows % s1 or cols % s2:
        raise ValueError(f"shape {tuple(x.shape)} is not a multiple of the {s1}x{s2} block")
    b = rearrange(x, "... (nr s1) (nc s2) -> ... nr nc s1 s2", s1=s1, s2=s2)
    d1, d2 = dct_basis(s1, x.device, x.dtype), dct_basis(s2, x.device, x.dtype)
    return d1 @ b @ d2.T


def idct_blocks(coeffs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct_blocks`: back to ``(..., rows, cols)``."""
    s1, s2 = coeffs.shape[-2:]
    d1, d2 = dct_basis(s1, coeffs.device, coeffs.dtype), dct_basis(s2, coeffs.device, coeffs.dtype)
    b = d1.T @ coeffs @ d2
    return rearrange(b, "... nr nc s1 s2 -> ... (nr s1) (nc s2)")
