"""Whether N simulated workers fit in memory, said in one line before the machine's OOM killer says it with none.

All N workers live in one process, each with its model, inner optimizer state and the algorithm's copies, so the
memory a simulation needs grows with N where a real run's does not. Two checks:

* before anything is built, a lower bound: every worker holds its fp32 weights and at least one more state of the
  same size (AdamW's moments, SGD's or DeMo's momentum, DiLoCo's global copy), 8 bytes a parameter;
* as the workers are built, one after another, what each added to this process (its resident memory on a CPU,
  what torch allocated on a GPU), measured on the first few and projected over the rest, plus the state a worker
  allocates only at its first step and round (AdamW's two moments, and an outer momentum or an exchange's
  buffer: 12 bytes a parameter). The projection is refused when it exceeds the memory free now.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from launch.config import Config
from launch.errors import RunError
from launch.metrics.log import human_bytes
from launch.models.transformer import model_args_from_config
from launch.loop.runtime import available_memory, check_model_fits, resolve_device
from launch.data.tokens import TokenData

AT_LEAST_PER_PARAM = 8  # fp32 weights and one more fp32 state of their size, whatever the algorithm
LATER_PER_PARAM = 12  # allocated at a worker's first step and round: AdamW's two moments and one more copy
MEASURED_ON = 3  # workers built before their cost is projected over the rest


def used_memory(device: torch.device) -> Optional[int]:
    """Bytes this process holds on ``device``: its resident memory on a CPU, torch's allocations on a GPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _refuse(workers: int, per_worker: float, free: int, device: torch.device, how: str, basis: str) -> None:
    fit = max(0, int(free // per_worker)) if per_worker > 0 else 0
    raise RunError(f"simulating {workers} workers needs {how} {human_bytes(workers * per_worker)} on {device} "
                   f"({human_bytes(per_worker)} a worker, {basis}) and {human_bytes(free)} is free: simulate at most "
                   f"about {fit} workers (--workers), or a smaller model; on a GPU, sim.offload keeps idle workers' "
                   f"state off it")


def check_workers_fit(cfg: Config, data: TokenData) -> None:
    """The lower bound, before any worker is built (a loco model's size is known from its config; a transformers
    model is left to the projection)."""
    m = cfg.model
    if m.hf_config or m.init_from:
        return
    args = model_args_from_config(m, data.vocab_size, cfg.data.seq_len)
    params, workers = args.n_params, cfg.sim.workers
    # sim.offload parks idle workers' state in host memory: there is where the N copies are
    device = torch.device("cpu") if cfg.sim.offload else resolve_device(cfg.run.device)
    check_model_fits(args, device)  # a model too large for one worker is that model's problem, said as such
    free = available_memory(device)
    per = AT_LEAST_PER_PARAM * params
    if free is not None and workers * per > free:
        _refuse(workers, per, free, device, "at least", f"{AT_LEAST_PER_PARAM} bytes a parameter")


class MemoryWatch:
    """The projection as workers are built: :meth:`built` after each (the simulator's ``on_built`` hook), in order."""

    def __init__(self, workers: int, offload: bool = False) -> None:
        self.workers, self.offload = workers, offload
        self.marks: list[int] = []  # this process's memory after each worker was built

    def built(self, model: torch.nn.Module, device: torch.device) -> None:
        if self.offload and device.type != "cpu":  # a GPU holds one worker at a time; the host the rest, pinned
            return
        used = used_memory(device)
        if used is None:
            return
        self.marks.append(used)
        n = len(self.marks)
        if n <= MEASURED_ON or n >= self.workers:
            return
        # the first worker also builds what workers share (the allocator's pools, torch's caches): it is left out
        per_build = (self.marks[-1] - self.marks[0]) / (n - 1)
        later = LATER_PER_PARAM * sum(p.numel() for p in model.parameters())
        need = (self.workers - n) * (per_build + later) + n * later
        free = available_memory(device)
        if free is not None and need > free:
            taken = self.marks[-1] - self.marks[0]  # by the workers built after the first
            _refuse(self.workers, per_build + later, free + taken, device, "about",
                    f"as measured on the first {n} built, and {LATER_PER_PARAM} bytes a parameter of later state")
