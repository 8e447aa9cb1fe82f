"""Loss against bytes: DDP, DiLoCo at several H, Streaming DiLoCo and one worker, side by side.

    python benchmarks/convergence.py                                  # tiny, 4 workers, 1200 steps, seeds 0,1,2
    python benchmarks/convergence.py --steps 300 --seeds 0 --methods ddp,diloco-h50
    python benchmarks/convergence.py --steps 600 --seeds 0 --methods ddp,diloco-h50,diloco-h50-int8,diloco-h50-topk2
    python benchmarks/convergence.py --model small --out benchmarks/results/convergence_gpu.md   # on a GPU

On a machine with few cores, seeds can run side by side (``OMP_NUM_THREADS=1``, one invocation per seed,
each with its own ``--out``) and be put together afterwards; runs of different settings are refused::

    python benchmarks/convergence.py --seeds 0 --report-only --out a.md --merge b.json --merge c.json

Every multi-worker method runs in the simulator with the same workers, per-worker batch, steps and seeds,
so all see the same tokens (``single`` is one of those workers alone: the same steps on 1/M of the tokens,
as in the DiLoCo paper's baseline). Every run is scored on the same ``--eval-tokens`` of windows spread over
the whole validation split (``eval.tokens``), so two runs of one seed compare window by window. Reported per
method: the median final validation loss over seeds with its standard error, its gap to DDP (in percent of
the median, and paired over the same windows seed by seed: ``benchmarks/paired.py``), bytes sent per worker
and DDP's bytes over them, the peak bytes of one exchange, and, with the network model (default 1 Gbit/s,
80 ms), the virtual wall-clock of the whole run, to reach DDP's final loss (the first evaluation at or below
it) and to reach DiLoCo's final loss (``--diloco-ref``, by default ``diloco-h50`` when it ran; interpolated
linearly between the two evaluations around the crossing; "not reached" when no evaluation gets there).
Virtual compute per step is fixed (``--step-time``, default: measured once here) so timings of all methods
compare. Writes a Markdown table (``--out``), a plot of validation loss vs tokens and vs bytes, and
the runs as JSON beside the table (what ``--merge`` and ``--report-only`` read, with each run's per-window
losses). ``--keep DIR`` keeps the run folders, final checkpoints included, to be scored again later.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.paired import gap_cell, loss_cell, validation_line, window_fields  # noqa: E402

DILOCO_GRID = (("0.5", "0.9"), ("0.7", "0.9"), ("1.0", "0.9"), ("0.5", "0.5"), ("0.7", "0.5"))
METHODS = {
    "single": ["algo.name=ddp", "sim.workers=1"],
    "ddp": ["algo.name=ddp"],
    "diloco-h10": ["algo.name=diloco", "algo.inner_steps=10"],
    "diloco-h15": ["algo.name=diloco", "algo.inner_steps=15"],
    # the DiLoCo side of SparseLoCo's published comparison: outer lr 0.5, 0.7 or 1.0 with Nesterov momentum 0.9
    # or 0.5; its sixth point, lr 1.0 with momentum 0.5, is diloco-h15 at the defaults of --outer-lr and
    # --outer-momentum
    **{f"diloco-h15-lr{lr}-m{m}": ["algo.name=diloco", "algo.inner_steps=15", f"algo.outer_lr={lr}",
                                   f"algo.outer_momentum={m}", "algo.nesterov=true"] for lr, m in DILOCO_GRID},
    "diloco-h50": ["algo.name=diloco", "algo.inner_steps=50"],
    "diloco-h100": ["algo.name=diloco", "algo.inner_steps=100"],
    "streaming-h50-p4": ["algo.name=streaming", "algo.inner_steps=50", "algo.fragments=4"],
    # the same with each exchange hidden behind 5 inner steps, merged with alpha 0.5 as published
    "streaming-h50-p4-tau5": ["algo.name=streaming", "algo.inner_steps=50", "algo.fragments=4",
                              "algo.overlap_steps=5", "algo.mix_alpha=0.5"],
    # DiLoCo H=50 with a lossy codec on the pseudo-gradients (error feedback for top-k)
    "diloco-h50-int8": ["algo.name=diloco", "algo.inner_steps=50", "compress.codec=int8"],
    "diloco-h50-fp4": ["algo.name=diloco", "algo.inner_steps=50", "compress.codec=fp4+zstd"],
    "diloco-h50-topk2": ["algo.name=diloco", "algo.inner_steps=50", "compress.codec=topk:0.02+2bit+zstd"],
    # SparseLoCo: the top 1, 2 or 3% of each chunk of 4096 values of an error-feedback buffer (decay 0.95) at
    # 2 bits a value, gathered exactly; the global step is alpha times their mean over all workers, no momentum.
    # alpha 4 did best on tiny with that mean (benchmarks/results/sparseloco_cpu.md)
    **{f"sparseloco-h50-d{d}": ["algo.name=sparseloco", "algo.inner_steps=50", f"algo.topk_density=0.0{d}",
                                "algo.outer_lr=4", "algo.aggregate=all"] for d in (1, 2, 3)},
    # SparseLoCo as published: rounds of 15 steps, k = 32, 64 or 128 of each chunk of 4096 (0.78, 1.56, 3.1%),
    # each position's mean over the workers that sent it, alpha 1
    **{f"sparseloco-h15-d{pct}": ["algo.name=sparseloco", "algo.inner_steps=15", f"algo.topk_density={k / 4096}",
                                  "algo.outer_lr=1", "algo.aggregate=senders"]
       for pct, k in (("0.78", 32), ("1.56", 64), ("3.1", 128))},
    # the same at 1.56% with the mean over all workers: what the published mean over senders changes
    "sparseloco-h15-d1.56-all": ["algo.name=sparseloco", "algo.inner_steps=15", "algo.topk_density=0.015625",
                                 "algo.outer_lr=1", "algo.aggregate=all"],
    # the same in chunks of 4096 consecutive values of the flat pseudo-gradient instead of 64 x 64 tiles
    "sparseloco-h15-d1.56-flat": ["algo.name=sparseloco", "algo.inner_steps=15", "algo.topk_density=0.015625",
                                  "algo.outer_lr=1", "algo.aggregate=senders", "algo.chunking=flat"],
    # and with the published values (stat2: four bins of 1.5 standard deviations, each its values' mean)
    "sparseloco-h15-d1.56-stat2": ["algo.name=sparseloco", "algo.inner_steps=15", "algo.topk_density=0.015625",
                                   "algo.outer_lr=1", "algo.aggregate=senders", "algo.value_format=stat2"],
    # MuLoCo: Muon (optim.muon_lr) on the hidden matrices, AdamW (--lr) on the rest, as the inner optimizer of DDP
    # and of DiLoCo H=50, in fp32 and with the two lossy codecs above
    "ddp-muon": ["algo.name=ddp", "optim.name=muon"],
    "muloco-h50": ["algo.name=diloco", "algo.inner_steps=50", "optim.name=muon"],
    "muloco-h50-int8": ["algo.name=diloco", "algo.inner_steps=50", "optim.name=muon", "compress.codec=int8"],
    "muloco-h50-topk2": ["algo.name=diloco", "algo.inner_steps=50", "optim.name=muon",
                         "compress.codec=topk:0.02+2bit+zstd"],
    # Muon inside SparseLoCo as published (H=15, 1.56%, mean over senders): 2-bit top-k with error feedback
    "muloco-sparseloco-h15-d1.56": ["algo.name=sparseloco", "algo.inner_steps=15", "algo.topk_density=0.015625",
                                    "algo.outer_lr=1", "algo.aggregate=senders", "optim.name=muon"],
    # DeMo (its lr is set by benchmarks/demo.py --demo-lr through --set-like overrides)
    "demo-k32": ["algo.name=demo", "algo.compression_topk=32"],
    "demo-k8": ["algo.name=demo", "algo.compression_topk=8"],
}
# run only when named: the codec, SparseLoCo, DeMo and Muon studies each have their own results file
NAMED_ONLY = ("diloco-h50-int8", "diloco-h50-fp4", "diloco-h50-topk2", "sparseloco-h50-d1", "sparseloco-h50-d2",
              "sparseloco-h50-d3", "sparseloco-h15-d0.78", "sparseloco-h15-d1.56", "sparseloco-h15-d3.1",
              "sparseloco-h15-d1.56-all", "sparseloco-h15-d1.56-stat2", "sparseloco-h15-d1.56-flat", "diloco-h15",
              *(f"diloco-h15-lr{lr}-m{m}" for lr, m in DILOCO_GRID),
              "demo-k32", "demo-k8",
              "ddp-muon", "muloco-h50", "muloco-h50-int8", "muloco-h50-topk2", "muloco-sparseloco-h15-d1.56")


def measure_step_time(args, data) -> float:
    """Median seconds of one training step of one worker on this device."""
    from launch.config import load_config
    from launch.loop.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg, _ = load_config([], _base(args, 0) + list(args.set) + ["run.max_steps=25", "run.eval_every=0",
                                                                    "eval.tokens=128", f"run.dir={tmp}",
                                                                    "run.checkpoint_final=false"])
        trainer = Trainer(cfg, data=data)
        times = []
        trainer.transport.advance_compute = times.append  # the loop reports each step's compute time here
        # on a GPU: CUDA events around the compute, as the simulator's
        trainer.transport.caps = replace(trainer.transport.caps, measures_compute=True)
        trainer.fit()
    return statistics.median(t if isinstance(t, float) else t.seconds() for t in times[5:])


def _base(args, seed: int) -> list[str]:
    return [f"model.size={args.model}", f"data.seq_len={args.seq_len}", f"run.batch_size={args.batch_size}",
            f"run.max_steps={args.steps}", f"run.seed={seed}", f"run.eval_every={max(1, args.steps // args.evals)}",
            f"eval.tokens={args.eval_tokens}", "run.checkpoint_every=0",
            # a kept run keeps its final checkpoint, to be scored again later; a throwaway one writes none
            f"run.checkpoint_final={'true' if getattr(args, 'keep', None) else 'false'}",
            "log.plot=false", "log.progress=off",
            f"log.every={max(1, args.steps // args.evals)}", f"sim.workers={args.workers}", "sim.baseline=none",
            f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}", "optim.weight_decay=0.05",
            f"sim.bandwidth={args.bandwidth}", f"sim.latency={args.latency}"] + \
        ([f"algo.outer_lr={args.outer_lr}", f"algo.outer_momentum={args.outer_momentum}"]
         if hasattr(args, "outer_lr") else []) + \
        ([f"run.device={args.device}"] if args.device else [])


def run_one(args, method: str, seed: int, data, step_time: float, out_dir: Path) -> dict[str, Any]:
    from launch.config import load_config
    from launch.metrics.log import read_metrics
    from launch.simulate.runner import simulate_once

    run_dir = run_folder(out_dir, method, seed)
    extra = list(getattr(args, "method_set", {}).get(method, []))
    cfg, _ = load_config([], _base(args, seed) + METHODS[method] + [f"sim.step_time={step_time}",
                                                                      f"run.dir={run_dir}"] + args.set + extra)
    start = time.perf_counter()
    summary = simulate_once(cfg, data)
    records = read_metrics(run_dir)
    curve = [(r["tokens"], r.get("bytes_sent", 0), r.get("virtual_s", 0.0), r["val_loss"])
             for r in records if r.get("val_loss") is not None]
    # an algorithm's own figures, from the last line that has them (SparseLoCo: senders per position, share sent)
    figures = next(({k: r[k] for k in ("senders_per_position", "sent_share") if r.get(k) is not None}
                    for r in reversed(records) if r.get("sent_share") is not None), {})
    return {"method": method, "seed": seed, "val_loss": summary["val_loss"], "val_bpb": summary.get("val_bpb"),
            "val_loss_se": summary.get("val_loss_se"), "val_bpb_se": summary.get("val_bpb_se"),
            **window_fields(run_dir), "figures": figures,
            "bytes": summary["bytes_sent"],
            "peak": summary.get("peak_bytes_per_exchange", 0), "virtual_s": summary.get("virtual_wall_s", 0.0),
            "curve": curve, "real_s": time.perf_counter() - start}


def run_folder(out_dir: Path, method: str, seed: int) -> Path:
    return out_dir / f"{method}-seed{seed}"


def check_keep(keep: Optional[str], methods: list[str], seeds: list[int]) -> None:
    """Refuse a --keep folder that already holds one of the runs asked for (a run folder is never written twice)."""
    if not keep:
        return
    taken = [str(d) for d in (run_folder(Path(keep), m, s) for s in seeds for m in methods) if d.exists()]
    if taken:
        raise SystemExit(f"--keep {keep}: {taken[0]} already exists" + (f" (and {len(taken) - 1} more)" if
                                                                           len(taken) > 1 else "") +
                         "; keep these runs elsewhere or move it aside")


def time_to(curve: list, target: float) -> Optional[float]:
    return next((v for _, _, v, loss in curve if loss <= target), None)


def time_to_interp(curve: list, target: float) -> Optional[float]:
    """Virtual seconds at which the validation loss first reaches ``target``, linear between evaluations.

    Before the first evaluation nothing is known, so a curve already at or below the target there gives the
    first evaluation's time; None when no evaluation gets there.
    """
    prev = None
    for _, _, v, loss in curve:
        if loss <= target:
            if prev is None or prev[1] <= loss:
                return v
            v0, l0 = prev
            return v0 + (l0 - target) / (l0 - loss) * (v - v0)
        prev = (v, loss)
    return None


def diloco_ref(args, methods: list[str]) -> Optional[str]:
    """The DiLoCo run whose final loss the 'virtual time to DiLoCo's loss' column aims at."""
    want = getattr(args, "diloco_ref", None) or "diloco-h50"
    if want in methods:
        return want
    plain = [m for m in methods if m.startswith("diloco-h") and m[len("diloco-h"):].isdigit()]
    return plain[0] if plain else None


