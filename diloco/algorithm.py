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
from diloco.comm.local import LocalTransport
from diloco.compress import collective, end_to_end, make_codec

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


def _move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device) -> None:
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != device and k != "step":
                state[k] = move_tensor(v, device)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite, in one read back however many tensors there are; True for
    none. fp32 tensors are tested through their largest magnitudes (one foreach op; a maximum cannot overflow as a
    norm can), others one by one on the device."""
    tensors = [t for t in tensors if t.numel()]  # an empty one holds nothing to test (and has no maximum)
    if not tensors:
        return True
    if all(t.dtype == torch.float32 for t in tensors):
        ok = torch.isfinite(torch.stack(torch._foreach_norm(tensors, float("inf"))))
    else:
        ok = torch.stack([torch.isfinite(t).all() for t in tensors])
    return bool(ok.all())


def flatten_parameters_(params: list[torch.Tensor]) -> bool:
    """Lay ``params`` end to end in one new flat fp32 buffer, in their order, values unchanged (each parameter's
    ``data`` becomes a view of it); True where they lie so now. Where the pseudo-gradients overwrite the
    parameters (DiLoCo's exchange), a compressed exchange then reads and writes them where they lie
    (:func:`diloco.compress.flat.end_to_end`) instead of concatenating each bucket and copying the result back.

    They move only where every one of them is fp32, contiguous, on one device and alone in its own storage (where one
    is a view into a tensor it shares, it stays there, and so do the others: False)."""
    if not params or (params[0].dtype == torch.float32 and end_to_end(params) is not None):
        return bool(params)
    device = params[0].device
    storages = set()
    for p in params:
        storage = p.untyped_storage()
        if (p.dtype != torch.float32 or p.device != device or not p.is_contiguous() or p.storage_offset() != 0
                or storage.nbytes() != p.numel() * p.element_size() or storage.data_ptr() in storages):
            return False
        storages.add(storage.data_ptr())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()
    return True


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``opt.load_state_dict(saved)`` for the state it holds (moments, momenta, step counts); the settings of
    ``opt``'s param groups (lr, betas, weight decay, momentum, DeMo's compression settings, the kernel choice
    ``fused``/``foreach``) stay the ones ``opt`` was made with.

    torch takes every key of the saved param groups, so a run resumed with changed settings
    (``--resume --set algo.outer_lr=0.5``) would go on with the checkpoint's, silently; and a state saved on
    one device would bring that device's kernel choice along: a checkpoint saved unfused (a CPU run's, before
    the CPU's optimizer was fused too) resumed where the step is fused left the fused step's on-device checks
    (:meth:`Algorithm._checks_on_device`) driving an unfused optimizer, which refuses them on the first step.
    The settings go into the state before it is loaded, so an optimizer that converts its state to its
    settings (DeMo's momenta, kept in the blocks of its ``compression_chunk``) converts it to these.
    Where the kernel is fused, each parameter's step count moves to its device, as the fused kernel keeps it.
    """
    theirs = saved.get("param_groups")
    if isinstance(theirs, list) and len(theirs) == len(opt.param_groups) and all(isinstance(g, dict) for g in theirs):
        settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        saved = {**saved, "param_groups": [{**g, **s} for g, s in zip(theirs, settings)]}
    opt.load_state_dict(saved)  # torch refuses groups of other numbers or sizes
    for group in opt.param_groups:
        if group.get("fused"):
            for p in group["params"]:
                step = opt.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                    opt.state[p]["step"] = step.to(p.device, torch.float32)


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

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 transport: Optional[Transport] = None, grad_clip: float = 0.0, *,
                 inner: Optional[Transport] = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.transport = transport or LocalTransport()
        self.grad_clip = grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
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
    def outer_lr_of(cls, cfg: Any) -> float:
        """``algo.outer_lr``, or this algorithm's own where it is left empty (SparseLoCo's alpha is 1, DiLoCo's
        outer lr 0.7): the one reading of the key, for the algorithm and for what peers must share."""
        return cls.default_outer_lr if cfg.algo.outer_lr is None else float(cfg.algo.outer_lr)

    @classmethod
    def check_config(cls, cfg: Any, n_layers: int) -> None:
        """Raise :class:`ConfigConflict` for settings this algorithm cannot run with (types and ranges are the
        config's own checks)."""
        if cfg.sync.mode == "time" and not cls.round_based:
            raise ConfigConflict("sync.mode", "time-budgeted rounds need a round-based algorithm (algo.name=diloco)")

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
        _move_optimizer_state(self.optimizer, device)

    def global_parameters(self) -> list[torch.Tensor]:
        """The parameters every worker shares (the model; DiLoCo: the global copy)."""
        return self.params

    def shared_state(self) -> dict[str, Any]:
        """What every worker holds alike, for a peer that joins the run (see :meth:`load_shared_state`).

        The live tensors, not copies (as ``state_dict`` gives them): a caller serializes them, or copies them to
        host memory, before training goes on (a copy here was a second one, on the GPU: 4 GB more for a 1B
        model at every checkpoint and every state a ``loco join`` peer publishes)."""
        return {"params": [p.detach() for p in self.params], "round": self.round,
                "global_tokens": self.global_tokens}

    def check_shared_state(self, state: dict[str, Any]) -> None:
        """Whether ``state`` (another worker's :meth:`shared_state`, from a peer) fits this algorithm: ValueError
        naming the first thing that does not, before :meth:`load_shared_state` changes anything. Its tensors
        fit this model's shapes, its counts are numbers, and nothing in it is NaN or infinite (a peer's broken
        state must not become this one's)."""
        _check_fits(self.params, _list_at(state, "params"), "params")
        _counts(state)
        _check_finite(state, "the state")

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Take another worker's :meth:`shared_state`, all of it or (ValueError, :meth:`check_shared_state`)
        none of it."""
        self.check_shared_state(state)
        _copy(self.params, state["params"])
        self.round, self.global_tokens = _counts(state)

    def _sync_inner(self) -> None:
        """A worker made of several processes (a node of a torchrun mesh): average their gradients first."""
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
        honours ``found_inf`` in its own way says so here (DeMo).
        """
        opt = self.optimizer
        return (type(self)._update is Algorithm._update and type(self)._skipped_update is Algorithm._skipped_update
                and isinstance(opt, (torch.optim.Adam, torch.optim.SGD)) and bool(opt.defaults.get("fused")))

    @staticmethod
    def _grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros(())
        if all(g.dtype == torch.float32 for g in grads):
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))

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

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "optimizer": self.optimizer.state_dict(),
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint holds algorithm {state.get('name')!r}, this run uses {self.name!r}")
        load_optimizer_state(self.optimizer, state["optimizer"])
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


