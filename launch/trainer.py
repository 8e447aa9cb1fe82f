"""The one training loop. It drives ``algo.step()`` and knows nothing of which algorithm runs.

Per step: ``grad_accum`` micro-batches forward/backward (bf16 autocast on CUDA),
then ``algo.step()`` (exchange, clip, inner step, maybe a round), then
``algo.zero_grad()``. Around it: the learning-rate schedule, metrics every
``log.every`` steps, validation every ``run.eval_every``, checkpoints every
``run.checkpoint_every``, and the stop conditions ``run.max_steps`` and
``run.max_time`` (a resumed run gets the budget afresh: it counts from the resume). At the end: a last
validation, a checkpoint, summary.json and a plot.

Stopping by signal: inside :func:`stop_signals` (the CLI's ``train`` and ``simulate``), Ctrl-C (SIGINT) or
SIGTERM asks the loop to stop at the next point where it can save: the end of the current step for one
worker, the next point every worker reaches (a sync, or any step for DDP) in the simulator. The loop saves a
checkpoint there and raises :class:`Interrupted`; a second signal stops at once, without saving.

Python API::

    from launch.config import load_config
    from launch.trainer import Trainer
    cfg, _ = load_config(["configs/tiny.yaml"], ["run.max_steps=200"])
    summary = Trainer(cfg, model=my_module).fit()   # model: ids [B, T] -> logits [B, T, V]
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from diloco import Algorithm
from diloco.comm import Transport, make_transport
from launch.algorithms import algorithm_class
from launch.checkpoint import (CheckpointError, checkpoint_name, latest_checkpoint, list_checkpoints, load_checkpoint,
                               rng_state, save_checkpoint, set_rng_state)
from launch.config import Config, changed_settings, dump_config, shared_settings
from launch.data import Batcher, TokenData, load_data
from launch.metrics import Metrics, human_bytes, matmul_precision, mfu_basis, plot_runs, truncate_metrics
from launch.models import Transformer, count_params, model_args_from_config


class RunError(RuntimeError):
    """A run that cannot start or continue as asked (existing run folder, missing checkpoint, ...)."""


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (``signum``: SIGINT for Ctrl-C, or SIGTERM).

    ``saved`` is the checkpoint written before stopping (None when the signal could not wait for one: a second
    signal, or one outside the training loop). The CLI exits with 128 + signum: 130 for Ctrl-C, 143 for SIGTERM.
    """

    def __init__(self, signum: int = signal.SIGINT, saved: Optional[Path] = None, clean: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.saved = int(signum), saved
        self.clean = clean  # raised where every worker stopped together, after the save (not mid-step)


class _StopRequest:
    """A signal waiting for the training loops of this process to reach a point where they can save."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.listening = 0  # training loops (simulated workers included) that check ``signum`` at step ends
        self.writing = 0  # checkpoint writes under way: a first signal waits for them to complete
        self.cut: Optional[int] = None  # a second signal that cut a write short (torch reports it as a failed write)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint write that a first signal does not cut short (it is recorded in ``signum``); a second
        signal still stops at once, and the atomic write leaves the older checkpoints as they were."""
        self.writing += 1
        try:
            yield
        finally:
            self.writing -= 1


STOP = _StopRequest()


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into a request to stop at the next point where the run can save a checkpoint.

    Outside a training loop (loading data, the final evaluation) or on a second signal, :class:`Interrupted`
    is raised at once. Only the main thread can install handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if STOP.writing and STOP.signum is None:
            STOP.signum = signum
            print(f"loco: {signal.Signals(signum).name}: stopping once the checkpoint being written is complete "
                  "(a second signal stops at once)", file=sys.stderr, flush=True)
            return
        if STOP.signum is not None or STOP.listening == 0:
            if STOP.writing:
                STOP.cut = signum
            raise Interrupted(signum)
        STOP.signum = signum
        print(f"loco: {signal.Signals(signum).name}: stopping at the next point where the run can save a checkpoint "
              "(a second signal stops at once, without saving)", file=sys.stderr, flush=True)

    # a signal the process was started to ignore (nohup, a shell's background job) stays ignored
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        STOP.signum = STOP.cut = None


def save_waiting_for_it(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """``save_checkpoint`` that a first SIGINT/SIGTERM does not interrupt (see ``_StopRequest.saving``).

    A second signal stops at once; torch's writer turns its exception into a failed write, which is reported
    as the Interrupted it was, not as a full disk. The older checkpoints stay as they were either way.
    """
    try:
        with STOP.saving():
            return save_checkpoint(directory, step, state, keep=keep)
    except (CheckpointError, RuntimeError):
        if STOP.cut is not None:
            raise Interrupted(STOP.cut) from None
        raise


_MEMORY_KEPT = False


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep memory that is freed for the next allocation, instead of handing it back to
    the OS at once. By default a freed block of more than 128 KiB (or of more than the largest freed so far)
    goes back to the OS, and the next tensor of that size faults in fresh zeroed pages, 4 KiB at a time: every
    step re-creates temporaries of the same sizes (activations, gradients, DeMo's transforms), and on CPU the
    page faults cost as much as the arithmetic (DeMo's optimizer step on ``tiny``, one worker: 28 ms, 16 ms
    with this). Blocks below 32 MiB (glibc's upper limit for this setting) then come from the heap, and the
    heap keeps up to 1 GiB of free memory at its top. Memory held stays at most the process's peak. Once per
    process; a no-op where the C library is not glibc. Whether it took effect."""
    global _MEMORY_KEPT
    if _MEMORY_KEPT:
        return True
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # another C library (musl): it has no such settings
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    _MEMORY_KEPT = bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))
    return _MEMORY_KEPT


def resolve_device(name: str) -> torch.device:
    """The device this process trains on.

    ``auto`` is CUDA where there is one, else the CPU. Under torchrun each process of a node takes its own GPU,
    ``cuda:LOCAL_RANK``, and is made that process's current device (NCCL needs one GPU per rank); a node that
    starts more processes than it has GPUs stops here, before any work, naming both counts and the ways out.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RunError(f"device {name!r} is not one: auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RunError(f"run.device={name!r} but CUDA is not available on this machine; use run.device=cpu")
    if device.type == "cuda":
        device = _torchrun_gpu(device, name)
        torch.cuda.set_device(device)
    return device


def _torchrun_gpu(device: torch.device, name: str) -> torch.device:
    """``cuda:LOCAL_RANK`` for a torchrun process (``device`` outside torchrun); RunError if GPUs are too few."""
    if "LOCAL_RANK" not in os.environ:
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise RunError(f"run.device={name!r} but this machine has {torch.cuda.device_count()} GPU(s)")
        return device
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    gpus = torch.cuda.device_count()
    check_gpu_share(local_world, gpus)
    if device.index is not None and local_world > 1:
        raise RunError(f"run.device={name!r} names one GPU for all {local_world} processes of this node; "
                       "use run.device=cuda (or auto): each process then takes cuda:LOCAL_RANK")
    return torch.device("cuda", local_rank if device.index is None else device.index)


def check_gpu_share(processes: int, gpus: int) -> None:
    """Stop a node that starts more training processes than it has GPUs (NCCL cannot put two ranks on one)."""
    if processes > gpus:
        raise RunError(
            f"this node starts {processes} processes but has {gpus} GPU(s), and each process needs its own GPU; "
            f"start at most {gpus} (torchrun --nproc-per-node {max(gpus, 1)}), simulate {processes} workers on one "
            f"GPU with 'loco simulate --workers {processes}', or train on the CPU with "
            "--set run.device=cpu --set transport.dist_backend=gloo")


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes this process could still allocate on ``device``: free GPU memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# fp32 weights, gradients and AdamW's two moments: no run of this model can hold less per parameter
BYTES_PER_PARAM = 16


def check_model_fits(args, device: torch.device, workers: int = 1) -> None:
    """One line instead of an allocator traceback when the model cannot possibly be trained on ``device``."""
    free = available_memory(device)
    need = BYTES_PER_PARAM * args.n_params * workers
    if free is not None and need > free:
        who = f" for {workers} workers" if workers > 1 else ""
        raise RunError(f"model (dim {args.dim}, {args.n_layers} layers) has {args.n_params:,} parameters and needs at "
                       f"least {human_bytes(need)}{who} ({BYTES_PER_PARAM} bytes per parameter: fp32 weights, "
                       f"gradients and AdamW moments); {device} has {human_bytes(free)} free: "
                       "choose a smaller model.size or model.dim")


def lr_factor(step: int, warmup: int, progress: float, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup over ``warmup`` steps, then decay by ``progress`` in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


FUSED_DEVICES = ("cuda", "cpu")  # where torch has fused AdamW and SGD kernels


def build_optimizer(model: nn.Module, ocfg, device: torch.device, acfg=None,
                    transport: Optional[Transport] = None, cfg: Optional[Config] = None) -> torch.optim.Optimizer:
    """AdamW (or SGD) with weight decay on matrices only, unless the algorithm brings its own (DeMo).

    ``cfg`` (the whole config) lets the algorithm of ``cfg.algo.name`` choose; ``acfg`` alone is read the
    same way, for callers that pass the algorithm's section only.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": ocfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg is None and acfg is not None:
        cfg = Config(optim=ocfg, algo=acfg)
    if cfg is not None:
        own = algorithm_class(cfg.algo.name).make_optimizer(cfg, groups, device, transport)
        if own is not None:
            return own
    # the fused kernels on CUDA and CPU alike: one pass per step (AdamW: 4-6x the per-parameter loop on a CPU), and
    # the step checks finiteness and clips on the device, so a step reads nothing back (Algorithm._checks_on_device)
    fused = device.type in FUSED_DEVICES
    if ocfg.name == "sgd":
        return torch.optim.SGD(groups, lr=ocfg.lr, momentum=ocfg.momentum, fused=fused)
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps, fused=fused)


def build_algorithm(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    tokens_per_step: int, inner: Optional[Transport] = None) -> Algorithm:
    """The configured algorithm around the inner optimizer (through the registry: the loop never asks which)."""
    return algorithm_class(cfg.algo.name).from_config(cfg, model, optimizer, transport,
                                                      tokens_per_step=tokens_per_step, inner=inner)


def _clone(obj: Any, later: bool = False) -> Any:
    """A copy of the tensors in a state, in host memory (another worker keeps training while rank 0 writes it;
    a simulator's workers would otherwise all hold a second copy of their state on the GPU at once).

    ``later``: a GPU tensor's copy goes into pinned memory without waiting for it (the device copies it in the
    stream's order, before any later change to the tensor); the caller waits for the stream before reading."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if later and t.device.type == "cuda":
            try:
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # page-locked memory refused (a container's limit): a plain copy, waited for
                return t.to("cpu", copy=True)
            return out.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone(v, later) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v, later) for v in obj)
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _saved(state: dict[str, Any]) -> bytes:
    """``state`` as the bytes of ``torch.save``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()  # the buffer itself, not a copy


class BufferReader(io.RawIOBase):
    """A read-only file over a ``bytes``/``bytearray``/memoryview, without copying it: ``torch.load`` reads each
    tensor straight into its storage. ``io.BytesIO`` copies a ``bytearray`` (a downloaded state is one) whole
    first, a third copy of the state in host memory at a join (8.8 GB more for a 1B DiLoCo state)."""

    def __init__(self, data: Union[bytes, bytearray, memoryview]) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}, before the start")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        try:
            self._view.release()  # the caller's buffer may be resized again
        except BufferError:  # a slice still held somewhere: it goes with its last reference
            pass
        super().close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def one_block(x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
    """The contiguous ``(B, T + 1)`` block whose ``[:, :-1]`` is ``x`` and ``[:, 1:]`` is ``y`` (as the batcher cuts
    inputs and targets), or None."""
    block = x._base
    if (block is None or y._base is not block or block.dim() != 2 or not block.is_contiguous()
            or x.shape != (block.shape[0], block.shape[1] - 1) or y.shape != x.shape):
        return None
    if x.data_ptr() != block.data_ptr() or y.data_ptr() != block.data_ptr() + block.element_size():
        return None
    return block


class Trainer:
    def __init__(self, cfg: Config, model: Optional[nn.Module] = None, transport: Optional[Transport] = None,
                 data: Optional[TokenData] = None, on_step: Optional[Callable[[int, dict], None]] = None,
                 restart: bool = False, join_run: Optional[Path] = None,
                 on_built: Optional[Callable[["Trainer"], None]] = None) -> None:
        """``restart``: start over from step 0 in ``run.dir``, moving its checkpoints and metrics aside.
        ``join_run``: the folder of a run in progress that this worker joins (a simulated worker coming back):
        it starts without the start-up collectives, and the caller loads the run's state (:meth:`join_at`).
        ``on_built``: called with this trainer once its model and algorithm exist, before the start-up
        collectives that find the run folder and the checkpoint (the simulator parks the worker while it waits
        in them)."""
        self.cfg = cfg
        self.restart = restart
        self.joining = join_run
        self.on_step = on_step
        self.on_round: Optional[Callable[[dict], None]] = None  # called after every round's sync (loco join)
        # called at the end of every step with whether it synced, where every worker's next collective is the
        # same (the simulator admits joining workers there)
        self.on_step_end: Optional[Callable[[bool, dict], None]] = None
        run = cfg.run
        if run.threads:
            torch.set_num_threads(run.threads)
        keep_freed_memory()
        self.device = resolve_device(run.device)
        self.transport = transport or make_transport(cfg.transport.backend, cfg.transport.dist_backend,
                                                     cfg.transport.timeout, self.device, cfg.transport.mesh,
                                                     settings={**shared_settings(cfg), "--restart": restart})
        self.rank, self.world = self.transport.rank, self.transport.world_size
        self.leader = self.transport.is_leader
        # a worker may be several processes (a node of a torchrun mesh): each takes its share of the worker's batch
        self.inner: Optional[Transport] = getattr(self.transport, "inner", None)
        procs = self.inner.world_size if self.inner is not None else 1
        self.micro_offset = (self.inner.rank if self.inner is not None else 0) * run.grad_accum
        seed_everything(run.seed)

        self.data = data or load_data(cfg.data)
        self.batcher = Batcher(self.data, cfg.data.seq_len, run.batch_size * procs, self.rank, self.world, run.seed,
                               run.grad_accum * procs)
        built_here = model is None  # from the run's seed (a model handed in may differ from worker to worker)
        if built_here:
            self.model_args = model_args_from_config(cfg.model, self.data.vocab_size, cfg.data.seq_len)
            if self.model_args.vocab_size < self.data.vocab_size:  # a token past the embedding: a device assert
                raise RunError(f"model.vocab_size={self.model_args.vocab_size} is smaller than the data's "
                               f"vocabulary of {self.data.vocab_size} tokens: raise it, or leave it unset to take "
                               f"the data's")
            check_model_fits(self.model_args, self.device)
            torch.manual_seed(run.seed)
            with torch.device(self.device):  # initialised where it trains: a 1B model takes seconds on a CPU
                model = Transformer(self.model_args)
        else:
            self.model_args = getattr(model, "args", None)
        self.model = model.to(self.device)
        self._compile()
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device, transport=self.transport, cfg=cfg)
        self.tokens_per_step = run.batch_size * procs * cfg.data.seq_len  # per worker
        # every worker starts from rank 0's parameters (and DiLoCo's copy), which models built alike already are
        if join_run is None:
            with torch.no_grad():
                self.transport.share_initial_([p.data for p in self.model.parameters()], seeded=built_here)
        self.algo = build_algorithm(cfg, self.model, self.optimizer, self.transport, self.tokens_per_step, self.inner)
        if on_built is not None:
            on_built(self)
        # rounds that end on a time budget: workers' step counts differ, so they meet only after syncs
        self.time_rounds = self.algo.round_based and cfg.sync.mode == "time"
        for group in self.optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        self.bf16 = run.precision == "bf16" or (run.precision == "auto" and self.device.type == "cuda")
        # MFU's FLOP count and datasheet peak, as benchmarks/train_throughput.py counts them (none on a CPU)
        self.mfu = mfu_basis(self.model, cfg.data.seq_len, self.device, matmul_precision(self.device, self.bf16))
        self.flops_per_token = self.mfu.flops_per_token
        self.peak = self.mfu.peak.flops if self.mfu.peak is not None else None

        self.step = 0
        self._t0: Optional[float] = None
        self._budget_mark: Any = None
        self.synced_step = 0
        self.last_val: Optional[tuple[int, float]] = None  # (step, val_loss) of the latest evaluation
        self.wall_prior = 0.0  # training seconds of earlier segments of a resumed run
        self.budget_prior = 0.0  # seconds of run.max_time they spent (virtual ones in the simulator)
        self.window_loss, self.window_steps = 0.0, 0  # train loss summed since the last metrics line
        self.saved_step: Optional[int] = None  # the step of the checkpoint this process last wrote or loaded
        # whether a signal (see stop_signals) may stop this loop at a step end: set below once the run is ready
        self.stop_on_request = False
        self.stopped_by: Optional[int] = None
        self.run_dir = self._prepare_run_dir()
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.resume_changes: Optional[str] = None  # settings changed since the checkpoint (set by a resume)
        self.resumed_from: Optional[Path] = self._maybe_resume()
        self._write_config()
        self.start_step = self.step
        self.skipped_reported = self.algo.skipped_steps  # non-finite steps already reported (see _report_skipped)
        # a signal stops the loop where every process can save: one worker at any step end; torchrun ranks
        # where rank 0's view is broadcast (round ends, or every log.every-th step); the simulator sets its own
        self.stop_on_request = self.world == 1 or self.transport.caps.shared_stop
        self.metrics = Metrics(self.run_dir, cfg.log, self.leader, run.max_steps, self.step, self.rank,
                               cfg.to_dict(), run.name)

    # ---- set-up -----------------------------------------------------------------------------
    @staticmethod
    def elastic_restart() -> int:
        """How often torchrun restarted this run's workers (--max-restarts): they continue from the checkpoint."""
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)

    def _prepare_run_dir(self) -> Path:
        run = self.cfg.run
        if self.joining is not None:
            return Path(self.joining)
        if self.restart:  # starts over, whatever the run's config.yaml says (a resume attempt wrote resume: true)
            run.resume = False
        if self.elastic_restart() and not run.resume:
            if not run.dir:
                raise RunError("torchrun restarted the workers, but the run has no fixed folder to continue from: "
                               "pass --run-dir DIR (needed with --max-restarts)")
            run.resume = True
        chosen = None
        if self.leader:
            if run.dir:
                chosen = run.dir
            elif run.resume:
                chosen = ""
            else:
                chosen = f"runs/{run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        chosen = self.transport.broadcast_object(chosen)
        if not chosen:
            raise RunError("run.resume needs the run folder to continue: pass --run-dir DIR")
        path = Path(chosen)
        if self.leader:
            if self.restart:
                discard_run(path)
            if not run.resume and any((path / "checkpoints").glob("step_*.pt")):
                raise RunError(f"{path} already holds checkpoints of an earlier run; "
                               f"pass --resume to continue it, --restart to start it over from step 0 "
                               f"(its checkpoints and metrics are moved aside), or choose another --run-dir")
            if not run.resume and not self.restart and (path / "metrics.jsonl").exists():
                # an earlier run without checkpoints (a crash before the first, checkpoint_every=0): its curve
                # would be appended to, and its wandb run continued; both are moved aside, nothing is lost
                discard_run(path, "an earlier run's metrics (no checkpoints)")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise RunError(f"{path}: the run folder cannot be made: {e.strerror or e}") from None
        return path

    def _write_config(self) -> None:
        """The run's settings, for --resume (written once the run starts: a refused resume leaves them alone)."""
        if self.leader:
            tmp = self.run_dir / ".config.yaml.tmp"
            tmp.write_text(dump_config(self.cfg))
            os.replace(tmp, self.run_dir / "config.yaml")

    def _maybe_resume(self) -> Optional[Path]:
        if not self.cfg.run.resume or self.joining is not None:
            return None
        found = None
        if self.leader:
            skipped: list[str] = []
            hit = latest_checkpoint(self.ckpt_dir, map_location="cpu", on_skip=skipped.append)
            if hit is not None:
                for line in skipped:
                    print(f"[worker {self.rank}] skipping checkpoint {line}", file=sys.stderr, flush=True)
                found = str(hit[0])
            elif skipped:  # files exist, none loads: starting over would lose the run (and prune its files)
                found = ("error", unreadable_message(self.run_dir, self.ckpt_dir))
        found = self.transport.broadcast_object(found)
        if isinstance(found, tuple):
            raise RunError(found[1])
        if found is None:
            if self.leader:
                print(f"[worker {self.rank}] no checkpoint in {self.ckpt_dir}: starting from step 0", flush=True)
                truncate_metrics(self.run_dir / "metrics.jsonl", 0)  # an earlier attempt's lines would repeat
            return None
        # every process reads the file; processes on another machine without it get the leader's copy
        have = self.transport.all_gather_object(Path(found).is_file())
        if all(have):
            state = load_checkpoint(found, map_location="cpu")
        else:
            state = self.transport.broadcast_object(load_checkpoint(found, map_location="cpu") if self.leader else None)
        self.resume_changes = changed_settings(state.get("config"), self.cfg)
        try:
            self.load_state(state)
        except (ValueError, RuntimeError) as e:  # another algorithm, model shape or fragment layout
            text = str(e).strip()
            text = text if len(text) <= 600 else text[:600] + " ..."
            changed = f"\nSettings changed since it was saved: {self.resume_changes}" if self.resume_changes else ""
            raise RunError(f"{found}: cannot resume this run from it: {text}{changed}") from None
        if self.leader:
            truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.saved_step = self.step
        return Path(found)

    # ---- state ------------------------------------------------------------------------------
    def worker_state(self) -> dict[str, Any]:
        """What differs between workers: local model, algorithm (inner and outer optimizer), data, RNG."""
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "algo": self.algo.state_dict(),
            "data": {"samples": self.batcher.samples_before(self.step), "worker_index": self.rank,
                     "num_workers": self.world, "seed": self.cfg.run.seed},
            "rng": rng_state(),
            "comm": self.transport.stats.as_dict(),
            # a run stopped between metrics lines continues the average of its next line where it was
            "log_window": {"loss": float(self.window_loss), "steps": self.window_steps},
        }

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: shared fields, then the worker state (replicated algorithms) or all workers' states."""
        shared: dict[str, Any] = {
            "wall_s": self.wall_s(),
            "budget_s": self.budget_prior + (self.budget_s() if self._t0 is not None else 0.0),
            "config": self.cfg.to_dict(),
            "model_args": vars(self.model_args) if self.model_args is not None else None,
            "tokenizer": self.data.tokenizer,
            "num_workers": self.world,
        }
        if self.algo.replicated_state:
            return {**shared, **self.worker_state()}
        mine = _clone(self.worker_state())
        codec = mine["algo"].get("codec")
        # a worker of several processes (a node of a torchrun mesh): each keeps the residuals of its own shares
        parts = self.transport.gather_in_worker(codec["residuals"] if codec is not None else None)
        if codec is not None and parts is not None and len(parts) > 1:
            codec["residuals_by_process"] = parts
        states = self.transport.gather_object(mine)  # on the leader only
        if states is None:
            return {}
        with self.algo.evaluation_weights():  # the global model, for sampling and evaluation
            global_model = _clone(self.model.state_dict())
        return {**shared, "model": global_model, "workers": states}

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("num_workers", 1) != self.world:
            raise RunError(f"the checkpoint was written by {state.get('num_workers', 1)} workers and this run has "
                           f"{self.world}; resume with the same number of workers")
        mine = state["workers"][self.rank] if "workers" in state else state
        self.model.load_state_dict(mine["model"])
        algo = mine["algo"]
        codec = algo.get("codec") if isinstance(algo, dict) else None
        if isinstance(codec, dict) and "residuals_by_process" in codec:  # this process's own (see state_dict)
            parts, r = codec["residuals_by_process"], self.transport.local_rank
            codec = {k: v for k, v in codec.items() if k != "residuals_by_process"}
            algo = {**algo, "codec": {**codec, "residuals": parts[r] if r < len(parts) else {}}}
        self.algo.load_state_dict(algo)
        set_rng_state(mine["rng"])
        self.step = int(mine["step"])
        self.wall_prior = float(state.get("wall_s", 0.0))
        # the time budget spent before (virtual seconds in the simulator): checkpoints of earlier versions only
        # have the real ones
        self.budget_prior = float(state.get("budget_s", self.wall_prior))
        window = mine.get("log_window", {})
        self.window_loss, self.window_steps = float(window.get("loss", 0.0)), int(window.get("steps", 0))
        comm = mine.get("comm", {})
        self.transport.stats.bytes_sent = int(comm.get("bytes_sent", 0))
        self.transport.stats.bytes_received = int(comm.get("bytes_received", 0))
        self.transport.stats.peak_bytes = int(comm.get("peak_bytes", 0))

    def shared_state_blob(self, **extra: Any) -> bytes:
        """What every worker shares (:meth:`Algorithm.shared_state`) and ``extra``, as the bytes a joining worker
        downloads (``loco join``, and a simulated worker that comes back)."""
        return _saved({**extra, **self.algo.shared_state()})

    def shared_state_later(self, **extra: Any) -> Callable[[], bytes]:
        """:meth:`shared_state_blob` as a function that makes those bytes when called: the state is copied to
        host memory now (training goes on without touching the copy), and serialized only if someone asks.
        A ``loco join`` peer publishes its state after every round, and in most rounds no peer downloads it:
        serializing and hashing it each time cost the training thread about 1.3 s per GB of state.
        On a GPU the copy goes into pinned memory without the training thread waiting for it (a synchronous copy
        into pageable memory held it about 1-4 s a round for a 1B state); the function waits for it first."""
        live = {**extra, **self.algo.shared_state()}
        device = next((t.device for t in _tensors(live) if t.device.type == "cuda"), None)
        state = _clone(live, later=device is not None)
        if device is None:
            return lambda: _saved(state)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))

        def made() -> bytes:
            copied.synchronize()  # on the thread that serializes, when a peer first asks
            return _saved(state)
        return made

    def load_shared_blob(self, blob: bytes, source: str = "a peer",
                         check: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
        """Take a :meth:`shared_state_blob`; ``check(state)`` may refuse it with a RunError first. Returns it.
        A state that does not load, does not fit this model, or holds NaN or infinite values is refused whole
        (RunError naming ``source`` and what is wrong), and this worker's state stays as it was."""
        try:
            with BufferReader(blob) as f:
                state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise RunError(f"the state from {source} does not load: {e}") from None
        if not isinstance(state, dict):
            raise RunError(f"the state from {source} is a {type(state).__name__}, not a run's state")
        if check is not None:
            check(state)
        try:  # checked whole first: a refused state leaves this one as it was
            self.algo.load_shared_state(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise RunError(f"the state from {source} does not fit this model: {e}") from None
        return state

    def join_at(self, blob: bytes, step: int, source: str) -> None:
        """A worker joining a run in progress (``join_run``): the run's state, at the run's step."""
        self.load_shared_blob(blob, source)
        self.step = self.start_step = self.algo.steps = step  # schedules keyed by step (Streaming's) follow the run

    def save(self) -> Optional[Path]:
        """Rank 0 writes; algorithms whose workers differ first gather every worker's state (a collective)."""
        state = self.state_dict()
        self.saved_step = self.step
        if not self.leader:
            return None
        before = STOP.signum
        path = save_waiting_for_it(self.ckpt_dir, self.step, state, keep=self.cfg.run.keep_checkpoints)
        if before is None and STOP.signum is not None and STOP.listening == 0:
            # a first signal came during a save outside the loop (the final one): it waited, and stops here
            self.metrics.info(f"stopped by {signal.Signals(STOP.signum).name}: saved {path}; continue with --resume "
                              f"--run-dir {self.run_dir}", self.step)
            self.metrics.close()
            raise Interrupted(STOP.signum, path, clean=True)
        return path

    # ---- the loop ---------------------------------------------------------------------------
    def wall_s(self) -> float:
        return self.wall_prior + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def budget_s(self) -> float:
        """Seconds spent of ``run.max_time``: a resumed run gets its budget afresh, counted from the resume. In the
        simulator, virtual seconds (this worker's clock), as its rounds and network count them: a simulated run
        of 10 minutes is the run 10 minutes of those workers would train, whatever this machine's load."""
        if self._budget_mark is not None:
            return self.transport.seconds_since(self._budget_mark)
        return self.wall_s() - self.wall_prior

    @property
    def solo(self) -> bool:
        """One process is the whole run: its own clock and signals decide, with nobody to agree with."""
        return self.world == 1 and self.inner is None

    def agreed_budget_s(self) -> float:
        """:meth:`budget_s` as every process of the run counts it alike (the time-keyed lr schedule reads it:
        replicas that must stay equal, DDP's, DeMo's, a node's processes, must take one lr). Rank 0's clock at
        the latest point where the processes agreed on it (:meth:`_should_stop`), moved on by the steps since at
        the rate seen until then; one process alone reads its own clock."""
        if self.solo:
            return self.budget_s()
        step, spent = self.agreed
        rate = spent / (step - self.start_step) if step > self.start_step else 0.0
        return spent + (self.step - step) * rate

    def loss_on(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = self._on_device(x, y)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self._forward(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def _on_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the run's device. On a GPU it goes from pinned memory, so the copy does not wait for the
        queued kernels; a pinned tensor keeps its strides, and a strided one would be staged through pageable
        memory (a copy the host waits for). The batcher cuts inputs and targets from one block of windows one
        token longer: that block goes over once, whole, and is cut again on the device."""
        if self.device.type != "cuda":
            return x.to(self.device), y.to(self.device)
        block = one_block(x, y)
        if block is not None:
            on = block.pin_memory().to(self.device, non_blocking=True)
            return on[:, :-1], on[:, 1:]
        return x.contiguous().pin_memory().to(self.device, non_blocking=True), \
            y.contiguous().pin_memory().to(self.device, non_blocking=True)

    def _compile(self) -> None:
        """``run.compile``: torch.compile the model in place (its state_dict keeps its names).

        Graphs are cached by code, not by module, so the simulator's workers (one model each, the same
        architecture) share them: a worker switch compiles nothing.
        """
        wanted = self.cfg.run.compile
        self.compiled = self.device.type == "cuda" if wanted is None else bool(wanted)
        self.compiled_modes: set[tuple[bool, bool]] = set()  # (training, grad enabled) that ran compiled
        self.backward_compiled = False  # the backward graph compiles at the first backward, apart from the forward
        if self.compiled:
            self.model.compile()

    def _uncompile(self, e: Exception) -> None:
        """A compilation failed: one line saying so, and the run goes on with the eager model."""
        first = (str(e).strip().splitlines() or [""])[0][:200]
        self.metrics.info(f"run.compile: torch.compile failed ({type(e).__name__}: {first}); "
                          "continuing without compiling (set run.compile=false to skip the attempt)", self.step)
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

    def _loss_and_backward(self, micro: int) -> torch.Tensor:
        """The loss of micro-batch ``micro`` of this step, its gradients added to the parameters'. The first
        compiled backward compiles its own graph: if that fails, nothing was added, and the micro-batch runs
        again on the eager model."""
        batch = self.batcher.train_batch(self.step, self.micro_offset + micro)
        loss = self.loss_on(*batch)
        try:
            (loss / self.cfg.run.grad_accum).backward()
        except Exception as e:
            if not self.compiled or self.backward_compiled:
                raise  # not a compilation: the run's own error
            self._uncompile(e)
            loss = self.loss_on(*batch)
            (loss / self.cfg.run.grad_accum).backward()
        self.backward_compiled = self.compiled
        return loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss of the model the algorithm stands for (DiLoCo: the global parameters)."""
        self.model.eval()
        total = 0.0
        with self.algo.evaluation_weights():
            for k in range(self.cfg.run.eval_batches):
                total += float(self.loss_on(*self.batcher.val_batch(k)))
        self.model.train()
        return total / self.cfg.run.eval_batches

    def _set_lr(self) -> float:
        run, o = self.cfg.run, self.cfg.optim
        if run.max_steps:
            progress = (self.run_step() - o.warmup_steps) / max(1, run.max_steps - o.warmup_steps)
        else:  # by time: the schedule ends where this segment's budget does (stretched on a resume)
            progress = (self.budget_prior + self.agreed_budget_s()) / (self.budget_prior + run.max_time)
        factor = lr_factor(self.step, o.warmup_steps, progress, o.schedule, o.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        return self.optimizer.param_groups[0]["lr"]

    def run_step(self) -> float:
        """How far the run is, in steps of ``run.max_steps``: this worker's step, except with time-budgeted rounds,
        where workers' step counts differ and the run stops on the tokens they agreed on (:meth:`_should_stop`):
        then those tokens as steps of every worker, plus this worker's steps since that agreement. The lr
        schedule follows it, so a slow worker ends its decay with the run instead of stopping at a third of it
        (and a fast one does not spend the run's last third at the floor)."""
        if not self.time_rounds:
            return self.step
        agreed = self.algo.tokens_agreed / max(1, self.tokens_per_step * self.world)
        return agreed + (self.step - self.synced_step)

    def _should_stop(self, synced: bool) -> bool:
        """Stop where every worker stops too: DDP at any step, round-based algorithms after a sync.

        With time-budgeted rounds the workers' step counts differ, so run.max_steps becomes a token budget
        (max_steps x batch tokens x workers) checked against the tokens all workers agreed on in the averages.
        """
        run = self.cfg.run
        if self.time_rounds:
            stop = synced and bool(run.max_steps) and \
                self.algo.tokens_agreed >= run.max_steps * self.tokens_per_step * self.world
        else:
            stop = bool(run.max_steps and self.step >= run.max_steps)
        timed = run.max_time is not None
        if stop or not (timed or self.stop_on_request):
            return stop
        # the clock and a signal (stop_signals): one process decides alone; several where every one of them is
        # (round-based: a sync; else every log.every-th step), on rank 0's view, in one broadcast
        if self.solo:
            spent, signum = self.budget_s(), STOP.signum
        elif synced if self.algo.round_based else self.step % self.cfg.log.every == 0:
            spent, signum = self.transport.broadcast_object((self.budget_s(), STOP.signum))
            self.agreed = (self.step, float(spent))
        else:
            return False
        if timed and spent >= run.max_time:
            return True
        if self.stop_on_request and signum is not None:
            self.stopped_by = int(signum)
            return True
        return False

    def _checkpoint_due(self, synced: bool) -> bool:
        every = self.cfg.run.checkpoint_every
        if not every:
            return False
        if self.time_rounds:  # a round count every worker shares
            rounds = max(1, -(-every // self.cfg.algo.inner_steps))
            return synced and self.algo.round % rounds == 0
        return self.step % every == 0

    def fit(self) -> dict[str, Any]:
        cfg, run = self.cfg, self.cfg.run
        m = self.metrics
        if self.leader:
            m.info(f"{self.data.description}: {self.data.train_tokens:,} train / {self.data.val_tokens:,} val tokens; "
                   f"model {count_params(self.model) / 1e6:.2f}M params on {self.device}; algorithm {cfg.algo.name} "
                   f"x {self.world} worker(s); run folder {self.run_dir}")
            if self.device.type != "cpu":  # a CPU has no datasheet peak: no MFU, and no line about it
                m.info(self.mfu.describe())
            if self.resumed_from:
                changes = f"; settings changed since it was saved: {self.resume_changes}" if self.resume_changes else ""
                m.info(f"resumed from {self.resumed_from}{changes}", self.step)
        self._t0 = time.perf_counter()
        self.synced_step = self.step  # the step of this worker's latest sync (the run's progress counts from it)
        # a simulated run's budget is virtual time (the simulator's transport measures the compute it is told of)
        self._budget_mark = self.transport.mark() if self.transport.caps.measures_compute else None
        self.agreed = (self.step, 0.0)  # (step, budget_s) as rank 0 saw it at the latest agreement: none yet
        window_t = time.perf_counter()
        listening = self.stop_on_request
        if listening:
            STOP.listening += 1
        try:
            # a worker that joins does so where the others' last step synced (round-based) or at any step (DDP)
            synced = self.joining is not None and self.algo.round_based
            while not self._should_stop(synced):
                lr = self._set_lr()
                step_loss = None  # stays on the device: read back only at log steps (no host sync per step)
                with self.transport.computing(self.device):  # the simulator's virtual time measures the compute
                    for micro in range(run.grad_accum):
                        loss = self._loss_and_backward(micro)
                        part = loss.detach() / run.grad_accum
                        step_loss = part if step_loss is None else step_loss + part
                info = self.algo.step()
                synced = bool(info.get("synced"))
                self.algo.zero_grad()
                self.step += 1
                if synced:
                    self.synced_step = self.step
                if synced and self.on_round is not None:
                    self.on_round(info)
                self.window_loss = self.window_loss + step_loss
                self.window_steps += 1
                evaluate = run.eval_every and self.step % run.eval_every == 0
                if self.step % cfg.log.every == 0 or evaluate:
                    self._report_skipped(info)
                    now = time.perf_counter()
                    tps_local = self.window_steps * self.tokens_per_step / max(now - window_t, 1e-9)
                    record = self._record(float(self.window_loss) / self.window_steps, lr, tps_local, info)
                    if evaluate:
                        record["val_loss"] = self.evaluate()
                        self.last_val = (self.step, record["val_loss"])
                    m.log(record)
                    self.window_loss, self.window_steps = 0.0, 0
                    if self.on_step:
                        self.on_step(self.step, record)
                    window_t = time.perf_counter()
                if self._checkpoint_due(synced):
                    self.save()
                if self.on_step_end is not None:
                    self.on_step_end(synced, info)
        except KeyboardInterrupt as e:
            # a plain KeyboardInterrupt (the Python API without stop_signals) saves at this step; an Interrupted
            # here is a second signal, or one the loop could not wait for (torchrun): it stops without saving
            if self.world == 1 and self.step > 0 and not isinstance(e, Interrupted):
                path = self.save()
                m.info(f"interrupted: saved {path}; continue with --resume --run-dir {self.run_dir}", self.step)
            m.close()
            raise
        finally:
            if listening:
                STOP.listening -= 1
        if self.stopped_by is not None:
            self._stop(self.stopped_by)
        return self._finish()

    def _report_skipped(self, info: dict[str, Any]) -> None:
        """Say (at a log step, where reading the device's count costs nothing extra) if steps were skipped."""
        skipped = self.algo.skipped_steps
        new, self.skipped_reported = skipped - self.skipped_reported, skipped
        if new > 0:
            norm = info.get("grad_norm")
            last = f"; last norm {float(norm):.4g}" if norm is not None else ""
            what = "this step's update was" if new == 1 else f"{new} steps' updates were"
            self.metrics.info(f"non-finite gradients{last}: {what} skipped; lower optim.lr or set optim.grad_clip",
                              self.step)

    def _stop(self, signum: int) -> None:
        """Save where a signal stopped the loop (every worker is here), then raise Interrupted."""
        m = self.metrics
        path = None
        if self.step != self.saved_step and self.step > 0:
            path = self.save()
        elif self.leader and self.step > 0:
            path = self.ckpt_dir / checkpoint_name(self.step)
        name = signal.Signals(signum).name
        if self.leader:
            if path is not None:
                m.info(f"stopped by {name}: saved {path}; continue with --resume --run-dir {self.run_dir}", self.step)
            else:
                m.info(f"stopped by {name} before the first step: nothing to save", self.step)
        m.close()
        raise Interrupted(signum, path, clean=True)

    def _record(self, loss: float, lr: float, tps_local: float, info: dict[str, Any]) -> dict[str, Any]:
        stats = self.transport.stats
        mfu = self.flops_per_token * tps_local / self.peak if self.peak else None
        norm = info.get("grad_norm")
        return {"step": self.step, "tokens": self.tokens_seen(), "loss": loss, "lr": lr,
                "tokens_per_s": tps_local * self.world, "mfu": mfu,
                "grad_norm": float(norm) if norm is not None else None,
                "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "wall_s": self.wall_s(),
                **self.transport.metrics()}

    def _final_line_logged(self) -> bool:
        """Whether metrics.jsonl already ends this step with a final validation line (leader; False elsewhere)."""
        path = self.run_dir / "metrics.jsonl"
        if not self.leader or not path.is_file():
            return False
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("step") == self.step and "val_loss" in r and "loss" not in r:
                return True
        return False

    def _codec_summary(self) -> dict[str, Any]:
        codec = self.algo.codec
        if codec is None or not codec.stats.wire_bytes:
            return {}
        return {"codec_chain": codec.chain, "compression_ratio": codec.stats.ratio}

    def tokens_seen(self) -> int:
        """Tokens trained by all workers (with time-budgeted rounds: as agreed at the last sync)."""
        if self.time_rounds:
            return int(self.algo.tokens_agreed)
        steps = self.transport.steps_trained()
        if steps is not None:  # the members changed (a simulation with churn)
            return steps * self.tokens_per_step
        return self.step * self.tokens_per_step * self.world

    def _finish(self) -> dict[str, Any]:
        m = self.metrics
        self.algo.finalize()
        # resumed from the run's final checkpoint: nothing trained since, and its last lines are already there
        at_end = self.resumed_from is not None and self.step == self.start_step
        if self.last_val is not None and self.last_val[0] == self.step and not self.algo.round_based:
            val = self.last_val[1]
        else:
            val = self.evaluate()
            stats = self.transport.stats
            if not (at_end and self._final_line_logged()):
                m.log({"step": self.step, "tokens": self.tokens_seen(), "val_loss": val,
                       "lr": self.optimizer.param_groups[0]["lr"], "bytes_sent": stats.bytes_sent,
                       "bytes_received": stats.bytes_received, "wall_s": self.wall_s(), **self.transport.metrics()},
                      show=False)  # the done line below prints it
        if self.cfg.run.checkpoint_final:  # again at_end too: the checkpoint there may predate algo.finalize()
            self.save()
        stats = self.transport.stats
        trained = self.transport.my_steps_trained()  # under churn: not the steps of the run while it was away
        steps = self.step if trained is None else trained
        mine = {"worker": self.rank, "tokens": steps * self.tokens_per_step, "bytes_sent": stats.bytes_sent,
                "bytes_received": stats.bytes_received, "val_loss": val, "steps": steps}
        workers = self.transport.all_gather_object(mine)
        tokens = sum(w["tokens"] for w in workers)
        if self.transport.steps_trained() is not None:  # also what workers away at the end trained
            tokens = self.tokens_seen()
        summary = {
            "val_loss": val, "steps": self.step, "tokens": tokens,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "wall_s": self.wall_s(),
            "peak_bytes_per_exchange": stats.peak_bytes, "algorithm": self.cfg.algo.name, "workers": workers,
            "num_workers": self.world, "codec": self.cfg.compress.codec, **self._codec_summary(),
            "skipped_steps": self.algo.skipped_steps, "run_dir": str(self.run_dir),
            **self.transport.summary(),
        }
        if summary.get("virtual_wall_s"):
            summary["tokens_per_virtual_s"] = summary["tokens"] / summary["virtual_wall_s"]
        if self.leader:
            tmp = self.run_dir / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, self.run_dir / "summary.json")
            if self.cfg.log.plot:
                plot_runs([self.run_dir], self.run_dir / "loss.png", title=self.cfg.run.name)
            m.info(f"done at step {self.step}: val_loss {val:.4f} after {summary['tokens']:,} tokens in "
                   f"{summary['wall_s']:.1f}s; summary in {self.run_dir / 'summary.json'}")
        m.close()
        return summary


def discard_run(path: Path, why: str = "--restart") -> Optional[Path]:
    """Move a run folder's checkpoints, metrics and wandb run id into ``path/discarded-<time>/`` (``--restart``,
    or a new run in the folder of one that left no checkpoint).

    Nothing is deleted: the unreadable (or unwanted) files stay there for a look, and go with ``rm -r``.
    """
    movable = list_checkpoints(path / "checkpoints")
    movable += [path / n for n in ("metrics.jsonl", "summary.json", "loss.png", ".wandb_id") if (path / n).exists()]
    if not movable:
        return None
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    dest, n = path / f"discarded-{stamp}", 1
    while dest.exists():
        n += 1
        dest = path / f"discarded-{stamp}-{n}"
    (dest / "checkpoints").mkdir(parents=True)
    for p in movable:
        shutil.move(str(p), str(dest / p.relative_to(path)))
    print(f"loco: {why}: moved {len(movable)} file(s) of the earlier run to {dest}", file=sys.stderr, flush=True)
    return dest


def unreadable_message(run_dir: Path, ckpt_dir: Path) -> str:
    """The one line that refuses to resume from a folder whose checkpoints are all unreadable."""
    names = [p.name for p in list_checkpoints(ckpt_dir)]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{ckpt_dir}: none of its {len(names)} checkpoint(s) can be read ({shown}: truncated, corrupted or "
            f"not loco checkpoints), so there is nothing to resume from; remove them, or pass --restart instead "
            f"of --resume to start over from step 0 in {run_dir} (they are moved to {run_dir}/discarded-<time>/)")


def train(cfg: Config, model: Optional[nn.Module] = None, **kwargs: Any) -> dict[str, Any]:
    """Train from a config; returns the summary."""
    trainer = Trainer(cfg, model=model, **kwargs)
    owned = kwargs.get("transport") is None
    try:
        summary = trainer.fit()
    except BaseException as e:
        if owned:  # a failing run ends now, with its error: it does not wait for exchanges other ranks won't finish
            if isinstance(e, Interrupted) and e.clean:
                trainer.transport.close()  # every worker stopped here together, after the save
            else:
                trainer.transport.abort()
        raise
    if owned:
        trainer.transport.close()
    return summary