def median_time_to(rs: list[dict], target: Optional[float], fn) -> str:
    """Median over seeds of ``fn(curve, target)``, a seed that never gets there counting as infinitely late."""
    if target is None:
        return ""
    reach = [fn(r["curve"], target) for r in rs]
    mid = statistics.median_high([float("inf") if t is None else t for t in reach]) if reach else float("inf")
    return f"{mid:.1f} s" if mid < float("inf") else "not reached"


def report(args, results: list[dict], step_time: float, device: str, settings: dict[str, Any]) -> str:
    from launch.metrics.log import human_bytes

    methods = [m for m in args.methods if any(r["method"] == m for r in results)]
    by = {m: sorted((r for r in results if r["method"] == m), key=lambda r: r["seed"]) for m in methods}
    med = {m: statistics.median(r["val_loss"] for r in by[m]) for m in methods}
    ddp = med.get("ddp")
    ddp_bytes = statistics.median(r["bytes"] for r in by["ddp"]) if "ddp" in by else None
    ref = diloco_ref(args, methods)
    ref_loss = med[ref] if ref else None
    import torch

    lines = [
        "# Convergence: loss against bytes",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; device: {device}; torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- model {args.model}, {args.workers} workers x batch {args.batch_size} x {args.seq_len} tokens, {args.steps} inner "
        f"steps per worker, seeds {','.join(map(str, args.seeds))}; inner AdamW lr {args.lr}, warmup {args.warmup}, cosine; "
        f"outer SGD lr {args.outer_lr}, Nesterov momentum {args.outer_momentum}",
        f"- network model: {args.bandwidth}, {args.latency} per worker; virtual compute {step_time * 1e3:.1f} ms/step",
        f"- command: python benchmarks/convergence.py {' '.join(sys.argv[1:])}",
        validation_line(settings, results),
    ]
    if ref:
        lines.append(f"- virtual time to {ref}'s loss: when the validation loss first reaches {ref}'s final median "
                     f"loss {ref_loss:.4f}, interpolated linearly between evaluations (to DDP's loss: the first "
                     f"evaluation at or below it); median over seeds")
    lines.append("- real s: the run's own wall-clock on this machine (its trainers built, every step, every "
                 "evaluation), median over seeds; real / DDP's: against DDP's on the same steps")
    lines += [
        "",
        "| method | val loss (median) | val bpb (median) | seeds | vs DDP | gap to DDP, paired | bytes sent / worker | "
        "DDP bytes / these | peak bytes / exchange | virtual wall | virtual time to DDP's loss |" +
        (f" virtual time to {ref}'s loss |" if ref else "") + " real s (median) | real / DDP's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if ref else "") + " --- | --- |",
    ]
    real = {m: statistics.median(r.get("real_s", math.nan) for r in by[m]) for m in methods}
    for m in methods:
        rs = by[m]
        b = statistics.median(r["bytes"] for r in rs)
        seeds = ", ".join(f"{r['val_loss']:.3f}" for r in rs)
        gap = "" if ddp is None else f"{100 * (med[m] / ddp - 1):+.1f}%"
        paired = gap_cell(rs, by["ddp"]) if "ddp" in by and m != "ddp" else ""
        fewer = f"{ddp_bytes / b:.0f}x" if ddp_bytes and b else ""
        peak = human_bytes(statistics.median(r["peak"] for r in rs))
        wall = statistics.median(r["virtual_s"] for r in rs)
        # median over seeds, a seed that never got there counting as infinitely late
        to_ddp = median_time_to(rs, ddp, time_to) if ddp is not None else "not reached"
        to_ref = f" {median_time_to(rs, ref_loss, time_to_interp)} |" if ref else ""
        slower = f"{real[m] / real['ddp']:.2f}x" if "ddp" in real and real["ddp"] > 0 else ""
        lines.append(f"| {m} | {loss_cell(rs)} | {loss_cell(rs, 'val_bpb')} | {seeds} | {gap} | {paired} | "
                     f"{human_bytes(b)} | {fewer} | {peak} | {wall:.1f} s | {to_ddp} |{to_ref} {real[m]:.1f} | {slower} |")
    own = [m for m in methods if any(r.get("figures") for r in by[m])]
    if own:
        lines += ["", "SparseLoCo's figures at the end of the run (median over seeds): the mean number of workers that "
                  "sent a position in the last round, and the share of positions whose mean moved at least once.", "",
                  "| method | senders per sent position | positions moved so far |", "| --- | --- | --- |"]
        for m in own:
            per = [r["figures"]["senders_per_position"] for r in by[m] if "senders_per_position" in r["figures"]]
            share = [r["figures"]["sent_share"] for r in by[m] if "sent_share" in r["figures"]]
            lines.append(f"| {m} | {f'{statistics.median(per):.2f}' if per else 'n/a'} | "
                         f"{f'{100 * statistics.median(share):.1f}%' if share else 'n/a'} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], methods: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from launch.metrics.log import human_bytes

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for m in methods:
        rs = [r for r in results if r["method"] == m]
        if not rs:
            continue
        r = sorted(rs, key=lambda r: r["val_loss"])[len(rs) // 2]  # the median seed's curve
        tok, byt, _, loss = zip(*r["curve"])
        line, = ax_t.plot(tok, loss, "o-", ms=3, label=m)
        pts = [(b, l) for b, l in zip(byt, loss) if b > 0]
        if pts:
            ax_b.plot(*zip(*pts), "o-", ms=3, color=line.get_color(), label=m)
    ax_t.set_xlabel("tokens trained (all workers)")
    ax_b.set_xlabel("bytes sent per worker")
    ax_b.set_xscale("log")
    ax_b.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_bytes(x)))
    ax_b.xaxis.set_minor_formatter(NullFormatter())
    for ax in (ax_t, ax_b):
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("validation loss vs tokens and vs bytes communicated (median seed)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default=",".join(m for m in METHODS if m not in NAMED_ONLY),
                   help=f"comma-separated, from: {', '.join(METHODS)} (default: all but the studies run only when named)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--outer-lr", type=float, default=1.0, help="outer SGD lr of DiLoCo and Streaming DiLoCo")
    p.add_argument("--outer-momentum", type=float, default=0.5, help="outer Nesterov momentum")
    p.add_argument("--evals", type=int, default=12, help="validation points per run")
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS,
                   help=f"validation tokens (eval.tokens), windows spread over the whole split (default {EVAL_TOKENS})")
    p.add_argument("--bandwidth", default="1Gbit")
    p.add_argument("--latency", default="80ms")
    p.add_argument("--step-time", type=float, help="virtual compute seconds per step (default: measured)")
    p.add_argument("--device", default=None)
    p.add_argument("--set", action="append", default=[], help="extra config override for every run")
    p.add_argument("--out", default="benchmarks/results/convergence_cpu.md")
    p.add_argument("--keep", "--keep-runs", dest="keep", metavar="DIR",
                   help="keep the run folders, final checkpoints included, under DIR (default: a temporary folder)")
    p.add_argument("--diloco-ref", default="diloco-h50",
                   help="the method whose final loss the last column aims at (default diloco-h50; if it did not "
                        "run: the first diloco-hN that did)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table and plot from the .json that an earlier (maybe interrupted) run saved")
    p.add_argument("--merge", action="append", default=[], metavar="JSON",
                   help="add the runs another invocation saved (same settings; e.g. seeds run in parallel)")
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")

    from launch.config import load_config
    from launch.data.batches import load_data
    from benchmarks.simulator import device_name

    device = device_name(args.device or "auto")
    saved = Path(args.out).with_suffix(".json")
    merged = [_load_runs(Path(f), _settings(args)) for f in args.merge]
    if args.report_only:
        state = _load_runs(saved, _settings(args))
        results, step_time = _combine([state] + merged)
        args.seeds = sorted({r["seed"] for r in results})
        settings = state.get("settings") or _settings(args)  # what the saved runs used, older files' included
        if merged:
            _save(saved, settings, step_time, results)
        _write(args, results, step_time, device, settings)
        return
    check_keep(args.keep, args.methods, args.seeds)
    cfg, _ = load_config([], _base(args, 0) + args.set)
    data = load_data(cfg.data)
    step_time = args.step_time or (merged[0]["step_time"] if merged else measure_step_time(args, data))
    settings, results = _settings(args), []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.keep or tmp)
        for seed in args.seeds:
            for m in args.methods:
                r = run_one(args, m, seed, data, step_time, out_dir)
                results.append(r)
                print(f"[convergence] {m} seed {seed}: val {r['val_loss']:.4f}, sent {r['bytes']:,} B, "
                      f"{r['real_s']:.0f}s", file=sys.stderr, flush=True)
                _save(saved, settings, step_time, results)  # survives Ctrl-C
    if merged:
        results, step_time = _combine([{"step_time": step_time, "settings": settings, "results": results}] + merged)
        args.seeds = sorted({r["seed"] for r in results})
        _save(saved, settings, step_time, results)
    _write(args, results, step_time, device, settings)


