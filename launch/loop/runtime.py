"""What a training process sets up before its model: threads, the allocator, the device, the seed, and
whether the model can fit at all."""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Optional

import numpy as np
import torch

from launch.errors import RunError
from launch.metrics.log import human_bytes

_MEMORY_KEPT = False


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep memory that is freed for the next allocation, instead of handing it back to
    the OS at once. By default a freed block of more than 128 KiB (or of more than the largest freed so far)
    goes back to the OS, and the next tensor of that size faults in fresh zeroed pages, 4 KiB at a time: every
    step re-creates temporaries of the same sizes (activations, gradients, DeMo's transforms), and on a CPU the
    page faults cost as much as the arithmetic. Blocks below 32 MiB (glibc's upper limit for this setting) then
    come from the heap, and the heap keeps up to 1 GiB of free memory at its top. Memory held stays at most the
    process's peak. Once per process; a no-op where the C library is not glibc. Whether it took effect."""
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


def start_process(threads: Optional[int | str], device: str, deterministic: bool = False) -> torch.device:
    """``run.threads`` (a number; ``auto`` is settled by :func:`settle_threads` once the model is built),
    ``run.deterministic`` and the allocator's habits for this process; returns the device it trains on."""
    if isinstance(threads, int):
        torch.set_num_threads(threads)
    if deterministic:
        make_deterministic()
    keep_freed_memory()
    return resolve_device(device)


def make_deterministic() -> None:
    """Kernels whose results do not depend on the run: two processes given the same state compute the same
    bits. On a GPU three things break that otherwise: kernels that add with atomics (attention's backward among
    them), cuBLAS's per-stream workspaces, and torch.compile's autotuning, which times candidate kernels on the
    device and keeps the fastest, so two processes may sum a reduction in different orders. AdamW turns such
    last-bit differences into lr-sized ones within a few steps. On a CPU the kernels are deterministic already.
    Before the first cuBLAS call (cuBLAS reads its workspace setting once); kernels with no deterministic form
    warn instead of failing."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    import torch._inductor.config as inductor

    if hasattr(inductor, "deterministic"):  # torch >= 2.8: no on-device benchmarking that changes numerics
        inductor.deterministic = True
    else:
        inductor.triton.autotune_pointwise = False
        inductor.max_autotune = False


# Below this many parameters a model takes one thread: its matrices are about one of torch's 32K-value grains, so a
# parallel region has nothing to split. On idle cores two threads still won at 41K parameters (16 x 128 tokens a
# step: the activations are what splits), so the line sits below that (benchmarks/results/threads_cpu.md).
SMALL_MODEL_PARAMS = 32_768
_SETTLED: Optional[tuple[int, str]] = None  # auto's choice: once per process, the same for every simulated worker


def settle_threads(setting: Optional[int | str], device: torch.device, n_params: int) -> Optional[tuple[int, str]]:
    """``run.threads: auto`` on a CPU: the threads this process takes and why, set; None where torch's default
    stands (empty), a number was given, or the model trains on a GPU."""
    global _SETTLED
    if setting != "auto" or device.type != "cpu":
        return None
    if _SETTLED is None:
        _SETTLED = auto_threads(len(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
                                os.environ.get("OMP_NUM_THREADS"), n_params, busy_cores())
    if torch.get_num_threads() != _SETTLED[0]:  # where auto agrees with torch's default, torch's setup stands
        torch.set_num_threads(_SETTLED[0])
    return _SETTLED


def threads_note(settled: Optional[tuple[int, str]]) -> str:
    """What the start line says of ``auto``'s choice: `` (1 thread: 2 core(s), 1.8 of them kept busy ...)``."""
    return "" if settled is None else f" ({settled[0]} thread{'s' if settled[0] > 1 else ''}: {settled[1]})"


def auto_threads(cores: int, processes: int, omp: Optional[str], n_params: int,
                 busy: float) -> tuple[int, str]:
    """How many threads ``auto`` takes, and the reason in a few words: never more than this process's share of
    the cores it may use (``cores`` divided among the node's ``processes``), nor more than the cores that other
    work leaves idle (``busy``: cores kept busy by others); one for a model under :data:`SMALL_MODEL_PARAMS`;
    what ``OMP_NUM_THREADS`` says where it is set. Threads that spin at barriers need every core they ask for:
    one descheduled thread stalls each parallel region (9x slower on 2 loaded cores)."""
    share = max(1, cores // max(1, processes))
    cap, why = share, f"{cores} core(s)" + (f" shared by {processes} processes" if processes > 1 else "")
    if omp and omp.strip().isdigit() and 0 < int(omp) < share:
        cap, why = int(omp), f"OMP_NUM_THREADS={omp.strip()}"
    if cap > 1 and n_params < SMALL_MODEL_PARAMS:
        return 1, f"a model under {SMALL_MODEL_PARAMS:,} parameters has nothing to split"
    idle = max(1, int(cores - busy + 0.5))
    if idle < cap:
        return idle, f"{why}, {busy:.1f} of them kept busy by other work"
    return cap, why


def busy_cores() -> float:
    """Cores other work keeps busy now: the threads running at this moment, this one's own left out (the median
    of a few looks over 50 ms); 0 where the system does not say. Not the load average: it lags a minute behind,
    so a job that just ended would still take cores from the next."""
    running = []
    for _ in range(5):
        try:
            with open("/proc/stat") as f:
                running += [int(line.split()[1]) - 1 for line in f if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            break
        time.sleep(0.01)
    return float(sorted(running)[len(running) // 2]) if running else 0.0


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
