"""Training throughput of the named model sizes: tokens/s, ms/step and peak memory.

Each model runs in a fresh Python process (this script re-invoked with a hidden flag), so the
peak memory of one model never includes another's: on CUDA the peak is
``torch.cuda.max_memory_allocated``, on CPU the peak resident set size (``VmHWM`` in
``/proc/self/status``). A step is what ``launch.loop.trainer.Trainer`` does for DDP on one worker:
forward (bf16 autocast on CUDA unless ``--precision fp32``; ``torch.compile`` of the model with
``--compile on``, the default on CUDA, as ``run.compile``), cross-entropy, backward, then
``diloco.DDP.step``: gradient clipping and AdamW (``launch.loop.build.build_optimizer``; fused on
CUDA and CPU, so the finiteness check and clipping stay on the device, with no host sync), zero_grad. After ``--warmup`` untimed steps,
``--repeats`` windows of ``--steps`` steps each are timed; the table shows the median window.

MFU is counted as the trainer's log counts it (``launch.metrics.mfu.mfu_basis``): 6N+attention FLOPs per
token against the device's datasheet peak at the run's precision (e.g. H100 dense bf16 989 TFLOP/s).
The caption says which; a CPU, or a device the table does not list, gets no MFU column.

    python benchmarks/train_throughput.py                              # tiny and small, auto device
    python benchmarks/train_throughput.py --models tiny --steps 50 --out benchmarks/results/x.md
    python benchmarks/train_throughput.py --steps tiny=20,small=5 --batch-size 8 --seq-len 128
    python benchmarks/train_throughput.py --models 150m,150m+recompute   # activation checkpointing's cost

A size with ``+recompute`` recomputes each block in the backward (``model.activation_checkpointing``); one with
``+muon`` steps with Muon on the hidden matrices and AdamW on the rest (``optim.name: muon``).

    python benchmarks/train_throughput.py --models small,small+muon    # a Muon step against an AdamW step
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
RESULT_MARK = "@@RESULT@@ "


# ---- helpers shared by parent and child -------------------------------------------------------

def proc_status_kib(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmHWM: peak RSS, VmRSS: current RSS); None off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_bytes(n: float | None) -> str:
    from launch.metrics.log import human_bytes

    return "n/a" if n is None else human_bytes(n)


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def parse_steps(text: str, models: list[str]) -> dict[str, int]:
    """'20' -> 20 for every model; 'tiny=20,small=5' -> per model (others: 20); a size's count holds for its
    options too (small=5: small+muon as well) unless they are named themselves."""
    if "=" not in text:
        return {m: int(text) for m in models}
    given = {}
    for part in text.split(","):
        name, value = (x.strip() for x in part.split("=", 1))
        if name not in models and name not in {m.partition("+")[0] for m in models}:
            raise SystemExit(f"--steps: {name!r} is not one of --models {','.join(models)}")
        given[name] = int(value)
    return {m: given.get(m, given.get(m.partition("+")[0], 20)) for m in models}


# ---- child: one model ---------------------------------------------------------------------------

def run_one(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    from launch.config.schema import DataConfig, OptimConfig
    from launch.metrics.mfu import matmul_precision, mfu_basis
    from launch.models.transformer import SIZES, Transformer, count_params
    from diloco import DDP
    from diloco.comm import LocalTransport
    from launch.loop.build import build_optimizer
    from launch.loop.runtime import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    bf16 = args.precision == "bf16" or (args.precision == "auto" and cuda)
    rss_before = proc_status_kib("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        mem_before = torch.cuda.memory_allocated(device)

    torch.manual_seed(args.seed)
    size, _, option = args.child.partition("+")
    margs = replace(SIZES[size], vocab_size=256, max_seq_len=args.seq_len)
    with torch.device(device):  # initialised where it trains: no CPU initialisation and copy of a 1b model
        model = Transformer(margs)
    options = set(option.split("+")) - {""}
    model.recompute_blocks("recompute" in options)
    opt = build_optimizer(model, OptimConfig(name="muon" if "muon" in options else "adamw"), device)
    algo = DDP(model, opt, LocalTransport(), grad_clip=1.0)
    compiled = cuda if args.compile == "auto" else args.compile == "on"
    if compiled:
        model.compile(mode=None if args.compile_mode == "default" else args.compile_mode)
    graphs = compiled and args.compile_mode == "reduce-overhead"
    B, T = args.batch_size, args.seq_len
    mfu = mfu_basis(model, T, device, matmul_precision(device, bf16))

    if args.data == "stdlib":
        from launch.data.batches import Batcher, load_data

        batcher = Batcher(load_data(DataConfig(source="stdlib", max_docs=200, seq_len=T)), T, B, seed=args.seed)

        def batch(step: int):
            x, y = batcher.train_batch(step)
            return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    else:
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        pool = [torch.randint(0, 256, (B, T + 1), generator=gen).to(device) for _ in range(8)]

        def batch(step: int):
            t = pool[step % len(pool)]
            return t[:, :-1], t[:, 1:]

    def train_step(step: int) -> torch.Tensor:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        x, y = batch(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        algo.step()
        algo.zero_grad()
        return loss.detach()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    step = 0
    for _ in range(args.warmup):
        train_step(step)
        step += 1
    sync()
    windows = []
    loss = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step(step)
            step += 1
        sync()
        windows.append(time.perf_counter() - t0)
    final_loss = float(loss) if loss is not None else float("nan")
    profile = profile_steps(train_step, step, sync, cuda, args.profile_steps) if args.profile else None
    if not final_loss == final_loss or final_loss == float("inf"):
        raise RuntimeError(f"{args.child}: non-finite loss {final_loss}")

    tokens = B * T * args.steps
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        peak_kind, baseline = "torch.cuda.max_memory_allocated", mem_before
        name = torch.cuda.get_device_name(device)
    else:
        hwm = proc_status_kib("VmHWM")
        peak = hwm * 1024 if hwm is not None else None
        peak_kind = "peak RSS (VmHWM)"
        baseline = rss_before * 1024 if rss_before is not None else None
        name = cpu_model()
    return {
        "model": args.child, "params": count_params(model), "batch_size": B, "seq_len": T, "steps": args.steps,
        "warmup": args.warmup, "window_s": windows, "tokens_per_s": [tokens / w for w in windows],
        "ms_per_step": [1000 * w / args.steps for w in windows], "peak_bytes": peak, "peak_kind": peak_kind,
        "baseline_bytes": baseline, "final_loss": final_loss, "device": str(device), "device_name": name,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "precision": "bf16 autocast" if bf16 else "fp32", "data": args.data, "compiled": compiled,
        "compile_mode": args.compile_mode if compiled else None,
        "flops_per_token": mfu.flops_per_token, "flop_count": mfu.count(),
        "peak": str(mfu.peak) if mfu.peak is not None else None, "mfu_device": mfu.device,
        "mfu": [mfu.of(tokens / w) for w in windows] if mfu.peak is not None else None,
        "profile": profile,
    }


def profile_steps(train_step, step: int, sync, cuda: bool, n: int) -> dict:
    """``n`` more steps under ``torch.profiler``: the operators that took the most device time (CPU time on a
    CPU), as Markdown rows, and the share of the profiled wall time the device was busy."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for i in range(n):
            train_step(step + i)
        sync()
    wall_us = (time.perf_counter() - t0) * 1e6
    if cuda:  # the kernels themselves: an operator's device time is its kernels' and would count twice
        key = "self_device_time_total"
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        key = "self_cpu_time_total"
        events = list(prof.key_averages())
    events = [e for e in events if getattr(e, key, 0) > 0]
    busy = sum(getattr(e, key) for e in events)
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    rows = []
    for e in events[:25]:
        t = getattr(e, key)
        rows.append(f"| `{e.key[:90]}` | {e.count // n} | {t / n / 1e3:.2f} | {100 * t / busy:.1f}% |")
    return {"steps": n, "wall_ms_per_step": wall_us / n / 1e3, "busy_ms_per_step": busy / n / 1e3,
            "busy_share": busy / wall_us if wall_us else 0.0, "clock": "device" if cuda else "CPU", "rows": rows}


