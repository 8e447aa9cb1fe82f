"""The Algorithm interface the training loop drives, and the one registry of algorithms.

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

Everything the application needs from an algorithm is declared here, on the
base class, and nowhere else: the loop, ``loco simulate`` and ``loco join``
use only this interface and never ask which algorithm runs.

* ``from_config(cfg, model, optimizer, transport, tokens_per_step=, inner=)``
  builds it from the application's config (one registry, :data:`ALGORITHMS`,
  filled by :func:`register`; DeMo registers itself from ``demo_optim``);
  ``make_optimizer`` names an inner optimizer of its own (DeMo) and
  ``check_config`` states the algorithm's own constraints across keys;
* ``to(device)`` moves everything it holds (model, inner and outer state);
* ``round`` and ``tokens_agreed``: rounds done and tokens every worker agreed on;
* ``global_parameters()``, ``shared_state()`` / ``load_shared_state()``: what
  every worker shares, for a peer that joins or falls out of step; another
  worker's is checked whole (``check_shared_state``) before any of it is taken.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from diloco.comm.base import Transport
from diloco.comm.dtensor import is_sharded, local_part
from diloco.comm.local import LocalTransport
from diloco.compress import collective, make_codec
from diloco.compress.chain import parse_chain
from diloco.muon import MuonAdamW
from diloco.reshard import KEPT_BY_SHARES, cut_optimizer, join_optimizer
from diloco.state import check_finite, check_fits, copy_into, counts_of, list_at, load_optimizer_state

if TYPE_CHECKING:
    from diloco.compress.codec import Codec

ALGORITHMS: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
    """Class decorator: make ``cls`` available as ``algo.name: <cls.name>``."""
    ALGORITHMS[cls.name] = cls
    return cls


def algorithm_class(name: str) -> type["Algorithm"]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}") from None


class ConfigConflict(ValueError):
    """Settings an algorithm cannot run with; ``key`` names the config key to change."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def move_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, without waiting where the copy engine can work alone: GPU to CPU lands in pinned
    host memory asynchronously (call :func:`settle` before the host reads it), and pinned CPU to GPU is
    asynchronous too (the GPU's stream orders it before any use)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cpu" and t.is_cuda:
        out = torch.empty_like(t, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to(device, non_blocking=t.device.type == "cpu" and t.is_pinned())


def settle(device: torch.device) -> None:
    """Wait for the copies :func:`move_tensor` started to the host from ``device`` (nothing to do on a CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Every state tensor goes to ``device``; a step count only where its kernel keeps it beside its parameter (a
    fused or capturable group), as torch's optimizers place it: elsewhere it stays a host scalar."""
    beside = {id(p) for g in opt.param_groups if g.get("fused") or g.get("capturable") for p in g["params"]}
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != device and (k != "step" or id(p) in beside):
                state[k] = move_tensor(v, device)


class SkipCount:
    """Steps skipped for non-finite gradients: counted on the host, and on the device where a step decides there
    (:meth:`add`, no host read); reading :attr:`total` waits for the device's count."""

    def __init__(self, value: int = 0) -> None:
        self.host = int(value)
        self.device: Optional[torch.Tensor] = None

    def add(self, flag: torch.Tensor) -> None:
        """Count the step if ``flag`` (a 0-d device tensor) is nonzero, on the device."""
        if self.device is None:
            self.device = torch.zeros((), dtype=torch.int64, device=flag.device)
        self.device += flag != 0

    @property
    def total(self) -> int:
        return self.host + (int(self.device.item()) if self.device is not None else 0)

    @staticmethod
    def _read(holder: Any) -> int:
        return holder.skips.total

    @staticmethod
    def _restart(holder: Any, value: int) -> None:
        holder.skips = SkipCount(value)

    # ``skipped_steps`` of a class that keeps a SkipCount in ``skips``: its total (reading it waits for the device's
    # count); assigning a number (a checkpoint's) starts the count again from it
    steps = property(_read, _restart)


class Algorithm:
    name = "base"
    round_based = False  # True: workers meet only at round ends (stop and checkpoint there)
    replicated_state = True  # True: every worker holds the same state (rank 0 alone checkpoints)
    codec: Optional["Codec"] = None  # what its exchanges go through (None: exact dense all-reduce)
    round = 0  # exchanges every worker took part in (round-based algorithms)
    global_tokens = 0.0  # tokens trained by all workers, as agreed through the exchanges
    default_outer_lr = 0.7  # algo.outer_lr left empty: DiLoCo's outer SGD lr (see outer_lr_of)
    # what the application asks of an algorithm instead of its name (config checks, loco join, loco plan, labels)
    baseline = False  # True: the one every other is compared with (loco simulate's baseline run, loco plan's)
    swarm = False  # True: it runs over internet peers (loco join), whose rounds average whoever reaches them
    fragmented = False  # True: algo.fragments parts on staggered schedules, each applied algo.overlap_steps later
    token_weighted = False  # True: an exchange is the mean weighted by tokens trained; the total weight travels too
    gather = False  # True: every worker decodes every worker's payload (exact mean, sparse on the wire)
    # the algo.* keys peers must hold alike to average together, besides algo.outer_lr (read by outer_lr_of): the
    # round's length and the outer step's settings, since every peer applies the outer step to one averaged update
    peer_settings: tuple[str, ...] = ("inner_steps", "outer_momentum", "nesterov")

    @classmethod
    def payload_chain(cls, algo: dict[str, Any]) -> Optional[str]:
        """The codec chain of the payload it makes itself from its ``algo`` settings (any of them possibly
        missing: the defaults); None where its exchanges go through ``compress.codec``."""
        return None

    @classmethod
    def step_payload_bytes(cls, shapes: list[tuple[int, ...]], algo: dict[str, Any]) -> Optional[int]:
        """The bytes of the payload it sends every step itself, for a model of these parameter shapes (DeMo);
        None where its exchanges are weighted means of its tensors."""
        return None

    @classmethod
    def payload_label(cls, algo: dict[str, Any], codec: Optional[str]) -> list[str]:
        """What its exchanges send, for a run's label: the codec chain unless it is the exact fp32 (``algo``: the
        run's ``algo`` settings as its config.yaml holds them, any of them possibly missing)."""
        return [str(codec)] if codec and codec != "fp32" else []

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 transport: Optional[Transport] = None, grad_clip: float = 0.0, *,
                 inner: Optional[Transport] = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.transport = transport or LocalTransport()
        self.grad_clip = grad_clip
        trainable = [p for p in model.parameters() if p.requires_grad]
        # a model sharded among a node's processes (run.shard: fsdp) holds DTensors: the algorithm works on this
        # process's slice of each (a plain tensor on the same storage), and the inner optimizer on the DTensors
        self._sharded = any(is_sharded(p) for p in trainable)
        if self._sharded:
            with torch.no_grad():
                self.params = [local_part(p) for p in trainable]
            self._slice_of = list(zip(trainable, self.params))
        else:
            self.params = trainable
        self.steps = 0
        self.skips = SkipCount()  # steps skipped for non-finite gradients (see _checks_on_device)
        self.inner = inner  # the processes of one worker (a node), averaged every step

    # ---- built from config ------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    *, tokens_per_step: int = 1, inner: Optional[Transport] = None) -> "Algorithm":
        """Built from the application's config (``cfg.algo``, ``cfg.optim``, ``cfg.sync``, ``cfg.compress``)."""
        return cls(model, optimizer, transport, cfg.optim.grad_clip, inner=inner)

    @classmethod
    def make_optimizer(cls, cfg: Any, groups: list[dict[str, Any]], device: torch.device,
                       transport: Optional[Transport]) -> Optional[torch.optim.Optimizer]:
        """The inner optimizer this algorithm must run with, or None for the configured one (``optim.name``)."""
        return None

    @classmethod
    def steps_per_round(cls, cfg: Any) -> float:
        """Inner steps between two of this algorithm's exchanges (rounds) under ``cfg`` with rounds of fixed
        steps: 1 where it exchanges every step (what a churn trace keyed by rounds counts)."""
        return 1.0

    @classmethod
    def state_copies(cls, cfg: Any) -> float:
        """fp32 copies of the parameters it keeps besides the model and the inner optimizer's state (what a process
        holds, ``launch.loop.memory``): a lossy codec's error-feedback residual."""
        spec = parse_chain(cfg.compress.codec)
        return 1.0 if spec.topk_chunk is not None and spec.ef_decay > 0 else 0.0

    @classmethod
    def optimizer_copies(cls, cfg: Any) -> Optional[float]:
        """fp32 copies of the parameters its own inner optimizer keeps (:meth:`make_optimizer`); None for the
        configured one's."""
        return None

    @classmethod
    def outer_lr_of(cls, cfg: Any) -> float:
        """``algo.outer_lr``, or this algorithm's own where it is left empty (SparseLoCo's alpha is 1, DiLoCo's
        outer lr 0.7): the one reading of the key, for the algorithm and for what peers must share."""
        return cls.default_outer_lr if cfg.algo.outer_lr is None else float(cfg.algo.outer_lr)

    @classmethod
    def check_config(cls, cfg: Any, n_layers: int) -> None:
        """Raise :class:`ConfigConflict` for settings this algorithm cannot run with (types and ranges are the
        config's own checks)."""
        if cfg.sync.mode == "time" and not cls.round_based:
            raise ConfigConflict("sync.mode", "time-budgeted rounds need a round-based algorithm "
                                              "(algo.name=diloco or sparseloco)")

    @staticmethod
    def _codec(cfg: Any) -> "Codec":
        return make_codec(cfg.compress.codec)

    # ---- what the application reads and moves ----------------------------------------------
    @property
    def tokens_agreed(self) -> float:
        """Tokens trained by all workers, as agreed at the last exchange (time-budgeted rounds stop on it)."""
        return self.global_tokens

    def to(self, device: torch.device) -> "Algorithm":
        """Move the model and every state this algorithm keeps to ``device`` (the simulator parks idle workers
        in pinned host memory and brings them back with asynchronous copies)."""
        source = next((p.device for p in self.params), torch.device("cpu"))
        self._move(device)
        if self.codec is not None:  # the error-feedback residuals go where the exchanges will read them
            home = self.codec.residuals.home = self._exchange_device(device)
            for key, residual in list(self.codec.residuals.items()):
                self.codec.residuals[key] = move_tensor(residual, home)
        if torch.device(device).type == "cpu":
            settle(source)  # parked state is whole before anyone on the host reads it (a checkpoint)
        return self

    def _exchange_device(self, device: torch.device) -> torch.device:
        """Where this algorithm's exchanges run once it is on ``device`` (the gradients'; DiLoCo: its outer
        device)."""
        return torch.device(device)

    def _move(self, device: torch.device) -> None:
        """What :meth:`to` moves; subclasses add their own state."""
        self.model._apply(lambda t: move_tensor(t, device))
        move_optimizer_state(self.optimizer, device)

    def global_parameters(self) -> list[torch.Tensor]:
        """The parameters every worker shares (the model; DiLoCo: the global copy)."""
        return self.params

    def shared_state(self) -> dict[str, Any]:
        """What every worker holds alike, for a peer that joins the run (see :meth:`load_shared_state`).

        The live tensors, not copies (as ``state_dict`` gives them): a caller serializes them, or copies them to
        host memory, before training goes on (a copy here would hold a second one on the GPU at every
        checkpoint and every state a ``loco join`` peer publishes)."""
        return {"params": [p.detach() for p in self.params], "round": self.round,
                "global_tokens": self.global_tokens}

    def check_shared_state(self, state: dict[str, Any]) -> None:
        """Whether ``state`` (another worker's :meth:`shared_state`, from a peer) fits this algorithm: ValueError
        naming the first thing that does not, before :meth:`load_shared_state` changes anything. Its tensors
        fit this model's shapes, its counts are numbers, and nothing in it is NaN or infinite (a peer's broken
        state must not become this one's)."""
        check_fits(self.params, list_at(state, "params"), "params")
        counts_of(state)
        check_finite(state, "the state")

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Take another worker's :meth:`shared_state`, all of it or (ValueError, :meth:`check_shared_state`)
        none of it."""
        self.check_shared_state(state)
        copy_into(self.params, state["params"])
        self.round, self.global_tokens = counts_of(state)

    def _sync_inner(self) -> None:
        """A worker made of several processes (a node of a torchrun mesh): average their gradients first. Sharded
        ones were reduce-scattered in the backward: each slice takes its part of its DTensor's gradient."""
        if self._sharded:
            for p, local in self._slice_of:
                local.grad = None if p.grad is None or local is p else local_part(p.grad)
            return
        if self.inner is not None and self.inner.world_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            collective.all_reduce_(self.inner, [p.grad for p in self.params], op="mean")

    skipped_steps = SkipCount.steps  # steps skipped for non-finite gradients

    def _checks_on_device(self) -> bool:
        """Whether a step can test finiteness and clip without reading anything back to the host.

        True for the plain update (no subclass hook that must know on the host) with a fused Adam/AdamW or SGD,
        which skips a step itself when it is handed ``found_inf`` (as under a GradScaler): the step then costs no
        host sync, and ``info`` carries the norm and the skip flag as device tensors. A subclass whose optimizer
        honours ``found_inf`` in its own way says so here (DeMo); loco's own inner optimizer (MuonAdamW) says
        whether it honours it by its settings.
        """
        opt = self.optimizer
        honours = isinstance(opt, (torch.optim.Adam, torch.optim.SGD)) and bool(opt.defaults.get("fused")) \
            or isinstance(opt, MuonAdamW) and opt.skips_found_inf
        return (type(self)._update is Algorithm._update and type(self)._skipped_update is Algorithm._skipped_update
                and honours)

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The worker's gradient norm: over the slices of all the node's processes where they are sharded (so
        every process clips by the same factor and skips the same steps)."""
        if not grads:
            norm = torch.zeros((), device=self.params[0].device if self.params else None)
        elif all(g.dtype == torch.float32 for g in grads):
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
        if self._sharded and self.inner is not None and self.inner.world_size > 1:
            squares = norm.square().reshape(1).to(torch.float32)
            self.inner.all_reduce_sum_(squares)
            norm = squares.sqrt()[0]
        return norm

    def _step_on_device(self, grads: list[torch.Tensor]) -> dict[str, Any]:
        norm = self._grad_norm(grads)
        found_inf = (~torch.isfinite(norm)).to(torch.float32)
        if self.grad_clip > 0:
            # the factor is 1 below the bound; a non-finite norm gives 0 (that step is skipped anyway)
            scale = torch.nan_to_num(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0), nan=0.0)
            torch._foreach_mul_(grads, scale)
        self.optimizer.found_inf = found_inf
        try:
            self._update()
        finally:
            del self.optimizer.found_inf
        self.skips.add(found_inf)
        self.steps += 1
        info: dict[str, Any] = {"grad_norm": norm, "skipped": found_inf}
        self.zero_grad()  # spent: not held through a round's exchange (a simulator's workers all wait in it at once)
        info.update(self._after_step())
        return info

    def figures(self) -> dict[str, Any]:
        """The algorithm's own figures for a metrics line (read at log steps only: they may read the device)."""
        return {}

    # ---- the interface ----------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One optimizer step on the exchanged gradients; ``info`` holds ``grad_norm`` and ``skipped`` (floats,
        or 0-d device tensors where the step makes no host sync) plus the algorithm's own keys."""
        self._sync_inner()
        self._exchange_gradients()
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and self._checks_on_device():
            return self._step_on_device(grads)
        norm = self._grad_norm(grads)
        grad_norm = float(norm)
        info: dict[str, Any] = {"grad_norm": grad_norm, "skipped": not math.isfinite(grad_norm)}
        if info["skipped"]:
            self.skips.host += 1
            self._skipped_update()
        else:
            if self.grad_clip > 0 and grad_norm > self.grad_clip:
                scale = self.grad_clip / (grad_norm + 1e-6)
                for g in grads:
                    g.mul_(scale)
            self._update()
        # a skipped step still counts: round schedules must stay in step on every worker
        self.steps += 1
        self.zero_grad()  # spent: not held through a round's exchange (a simulator's workers all wait in it at once)
        info.update(self._after_step())
        return info

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._sharded:  # the slices' views of the spent gradients go too
            for local in self.params:
                local.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint holds algorithm {state.get('name')!r}, this run uses {self.name!r}")
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.steps = state["steps"]
        self.skipped_steps = state["skipped_steps"]

    @classmethod
    def whole_state(cls, slices: list[dict[str, Any]]) -> dict[str, Any]:
        """The :meth:`state_dict` a worker held whole would keep, from the slices its processes kept when they
        sharded it (``run.shard: fsdp``), in process order: ValueError where it cannot be (:mod:`diloco.reshard`)."""
        return {**slices[0], "optimizer": join_optimizer([p["optimizer"] for p in slices])}

    def cut_state(self, whole: dict[str, Any]) -> dict[str, Any]:
        """This process's slice of ``whole`` (a :meth:`whole_state`): itself where the model is not sharded, but
        a node mesh's processes keep a codec's residuals by shares of their buffers, not whole."""
        if self._sharded:
            return {**whole, "optimizer": cut_optimizer(self.optimizer, whole["optimizer"])}
        if self.inner is not None and self.inner.world_size > 1 and (whole.get("codec") or {}).get("residuals"):
            raise ValueError(KEPT_BY_SHARES)
        return whole

    def _codec_state(self) -> dict[str, Any]:
        """The codec's state for a checkpoint. Where a worker is several processes (a node of a torchrun mesh) and
        workers differ, each process keeps the error-feedback residuals of its own shares: they are gathered at
        the worker's first process as ``residuals_by_process`` (a collective every process of the worker takes
        part in)."""
        state = self.codec.state_dict()
        if not self.replicated_state and not self._sharded:  # a sharded process saves its own state
            by_process = self.transport.gather_in_worker(state["residuals"])
            if by_process is not None and len(by_process) > 1:
                state["residuals_by_process"] = by_process
        return state

    def _load_codec_state(self, state: dict[str, Any]) -> None:
        """Take a :meth:`_codec_state`: this process's own residuals where they were kept by process."""
        if "residuals_by_process" in state:
            by_process, r = state["residuals_by_process"], self.transport.local_rank
            state = {**{k: v for k, v in state.items() if k != "residuals_by_process"},
                     "residuals": by_process[r] if r < len(by_process) else {}}
        self.codec.load_state_dict(state)

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
