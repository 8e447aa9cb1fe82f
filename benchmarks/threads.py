"""``run.threads: auto`` against torch's default and one thread, on idle cores and beside a second process that
keeps every core busy.

Each cell is one ``loco train`` process (``configs/tiny.yaml``, ``--max-steps``, no evaluation or checkpoint); the
figure is its training time (``wall_s`` of summary.json: the steps, not the start-up). The loader is another process
running fp32 matrix products on torch's default threads, as a second training job would. Targets: ``auto`` within
10% of the default when idle, and never 2x slower than one thread when loaded. A second table times one training
step of small models on one thread and on all, which places ``SMALL_MODEL_PARAMS`` (``launch/loop/runtime.py``).

    python benchmarks/threads.py --out benchmarks/results/threads_cpu.md      # about 3 to 5 minutes
    python benchmarks/threads.py --loader 60                                  # only the load, for other benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {"auto": "auto", "torch's default": "", "1 thread": "1"}


def loader(seconds: float) -> None:
    """Keep every core busy with matrix products for ``seconds`` (torch's default threads)."""
    import torch

    a = torch.randn(512, 512)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = torch.tanh(a @ a)


def start_loader(seconds: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen([sys.executable, __file__, "--loader", str(seconds)], env=env)
    time.sleep(2.0)  # its threads are running before the measured run starts
    return proc


def train(threads: str, steps: int, folder: Path, limit: float) -> tuple[float, str]:
    """Training seconds of one ``loco train`` and what its start line says of threads; a run still going after
    ``limit`` seconds is stopped, and its figure is the limit (a lower bound, marked ``>`` in the table)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default: every core
    env.update(PYTHONPATH=str(ROOT), WANDB_SILENT="true")
    sets = ["run.eval_every=0", "run.checkpoint_every=0", "run.checkpoint_final=false", "log.plot=false",
            "log.progress=plain", "data.max_docs=200", "run.device=cpu", f"run.threads={threads}"]
    cmd = [sys.executable, "-m", "launch.cli", "train", "--config", "configs/tiny.yaml", "--max-steps", str(steps),
           "--run-dir", str(folder), *[a for s in sets for a in ("--set", s)]]
    start = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return -(time.monotonic() - start), ""
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    note = re.search(r"params on cpu \((\d+ threads?: .*?)\); algorithm", res.stderr)
    return json.loads((folder / "summary.json").read_text())["wall_s"], note.group(1) if note else ""


def _s(seconds: float) -> str:
    """A run's seconds; a stopped run's (negative) as a lower bound."""
    return f"> {-seconds:.1f}" if seconds < 0 else f"{seconds:.1f}"


def step_times(dims: list[int], threads: int, steps: int = 8) -> dict[int, tuple[int, float, float]]:
    """dim -> (parameters, fastest step on one thread, fastest on ``threads``), a tiny-shaped model of 2 layers."""
    from dataclasses import replace

    import torch
    import torch.nn.functional as F

    from launch.models.transformer import SIZES, Transformer

    out = {}
    for dim in dims:
        best = {}
        for n in (1, threads, 1, threads):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            model = Transformer(replace(SIZES["tiny"], dim=dim, n_layers=2, n_heads=max(2, dim // 32), vocab_size=256,
                                        max_seq_len=128))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randint(0, 256, (16, 128))
            for s in range(steps):
                t = time.perf_counter()
                F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
                if s:
                    best[n] = min(best.get(n, 1e9), time.perf_counter() - t)
        out[dim] = (sum(p.numel() for p in model.parameters()), best[1], best[threads])
    torch.set_num_threads(threads)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps of each run")
    p.add_argument("--repeats", type=int, default=3, help="tries of each idle cell (the median is reported)")
    p.add_argument("--limit", type=float, default=60, help="seconds after which a run is stopped (a lower bound)")
    p.add_argument("--dims", default="32,64,128", help="model widths of the step-time table ('' to skip it)")
    p.add_argument("--loader", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args()
    if args.loader is not None:
        loader(args.loader)
        return
    import torch

    cores = len(os.sched_getaffinity(0))
    rows: dict[str, dict[str, tuple[float, str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for load in ("idle", "loaded"):
            before = os.getloadavg()[0]
            proc = start_loader(3600) if load == "loaded" else None
            try:
                tries: dict[str, list[tuple[float, str]]] = {}
                for r in range(args.repeats if load == "idle" else 1):  # the settings alternate, try by try
                    for i, (name, value) in enumerate(SETTINGS.items()):
                        got = train(value, args.steps, Path(tmp) / f"{load}-{i}-{r}", args.limit)
                        tries.setdefault(name, []).append(got)
                        print(f"  {load:6s} {name:16s} {_s(got[0]):>8} s  {got[1]}", flush=True)
                for name, got in tries.items():  # the median try (a stopped run counts as the slowest)
                    rows.setdefault(name, {})[load] = sorted(got, key=lambda t: t[0] if t[0] > 0 else 1e9)[len(got) // 2]
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            rows.setdefault("_load", {})[load] = (before, "")
        dims = [int(d) for d in args.dims.split(",") if d]
        steps = step_times(dims, cores) if dims else {}
    auto, default, one = rows["auto"], rows["torch's default"], rows["1 thread"]
    idle_ratio = abs(auto["idle"][0]) / abs(default["idle"][0])  # a stopped default: auto's ratio is at most this
    loaded_ratio = abs(auto["loaded"][0]) / abs(one["loaded"][0])
    lines = [
        "# `run.threads: auto` against torch's default (CPU)", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.processor() or platform.machine()}, "
        f"{cores} cores this process may use; torch {torch.__version__}, python {platform.python_version()}",
        f"- `python benchmarks/threads.py {' '.join(sys.argv[1:])}`: `loco train --config configs/tiny.yaml "
        f"--max-steps {args.steps}`, training seconds (summary.json `wall_s`; idle: the median of {args.repeats} tries, the settings alternating; `> T`: stopped after T seconds of "
        "wall time, start-up included); loaded: beside a process doing matrix products on torch's default threads",
        f"- 1-minute load average before the idle runs {rows['_load']['idle'][0]:.1f}, before the loaded runs "
        f"{rows['_load']['loaded'][0]:.1f} (above 0: the machine was shared with other jobs, and \"idle\" is "
        "only without the loader)", "",
        "| run.threads | idle s | loaded s | auto chose (idle / loaded) |", "|---|---:|---:|---|"]
    for name in SETTINGS:
        r = rows[name]
        chose = f"{r['idle'][1]} / {r['loaded'][1]}" if name == "auto" else ""
        lines.append(f"| {name} | {_s(r['idle'][0])} | {_s(r['loaded'][0])} | {chose} |")
    lines += ["", f"- idle: auto / default = {idle_ratio:.2f} (target <= 1.10: "
              f"{'met' if idle_ratio <= 1.10 else 'missed'})",
              f"- loaded: auto / one thread = {loaded_ratio:.2f} (target < 2: {'met' if loaded_ratio < 2 else 'missed'})"]
    if steps:
        lines += ["", f"One training step (16 x 128 tokens, 2 layers), fastest of 14, one thread against {cores}:", "",
                  "| dim | parameters | 1 thread ms | all threads ms | 1 thread / all |", "|---:|---:|---:|---:|---:|"]
        for dim, (n, t1, tn) in steps.items():
            lines.append(f"| {dim} | {n:,} | {t1 * 1e3:.1f} | {tn * 1e3:.1f} | {t1 / tn:.2f} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
