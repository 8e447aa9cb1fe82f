"""What a training process sets up before its model: threads, the allocator, the device, the seed, and
whether the model can fit at all."""

from __future__ import annotations

import os
import random
import sys
from typing import Optional

import numpy as np
import torch

from launch.errors import RunError
from launch.metrics import human_bytes

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


def start_process(threads: Optional[int], device: str) -> torch.device:
    """``run.threads`` and the allocator's habits for this process; returns the device it trains on."""
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()
    return resolve_device(device)


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
