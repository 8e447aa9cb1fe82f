"""Whether and where the codecs' Triton kernels run: Triton's presence, the interpreter, and the dispatch rule
(CUDA tensors, unless ``LOCO_KERNELS=torch`` forces the torch references)."""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

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


F = TypeVar("F", bound=Callable)


def one_host_thread(method: F) -> F:
    """Run ``method`` on one torch thread when its first tensor argument (or ``out``) is not on a GPU.

    The host paths walk a bucket in pieces of 128K to 1M values, each op small enough that a parallel region
    costs about what it saves on idle cores; on a loaded machine every region also waits for a descheduled
    thread at its barrier, and a bucket's hundreds of regions fell to 1% of memcpy
    (``benchmarks/results/codecs_threads_cpu.md``). One thread keeps each piece in its core's cache and never
    waits. Only this thread's OpenMP team changes, and it is put back after the call."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        tensor = next((a for a in (*args, kwargs.get("out")) if isinstance(a, torch.Tensor)), None)
        threads = torch.get_num_threads()
        if threads == 1 or (tensor is not None and tensor.is_cuda) or str(kwargs.get("device", "cpu")) != "cpu":
            return method(self, *args, **kwargs)
        torch.set_num_threads(1)
        try:
            return method(self, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run  # type: ignore[return-value]
