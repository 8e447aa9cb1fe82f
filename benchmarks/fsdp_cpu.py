"""A training step with ``run.shard: fsdp`` against the node mesh's (DDP inside the node), on one node of CPU
processes over gloo. Target: at most 1.5x.

Each cell is one ``torchrun --nproc-per-node G -m launch.cli train`` (DDP, so every step is alike, no evaluation
or checkpoint); the figure is the median seconds per step over the log windows after the first (the first holds
the warm-up). The two layouts alternate, ``--repeats`` times, so both see the same machine.

    python benchmarks/fsdp_cpu.py --out benchmarks/results/fsdp_cpu.md       # about 5 minutes on two cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"node mesh (DDP)": [], "fsdp": ["run.shard=fsdp"]}


def step_seconds(size: str, layout: list[str], steps: int, procs: int, every: int = 2) -> float:
    """Median seconds per step of one run (the log windows after the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"model.size={size}", "algo.name=ddp", "run.batch_size=2", "run.eval_every=0",
                "run.checkpoint_final=false", "log.plot=false", "log.progress=plain", f"log.every={every}",
                "transport.mesh=nodes", "data.max_docs=200", *layout]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-addr",
               "127.0.0.1", "--master-port", str(29500 + os.getpid() % 1000), "-m", "launch.cli", "train",
               "--config", "tiny", "--max-steps", str(steps), "--run-dir", tmp,
               *[a for s in sets for a in ("--set", s)]]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        walls = [json.loads(line)["wall_s"] for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()
                 if '"tokens_per_s"' in line]
    windows = [(b - a) / every for a, b in zip(walls, walls[1:])]
    return statistics.median(windows[1:] or windows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--steps", default="tiny=40,small=12", help="steps per run, by size")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    steps = dict(item.split("=") for item in args.steps.split(","))
    rows = []
    for size in args.sizes.split(","):
        times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        for r in range(args.repeats):
            for name, layout in LAYOUTS.items():
                t = step_seconds(size, layout, int(steps.get(size, 12)), args.procs)
                times[name].append(t)
                print(f"{size} {name} run {r + 1}: {t * 1000:.1f} ms/step", flush=True)
        mesh, fsdp = (statistics.median(times[n]) for n in LAYOUTS)
        rows.append(f"| {size} | {mesh * 1000:.1f} | {fsdp * 1000:.1f} | {fsdp / mesh:.2f}x | "
                    f"{'met' if fsdp / mesh <= 1.5 else 'missed'} |")
    cores = os.cpu_count()
    text = "\n".join([
        f"# fsdp against the node mesh, one node of {args.procs} CPU processes (gloo)",
        "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {platform.processor() or platform.machine()}, {cores} "
        f"cores, by `python benchmarks/fsdp_cpu.py`: DDP, batch 2 a process, medians of {args.repeats} alternating "
        f"runs of each layout (each run's figure: the median seconds per step after its first log window).",
        "Target: a step with `run.shard: fsdp` at most 1.5x the node mesh's.",
        "",
        "| model | node mesh ms/step | fsdp ms/step | ratio | target |",
        "| --- | --- | --- | --- | --- |",
        *rows, ""])
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
