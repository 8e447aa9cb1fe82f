"""What ``loco simulate`` prints at the end: a row per run, then against the DDP baseline the bytes, time and loss
at equal tokens and the loss at equal virtual time, the step time and where it came from, churn, and where each
worker's virtual time went."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from diloco.sim import NetworkModel
from launch.config.algorithms import algorithm_class
from launch.config import Config
from launch.eval.validation import run_gap
from launch.metrics.log import format_seconds, human_bytes, read_metrics


def run_label(cfg: Config) -> str:
    a, w = cfg.algo, cfg.sim.workers
    algo = algorithm_class(a.name)
    codec = "" if cfg.compress.codec == "fp32" else f" {cfg.compress.codec}"
    if not algo.round_based:
        return f"{a.name} x{w}{codec}"
    extra = f", P={a.fragments}" if algo.fragmented else ""
    return f"{a.name} x{w} (H={a.inner_steps}{extra}){codec}"


EVAL_COST = 1 / 3  # a validation token's forward pass against a training token's forward and backward (two more)


def evaluations(run: Any, after: int = 0) -> int:
    """The validations a run of ``run.max_steps`` makes after step ``after``: one every ``run.eval_every`` steps,
    and the final one."""
    every, steps = run.eval_every, run.max_steps
    return (steps // every - after // every if every and steps else 0) + 1


def baseline_line(cfg: Config, base: Config, run: dict[str, Any]) -> str:
    """``[simulate] baseline: DDP with 4 workers on the same tokens and 21 evaluations; about 2m10s at the pace of
    the run above (4.2k tokens/s)``: the baseline trains the run's tokens (what a resumed one has logged already is
    done) and evaluates more often than the run (``cfg``); every simulated worker scores ``eval.tokens``, and the
    run's time is cut into its training and its evaluations by :data:`EVAL_COST`."""
    done = 0
    if base.run.resume and base.run.max_steps:
        try:
            done = max((r.get("step", 0) for r in read_metrics(base.run.dir)), default=0)
        except FileNotFoundError:  # it had not started
            pass
    evals = evaluations(base.run, done)
    line = f"[simulate] baseline: DDP with {base.sim.workers} workers on the same tokens and {evals} evaluations"
    wall, tokens = run.get("wall_s"), run.get("tokens")
    if not wall or not tokens:
        return line
    per_eval = cfg.eval.tokens * cfg.sim.workers * EVAL_COST  # in training tokens' worth of compute
    pace = wall / (tokens + evaluations(cfg.run) * per_eval)
    left = tokens * max(0.0, 1 - done / base.run.max_steps) if base.run.max_steps else tokens
    return (f"{line}; about {format_seconds(pace * (left + evals * per_eval))} at the pace of the run above "
            f"({tokens / wall / 1e3:.1f}k tokens/s)")


# a measured step time whose eighths' medians differ by more than this moved with the host's load
DRIFT = 1.5


def _step_time_line(summary: dict[str, Any], note: Optional[str] = None) -> list[str]:
    """How long a step takes in virtual time, and why: ``virtual compute: 0.0213 s per step at speed 1 (...)``;
    ``note``: what a fixed step time stands for. A measured step time that moved during the run adds a line: the
    virtual times then carry the host's load."""
    step = summary.get("virtual_step_time_s")
    if not step:
        return []
    if summary.get("virtual_step_time_source") == "sim.step_time":
        why = f"fixed: {note}; set yours with --step-time" if note else "fixed: sim.step_time, or --step-time"
        return [f"virtual compute: {step:.4g} s per step at speed 1 ({why})"]
    lines = [f"virtual compute: {step:.4g} s per step at speed 1 (the median of {summary.get('measured_steps', 0)} "
             f"measured steps; fix it with --step-time)"]
    spread = summary.get("measured_step_time_range_s")
    if spread and spread[0] > 0 and spread[1] / spread[0] > DRIFT:
        lines.append(f"the measured step time moved during the run ({spread[0]:.3g} s to {spread[1]:.3g} s, medians "
                     f"of eighths of it): this machine was busy, and the virtual times carry its load; for results "
                     f"that do not depend on it, run again with --step-time {spread[0]:.3g}")
    return lines


