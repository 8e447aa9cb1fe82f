"""Another worker's state, taken whole or not at all: every piece is checked (shapes, counts, finiteness, an
optimizer's moments) before anything is loaded, and loading keeps this worker's own settings."""

from __future__ import annotations

import math
from typing import Any

import torch

from diloco.comm.dtensor import is_sharded, local_part, sharded_like
from diloco.muon import MuonAdamW


def list_at(state: Any, key: str) -> list:
    """``state[key]``, a list or tuple: ValueError naming the key otherwise."""
    if not isinstance(state, dict) or key not in state:
        raise ValueError(f"no {key!r}")
    value = state[key]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key!r} is a {type(value).__name__}, not a list")
    return list(value)


def counts_of(state: dict[str, Any]) -> tuple[int, float]:
    """A shared state's round and tokens: a non-negative whole number and a finite non-negative one."""
    r, tokens = state.get("round"), state.get("global_tokens")
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"'round' is {r!r}, not a round number")
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens < 0:
        raise ValueError(f"'global_tokens' is {tokens!r}, not a count of tokens")
    return r, float(tokens)


def check_fits(dst: list[torch.Tensor], src: list[Any], what: str = "params") -> None:
    """``src`` holds a floating tensor of each shape of ``dst``, in order: ValueError naming the first misfit."""
    if len(src) != len(dst):
        raise ValueError(f"{what}: {len(src)} parameters, this model has {len(dst)}")
    for i, (d, s) in enumerate(zip(dst, src)):
        if not isinstance(s, torch.Tensor) or not s.is_floating_point() or s.layout != torch.strided:
            raise ValueError(f"{what}[{i}] is not a dense floating-point tensor")
        if d.shape != s.shape:
            raise ValueError(f"{what}[{i}]: a parameter of shape {tuple(s.shape)}, this model's is {tuple(d.shape)}")


