"""A simulated swarm on one machine: DDP, DiLoCo and Streaming DiLoCo with uneven workers behind home links.

Every method runs in ``loco simulate``'s engine with the same workers, tokens and seed:
- ``--workers`` workers (default 16) whose speeds are drawn from ``--speed-dist`` (default ``lognormal:0.5``,
  fastest = 1), so every collective waits for the slowest;
- each worker's link replayed from ``--links`` (default the shipped diurnal home uplink, 20-100 Mbit/s);
- virtual compute per step fixed (``--step-time``, default: measured once here), so the methods compare;
- churn (``--churn``, default ``poisson:mtbf=30m,rejoin=5m``): every worker but worker 0 leaves after an up-time
  of mean 30 virtual minutes, losing its round, and comes back after a mean 5 minutes with the run's state;
  ``--churn none`` keeps every worker for the whole run.

Methods: ``ddp``, ``diloco-h50``, ``streaming-h50-p4`` (4 fragments) and ``diloco-time`` (rounds of the median
worker's 50 steps in virtual time, so fast workers do more steps; averages weighted by tokens).

Reported per method: final validation loss and its gap to DDP, bytes sent per worker, virtual wall-clock,
compute utilization (the share of the workers' virtual time in the run spent computing) with the mean split
into compute, waiting for the others, sending and away (churn), leaves and joins, the mean number of members
per round, and the virtual time to reach ``--target`` (default: the worst
final loss of the methods, so every method gets there; interpolated between evaluations). Writes a Markdown
table (``--out``) and a plot beside it (loss against virtual time, and the time split).

    python benchmarks/swarm.py                                     # tiny, 16 workers, 300 steps
    python benchmarks/swarm.py --steps 100 --workers 8 --out /tmp/swarm.md

The churn is drawn per worker from the seed, but when a worker leaves depends on each method's virtual clock,
so the methods see the same rates, not the same events. Under churn every method averages as ``loco join``
peers do (an all-gather of weighted payloads rather than a ring all-reduce), which the bytes include.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import convergence as conv  # noqa: E402

SWARM_METHODS = {
    "ddp": ["algo.name=ddp"],
    "diloco-h50": ["algo.name=diloco", "algo.inner_steps=50"],
    "streaming-h50-p4": ["algo.name=streaming", "algo.inner_steps=50", "algo.fragments=4"],
    # rounds of a fixed virtual length (the median worker's 50 steps): fast workers do more steps, the slowest
    # fewer, and the average is weighted by tokens; sync.time_budget_s is filled in from the step time and speeds
    "diloco-time": ["algo.name=diloco", "algo.inner_steps=50", "sync.mode=time"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed-dist", default="lognormal:0.5", help="sim.speed_dist: lognormal:SIGMA or uniform:LOW")
    p.add_argument("--links", default="configs/links-home-uplink.csv", help="a link trace (sim.links)")
    p.add_argument("--step-time", type=float, default=None,
                   help="virtual compute seconds per step at speed 1 (default: measured once here)")
    p.add_argument("--churn", default="poisson:mtbf=30m,rejoin=5m",
                   help="sim.churn: poisson:mtbf=DURATION,rejoin=DURATION, a trace file, or none")
    p.add_argument("--methods", default=",".join(SWARM_METHODS))
    p.add_argument("--target", type=float, default=None,
                   help="loss whose virtual time to reach is reported (default: the worst final loss)")
    p.add_argument("--evals", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default="benchmarks/results/swarm_cpu.md")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in SWARM_METHODS]
    if unknown or not methods:
        p.error(f"--methods: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SWARM_METHODS)}")
    links = Path(args.links)
    if not links.is_file():
        p.error(f"--links: no such file {links}")

    from launch.config import load_config
    from launch.data.batches import load_data
    from launch.metrics.log import human_bytes
    from diloco.sim.speeds import sample_speeds

    conv.METHODS.update(SWARM_METHODS)
    # what convergence's helpers read; the network comes from the link trace, not from bandwidth/latency
    args.bandwidth, args.latency = "1Gbit", "80ms"
    args.set = [f"sim.speed_dist={args.speed_dist}", f"sim.links={links}"]
    churn = None if args.churn in ("", "none") else args.churn
    if churn:
        args.set.append(f"sim.churn={churn}")
    cfg, _ = load_config([], conv._base(args, args.seed))
    data = load_data(cfg.data)
    step_time = args.step_time or conv.measure_step_time(args, data)
    speeds = sample_speeds(args.speed_dist, args.workers, args.seed)
    print(f"[swarm] {args.workers} workers, speeds {min(speeds):.2f}-{max(speeds):.2f}, step time "
          f"{step_time * 1e3:.1f} ms at speed 1, links {links}", file=sys.stderr, flush=True)

    median_speed = sorted(speeds)[len(speeds) // 2]
    budget = 50 * step_time / median_speed
    args.method_set = {"diloco-time": [f"sync.time_budget_s={budget}"]}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in methods:
            print(f"[swarm] {m} ...", file=sys.stderr, flush=True)
            r = results[m] = conv.run_one(args, m, args.seed, data, step_time, Path(tmp))
            r["summary"] = json.loads((Path(tmp) / f"{m}-seed{args.seed}" / "summary.json").read_text())
            print(f"[swarm] {m}: val {r['val_loss']:.4f}, {r['virtual_s']:.0f} virtual s, "
                  f"{r['real_s']:.0f} s real", file=sys.stderr, flush=True)

    target = args.target if args.target is not None else max(r["val_loss"] for r in results.values())
    ddp = results.get("ddp")
    lines = [
        "# A simulated swarm: uneven workers behind home links", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}, Python "
        f"{platform.python_version()}; device {args.device or 'auto'}",
        f"- model `{args.model}`, {args.workers} workers x batch {args.batch_size} x {args.seq_len}, {args.steps} "
        f"steps, seed {args.seed}, AdamW lr {args.lr} (warmup {args.warmup})",
        f"- worker speeds `{args.speed_dist}` (fastest 1): {min(speeds):.2f} to {max(speeds):.2f}, median "
        f"{sorted(speeds)[len(speeds) // 2]:.2f}; virtual compute {step_time * 1e3:.1f} ms per step at speed 1",
        f"- links: `{links}` replayed per worker over virtual time",
        (f"- churn: `{churn}` (worker 0 stays; a worker that leaves loses its round and comes back with the run's "
         f"state)" if churn else "- churn: none (every worker stays for the whole run)"),
        f"- diloco-time: rounds of {budget:.1f} virtual s (the median worker's 50 steps)",
        f"- `python benchmarks/swarm.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
        f"| method | val loss | vs DDP | tokens | bytes sent / worker | virtual wall | compute util | mean split: "
        f"compute / waiting / sending / away | leaves / joins | members per round | virtual time to loss {target:.4f} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    splits = {}
    for m, r in results.items():
        s = r["summary"]
        wall = s.get("virtual_wall_s") or 0.0
        comp = s.get("virtual_compute_s_per_worker") or []
        wait = s.get("virtual_wait_s_per_worker") or []
        send = s.get("virtual_send_s_per_worker") or []
        away = s.get("virtual_away_s_per_worker") or [0.0] * len(comp)
        n = max(len(comp), 1)
        split = [sum(x) / n / wall if wall else 0.0 for x in (comp, wait, send, away)]
        member = s.get("membership") or {}
        mean_members = member.get("mean_members")
        splits[m] = split
        util = s.get("compute_utilization")
        gap = f"{100 * (r['val_loss'] / ddp['val_loss'] - 1):+.1f}%" if ddp else ""
        reach = conv.time_to_interp(r["curve"], target)
        tokens = s.get("tokens")
        lines.append(f"| {m} | {r['val_loss']:.4f} | {gap} | {'' if tokens is None else f'{tokens / 1e6:.2f}M'} | "
                     f"{human_bytes(r['bytes'])} | {wall:,.0f} s | "
                     f"{'' if util is None else f'{100 * util:.1f}%'} | "
                     f"{' / '.join(f'{100 * x:.1f}%' for x in split)} | "
                     f"{sum(s.get('leaves_per_worker') or [0])} / {sum(s.get('joins_per_worker') or [0])} | "
                     f"{'' if mean_members is None else f'{mean_members:.1f} of {args.workers}'} | "
                     f"{'not reached' if reach is None else f'{reach:,.0f} s'} |")
    lines += ["", "Compute utilization counts every worker's virtual time in the run (time away excluded), the slow "
              "ones' too: a worker at speed "
              "0.4 computes for 2.5x as long per step, and the others wait for it at every collective. "
              "With `sync.mode=time` the workers do different numbers of steps, so its token count differs from "
              "the others' (the tokens column says by how much)."]
    if churn:
        lines += ["", "Under churn the workers average the way `loco join` peers do, since the members change: every "
                  "worker receives every member's payload with its weight (an all-gather) and takes a validated mean, "
                  "where a fixed group runs a ring all-reduce. The bytes and the sending time include that, in "
                  "every method and even in rounds where nobody left; compare with `--churn none` for the fixed "
                  "group."]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(results, splits, target, png)
    lines += ["", f"Plot: `{png.name}` (validation loss against virtual time; each method's mean time split)."]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    print(text)
    return 0


def plot(results: dict, splits: dict, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for m, r in results.items():
        xs = [v / 3600 for _, _, v, _ in r["curve"]]
        ax.plot(xs, [loss for *_, loss in r["curve"]], marker="o", ms=3, label=m)
    ax.axhline(target, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("virtual hours")
    ax.set_ylabel("validation loss")
    ax.set_title("loss against virtual time")
    ax.legend()
    names = list(splits)
    bottom = [0.0] * len(names)
    parts = ("compute", "waiting", "sending", "away")
    for i, (part, color) in enumerate(zip(parts, ("tab:green", "tab:orange", "tab:red", "tab:gray"))):
        vals = [100 * splits[m][i] for m in names]
        bx.bar(names, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_ylabel("% of a worker's virtual time (mean)")
    bx.set_title("where the time went")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
