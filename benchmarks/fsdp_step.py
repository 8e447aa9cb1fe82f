"""A training step with ``run.shard: fsdp`` (and with its blocks recomputed) against the node mesh's (DDP inside
the node), on one node. Targets: on CPU processes over gloo at most 1.5x; on one GPU, one process, fsdp at most
1.05x the plain step and fsdp with ``model.activation_checkpointing`` at most 1.4x.

Each cell is one ``torchrun --nproc-per-node G -m launch.cli train`` (DDP, so every step is alike, no evaluation
or checkpoint); the figure is the median seconds per step over the log windows after the first (the first holds
the warm-up). The layouts alternate, ``--repeats`` times, so all see the same machine.

    python benchmarks/fsdp_step.py --out benchmarks/results/fsdp_cpu.md       # about 5 minutes on two cores
    python benchmarks/fsdp_step.py --device cuda --procs 1 --sizes 150m --steps 150m=40 --batch-size 16 \
        --seq-len 1024 --layouts mesh,fsdp,fsdp+recompute --out benchmarks/results/fsdp_gpu.md
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
LAYOUTS = {"mesh": ("node mesh (DDP)", []), "fsdp": ("fsdp", ["run.shard=fsdp"]),
           "fsdp+recompute": ("fsdp, blocks recomputed", ["run.shard=fsdp", "model.activation_checkpointing=true"])}
TARGETS = {("cpu", "fsdp"): 1.5, ("cuda", "fsdp"): 1.05, ("cuda", "fsdp+recompute"): 1.4}


def step_seconds(size: str, layout: list[str], steps: int, procs: int, device: str, batch: int, seq_len: int,
                 every: int = 2) -> float:
    """Median seconds per step of one run (the log windows after the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"model.size={size}", "algo.name=ddp", f"run.batch_size={batch}", f"data.seq_len={seq_len}",
                f"run.device={device}", "run.eval_every=0", "run.checkpoint_final=false", "log.plot=false",
                "log.progress=plain", f"log.every={every}", "transport.mesh=nodes", "data.max_docs=200", *layout]
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
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layouts", default="mesh,fsdp", help=f"the first is the reference; of {', '.join(LAYOUTS)}")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    steps = dict(item.split("=") for item in args.steps.split(","))
    layouts = args.layouts.split(",")
    rows = []
    for size in args.sizes.split(","):
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for r in range(args.repeats):
            for name in layouts:
                t = step_seconds(size, LAYOUTS[name][1], int(steps.get(size, 12)), args.procs, args.device,
                                 args.batch_size, args.seq_len)
                times[name].append(t)
                print(f"{size} {LAYOUTS[name][0]} run {r + 1}: {t * 1000:.1f} ms/step", flush=True)
        base = statistics.median(times[layouts[0]])
        for name in layouts:
            t = statistics.median(times[name])
            target = TARGETS.get((args.device, name))
            verdict = "" if target is None else f"at most {target}x: {'met' if t / base <= target else 'missed'}"
            rows.append(f"| {size} | {LAYOUTS[name][0]} | {t * 1000:.1f} | {t / base:.2f}x | {verdict} |")
    where = (f"{os.cpu_count()} CPU cores, {args.procs} processes over gloo" if args.device == "cpu" else
             f"{_gpu_name()}, {args.procs} process(es)")
    text = "\n".join([
        f"# fsdp against the node mesh, one node ({where})",
        "",
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {platform.processor() or platform.machine()}, {where}, "
        f"by `python benchmarks/fsdp_step.py`: DDP, batch {args.batch_size} x {args.seq_len} a process, medians "
        f"of {args.repeats} alternating runs of each layout (each run's figure: the median seconds per step after "
        f"its first log window).",
        "",
        "| model | layout | ms/step | against the first | target |",
        "| --- | --- | --- | --- | --- |",
        *rows, ""])
    print(text)
    if args.out:
        args.out.write_text(text)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    main()