# ---- parent: one subprocess per model, then the table -------------------------------------------

def run_child(model: str, steps: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", model, "--steps", str(steps),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--device", args.device, "--precision", args.precision,
           "--data", args.data, "--seed", str(args.seed), "--compile", args.compile,
           "--compile-mode", args.compile_mode]
    if args.profile:
        cmd += ["--profile", args.profile, "--profile-steps", str(args.profile_steps)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise SystemExit(f"benchmark of {model} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def compile_label(result: dict) -> str:
    if not result.get("compiled"):
        return "eager"
    mode = result.get("compile_mode") or "default"
    return "torch.compile" if mode == "default" else f"torch.compile mode={mode}"


def mfu_caption(result: dict) -> str:
    """Which FLOP count and which peak the MFU column uses, as the trainer's start-up line says it."""
    from launch.metrics.mfu import MFU_RULE

    if result.get("peak") is None:
        return f"MFU: not reported: no datasheet peak for {result.get('mfu_device', result['device'])}"
    return f"MFU: {MFU_RULE} against {result['peak']}"


def render(results: list[dict], args: argparse.Namespace, started: str, load: tuple[float, float]) -> str:
    first = results[0]
    with_mfu = all(r.get("mfu") for r in results)
    lines = [
        "# Training throughput",
        "",
        f"- date: {started}",
        f"- device: {first['device']} ({first['device_name']})",
        f"- torch {first['torch']}, Python {platform.python_version()}, {platform.system()} {platform.release()}",
        f"- torch threads: {first['threads']} (logical CPUs on the machine: {os.cpu_count()})",
        f"- step: forward ({first['precision']}, {compile_label(first)}) "
        f"+ cross-entropy + backward + grad clip + AdamW (diloco.DDP.step); "
        f"data: {'random byte tokens' if args.data == 'random' else 'launch.data.batches stdlib batches'}, vocab 256",
        f"- {args.warmup} warmup steps, then {args.repeats} timed windows per model; "
        f"tokens/s and ms/step are the median window (range in brackets)",
        f"- peak memory: {first['peak_kind']}, each model in its own process "
        f"(in brackets: the part above the process before the model was built)",
        f"- load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}",
        f"- {mfu_caption(first)}",
        "",
        "| model | params | batch x seq | steps/window | tokens/s (median) | ms/step (median) | peak memory |"
        + (" MFU (median) |" if with_mfu else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_mfu else ""),
    ]
    for r in results:
        tps, ms = r["tokens_per_s"], r["ms_per_step"]
        extra = r["peak_bytes"] - r["baseline_bytes"] if r["peak_bytes"] is not None and r["baseline_bytes"] is not None else None
        lines.append(
            f"| {r['model']} | {fmt_params(r['params'])} | {r['batch_size']} x {r['seq_len']} | {r['steps']} "
            f"| {statistics.median(tps):,.0f} [{min(tps):,.0f}-{max(tps):,.0f}] "
            f"| {statistics.median(ms):,.1f} [{min(ms):,.1f}-{max(ms):,.1f}] "
            f"| {fmt_bytes(r['peak_bytes'])} [+{fmt_bytes(extra)}] |"
            + (f" {100 * statistics.median(r['mfu']):.1f}% |" if with_mfu else "")
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,small", help="comma-separated sizes from launch.models.transformer.SIZES")
    p.add_argument("--steps", default="20", help="timed steps per window: N, or per model: tiny=20,small=5")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the first window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per model; the median is reported")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 autocast on CUDA, fp32 on CPU (as the trainer)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--data", default="random", choices=["random", "stdlib"],
                   help="random byte tokens, or real batches from launch.data.batches (stdlib corpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the model (auto: on CUDA, as run.compile)")
    p.add_argument("--compile-mode", default="default", choices=["default", "reduce-overhead", "max-autotune",
                                                                  "max-autotune-no-cudagraphs"],
                   help="torch.compile mode (with --compile on); reduce-overhead replays the step's kernels as CUDA "
                        "graphs")
    p.add_argument("--out", default=None, help="also write the Markdown table to this file")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="after the timed windows, profile --profile-steps more steps per model with torch.profiler "
                        "and write the top operators by device time (CPU time on a CPU) to this Markdown file")
    p.add_argument("--profile-steps", type=int, default=5, help="steps under the profiler (with --profile)")
    p.add_argument("--_child", dest="child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.warmup < 0 or args.repeats < 1 or args.batch_size < 1 or args.seq_len < 2:
        p.error("need --warmup >= 0, --repeats >= 1, --batch-size >= 1, --seq-len >= 2")
    if args.child:
        args.steps = int(args.steps)
        print(RESULT_MARK + json.dumps(run_one(args)), flush=True)
        return 0

    sys.path.insert(0, str(ROOT))
    from launch.models.transformer import SIZES

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m.partition("+")[0] not in SIZES
               or not set(m.split("+")[1:]) <= {"recompute", "muon"}]
    if not models or unknown:
        p.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; sizes: {', '.join(SIZES)}, each "
                f"optionally with +recompute and/or +muon")
    steps = parse_steps(args.steps, models)
    if min(steps.values()) < 1:
        p.error("--steps must be >= 1")

    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = []
    for m in models:
        print(f"[train_throughput] {m}: {args.warmup} warmup + {args.repeats} x {steps[m]} steps ...",
              file=sys.stderr, flush=True)
        r = run_child(m, steps[m], args)
        print(f"[train_throughput] {m}: {statistics.median(r['tokens_per_s']):,.0f} tokens/s", file=sys.stderr, flush=True)
        results.append(r)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = render(results, args, started, (load_before, load_after))
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
    if args.profile:
        write_profile(Path(args.profile), results, started)
    return 0


def write_profile(path: Path, results: list[dict], started: str) -> None:
    lines = ["# Where a training step spends its time (torch.profiler)", "",
             f"- date: {started}; device: {results[0]['device_name']}; torch {results[0]['torch']}",
             "- the steps of `benchmarks/train_throughput.py` (same flags), profiled after the timed windows; "
             "operators by self time on the device (on a CPU: self CPU time), per step", ""]
    for r in results:
        pr = r["profile"]
        lines += [f"## {r['model']} ({r['batch_size']} x {r['seq_len']}, "
                  f"{compile_label(r)}, {r['precision']})", "",
                  f"- {pr['steps']} steps: {pr['wall_ms_per_step']:.1f} ms per step under the profiler, "
                  f"{pr['clock']} busy {pr['busy_ms_per_step']:.1f} ms of it ({100 * pr['busy_share']:.0f}%)", "",
                  "| operator | calls / step | ms / step | share of busy time |", "| --- | ---: | ---: | ---: |",
                  *pr["rows"], ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print(f"[train_throughput] profile -> {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