def _seconds(t: Optional[float]) -> str:
    return "not reached" if t is None else f"{t:.1f}s"


def format_table(rows: list[tuple[str, dict[str, Any]]], network: NetworkModel,
                 step_note: Optional[str] = None) -> str:
    """The comparison printed at the end of ``loco simulate``: one row per run, then (against the DDP baseline)
    bytes, time and loss at equal tokens, and the loss at equal virtual time (``equal_time`` in the run's
    summary, from :func:`launch.metrics.plots.equal_time_comparison`). ``step_note``: what a fixed step time stands for."""
    equal = rows[0][1].get("equal_time") if len(rows) == 2 else None
    width = max(28, *(len(label) for label, _ in rows))
    at_head = f"loss at {equal['at_s']:.1f}s" if equal else ""
    head = (f"{'run':<{width}} {'val loss':>9} {'± se':>7} {'val bpb':>8} {'tokens':>9} {'sent/worker':>12} {'virtual wall':>13} "
            f"{'compute util':>13}")
    at_w = max(15, len(at_head))
    if equal:
        head += f" {at_head:>{at_w}} {'time to the other':>18}"
    lines = ["", f"simulated network: {network.describe()} per worker", *_step_time_line(rows[0][1], step_note), head,
             "-" * len(head)]
    for i, (label, s) in enumerate(rows):
        per_worker = s.get("bytes_sent_per_worker") or [s["bytes_sent"]]
        util = s.get("compute_utilization")
        bpb = "n/a" if s.get("val_bpb") is None else f"{s['val_bpb']:.4f}"
        se = s.get("val_loss_se")
        se = "" if se is None or se != se else f"{se:.4f}"
        line = (f"{label:<{width}} {s['val_loss']:>9.4f} {se:>7} {bpb:>8} {s['tokens'] / 1e6:>8.2f}M {human_bytes(max(per_worker)):>12} "
                f"{s.get('virtual_wall_s', 0):>12.1f}s {'' if util is None else f'{100 * util:.1f}%':>13}")
        if equal:
            loss = equal["loss_at"][i]
            line += f" {'n/a' if loss is None else f'{loss:.4f}':>{at_w}} {_seconds(equal['time_to_other'][i]):>18}"
        lines.append(line)
    if len(rows) == 2:
        (name, a), (_, b) = rows
        ratio = (max(b["bytes_sent_per_worker"]) / max(1, max(a["bytes_sent_per_worker"])))
        speed = b["virtual_wall_s"] / a["virtual_wall_s"] if a.get("virtual_wall_s") else float("nan")
        faster = f"finishes {speed:.1f}x sooner" if speed >= 1.05 else f"takes {1 / speed:.1f}x longer" \
            if speed <= 1 / 1.05 else "finishes about as fast"
        lines.append(f"at equal tokens: {name} sends {ratio:.0f}x fewer bytes than DDP and {faster} in "
                     f"virtual time; val loss {_loss_verdict(a, b)}.")
        if equal:
            lines.extend(_equal_time_lines(name, equal))
        lines.append(f"plot: {Path(a['run_dir']) / 'compare.png'}")
    for label, s in rows:
        lines.extend(_churn_lines(label, s))
        lines.extend(_time_split_lines(label, s))
    return "\n".join(lines)


