"""Whether and where the codecs' Triton kernels run: Triton's presence, the interpreter, and the dispatch rule
(CUDA tensors, unless ``LOCO_KERNELS=torch`` forces the torch references)."""

from __future__ import annotations

import os

import torch

try:  # Triton is a dependency on Linux; elsewhere the references run
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - platform without Triton
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernel should handle tensor ``t`` (CUDA tensors, unless LOCO_KERNELS=torch)."""
    return HAVE_TRITON and t.is_cuda and os.environ.get("LOCO_KERNELS", "auto") != "torch"


def require_triton(t: torch.Tensor) -> None:
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    if not (t.is_cuda or INTERPRET):
        raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before importing loco")
