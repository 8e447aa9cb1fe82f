"""Muon on a model's hidden matrices and AdamW on the rest, as one inner optimizer (``optim.name: muon``).

One optimizer rather than two, so that everything that holds "the inner optimizer" (the lr schedule, a
checkpoint, a peer's shared state, the moves of a simulated worker between devices) sees one ``param_groups``
and one ``state``. The Muon groups run ``torch.optim.Muon``'s update: its Newton-Schulz orthogonalization and
its lr adjustment, called as torch defines them (on a CPU the iteration runs in fp32: see ``_orthogonalized``). The other groups are stepped by a ``torch.optim.AdamW`` that
shares this optimizer's groups and state.

What torch's Muon does not do and this one does: honour ``found_inf`` (as torch's fused AdamW does under a
GradScaler). A step handed a non-finite flag leaves the matrices, their momenta and the AdamW step counts as
they were, decided on the device, so a step with a non-finite gradient costs no host read
(``Algorithm._step_on_device``).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

MUON_DEFAULTS = {"momentum": 0.95, "nesterov": True, "ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7,
                 "ns_steps": 5, "adjust_lr_fn": None}


class MuonAdamW(torch.optim.Optimizer):
    """AdamW on ``adamw_groups``, then Muon on ``matrices`` (one group, marked ``"muon": True``).

    ``lr`` and ``weight_decay`` are Muon's (decoupled: each step scales a matrix by ``1 - lr * weight_decay``);
    ``adamw`` holds the AdamW keyword arguments (``lr``, ``betas``, ``eps``, ``fused``...)."""

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
        found_inf = getattr(self, "found_inf", None)
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
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        keep = None if found_inf is None else 1.0 - found_inf  # 1: step, 0: leave everything as it was
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf, grad = state["momentum_buffer"], p.grad
            if keep is not None:  # a non-finite gradient must reach nothing, not even times zero
                grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
            buf.lerp_(grad, 1 - mu if keep is None else (1 - mu) * keep)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            ortho = _orthogonalized(update, group)
            step_lr = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
            if keep is None:
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-step_lr)
            else:
                if wd:
                    p.mul_(1 - lr * wd * keep)
                p.addcmul_(ortho, keep * -step_lr)  # in fp32, as add_'s alpha is


def _orthogonalized(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """torch's Newton-Schulz iteration (in bf16) on an accelerator; on a CPU the same iteration in fp32, because
    a CPU without bf16 matrix units multiplies bf16 about 20x slower than fp32 (2.1 against 42 ms for two
    344x128 products on the CI's cores), which made a Muon step cost more than the rest of a CPU step together."""
    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    if update.device.type != "cpu":
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    a, b, c = coefficients
    x = update.T if update.size(0) > update.size(1) else update
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1, as the iteration needs
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if update.size(0) > update.size(1) else x
