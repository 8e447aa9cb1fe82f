"""What simulating N workers costs: time against N*H single-worker steps, and memory per extra worker.

    python benchmarks/simulator.py                      # tiny on this device, N=8, H=25, 3 repeats
    python benchmarks/simulator.py --model small --workers 8 --inner-steps 50 --out benchmarks/results/simulator_gpu.md
    python benchmarks/simulator.py --model 1b --workers 4 --offload --mem-workers 1,4   # idle workers parked on the CPU

Time: the training loop of a simulated DiLoCo run (N workers, H inner steps each, one round, no evaluation)
against one worker doing N*H steps of the same batch, measured side by side, median of the repeats.
Memory: peak of a simulated run with 1, 2, 4, ... N workers, each in a fresh process (CUDA: max allocated;
CPU: peak resident set); the slope is the memory each extra worker adds. ``--mem-workers`` picks the worker
counts measured (default 1, 2, 4, ... up to N).

``--offload`` sets ``sim.offload`` (launch.simulate.runner): a worker's model, optimizer and algorithm state leave the
accelerator while it waits at a collective and come back when it runs again, so N workers need about the
memory of one; the time ratio then includes those copies. ``--offload-outer`` sets ``algo.offload_outer`` too
(DiLoCo's global parameters and outer momentum stay on the CPU). The one-worker side never offloads.
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
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _config(args, workers: int, steps: int, algo: str, run_dir: str):
    from launch.config import load_config

    overrides = [f"model.size={args.model}", f"data.seq_len={args.seq_len}", f"run.batch_size={args.batch_size}",
                 f"run.max_steps={steps}", "run.eval_every=0", "eval.tokens=256", "run.checkpoint_every=0",
                 "log.plot=false", "log.progress=off", "data.max_docs=300", f"algo.name={algo}",
                 f"algo.inner_steps={args.inner_steps}", f"sim.workers={workers}", "sim.baseline=none",
                 "optim.warmup_steps=5", f"run.dir={run_dir}", f"run.device={args.device}",
                 "run.checkpoint_final=false"]  # the loops, not a final checkpoint of N workers' state
    if workers and args.offload:
        overrides.append("sim.offload=true")
    if workers and args.offload_outer and algo == "diloco":
        overrides.append("algo.offload_outer=true")
    if args.threads:
        overrides.append(f"run.threads={args.threads}")
    cfg, _ = load_config([], overrides)
    return cfg


def _on_cuda(args) -> bool:
    import torch

    return torch.cuda.is_available() and args.device != "cpu"


def _timed_fit(cfg, data, workers: int, cuda: bool = False) -> tuple[float, int | None]:
    """Seconds in the training loops (excluding data loading): simulated when workers > 0, else one worker;
    and on CUDA the peak memory the run itself allocated (torch.cuda.max_memory_allocated, less what was still
    allocated when it began: an earlier run of this process may hold some), else None."""
    import gc

    import torch

    from launch.simulate.runner import simulate_once
    from launch.loop.trainer import Trainer

    held = 0
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        if held:
            print(f"[simulator] {held / 2**20:.0f} MiB still allocated as this run begins", file=sys.stderr, flush=True)
    start = time.perf_counter()
    if workers:
        simulate_once(cfg, data)
    else:
        Trainer(cfg, data=data).fit()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() - held if cuda else None


def measure_time(args) -> dict:
    import tempfile

    from launch.data.batches import load_data

    data = None
    sim_s, single_s, sim_peak, single_peak = [], [], [], []
    steps = args.workers * args.inner_steps
    cuda = _on_cuda(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.warmup == "light":  # a few one-worker steps warm the device's kernels and caches
            light = _config(args, 1, 3, "ddp", f"{tmp}/light")
            data = load_data(light.data)
            seconds, _ = _timed_fit(light, data, 0, cuda)
            print(f"[simulator] light warm-up (one worker, 3 steps): {seconds:.2f} s", file=sys.stderr, flush=True)
        first = 0 if args.warmup == "pair" else 1  # the pair numbered 0 warms up caches and is not counted
        for rep in range(first, args.repeats + 1):
            sim_cfg = _config(args, args.workers, args.inner_steps, "diloco", f"{tmp}/sim{rep}")
            one_cfg = _config(args, 1, steps, "ddp", f"{tmp}/one{rep}")
            data = data or load_data(sim_cfg.data)
            (a, a_peak), (b, b_peak) = _timed_fit(sim_cfg, data, args.workers, cuda), _timed_fit(one_cfg, data, 0, cuda)
            print(f"[simulator] {'warm-up pair' if not rep else f'pair {rep}/{args.repeats}'}: simulated "
                  f"{a:.2f} s, one worker {b:.2f} s", file=sys.stderr, flush=True)
            if rep:
                sim_s.append(a)
                single_s.append(b)
                if cuda:
                    sim_peak.append(a_peak)
                    single_peak.append(b_peak)
    ratios = [a / b for a, b in zip(sim_s, single_s)]
    return {"sim_s": sim_s, "single_s": single_s, "ratio_median": statistics.median(ratios), "ratios": ratios,
            "sim_peak": max(sim_peak) if sim_peak else None, "single_peak": max(single_peak) if single_peak else None}


def peak_memory_child(args) -> None:
    """Hidden mode: one simulated run, print its peak memory in bytes."""
    import tempfile

    import torch

    from launch.simulate.runner import simulate_once

    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args, args.child_workers, args.inner_steps, "diloco", f"{tmp}/run")
        simulate_once(cfg)
    if _on_cuda(args):
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"peak": peak}))


def model_params(args) -> int:
    """The parameters of ``--model`` at the benchmark's vocabulary and sequence length (built on the meta device)."""
    import torch

    from launch.models.transformer import SIZES, Transformer

    with torch.device("meta"):
        model = Transformer(replace(SIZES[args.model], vocab_size=256, max_seq_len=args.seq_len))
    return sum(p.numel() for p in model.parameters())