def _loss_verdict(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Run ``a``'s final validation loss against DDP's (``b``): on the same windows, the gap and its paired
    standard error, and level where it is within two of them."""
    pct = f"{100 * (a['val_loss'] / b['val_loss'] - 1):+.1f}%"
    gap = run_gap(a["run_dir"], b["run_dir"])
    if gap is None:
        return f"{pct} vs DDP"
    if gap.level:
        return f"{pct} vs DDP, level with it ({gap.gap:+.4f} ± {gap.se:.4f}, within two standard errors)"
    return f"{pct} vs DDP ({gap.gap:+.4f} ± {gap.se:.4f}, paired over the same windows)"


def _time_split_lines(label: str, s: dict[str, Any], most: int = 8) -> list[str]:
    """Where each worker's virtual time went: ``worker 0: compute 80.1%, waiting 2.3%, sending 17.6%`` (and
    ``away`` under churn); with more than ``most`` workers, the least and the most computing ones and the mean."""
    compute, wait, send = (s.get(k) for k in ("virtual_compute_s_per_worker", "virtual_wait_s_per_worker",
                                                "virtual_send_s_per_worker"))
    away = s.get("virtual_away_s_per_worker")
    wall = s.get("virtual_wall_s")
    if not (compute and wait and send and wall):
        return []
    parts = [("compute", compute), ("waiting", wait), ("sending", send)] + ([("away", away)] if away else [])

    def share(i: int) -> str:
        return ", ".join(f"{name} {100 * values[i] / wall:.1f}%" for name, values in parts)

    if len({share(i) for i in range(len(compute))}) == 1:
        return [f"{label}, every worker's virtual time: {share(0)}"]
    lines = [f"{label}: virtual time of each worker"]
    order = range(len(compute))
    if len(compute) > most:
        lo, hi = min(order, key=lambda i: compute[i]), max(order, key=lambda i: compute[i])
        order = [lo, hi]
        n = len(compute)
        lines.append(f"  mean of {n}: " + ", ".join(f"{name} {100 * sum(values) / n / wall:.1f}%"
                                                     for name, values in parts))
    lines.extend(f"  worker {i}: {share(i)}" for i in order)
    return lines


def _churn_lines(label: str, s: dict[str, Any]) -> list[str]:
    """``diloco x8 (H=50): churn poisson:...: 5 leaves, 4 joins; 6.9 of 8 workers per round on average (fewest 5)``"""
    m = s.get("membership")
    if not s.get("churn") or not m:
        return []
    mean = f"{m['mean_members']:.1f}" if m.get("mean_members") is not None else "n/a"
    return [f"{label}: churn {s['churn']}: {sum(s.get('leaves_per_worker', []))} leaves, "
            f"{sum(s.get('joins_per_worker', []))} joins; {mean} of {len(s.get('leaves_per_worker', []))} workers per "
            f"round on average (fewest {m.get('fewest_members')}); compute util counts the time in the run only"]


def _equal_time_lines(name: str, equal: dict[str, Any]) -> list[str]:
    """``at equal time (12.3 s, when diloco finished): DDP's val loss was 1.9021, diloco's 1.7012 (-10.6%).``"""
    names = [name, "DDP"]
    first = 0 if equal["final_s"][0] <= equal["final_s"][1] else 1
    other = 1 - first
    mine, theirs = equal["loss_at"][first], equal["loss_at"][other]
    head = f"at equal virtual time ({equal['at_s']:.1f}s, when {names[first]} finished): "
    if theirs is None:
        head += f"{names[other]} had not evaluated yet (no validation loss before then)."
    else:
        head += (f"{names[other]}'s val loss was {theirs:.4f}, {names[first]}'s {mine:.4f} "
                 f"({100 * (mine / theirs - 1):+.1f}%).")
    reach = []
    for i, j in ((1, 0), (0, 1)):
        t = equal["time_to_other"][i]
        target = f"{names[j]}'s final {equal['final_loss'][j]:.4f}"
        reach.append(f"{names[i]} never reaches {target}" if t is None else
                     f"{names[i]} reaches {target} at {t:.1f}s")
    return [head, "to reach the other's final loss: " + "; ".join(reach) + "."]
