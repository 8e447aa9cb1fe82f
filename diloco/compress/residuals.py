"""Top-k's error feedback: per buffer the caller encodes repeatedly (its key), what was selected but not sent
yet, added to the next selection of that buffer."""

from __future__ import annotations

from typing import Hashable, Optional

import torch


class Residuals(dict):
    """A codec's residuals, ``key -> flat fp32 tensor``, and where they wait between encodes (:attr:`home`)."""

    def __init__(self) -> None:
        super().__init__()
        # where the residuals were put to wait between encodes (Algorithm.to sets it; None: where they are used)
        self.home: Optional[torch.device] = None

    def take(self, key: Hashable, length: int, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The residual of ``key`` on ``device``, and where the encode copies it back when it is done: the
        residual's own tensor where it was parked at :attr:`home` on purpose (a simulated worker waiting in an
        exchange, with ``sim.offload``: each bucket's residual visits the device for its encode and goes back, or
        every parked worker's would gather on the GPU bucket by bucket); else None, and it stays on ``device``
        (one loaded from a checkpoint on the host moves over on first use)."""
        r = self.get(key)
        device = torch.device(device)
        if r is None or r.numel() != length:  # new buffer (or its size changed: the group did): start empty
            r = self[key] = torch.zeros(length, dtype=torch.float32, device=device)
        elif r.device != device:
            if self.home is not None and r.device == self.home:
                return r.to(device, non_blocking=r.is_pinned()), r
            r = self[key] = r.to(device)
        return r, None

    def state(self) -> dict[Hashable, torch.Tensor]:
        """The live residuals (as torch's own ``state_dict`` hands out tensors): a caller copies them, or writes
        them, before the next exchange (a checkpoint copies them to host memory, so the state costs no second
        copy on the device)."""
        return {k: v.detach() for k, v in self.items()}

    def load(self, residuals: dict[Hashable, torch.Tensor]) -> None:
        """Copies of ``residuals`` in place of these (:attr:`home` stays)."""
        copies = [(k, v.clone()) for k, v in residuals.items()]  # made first: ``residuals`` may be these
        self.clear()
        self.update(copies)
