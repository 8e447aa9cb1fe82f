"""Checks and layouts of lists of tensors that the algorithms share: whether every value is finite (one read
back), and parameters laid end to end in one buffer."""

from __future__ import annotations

import torch

from diloco.compress import end_to_end


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite, in one read back however many tensors there are; True for
    none. fp32 tensors are tested through their largest magnitudes (one foreach op; a maximum cannot overflow as a
    norm can), others one by one on the device."""
    tensors = [t for t in tensors if t.numel()]  # an empty one holds nothing to test (and has no maximum)
    if not tensors:
        return True
    if all(t.dtype == torch.float32 for t in tensors):
        ok = torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf"))))
    else:
        ok = torch.stack([torch.isfinite(t).all() for t in tensors])
    return bool(ok.all())


def flatten_parameters_(params: list[torch.Tensor]) -> bool:
    """Lay ``params`` end to end in one new flat fp32 buffer, in their order, values unchanged (each parameter's
    ``data`` becomes a view of it); True where they lie so now. Where the pseudo-gradients overwrite the
    parameters (DiLoCo's exchange), a compressed exchange then reads and writes them where they lie
    (:func:`diloco.compress.flat.end_to_end`) instead of concatenating each bucket and copying the result back.

    They move only where every one of them is fp32, contiguous, on one device and alone in its own storage (where one
    is a view into a tensor it shares, it stays there, and so do the others: False), and is the model's own
    parameter (its type, not ``isinstance``: a sharded parameter's local slice passes that test, and moving it
    would leave the storage its DTensor and FSDP read)."""
    if not params or (params[0].dtype == torch.float32 and end_to_end(params) is not None):
        return bool(params)
    device = params[0].device
    storages = set()
    for p in params:
        storage = p.untyped_storage()
        if (not issubclass(type(p), torch.nn.Parameter) or p.dtype != torch.float32 or p.device != device
                or not p.is_contiguous() or p.storage_offset() != 0
                or storage.nbytes() != p.numel() * p.element_size() or storage.data_ptr() in storages):
            return False
        storages.add(storage.data_ptr())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()
    return True