def memory_counts(args) -> list[int]:
    """Worker counts whose peak memory is measured: --mem-workers, or 1, 2, 4, ... up to --workers."""
    if args.mem_workers == "none":
        return []
    if args.mem_workers:
        return sorted({int(n) for n in args.mem_workers.split(",") if n.strip()})
    counts, n = [], 1
    while n <= args.workers:
        counts.append(n)
        n *= 2
    return counts


def measure_memory(args) -> list[tuple[int, int]]:
    out = []
    for n in memory_counts(args):
        cmd = [sys.executable, __file__, "--child-workers", str(n), *sys.argv[1:]]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep the caller's
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
        if res.returncode:
            raise SystemExit(res.stderr[-2000:])
        out.append((n, json.loads(res.stdout.strip().splitlines()[-1])["peak"]))
        print(f"[simulator] peak memory with {n} worker(s): {out[-1][1] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    return out


def device_name(device: str) -> str:
    """The device a report names: the GPU's name (``cuda``, ``cuda:N`` or ``auto`` with CUDA), else the CPU's."""
    import torch

    from benchmarks.train_throughput import cpu_model

    if torch.cuda.is_available() and device != "cpu":
        index = torch.device(device).index if device.startswith("cuda") else None
        return torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())
    return f"CPU ({cpu_model()}, {os.cpu_count()} logical cores)"


def offload_text(args) -> str:
    if not (args.offload or args.offload_outer):
        return "none (every worker's state stays on the device)"
    parts = []
    if args.offload:
        parts.append("sim.offload (idle workers' model, optimizer and algorithm state parked on the CPU)")
    if args.offload_outer:
        parts.append("algo.offload_outer (global parameters and outer momentum kept on the CPU)")
    return "; ".join(parts) + "; the one-worker side runs without"


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
    p.add_argument("--offload", action="store_true",
                   help="sim.offload: park idle workers' state off the accelerator (the simulated side only)")
    p.add_argument("--offload-outer", action="store_true",
                   help="algo.offload_outer: DiLoCo's global parameters and outer momentum on the CPU")
    p.add_argument("--mem-workers", default=None,
                   help="comma-separated worker counts for the memory rows, each a fresh process (default: 1, 2, "
                        "4, ... up to --workers; 'none': only the peaks of the timed runs, on CUDA)")
    p.add_argument("--warmup", default="pair", choices=["pair", "light", "none"],
                   help="before the timed pairs: one uncounted pair (default), 3 one-worker steps, or nothing")
    p.add_argument("--out", help="also write the report to this file")
    p.add_argument("--child-workers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mem_workers and args.mem_workers != "none" and (not memory_counts(args) or min(memory_counts(args)) < 1):
        p.error("--mem-workers: positive worker counts, e.g. 1,4, or none")
    if args.child_workers:
        peak_memory_child(args)
        return

    import torch

    t = measure_time(args)
    mem = measure_memory(args)
    slope = (mem[-1][1] - mem[0][1]) / max(1, mem[-1][0] - mem[0][0]) if mem else 0.0
    lines = [
        "# Simulator cost",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- device: {device_name(args.device)}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, threads {torch.get_num_threads()}",
        f"- model {args.model}, batch {args.batch_size} x {args.seq_len}, N={args.workers} workers, H={args.inner_steps}",
        f"- offload: {offload_text(args)}",
        f"- command: python benchmarks/simulator.py {' '.join(sys.argv[1:])}",
        f"- warm-up before the timed pairs: "
        f"{ {'pair': 'one uncounted pair', 'light': '3 one-worker steps', 'none': 'none'}[args.warmup]}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| simulated N workers x H steps (median) | {statistics.median(t['sim_s']):.2f} s |",
        f"| one worker, N*H steps (median) | {statistics.median(t['single_s']):.2f} s |",
        f"| ratio (median of {len(t['ratios'])} side-by-side pairs; "
        f"{'offload copies included' if args.offload or args.offload_outer else 'target <= 1.10'}) | {t['ratio_median']:.3f} "
        f"({', '.join(f'{r:.3f}' for r in t['ratios'])}) |",
    ]
    if t["sim_peak"] is not None:
        extra, params = (t["sim_peak"] - t["single_peak"]) / max(1, args.workers - 1), model_params(args)
        lines += [f"| peak memory of the timed runs, simulated {args.workers} workers (max allocated, less what was "
                  f"allocated before) | {t['sim_peak'] / 2**20:.0f} MiB |",
                  f"| the same, one worker | {t['single_peak'] / 2**20:.0f} MiB |",
                  f"| memory per extra worker, from these two | {extra / 2**20:.0f} MiB = "
                  f"{extra / params:.1f} bytes a parameter ({params / 1e6:.2f}M) |"]
    for n, peak in mem:
        lines.append(f"| peak memory, {n} worker(s) | {peak / 2**20:.0f} MiB |")
    if len(mem) > 1:
        lines.append(f"| memory per extra worker | {slope / 2**20:.1f} MiB |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