def check_finite(tree: Any, where: str) -> None:
    """Every floating-point tensor in ``tree`` (dicts, lists) finite: ValueError naming the first one that is not.
    One reduction per tensor; the caller holds a peer's state in host memory, where that costs no device sync."""
    if isinstance(tree, torch.Tensor):
        if tree.layout != torch.strided:
            raise ValueError(f"{where} is a {tree.layout} tensor, not a dense one")
        if tree.is_floating_point() and tree.numel() and not bool(torch.isfinite(tree).all()):
            raise ValueError(f"{where} holds NaN or infinite values")
    elif isinstance(tree, dict):
        for k, v in tree.items():
            check_finite(v, f"{where}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            check_finite(v, f"{where}[{i}]")
    elif isinstance(tree, float) and not math.isfinite(tree):
        raise ValueError(f"{where} is {tree}")


def check_optimizer_state(opt: torch.optim.Optimizer, saved: Any, what: str = "optimizer") -> None:
    """Whether ``saved`` (an optimizer's ``state_dict()`` from a peer) fits ``opt`` before anything is loaded:
    ValueError naming the first misfit. torch's ``load_state_dict`` checks the groups' number and sizes only; a
    moment of another shape would load and fail at the next step, after the rest of the state was taken."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or \
            not isinstance(saved.get("param_groups"), (list, tuple)):
        raise ValueError(f"{what}: no 'state' and 'param_groups'")
    groups = list(saved["param_groups"])
    sizes = [len(g["params"]) for g in opt.param_groups]
    theirs = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) else None
              for g in groups]
    if theirs != sizes:
        raise ValueError(f"{what}: groups of {theirs} parameters, this optimizer's are of {sizes}")
    params = {}
    for g, mine in zip(groups, opt.param_groups):
        for i, p in zip(g["params"], mine["params"]):
            params[i] = p
    needed_by = {i: _moments(opt, mine) for g, mine in zip(groups, opt.param_groups) for i in g["params"]}
    for i, entry in saved["state"].items():
        if i not in params or not isinstance(entry, dict):
            raise ValueError(f"{what}: a state for parameter {i!r}, which no group lists")
        needed = needed_by[i]
        missing = sorted(needed - set(entry))
        if missing:
            raise ValueError(f"{what}: parameter {i} has no {missing[0]!r}")
        for key, v in entry.items():
            if key == "step":  # a count: a number or a one-value tensor
                if isinstance(v, torch.Tensor) and v.numel() != 1:
                    raise ValueError(f"{what}: 'step' of parameter {i} holds {v.numel()} values")
                continue
            if v is None and key not in needed:  # SGD without momentum keeps a None buffer
                continue
            if not isinstance(v, torch.Tensor) or v.layout != torch.strided or v.shape != params[i].shape:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"{what}: {key!r} of parameter {i} is {shape}, the parameter's shape is "
                                 f"{tuple(params[i].shape)}")


def _moments(opt: torch.optim.Optimizer, group: dict[str, Any]) -> set[str]:
    """The per-parameter state an optimizer of this kind cannot step ``group`` without (where it has stepped at
    all)."""
    if isinstance(opt, MuonAdamW):  # groups of two kinds: it says which
        return opt.moments(group)
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return {"exp_avg", "exp_avg_sq"}
    if isinstance(opt, torch.optim.SGD) and group.get("momentum", 0):
        return {"momentum_buffer"}
    return set()


def copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy ``src`` into ``dst``, checked by :func:`check_fits` before."""
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s.to(d.device, d.dtype))


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``opt.load_state_dict(saved)`` for the state it holds (moments, momenta, step counts); the settings of
    ``opt``'s param groups (lr, betas, weight decay, momentum, DeMo's compression settings, the kernel choice
    ``fused``/``foreach``) stay the ones ``opt`` was made with.

    torch takes every key of the saved param groups, so a run resumed with changed settings
    (``--resume --set algo.outer_lr=0.5``) would go on with the checkpoint's, silently; and a state saved on
    one device would bring that device's kernel choice along: a checkpoint saved by an unfused optimizer, resumed
    where the step is fused, would leave the fused step's on-device checks (:meth:`Algorithm._checks_on_device`)
    driving an unfused optimizer, which refuses them on the first step.
    The settings go into the state before it is loaded, so an optimizer that converts its state to its
    settings (DeMo's momenta, kept in the blocks of its ``compression_chunk``) converts it to these.
    Where the kernel is fused, each parameter's step count moves to its device, as the fused kernel keeps it.
    """
    theirs = saved.get("param_groups")
    if isinstance(theirs, list) and len(theirs) == len(opt.param_groups) and all(isinstance(g, dict) for g in theirs):
        settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        saved = {**saved, "param_groups": [{**g, **s} for g, s in zip(theirs, settings)]}
    opt.load_state_dict(saved)  # torch refuses groups of other numbers or sizes
    _moments_as_slices(opt)
    for group in opt.param_groups:
        if group.get("fused"):
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                    opt.state[p]["step"] = step.to(p.device, torch.float32)


def local_tree(obj: Any) -> Any:
    """``obj`` with every sharded tensor (a DTensor) in it replaced by this process's slice of it."""
    if isinstance(obj, dict):
        return {k: local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tree(v) for v in obj)
    return local_part(obj)


def like_sharded(template: Any, saved: Any) -> Any:
    """``saved`` (a state saved as slices) with each tensor that ``template`` holds as a DTensor made one again
    (:func:`~diloco.comm.dtensor.sharded_like`): what a sharded model's ``load_state_dict`` takes."""
    if is_sharded(template) and isinstance(saved, torch.Tensor):
        return sharded_like(template, saved)
    if isinstance(template, dict) and isinstance(saved, dict):
        return {k: like_sharded(template[k], v) if k in template else v for k, v in saved.items()}
    return saved


def _moments_as_slices(opt: torch.optim.Optimizer) -> None:
    """A sharded parameter's (a DTensor's) moments come from a checkpoint as this process's slices: each becomes a
    DTensor of its parameter's layout again, as the optimizer made it (its step count stays a plain tensor)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not is_sharded(p):
                continue
            shape = local_part(p).shape
            state = opt.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and not is_sharded(v) and v.dim() and v.shape == shape:
                    state[k] = sharded_like(p, v)
