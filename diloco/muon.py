"""Muon on a model's hidden matrices and AdamW on the rest, as one inner optimizer (``optim.name: muon``).

One optimizer rather than two, so that everything that holds "the inner optimizer" (the lr schedule, a
checkpoint, a peer's shared state, the moves of a simulated worker between devices) sees one ``param_groups``
and one ``state``. The Muon groups run ``torch.optim.Muon``'s update (its momentum, its Newton-Schulz
iteration with torch's coefficients and steps, its lr adjustment by shape, its decoupled weight decay); the other
groups are stepped by a ``torch.optim.AdamW`` that shares this optimizer's groups and state.

Where it differs from torch's Muon, on purpose:
- it honours ``found_inf`` (as torch's fused AdamW does under a GradScaler): a step handed a non-finite flag
  leaves the matrices, their momenta and the AdamW step counts as they were, decided on the device, so a step
  with a non-finite gradient costs no host read (``Algorithm._step_on_device``);
- the matrices of one shape are orthogonalized together, in one batched iteration (``_muon_group``);
- on a CPU the iteration runs in fp32 (``orthogonalized``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch.optim._muon import _adjust_lr

# values of the matrices orthogonalized in one batch: its stacked copies (gradients, momenta, the update) are
# transient memory, a few times this in fp32, however many layers a model has
BATCH_NUMEL = 1 << 25

MUON_DEFAULTS = {"momentum": 0.95, "nesterov": True, "ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7,
                 "ns_steps": 5, "adjust_lr_fn": None}


class MuonAdamW(torch.optim.Optimizer):
    """AdamW on ``adamw_groups``, then Muon on ``matrices`` (one group, marked ``"muon": True``).

    ``lr`` and ``weight_decay`` are Muon's (decoupled: each step scales a matrix by ``1 - lr * weight_decay``);
    ``adamw`` holds the AdamW keyword arguments (``lr``, ``betas``, ``eps``, ``fused``...)."""

    #: set for one step by :meth:`Algorithm._step_on_device` (as torch's GradScaler sets it on a fused AdamW): a
    #: 0-d device tensor, nonzero where the gradients are not finite and the step must change nothing
    found_inf: Optional[torch.Tensor] = None

    def __init__(self, matrices: Iterable[torch.Tensor], adamw_groups: list[dict[str, Any]], *, lr: float,
                 weight_decay: float = 0.0, momentum: float = 0.95, adjust_lr_fn: Optional[str] = None,
                 adamw: Optional[dict[str, Any]] = None) -> None:
        matrices = list(matrices)
        for p in matrices:
            if p.dim() != 2:
                raise ValueError(f"Muon steps 2-D matrices; got a parameter of shape {tuple(p.shape)}")
        adamw = dict(adamw or {})
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw) if adamw_groups else None
        muon = {**MUON_DEFAULTS, "params": matrices, "muon": True, "lr": lr, "weight_decay": weight_decay,
                "momentum": momentum, "adjust_lr_fn": adjust_lr_fn}
        # AdamW's groups first: the first group's lr is the one a run logs (optim.lr)
        groups = (self._adamw.param_groups if self._adamw else []) + ([muon] if matrices else [])
        super().__init__(groups, {})  # every group carries its own settings

    @property
    def skips_found_inf(self) -> bool:
        """Whether every group honours ``found_inf``: the Muon groups always, the AdamW groups where fused."""
        return all(g.get("muon") or g.get("fused") for g in self.param_groups)

    @staticmethod
    def moments(group: dict[str, Any]) -> set[str]:
        """The per-parameter state a group's step cannot go without."""
        return {"momentum_buffer"} if group.get("muon") else {"exp_avg", "exp_avg_sq"}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = self.found_inf
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_group(group, found_inf)
        adamw = [g for g in self.param_groups if not g.get("muon")]
        if adamw:
            # the AdamW steps this optimizer's own groups and state (load_state_dict replaces both objects)
            self._adamw.param_groups, self._adamw.state = adamw, self.state
            if found_inf is not None:
                self._adamw.found_inf = found_inf
            try:
                self._adamw.step()
            finally:
                self._adamw.__dict__.pop("found_inf", None)
        return loss

    def _muon_group(self, group: dict[str, Any], found_inf: Optional[torch.Tensor]) -> None:
        """One Muon step of every matrix of ``group``, the matrices of one shape orthogonalized together: torch's
        Muon runs some twenty small kernels per matrix, which on a GPU cost more in launches than in work for a
        model of a few hundred matrices."""
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        keep = None if found_inf is None else 1.0 - found_inf  # 1: step, 0: leave everything as it was
        by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_shape.setdefault(tuple(p.shape), []).append(p)
        batches = [(shape, same[i:i + n]) for shape, same in by_shape.items()
                   for n in [max(1, BATCH_NUMEL // math.prod(shape))] for i in range(0, len(same), n)]
        for shape, params in batches:
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            grads = torch.stack([p.grad for p in params])
            if keep is not None:  # a non-finite gradient must reach nothing, not even times zero
                grads = torch.nan_to_num_(grads, nan=0.0, posinf=0.0, neginf=0.0)
            # on the stack, then copied back: a foreach lerp with a tensor weight reads it back to the host
            momenta = torch.stack(bufs).lerp_(grads, 1 - mu if keep is None else (1 - mu) * keep)
            torch._foreach_copy_(bufs, list(momenta.unbind(0)))
            update = grads.lerp_(momenta, mu) if group["nesterov"] else momenta
            ortho = orthogonalized(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
            step = ortho.float().mul_(-_adjust_lr(lr, group["adjust_lr_fn"], shape) * (1.0 if keep is None else keep))
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd if keep is None else 1 - lr * wd * keep)
            torch._foreach_add_(params, list(step.unbind(0)))


def orthogonalized(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                   eps: float) -> torch.Tensor:
    """The Newton-Schulz iteration of torch's Muon (its coefficients, steps and normalization) on a stack of
    matrices of one shape [b, rows, cols] at once: in bf16 on an accelerator, as torch runs it; on a CPU in fp32,
    because a CPU without bf16 matrix units multiplies bf16 about 20x slower than fp32 (2.1 against 42 ms for two
    344x128 products on the CI's cores), which made a Muon step cost more than the rest of a CPU step together."""
    a, b, c = coefficients
    x = update.bfloat16() if update.device.type != "cpu" else update.float()
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norms at most 1, as the iteration needs
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x
