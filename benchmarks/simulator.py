"""What simulating N workers costs: time against N*H single-worker steps, and memory per extra worker.

    python benchmarks/simulator.py                      # tiny on this device, N=8, H=25, 3 repeats
    python benchmarks/simulator.py --model small --workers 8 --inner-steps 50 --out benchmarks/results/simulator_gpu.md

Time: the training loop of a simulated DiLoCo run (N workers, H inner steps each, one round, no evaluation)
against one worker doing N*H steps of the same batch, measured side by side, median of the repeats.
Memory: peak of a simulated run with 1, 2, 4, ... N workers, each in a fresh process (CUDA: max allocated;
CPU: peak resident set); the slope is the memory each extra worker adds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _config(args, workers: int, steps: int, algo: str, run_dir: str):
    from launch.config import load_config

    overrides = [f"model.size={args.model}", f"data.seq_len={args.seq_len}", f"run.batch_size={args.batch_size}",
                 f"run.max_steps={steps}", "run.eval_every=0", "run.eval_batches=1", "run.checkpoint_every=0",
                 "log.plot=false", "log.progress=off", "data.max_docs=300", f"algo.name={algo}",
                 f"algo.inner_steps={args.inner_steps}", f"sim.workers={workers}", "sim.baseline=none",
                 "optim.warmup_steps=5", f"run.dir={run_dir}", f"run.device={args.device}"]
    if args.threads:
        overrides.append(f"run.threads={args.threads}")
    cfg, _ = load_config([], overrides)
    return cfg


def _timed_fit(cfg, data, workers: int) -> float:
    """Seconds in the training loops (excluding data loading): simulated when workers > 0, else one worker."""
    import torch

    from launch.simulate import simulate_once
    from launch.trainer import Trainer

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    if workers:
        simulate_once(cfg, data)
    else:
        Trainer(cfg, data=data).fit()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_time(args) -> dict:
    import tempfile

    from launch.data import load_data

    data = None
    sim_s, single_s = [], []
    steps = args.workers * args.inner_steps
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats + 1):  # the first pair warms up caches and is not counted
            sim_cfg = _config(args, args.workers, args.inner_steps, "diloco", f"{tmp}/sim{rep}")
            one_cfg = _config(args, 1, steps, "ddp", f"{tmp}/one{rep}")
            data = data or load_data(sim_cfg.data)
            pair = (_timed_fit(sim_cfg, data, args.workers), _timed_fit(one_cfg, data, 0))
            if rep:
                sim_s.append(pair[0])
                single_s.append(pair[1])
    ratios = [a / b for a, b in zip(sim_s, single_s)]
    return {"sim_s": sim_s, "single_s": single_s, "ratio_median": statistics.median(ratios), "ratios": ratios}


def peak_memory_child(args) -> None:
    """Hidden mode: one simulated run, print its peak memory in bytes."""
    import tempfile

    import torch

    from launch.simulate import simulate_once

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, args.child_workers, args.inner_steps, "diloco", f"{tmp}/run")
        simulate_once(cfg)
    if torch.cuda.is_available() and args.device != "cpu":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"peak": peak}))


def measure_memory(args) -> list[tuple[int, int]]:
    out = []
    n = 1
    counts = []
    while n <= args.workers:
        counts.append(n)
        n *= 2
    for n in counts:
        cmd = [sys.executable, __file__, "--child-workers", str(n), *sys.argv[1:]]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if res.returncode:
            raise SystemExit(res.stderr[-2000:])
        out.append((n, json.loads(res.stdout.strip().splitlines()[-1])["peak"]))
    return out


def device_name(device: str) -> str:
    import torch

    if torch.cuda.is_available() and device != "cpu":
        return torch.cuda.get_device_name()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return f"CPU ({line.split(':', 1)[1].strip()}, {os.cpu_count()} logical cores)"
    return f"CPU ({platform.processor()})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="also write the report to this file")
    p.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_workers:
        peak_memory_child(args)
        return

    import torch

    t = measure_time(args)
    mem = measure_memory(args)
    slope = (mem[-1][1] - mem[0][1]) / max(1, mem[-1][0] - mem[0][0])
    lines = [
        "# Simulator cost",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- device: {device_name(args.device)}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, threads {torch.get_num_threads()}",
        f"- model {args.model}, batch {args.batch_size} x {args.seq_len}, N={args.workers} workers, H={args.inner_steps}",
        f"- command: python benchmarks/simulator.py {' '.join(sys.argv[1:])}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| simulated N workers x H steps (median) | {statistics.median(t['sim_s']):.2f} s |",
        f"| one worker, N*H steps (median) | {statistics.median(t['single_s']):.2f} s |",
        f"| ratio (median of {len(t['ratios'])} side-by-side pairs; target <= 1.15) | {t['ratio_median']:.3f} "
        f"({', '.join(f'{r:.3f}' for r in t['ratios'])}) |",
    ]
    for n, peak in mem:
        lines.append(f"| peak memory, {n} worker(s) | {peak / 2**20:.0f} MiB |")
    lines.append(f"| memory per extra worker | {slope / 2**20:.1f} MiB |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
