"""``algo.name=ddp``: the gradient exchange at every step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from diloco.algorithm import Algorithm, register
from diloco.tensors import all_finite
from diloco.comm.base import Transport
from diloco.compress import collective
from diloco.state import check_optimizer_state, load_optimizer_state

if TYPE_CHECKING:
    from diloco.compress.codec import Codec


@register
class DDP(Algorithm):
    """Average gradients over all workers every step: the baseline that low-communication methods beat.

    With a lossy ``codec`` the gradients go through the compressed all-reduce (each worker keeps its
    own error-feedback residuals, so its state is no longer the same as the others').
    """

    name = "ddp"
    baseline = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 transport: Optional[Transport] = None, grad_clip: float = 0.0, codec: Optional["Codec"] = None, *,
                 inner: Optional[Transport] = None) -> None:
        super().__init__(model, optimizer, transport, grad_clip, inner=inner)
        self.codec = None if codec is None or codec.is_identity else codec
        if self.codec is not None and self.codec.error_feedback:
            self.replicated_state = False

    @classmethod
    def from_config(cls, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    *, tokens_per_step: int = 1, inner: Optional[Transport] = None) -> "DDP":
        return cls(model, optimizer, transport, cfg.optim.grad_clip, codec=cls._codec(cfg), inner=inner)

    def _exchange_gradients(self) -> None:
        if self.transport.world_size == 1 and self.codec is None:
            return
        for p in self.params:
            if p.grad is None:  # every worker must send the same buffers
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        # the exchange holds the gradients, off the parameters: a simulated worker that waits in it with
        # ``sim.offload`` moves its model and moments to the host (once an exchange) and leaves these on the GPU,
        # where the exchange reads and writes them and the other workers' are (moved with the model, its
        # buckets would be read on the host)
        for p in self.params:
            p.grad = None
        try:
            self._exchange(grads)
        finally:
            for p, g in zip(self.params, grads):
                if p.device == g.device:  # not on a failed exchange that left the worker parked on the host
                    p.grad = g

    def _exchange(self, grads: list[torch.Tensor]) -> None:
        if self.codec is None:  # every worker counts once
            collective.weighted_mean(self.transport, grads)
        elif all_finite(grads):
            collective.weighted_mean(self.transport, grads, 1.0, self.codec, key="grads")
        else:  # a worker with non-finite gradients adds nothing; the step is skipped only if nobody sent any
            for g in grads:
                g.zero_()
            if collective.weighted_mean(self.transport, grads, 0.0, self.codec, key="grads") == 0:
                grads[0].fill_(float("nan"))

    def shared_state(self) -> dict[str, Any]:
        """Also the optimizer's state: DDP's workers hold one replica, moments included, so a worker that joins
        takes them too (with fresh moments its replica would drift from the others')."""
        return {**super().shared_state(), "optimizer": self.optimizer.state_dict()}

    def check_shared_state(self, state: dict[str, Any]) -> None:
        super().check_shared_state(state)
        if "optimizer" in state:
            check_optimizer_state(self.optimizer, state["optimizer"], "optimizer")

    def load_shared_state(self, state: dict[str, Any]) -> None:
        super().load_shared_state(state)  # checks the optimizer's state too, before anything is taken
        if "optimizer" in state:
            load_optimizer_state(self.optimizer, state["optimizer"])

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.codec is not None:
            state["codec"] = self._codec_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.codec is not None and "codec" in state:
            self._load_codec_state(state["codec"])
