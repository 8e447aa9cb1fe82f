"""The collective's flat views: tensors grouped into buckets, read where they lie end to end, or concatenated into
scratch buffers and written back.

A bucket is reduced as one flat 1-D buffer. Tensors that lie one after the other in one storage are that buffer
already (:func:`end_to_end`); others are concatenated into a scratch buffer (:class:`Scratch`) and the result is
copied back piece by piece (:func:`unflatten_into`).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch

from diloco.comm.base import Transport


def bucket_groups(sizes: Sequence[int], limit: int, joins: Optional[Callable[[int], bool]] = None) -> list[list[int]]:
    """The bucketing rule, on byte sizes: consecutive items share a bucket while it stays within ``limit`` bytes
    (an item larger than that is a bucket of its own) and ``joins(i)`` allows item i to follow item i-1.
    Returns each bucket's item indices. :func:`buckets` groups tensors by it; ``loco plan`` predicts with it."""
    out: list[list[int]] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        if out and size + nbytes <= limit and (joins is None or joins(i)):
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Group tensors of one dtype and device into buckets of at most ``limit`` bytes (or one tensor)."""
    def joins(i: int) -> bool:
        return tensors[i].dtype == tensors[i - 1].dtype and tensors[i].device == tensors[i - 1].device

    groups = bucket_groups([t.numel() * t.element_size() for t in tensors], limit, joins)
    return [[tensors[i] for i in g] for g in groups]


def end_to_end(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat view of ``tensors`` where they are contiguous, of one dtype, and lie one after the other in one
    storage (writing the view writes them), else None. DiLoCo's pseudo-gradients with a codec lie so (the
    compressed collective reduces them where they lie), and so do DeMo's momenta (its kernels step them there)."""
    if not tensors or any(t.dtype != tensors[0].dtype or not t.is_contiguous() for t in tensors):
        return None
    first = tensors[0].detach()
    if len(tensors) == 1:
        return first.reshape(-1)
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != at:
            return None
        at += t.numel()
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


def unflatten_into(bucket: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive pieces of ``flat`` back into the tensors it was concatenated from."""
    offset = 0
    for t in bucket:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class Scratch:
    """fp32 buffers for one use each in an exchange, by slot ("concat": the concatenated buckets; "mean": a
    shard's mean). With ``keep`` a host buffer handed back is kept for the next taker of its slot, so its pages
    are faulted in once per run instead of once per exchange; without, every take is a new buffer."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._kept: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # held for a swap only

    def take(self, numel: int, device: torch.device, slot: str = "concat") -> torch.Tensor:
        """An fp32 buffer of at least ``numel`` values on ``device`` (its contents undefined); hand it back with
        :meth:`give`. A concurrent taker of the same slot gets a new one."""
        with self._lock:
            kept = self._kept.pop(slot, None)
        if kept is not None and kept.numel() >= numel and kept.device == torch.device(device):
            return kept
        return torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, scratch: Optional[torch.Tensor], slot: str = "concat") -> None:
        if scratch is not None and self.keep and scratch.device.type == "cpu":
            with self._lock:
                self._kept[slot] = scratch

    def concat(self, bucket: Sequence[torch.Tensor], scratch: Optional[torch.Tensor], largest: int,
               slot: str = "concat") -> tuple[torch.Tensor, torch.Tensor]:
        """``bucket`` (fp32 tensors on one device) concatenated into ``scratch``: (the flat view, the scratch). A
        missing scratch, or one too small or elsewhere, is handed back and one of at least ``largest`` values taken
        in its place (from ``slot``); the caller hands the last one back (:meth:`give`) when its buckets are
        done."""
        n = sum(t.numel() for t in bucket)
        if scratch is None or scratch.numel() < n or scratch.device != bucket[0].device:
            self.give(scratch, slot)
            scratch = self.take(max(n, largest), bucket[0].device, slot)
        flat = torch.cat([t.detach().reshape(-1) for t in bucket], out=scratch[:n])
        return flat, scratch


# one process, one worker (``Capabilities.keep_scratch``): its exchanges take turns with the kept buffers
_KEPT = Scratch(keep=True)
_FRESH = Scratch(keep=False)  # keeps nothing: shared by every transport that keeps no scratch


def scratch_for(transport: Transport) -> Scratch:
    """Where ``transport``'s exchanges take their scratch buffers: kept from one exchange to the next where it
    is the one worker of its process (``caps.keep_scratch``), fresh each time elsewhere."""
    return _KEPT if transport.caps.keep_scratch else _FRESH
