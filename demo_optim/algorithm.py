"""DeMo in loco's training loop: the optimizer does the exchange, so no gradient all-reduce runs."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from diloco.algorithm import Algorithm
from diloco.comm.base import Transport
from demo_optim.optimizer import DeMo


class DeMoAlgorithm(Algorithm):
    """``algo.name=demo``. Every worker calls ``DeMo.step()`` every step (it holds the collective), even
    with non-finite gradients: such a worker sends nothing and still applies the others' update."""

    name = "demo"
    replicated_state = False  # the parameters agree; each worker's momentum (delta) is its own

    def __init__(self, model: torch.nn.Module, optimizer: DeMo, transport: Optional[Transport] = None,
                 grad_clip: float = 0.0) -> None:
        if not isinstance(optimizer, DeMo):
            raise TypeError("algo.name=demo needs a demo_optim.DeMo optimizer")
        super().__init__(model, optimizer, transport or optimizer.transport, grad_clip)

    def step(self) -> dict[str, Any]:
        self._sync_inner()
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = [torch.linalg.vector_norm(g.float()) for g in grads]
        grad_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
        finite = math.isfinite(grad_norm)
        if not finite:
            self.skipped_steps += 1
            self.optimizer.contribute = False
        elif self.grad_clip > 0 and grad_norm > self.grad_clip:
            for g in grads:
                g.mul_(self.grad_clip / (grad_norm + 1e-6))
        self.optimizer.grads_checked = True
        self.optimizer.step()
        self.steps += 1
        return {"grad_norm": grad_norm, "skipped": not finite, "contributors": self.optimizer.last_contributors}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(skipped_payloads=self.optimizer.rejected_payloads)
        return state
