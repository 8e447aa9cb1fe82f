"""The Algorithm interface the training loop drives, and the DDP baseline.

    loss.backward()
    info = algo.step()     # inner step; on a round boundary it also syncs
    algo.zero_grad()

An algorithm wraps an inner ``torch.optim.Optimizer`` and a :class:`Transport`.
``step()`` runs, in order: gradient exchange (DDP only), a check that the
gradients are finite (a step with NaN/Inf gradients skips its optimizer update,
so nothing non-finite reaches the model; under DDP every worker decides alike,
since the check follows the exchange), clipping of the global norm, the inner
optimizer step, and the algorithm's own after-step work (a DiLoCo round), which
runs for skipped steps too so that round schedules stay aligned. Clipping after
the exchange makes DDP equal to one worker with the combined batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from diloco.comm.base import Transport
from diloco.comm.local import LocalTransport

if TYPE_CHECKING:
    from diloco.compress.codec import Codec


class Algorithm:
    name = "base"
    round_based = False  # True: workers meet only at round ends (stop and checkpoint there)
    replicated_state = True  # True: every worker holds the same state (rank 0 alone checkpoints)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 transport: Optional[Transport] = None, grad_clip: float = 0.0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.transport = transport or LocalTransport()
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.steps = 0
        self.skipped_steps = 0
        self.inner: Optional[Transport] = None  # the processes of one worker (a node), averaged every step

    def _sync_inner(self) -> None:
        """A worker made of several processes (a node of a torchrun mesh): average their gradients first."""
        if self.inner is not None and self.inner.world_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.inner.all_reduce_([p.grad for p in self.params], op="mean")

    # ---- the interface ----------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        self._sync_inner()
        self._exchange_gradients()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) if grads else torch.zeros(())
        grad_norm = float(norm)
        info: dict[str, Any] = {"grad_norm": grad_norm, "skipped": not math.isfinite(grad_norm)}
        if info["skipped"]:
            self.skipped_steps += 1
            self._skipped_update()
        else:
            if self.grad_clip > 0 and grad_norm > self.grad_clip:
                scale = self.grad_clip / (grad_norm + 1e-6)
                for g in grads:
                    g.mul_(scale)
            self._update()
        # a skipped step still counts: round schedules must stay in step on every worker
        self.steps += 1
        info.update(self._after_step())
        return info

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint holds algorithm {state.get('name')!r}, this run uses {self.name!r}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["steps"]
        self.skipped_steps = state.get("skipped_steps", 0)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def finalize(self) -> None:
        """Called once when training ends, before the last evaluation."""

    def evaluation_weights(self) -> contextlib.AbstractContextManager:
        """The weights to evaluate (DiLoCo: the global model)."""
        return contextlib.nullcontext()

    # ---- hooks for subclasses ---------------------------------------------------------------
    def _update(self) -> None:
        """The optimizer step on finite (exchanged, clipped) gradients."""
        self.optimizer.step()

    def _skipped_update(self) -> None:
        """Non-finite gradients: no update (DeMo still joins its collective here)."""
        self.zero_grad()

    def _exchange_gradients(self) -> None:
        pass

    def _after_step(self) -> dict[str, Any]:
        return {}


class DDP(Algorithm):
    """Average gradients over all workers every step: the baseline that low-communication methods beat.

    With a lossy ``codec`` the gradients go through the compressed all-reduce (each worker keeps its
    own error-feedback residuals, so its state is no longer the same as the others').
    """

    name = "ddp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 transport: Optional[Transport] = None, grad_clip: float = 0.0, codec: Optional["Codec"] = None) -> None:
        super().__init__(model, optimizer, transport, grad_clip)
        self.codec = None if codec is None or codec.is_identity else codec
        if self.codec is not None and self.codec.error_feedback:
            self.replicated_state = False

    def _exchange_gradients(self) -> None:
        if self.transport.world_size == 1 and self.codec is None:
            return
        for p in self.params:
            if p.grad is None:  # every worker must send the same buffers
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if self.codec is None:
            self.transport.all_reduce_(grads, op="mean")
        elif all(bool(torch.isfinite(g).all()) for g in grads):
            self.transport.all_reduce_compressed_(grads, self.codec, 1.0, key="grads")
        else:  # a worker with non-finite gradients adds nothing; the step is skipped only if nobody sent any
            for g in grads:
                g.zero_()
            if self.transport.all_reduce_compressed_(grads, self.codec, 0.0, key="grads") == 0:
                grads[0].fill_(float("nan"))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.codec is not None:
            state["codec"] = self.codec.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])