@register
class DDP(Algorithm):
    """Average gradients over all workers every step: the baseline that low-communication methods beat.

    With a lossy ``codec`` the gradients go through the compressed all-reduce (each worker keeps its
    own error-feedback residuals, so its state is no longer the same as the others').
    """

    name = "ddp"

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
            state["codec"] = self.codec.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.codec is not None and "codec" in state:
            self.codec.load_state_dict(state["codec"])


def _list_at(state: Any, key: str) -> list:
    """``state[key]``, a list or tuple: ValueError naming the key otherwise."""
    if not isinstance(state, dict) or key not in state:
        raise ValueError(f"no {key!r}")
    value = state[key]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{key!r} is a {type(value).__name__}, not a list")
    return list(value)


def _counts(state: dict[str, Any]) -> tuple[int, float]:
    """A shared state's round and tokens: a non-negative whole number and a finite non-negative one."""
    r, tokens = state.get("round"), state.get("global_tokens")
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"'round' is {r!r}, not a round number")
    if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not math.isfinite(tokens) or tokens < 0:
        raise ValueError(f"'global_tokens' is {tokens!r}, not a count of tokens")
    return r, float(tokens)


def _check_fits(dst: list[torch.Tensor], src: list[Any], what: str = "params") -> None:
    """``src`` holds a floating tensor of each shape of ``dst``, in order: ValueError naming the first misfit."""
    if len(src) != len(dst):
        raise ValueError(f"{what}: {len(src)} parameters, this model has {len(dst)}")
    for i, (d, s) in enumerate(zip(dst, src)):
        if not isinstance(s, torch.Tensor) or not s.is_floating_point() or s.layout != torch.strided:
            raise ValueError(f"{what}[{i}] is not a dense floating-point tensor")
        if d.shape != s.shape:
            raise ValueError(f"{what}[{i}]: a parameter of shape {tuple(s.shape)}, this model's is {tuple(d.shape)}")


def _check_finite(tree: Any, where: str) -> None:
    """Every floating-point tensor in ``tree`` (dicts, lists) finite: ValueError naming the first one that is not.
    One reduction per tensor; the caller holds a peer's state in host memory, where that costs no device sync."""
    if isinstance(tree, torch.Tensor):
        if tree.layout != torch.strided:
            raise ValueError(f"{where} is a {tree.layout} tensor, not a dense one")
        if tree.is_floating_point() and tree.numel() and not bool(torch.isfinite(tree).all()):
            raise ValueError(f"{where} holds NaN or infinite values")
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _check_finite(v, f"{where}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _check_finite(v, f"{where}[{i}]")
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
    needed = _moments(opt)
    for i, entry in saved["state"].items():
        if i not in params or not isinstance(entry, dict):
            raise ValueError(f"{what}: a state for parameter {i!r}, which no group lists")
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


def _moments(opt: torch.optim.Optimizer) -> set[str]:
    """The per-parameter state an optimizer of this kind cannot step without (where it has stepped at all)."""
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return {"exp_avg", "exp_avg_sq"}
    if isinstance(opt, torch.optim.SGD) and any(g.get("momentum", 0) for g in opt.param_groups):
        return {"momentum_buffer"}
    return set()


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy ``src`` into ``dst``, checked by :func:`_check_fits` before."""
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s.to(d.device, d.dtype))
