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

from diloco.compress.kernels.backend import HAVE_TRITON, require_triton, use_triton
from diloco.compress.kernels.quant import FORMATS, dequantize, quantize
from diloco.compress.kernels.topk import topk_chunks, topk_chunks_ref

__all__ = ["FORMATS", "quantize", "dequantize", "topk_chunks", "topk_chunks_ref", "use_triton", "require_triton",
           "HAVE_TRITON"]

if HAVE_TRITON:  # the @triton.jit top-k selection, for other kernels (DeMo's) to call
    from diloco.compress.kernels.topk import select_topk
    __all__.append("select_topk")
