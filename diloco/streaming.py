"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512).

The model is cut into P fragments, strided by layer (layer j goes to fragment
j mod P; the embedding and head are cut by rows to even out the fragments'
sizes, see ``layer_fragments``). Fragment p is exchanged every H inner
steps, offset by p*H/P steps, so at most one
fragment's bytes are on the wire at a time: the peak bytes per exchange drop
by about P. The exchange of a fragment sent at step t is applied at step
t + tau (``overlap_steps``), so communication hides behind tau inner steps;
then the fragment's local parameters are merged with the new global ones:
``local = alpha * local + (1 - alpha) * global`` (``mix_alpha``, ``overlap_merge="mix"``, as published),
or ``local = global + (local - local_at_send)`` (``overlap_merge="keep"``: the new global model plus
the tau steps this worker made while the exchange was on the wire; those steps go out with the
fragment's next exchange). When training ends, exchanges still in flight are applied the ``keep``
way and every fragment's unsent steps are exchanged, so every worker ends on the global model.

With P=1, tau=0, alpha=0 this is exactly DiLoCo (a test proves it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from diloco.algorithm import ConfigConflict, register
from diloco.comm.base import Handle, Transport
from diloco.layers import layer_stack
from diloco.outer import DiLoCo


MERGES = ("mix", "keep")


@dataclass
class Pending:
    """One fragment's exchange in flight: started when the fragment was sent, applied at step ``apply_at``.

    Once ``handle.wait()`` returns, ``deltas`` hold the weighted mean of the workers' pseudo-gradients and ``total``
    (a one-element tensor) their total weight. ``sent`` is a copy of the local values sent, kept where the exchange
    is applied after later steps (those steps are local - sent); None where it is applied at once, or where this
    worker was ``left_out`` (a non-finite pseudo-gradient, weight 0: it takes the global values as they are).
    """

    apply_at: int
    fragment: int
    deltas: list[torch.Tensor]
    total: torch.Tensor
    handle: Handle
    sent: Optional[list[torch.Tensor]]
    left_out: bool

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it, once ended (``averaged``: the deltas hold the mean, not weighted sums)."""
        return {"apply_at": self.apply_at, "fragment": self.fragment, "deltas": self.deltas, "total": self.total,
                "sent": self.sent, "left_out": self.left_out, "averaged": True}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Pending":
        """An exchange a checkpoint kept: ended, so there is nothing left to wait for."""
        return cls(state["apply_at"], state["fragment"], state["deltas"], state["total"], Handle(), state["sent"],
                   state["left_out"])


def layer_fragments(model: torch.nn.Module, num_fragments: int) -> list[list[Any]]:
    """Each fragment's parameters: indices into the trainable parameters (``model.parameters()`` order), or
    ``(index, start, stop)`` for rows of one.

    Layer j goes to fragment j mod P. The parameters outside the layers (embedding, output head, final
    norm; largest first) then even the fragments out: a matrix's rows are cut among the fragments below
    an even share, in proportion to what each lacks, and what is too small to cut joins the lightest.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    stack = layer_stack(model)  # its children are the layers
    layers: list[list[int]] = []
    if stack is not None:
        layers.extend([index[id(p)] for p in layer.parameters() if id(p) in index] for layer in stack)
    layers = [l for l in layers if l]
    if num_fragments > len(layers):
        raise ValueError(f"algo.fragments={num_fragments} is more than the model's {len(layers)} layers")
    fragments: list[list[Any]] = [[] for _ in range(num_fragments)]
    for j, layer in enumerate(layers):
        fragments[j % num_fragments].extend(layer)
    in_layers = {i for layer in layers for i in layer}
    size = [sum(params[i].numel() for i in f) for f in fragments]
    target = sum(p.numel() for p in params) / num_fragments
    rest = sorted((i for i in range(len(params)) if i not in in_layers), key=lambda i: -params[i].numel())
    for i in rest:  # embeddings, output head, final norm: largest first
        p = params[i]
        rows = p.shape[0] if p.dim() > 1 else 1
        row = p.numel() // rows
        # cut the rows among the fragments below the even share, in proportion to what each lacks
        short = {f: target - size[f] for f in range(num_fragments) if target - size[f] >= row}
        if rows == 1 or len(short) < 2:
            lightest = min(range(num_fragments), key=lambda f: size[f])
            fragments[lightest].append(i)
            size[lightest] += p.numel()
            continue
        need = sum(short.values())
        start = 0
        for n, f in enumerate(sorted(short)):
            take = rows - start if n == len(short) - 1 else min(rows - start, round(rows * short[f] / need))
            if take > 0:
                fragments[f].append((i, start, start + take) if take < rows else i)
                size[f] += take * row
                start += take
    return [sorted(f, key=lambda x: (x, 0, 0) if isinstance(x, int) else tuple(x)) for f in fragments]


@register
class StreamingDiLoCo(DiLoCo):
    name = "streaming"
    swarm = False  # its fragments' staggered exchanges are not averaged over internet peers
    fragmented = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Optional[Transport] = None,
                 grad_clip: float = 0.0, *, fragments: int = 1, overlap_steps: int = 0, mix_alpha: float = 0.0,
                 overlap_merge: str = "mix", **kwargs: Any) -> None:
        self.check(fragments, overlap_steps, mix_alpha, overlap_merge, kwargs.get("inner_steps", 100),
                   kwargs.get("sync_mode", "steps"))
        super().__init__(model, optimizer, transport, grad_clip, fragments=layer_fragments(model, fragments), **kwargs)
        self.overlap_steps, self.mix_alpha, self.overlap_merge = overlap_steps, mix_alpha, overlap_merge
        num = len(self.fragments)
        self.offsets = [p * self.policy.inner_steps // num for p in range(num)]
        self.fragment_steps = [0] * num  # inner steps since each fragment was last sent
        self.finalized_at: Optional[int] = None  # the step whose finalize() sent every fragment's unsent steps
        self.pending: list[Pending] = []  # exchanges started, not yet applied

    @staticmethod
    def check(fragments: int, overlap_steps: int, mix_alpha: float, overlap_merge: str, inner_steps: int,
              sync_mode: str, n_layers: Optional[int] = None) -> None:
        """Streaming DiLoCo's constraints, stated once (the config check and the constructor both run it)."""
        if n_layers is not None and fragments > n_layers:
            raise ConfigConflict("algo.fragments", f"{fragments} fragments but the model has {n_layers} layers; "
                                                   f"use at most {n_layers}")
        if overlap_steps >= inner_steps:
            raise ConfigConflict("algo.overlap_steps", f"{overlap_steps} must be smaller than "
                                                       f"algo.inner_steps={inner_steps}")
        if sync_mode != "steps":
            raise ConfigConflict("sync.mode", "streaming follows a step schedule: use sync.mode=steps")
        if not 0.0 <= mix_alpha <= 1.0:
            raise ConfigConflict("algo.mix_alpha", f"must be in [0, 1], got {mix_alpha}")
        if overlap_merge not in MERGES:
            raise ConfigConflict("algo.overlap_merge", f"must be one of {', '.join(MERGES)}, got {overlap_merge!r}")

    @classmethod
    def check_config(cls, cfg: Any, n_layers: int) -> None:
        super().check_config(cfg, n_layers)
        a = cfg.algo
        cls.check(a.fragments, a.overlap_steps, a.mix_alpha, a.overlap_merge, a.inner_steps, cfg.sync.mode, n_layers)
        if cfg.sim.churn and a.overlap_steps > 0:
            raise ConfigConflict("sim.churn", "Streaming DiLoCo with algo.overlap_steps > 0 has exchanges in flight that "
                                              "a joining worker cannot take over; use algo.overlap_steps=0 with churn")

    @classmethod
    def from_config(cls, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    *, tokens_per_step: int = 1, inner: Optional[Transport] = None) -> "StreamingDiLoCo":
        a = cfg.algo
        return cls(model, optimizer, transport, cfg.optim.grad_clip, tokens_per_step=tokens_per_step,
                   codec=cls._codec(cfg), inner=inner, fragments=a.fragments, overlap_steps=a.overlap_steps,
                   mix_alpha=a.mix_alpha, overlap_merge=a.overlap_merge, **cls._settings(cfg))

    @classmethod
    def state_copies(cls, cfg: Any) -> float:
        """DiLoCo's, and a fragment's deltas waiting tau steps to be applied (about one fragment at a time)."""
        a = cfg.algo
        return super().state_copies(cfg) + (1.0 / max(1, a.fragments) if a.overlap_steps > 0 else 0.0)

    @classmethod
    def steps_per_round(cls, cfg: Any) -> float:
        """A round is one fragment's exchange: P of them every H steps, evenly staggered."""
        return cfg.algo.inner_steps / max(1, cfg.algo.fragments)

    def _due(self, step: int) -> list[int]:
        H = self.policy.inner_steps
        return [p for p, off in enumerate(self.offsets) if step >= max(off, 1) and (step - off) % H == 0]

    def _unsent(self, p: int) -> int:
        """Steps since fragment ``p``'s last scheduled send, by the schedule alone: every worker counts alike,
        also one that joined the run in the middle (its own ``fragment_steps`` only count what it trained)."""
        H, off, s = self.policy.inner_steps, self.offsets[p], self.steps
        last = s - (s - off) % H
        return s if last < max(off, 1) else s - last

    def _after_step(self) -> dict[str, Any]:
        step = self.steps
        self.round_steps += 1
        self.fragment_steps = [s + 1 for s in self.fragment_steps]
        for p in self._due(step):
            self._send(p, apply_at=step + self.overlap_steps)
        return self._apply_due(step)

    def _send(self, p: int, apply_at: int) -> None:
        weight = float(self.fragment_steps[p] * self.tokens_per_step)
        self.fragment_steps[p] = 0
        # an exchange applied later keeps a copy of what was sent: the steps made meanwhile are local - sent
        sent = [self._local(k).detach().clone() for k in self.fragments[p]] if apply_at > self.steps else None
        # applied now and not mixed: the fragment's local parameters are set from the global copy right after, so
        # they can hold its pseudo-gradient (as DiLoCo's do): no second copy of the fragment while it is exchanged
        in_place = self.transport.world_size > 1 and sent is None and self.mix_alpha == 0
        deltas, total, handle = self.start_exchange(self.fragments[p], weight, key=p, in_place=in_place)
        # left out (not finite): the fragment takes the global values as they are, neither mixed nor kept
        self.pending.append(Pending(apply_at, p, deltas, total, handle, None if self.left_out else sent,
                                    self.left_out))

    def _apply_due(self, step: float, alpha: Optional[float] = None) -> dict[str, Any]:
        info: dict[str, Any] = {}
        due = [x for x in self.pending if x.apply_at <= step]
        self.pending = [x for x in self.pending if x.apply_at > step]
        for x in due:
            x.handle.wait()
            indices = self.fragments[x.fragment]
            self._place(x, indices)
            total = self._total(x.total)
            # "keep" merge, and any exchange applied before its step (training ended): global + steps since the send
            keep = x.sent is not None and (self.overlap_merge == "keep" or x.apply_at > self.steps)
            progress = [self._local(k) - s for k, s in zip(indices, x.sent)] if keep else []
            mix = 0.0 if keep or x.left_out else self.mix_alpha if alpha is None else alpha
            self.apply_exchange(indices, x.deltas, total, mix)
            with torch.no_grad():
                for k, d in zip(indices, progress):
                    self._local(k).add_(d)
            if x.fragment == 0:  # every step is counted once, through fragment 0's exchanges
                self.round += 1
                self.round_steps = 0
                self.global_tokens += total
            info = {"synced": True, "round": self.round, "fragment": x.fragment}
        return info

    def sync(self) -> dict[str, Any]:
        """End of training: apply the exchanges still in flight, then exchange every fragment's unsent steps."""
        info = self._apply_due(math.inf)
        for p in range(len(self.fragments)):  # every worker sends the same fragments (a joiner's weight may be 0)
            if self._unsent(p) > 0:
                self._send(p, apply_at=self.steps)
        return self._apply_due(self.steps, alpha=0.0) or info

    def finalize(self) -> None:
        # done at this step already (a run resumed from its final checkpoint): the schedule alone would still count
        # unsent steps, and every fragment would go out again with weight 0, one round more
        if self.finalized_at == self.steps and not self.pending:
            return
        if self.pending or any(self._unsent(p) for p in range(len(self.fragments))):
            self.sync()
        self.finalized_at = self.steps

    def state_dict(self) -> dict[str, Any]:
        for x in self.pending:  # first: an exchange in flight still updates the codec's residuals
            x.handle.wait()
        state = super().state_dict()
        state["pending"] = [x.state() for x in self.pending]
        state["fragment_steps"] = list(self.fragment_steps)
        state["finalized_at"] = self.finalized_at
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fragment_steps = list(state["fragment_steps"])
        self.finalized_at = state.get("finalized_at")
        self.pending = [Pending.from_state(x) for x in state["pending"]]

    @classmethod
    def whole_state(cls, slices: list[dict[str, Any]]) -> dict[str, Any]:
        state = super().whole_state(slices)
        if "whole_layout" in slices[0]:  # the exchanges in flight are the same on every process: joined one by one
            state["pending"] = [cls._joined_pending(slices, e) for e in range(len(slices[0]["pending"]))]
        return state

    @classmethod
    def _joined_pending(cls, slices: list[dict[str, Any]], e: int) -> dict[str, Any]:
        x = slices[0]["pending"][e]
        joined = {k: cls._joined(slices, x["fragment"], [p["pending"][e][k] for p in slices]) if x[k] is not None
                  else None for k in ("deltas", "sent")}
        return {**x, **joined}

    def cut_state(self, whole: dict[str, Any]) -> dict[str, Any]:
        state = super().cut_state(whole)
        if self.whole_layout is not None:
            state["pending"] = [{**x, **{k: self._cut(x["fragment"], x[k]) if x[k] is not None else None
                                         for k in ("deltas", "sent")}} for x in whole["pending"]]
        return state

    def _place(self, x: Pending, indices: list[int]) -> None:
        """An exchange that ended, beside what it is applied to: its averaged deltas on the global copy's device
        (they become its gradients), what was sent on the local parameters' (the steps since are local - sent).
        They may lie elsewhere: a checkpoint loads on the CPU, and a simulated worker parked while the exchange
        was in flight moved its model but not these (waiting for the exchange there would move its virtual clock)."""
        x.deltas = [d.to(self.global_views[k].device) for k, d in zip(indices, x.deltas)]
        if x.sent is not None:
            x.sent = [t.to(self._local(k).device) for k, t in zip(indices, x.sent)]
