"""Fused kernels for the codecs' hot paths, each beside a plain-torch reference with the same signature.

The dispatching function (e.g. :func:`quantize`) runs the Triton kernel on CUDA
tensors and the torch reference elsewhere. ``LOCO_KERNELS=torch`` forces the
reference everywhere (to compare or debug). Tests run the Triton versions on CPU
tensors with ``TRITON_INTERPRET=1``, which must be set before this package is
imported.

Exported for kernels elsewhere (DeMo's): ``topk_chunks_ref`` and, with Triton, the
``@triton.jit`` helper ``select_topk``.
"""

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


from diloco.compress.kernels.quant import FORMATS, dequantize, quantize  # noqa: E402
from diloco.compress.kernels.topk import topk_chunks, topk_chunks_ref  # noqa: E402

__all__ = ["FORMATS", "quantize", "dequantize", "topk_chunks", "topk_chunks_ref", "use_triton", "require_triton",
           "HAVE_TRITON"]

if HAVE_TRITON:  # the @triton.jit top-k selection, for other kernels (DeMo's) to call
    from diloco.compress.kernels.topk import select_topk  # noqa: E402
    __all__.append("select_topk")
