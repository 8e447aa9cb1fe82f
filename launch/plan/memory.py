"""``loco plan --shard G``: what one process holds for its worker under each algorithm, with its default settings."""

from __future__ import annotations

from launch.config import Config
from launch.config.algorithms import algorithm_class
from launch.loop.memory import process_bytes


def format_memory(params: int, processes: int, algorithms: tuple[str, ...] = ("ddp", "diloco", "streaming",
                                                                              "sparseloco")) -> str:
    """``loco plan --shard G``: what one process holds under each algorithm with its default settings and AdamW."""
    lines = [f"memory a process holds for a worker of {params / 1e6:,.0f}M parameters, "
             + (f"sharded over {processes} processes (run.shard: fsdp)" if processes > 1 else "unsharded")
             + " (activations and exchange buffers not counted):"]
    for name in algorithms:
        cfg = Config()
        cfg.algo.name = name
        if algorithm_class(name).fragmented:  # fragments in flight, as loco plan's streaming rows run them
            cfg.algo.fragments, cfg.algo.overlap_steps = 4, 5
        lines.append(f"  {name:<11} {process_bytes(cfg, params, processes).describe()}")
    return "\n".join(lines)
