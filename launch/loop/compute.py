"""A step's compute: the forward pass (bf16 autocast where asked, ``run.compile``
with a fallback to the eager model), the loss and its backward pass over the step's micro-batches."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from launch.data.batches import Batcher, to_device
from launch.eval.validation import row_nll


class StepCompute:
    """The model's forward and backward passes on ``device``.

    ``compile`` (``run.compile``; None: on CUDA only) compiles the model in place (its state_dict keeps its
    names). Graphs are cached by code, not by module, so the simulator's workers (one model each, the same
    architecture) share them: a worker switch compiles nothing. A compilation that fails is said once through
    ``say`` and the run goes on with the eager model.
    """

    def __init__(self, model: nn.Module, device: torch.device, bf16: bool, compile: Optional[bool],
                 say: Callable[[str], None]) -> None:
        self.model, self.device, self.bf16, self.say = model, device, bf16, say
        self.compiled = device.type == "cuda" if compile is None else bool(compile)
        self.compiled_modes: set[tuple[bool, bool]] = set()  # (training, grad enabled) that ran compiled
        self.backward_compiled = False  # the backward graph compiles at the first backward, apart from the forward
        if self.compiled:
            self.model.compile()

    def loss_on(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, y = self._logits(x, y)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def row_nll(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each row's summed negative log-likelihood of its targets, ``[B]`` in fp32, on the device."""
        return row_nll(*self._logits(x, y))

    def _logits(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's logits (bf16 autocast where asked) and its targets, both on the device."""
        x, y = to_device(x, y, self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            return self._forward(x), y

    def accumulate(self, batcher: Batcher, step: int, first_micro: int, micros: int) -> torch.Tensor:
        """The step's mean loss over its ``micros`` micro-batches (``first_micro`` on: this process's share of its
        worker's batch), their gradients added to the parameters'. The loss stays on the device: it is read
        back only where a metrics line needs it."""
        step_loss = None
        for micro in range(micros):
            loss = self._loss_and_backward(batcher.train_batch(step, first_micro + micro), micros)
            part = loss.detach() / micros
            step_loss = part if step_loss is None else step_loss + part
        return step_loss

    def _uncompile(self, e: Exception) -> None:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        self.say(f"run.compile: torch.compile failed ({type(e).__name__}: {first}); "
                 "continuing without compiling (set run.compile=false to skip the attempt)")
        self.model._compiled_call_impl = None  # what nn.Module.compile set: back to the eager forward
        self.compiled = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = (self.model.training, torch.is_grad_enabled())
        if not self.compiled or mode in self.compiled_modes:
            return self.model(x)
        try:  # the first call in a mode compiles; if that fails, the run goes on uncompiled
            out = self.model(x)
        except Exception as e:
            self._uncompile(e)
            return self.model(x)
        self.compiled_modes.add(mode)
        return out

    def _loss_and_backward(self, batch: tuple[torch.Tensor, torch.Tensor], micros: int) -> torch.Tensor:
        """The loss of one micro-batch, its gradients added to the parameters'. The first compiled backward
        compiles its own graph: if that fails, nothing was added, and the micro-batch runs again on the eager
        model."""
        loss = self.loss_on(*batch)
        try:
            (loss / micros).backward()
        except Exception as e:
            if not self.compiled or self.backward_compiled:
                raise  # not a compilation: the run's own error
            self._uncompile(e)
            loss = self.loss_on(*batch)
            (loss / micros).backward()
        self.backward_compiled = self.compiled
        return loss