# twice a run's default for a smaller error, while every simulated worker's 12 evaluations stay under a tenth of
# a run's time on a CPU (65,536 tokens took about 15% of a 1,200-step run of tiny)
EVAL_TOKENS = 32768
SETTINGS = ("model", "workers", "steps", "batch_size", "seq_len", "lr", "warmup", "eval_tokens", "bandwidth", "latency")
OUTER_SETTINGS = ("outer_lr", "outer_momentum")


def _settings(args) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SETTINGS + OUTER_SETTINGS}


def _save(path: Path, settings: dict[str, Any], step_time: float, results: list[dict]) -> None:
    path.write_text(json.dumps({"step_time": step_time, "settings": settings, "results": results}) + "\n")


def _load_runs(path: Path, mine: dict[str, Any], script: str = "benchmarks/convergence.py") -> dict[str, Any]:
    """A saved .json, checked against this invocation's settings ``mine`` (runs of other settings do not mix)."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (a .json that {script} saved)")
    state = json.loads(path.read_text())
    theirs = state.get("settings", {})
    for key, value in theirs.items():
        if key in mine and value != mine[key]:
            outer_only = key in OUTER_SETTINGS
            if outer_only and all(r["method"] in ("ddp", "single") for r in state["results"]):
                continue  # the outer optimizer does not exist in DDP or single-worker runs
            flag = ",".join(map(str, value)) if isinstance(value, list) else value
            raise SystemExit(f"{path}: its runs used {key}={value}, this invocation {key}={mine[key]}; "
                             f"pass --{key.replace('_', '-')} {flag} or leave the file out")
    return state


def _combine(states: list[dict[str, Any]]) -> tuple[list[dict], float]:
    """All runs of several saved states; a (method, seed) run twice keeps the first one given. Runs scored on
    different validations (an older file's first batches of the split against eval.tokens) do not mix."""
    scored = {json.dumps([s.get("settings", {}).get(k) for k in ("eval_tokens", "eval_batches")]) for s in states}
    if len(scored) > 1:
        raise SystemExit("the runs were scored on different validations (eval.tokens, or an older file's first "
                         "batches of the split); merge only runs scored alike")
    step_times = {round(s["step_time"], 6) for s in states}
    if len(step_times) > 1:
        raise SystemExit(f"the runs were timed with different virtual step times {sorted(step_times)}; "
                         f"rerun them with the same --step-time")
    seen, results = set(), []
    for s in states:
        for r in s["results"]:
            if (r["method"], r["seed"]) not in seen:
                seen.add((r["method"], r["seed"]))
                results.append(r)
    return results, states[0]["step_time"]


def _write(args, results: list[dict], step_time: float, device: str, settings: dict[str, Any]) -> None:
    text = report(args, results, step_time, device, settings)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    plot(results, args.methods, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
