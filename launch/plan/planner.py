"""`loco plan`: choose the algorithm, H, codec and fragments for a model, a number of workers and a link.

For every candidate setting the planner predicts the bytes each worker sends per round, the virtual time a round
takes, and the share of it spent computing (the compute utilization), with the simulator's own accounting
(:mod:`diloco.sim.group`): a step costs the step time; every collective starts when the link is free and lasts
what :class:`diloco.sim.NetworkModel` says its bytes take, collectives on one link one after another; a blocking
exchange holds the workers until it ends, and Streaming DiLoCo's exchange of a fragment is waited for only
``overlap`` steps later. The bytes are the real payload sizes: the transports' 32 MiB buckets, the compressed
all-reduce's shards and messages (weight, wire header, ``Codec.payload_bytes``), the same collectives the
algorithms call (a ring all-reduce for fp32 DDP and DiLoCo; an all-to-all then an all-gather per bucket for a
codec). Every worker is assumed to run at the same speed.

The expected loss penalty against DDP is what loco measured (:data:`MEASURED`, each with the file under
``benchmarks/results/`` it comes from); a setting that was never measured says "unmeasured".

``--check`` simulates the recommended setting on the ``tiny`` model with the same link and a fixed step time,
and prints the utilization predicted for that very run beside the one the simulator reports, and the table's row
for the plan's own model and workers, which it does not simulate.
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from typing import Optional

from diloco.sim import NetworkModel
from launch.config.algorithms import algorithm_class
from launch.config.loader import PRESETS_DIR
from launch.metrics.log import human_bytes
from launch.plan.inputs import Link, parse_link, parse_step_time
from launch.plan.settings import FRAGMENTS, SOURCES, Model, PlanError, Setting, model_of, resolve_model
from launch.plan.timeline import TARGET_UTILIZATION, Row, predict, recommend, timeline

CHECK_WORKERS = 4  # --check simulates at most this many workers, so that it stays short
CHECK_ROUNDS = 1  # the prediction replays the same steps, start and end of training included

# candidate settings
DILOCO_H = (10, 50, 100, 500)
STREAMING_H = (50, 100, 500)
CODECS = ("fp32", "bf16", "int8", "fp4")
STREAMING_CODECS = ("fp32", "int8", "fp4")
OVERLAP = 5  # Streaming DiLoCo's tau (at most H - 1), with the published merge alpha (plan_model.MIX_ALPHA)
SPARSELOCO_H = (15, 50, 100)
SPARSELOCO_DENSITIES = (32 / 4096, 64 / 4096, 128 / 4096)  # the published k of 32, 64 and 128 per chunk of 4096
DEMO_TOPK = (8, 32)  # DeMo's coefficients kept per 64 x 64 DCT block, every step


def candidates(model: Model) -> list[Setting]:
    out = [Setting("ddp")]
    out += [Setting("diloco", h, c) for h in DILOCO_H for c in CODECS]
    out += [Setting("streaming", h, c, p, min(OVERLAP, h - 1)) for h in STREAMING_H for p in FRAGMENTS
            if p <= model.n_layers and p in model.fragments for c in STREAMING_CODECS]
    out += [Setting("sparseloco", h, "2bit", density=d) for h in SPARSELOCO_H for d in SPARSELOCO_DENSITIES]
    out += [Setting("demo", codec="dct", topk=k) for k in DEMO_TOPK]
    return out


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: Model
    workers: int
    link: Link
    step_time: float
    step_time_given: bool
    rows: list[Row]
    cheapest: Optional[Row]
    nearest: Optional[Row]
    inputs: tuple[str, ...] = ()  # the link and step-time flags as given, which `loco simulate` takes alike

    @property
    def network(self) -> NetworkModel:
        return NetworkModel(self.link.bandwidth, self.link.latency)


def make_plan(model: str, workers: int, bandwidth: Optional[str], latency: Optional[str],
              step_time: Optional[str] = None, links: Optional[str] = None) -> Plan:
    if not isinstance(workers, int) or workers < 1:
        raise PlanError(f"--workers {workers}: must be a whole number >= 1")
    link = parse_link(bandwidth, latency, links, workers)
    step, given = parse_step_time(step_time)
    m = resolve_model(model)
    net = NetworkModel(link.bandwidth, link.latency)
    rows = [predict(s, m, workers, net, step) for s in candidates(m)]
    rows.sort(key=lambda r: (r.bytes_per_step, -r.utilization))
    cheapest, nearest = recommend(rows)
    flags = (("--bandwidth", bandwidth), ("--latency", latency), ("--links", links), ("--step-time", step_time))
    inputs = tuple(f"{flag} {shlex.quote(str(value))}" for flag, value in flags if value is not None)
    return Plan(m, workers, link, step, given, rows, cheapest, nearest, inputs)


def run_command(plan: Plan, row: Row) -> str:
    """The `loco simulate` line that runs ``row``'s setting on the plan's model, workers and link: a named size
    is its preset (configs/<size>.yaml); a parameter count has none, so the line asks for the user's own file."""
    named = (PRESETS_DIR / f"{plan.model.name}.yaml").is_file()
    config = f"--config {plan.model.name}" if named else "--config FILE"
    parts = ["loco simulate", config, f"--workers {plan.workers}", *plan.inputs]
    parts += [f"--set {o}" for o in row.setting.overrides()]
    line = " ".join(parts)
    return line if named else f"{line}   # FILE: your config of a model of {plan.model.name}"


def penalty_text(row: Row, sources: list[str]) -> str:
    m = row.measured
    if m is None:
        return "unmeasured"
    if algorithm_class(row.setting.algo).baseline:
        return "baseline"
    if m.source not in sources:
        sources.append(m.source)
    se = f" ± {100 * m.se:.1f}" if m.se is not None else ""
    return f"{100 * m.penalty:+.1f}%{se} [{sources.index(m.source) + 1}]"


def format_plan(plan: Plan) -> str:
    net = plan.network
    step = f"{plan.step_time:g} s per step" + ("" if plan.step_time_given else " (assumed: pass --step-time)")
    lines = [f"model: {plan.model.name} ({plan.model.params / 1e6:.1f}M parameters, fp32 exchanges); "
             f"{plan.workers} workers at equal speed; {step}",
             f"link: {net.describe()} per worker" + (f" ({plan.link.note})" if plan.link.note else ""),
             ""]
    sources: list[str] = []
    head = (f"{'algorithm':<30} {'codec':<6} {'sent/round':>11} {'sent/step':>11} {'round time':>11} "
            f"{'compute':>9} {'utilization':>12}  loss vs DDP")
    lines += [head, "-" * (len(head) + 6)]
    for r in plan.rows:
        mark = " <-" if r is plan.cheapest else ""
        lines.append(f"{r.setting.label():<30} {r.setting.codec:<6} {human_bytes(r.bytes_per_round):>11} "
                     f"{human_bytes(r.bytes_per_step):>11} {r.round_s:>10.4g}s {r.compute_s:>8.4g}s "
                     f"{100 * r.utilization:>11.1f}%  {penalty_text(r, sources)}{mark}")
    lines.append("")
    lines.append("round: H steps (DDP: one step); utilization: compute time / round time, as `loco simulate` "
                 "counts it (Streaming's exchanges hide behind tau steps where the link keeps up).")
    for i, src in enumerate(sources, 1):
        lines.append(f"[{i}] benchmarks/results/{src}: val loss vs DDP; {SOURCES[src]}")
    lines.append("loss penalties: loco's measurements on the tiny model with 4 workers (at this model's scale they "
                 "may differ); a setting never measured says so.")
    if plan.cheapest is None:
        best = max(plan.rows, key=lambda r: r.utilization)
        lines.append(f"no setting reaches {100 * TARGET_UTILIZATION:.0f}% utilization; the highest is "
                     f"{best.setting.label()} {best.setting.codec} at {100 * best.utilization:.1f}%.")
    else:
        c, n = plan.cheapest, plan.nearest
        lines.append(f"recommended (fewest bytes at >= {100 * TARGET_UTILIZATION:.0f}% utilization): "
                     f"{c.setting.label()} {c.setting.codec}: {human_bytes(c.bytes_per_round)} per round, "
                     f"{100 * c.utilization:.1f}% utilization, loss vs DDP {penalty_text(c, sources)}")
        lines.append(f"  run it: {run_command(plan, c)}")
        if n is not None and n is not c:
            lines.append(f"nearest DDP at >= {100 * TARGET_UTILIZATION:.0f}%: {n.setting.label()} {n.setting.codec}: "
                         f"{human_bytes(n.bytes_per_round)} per round, {100 * n.utilization:.1f}% utilization, "
                         f"loss vs DDP {penalty_text(n, sources)}")
    return "\n".join(lines)


# ---- --check ----------------------------------------------------------------------------------------------------
@dataclass
class Check:
    """A run small enough to simulate here (``setting`` on tiny, ``workers`` workers, ``steps`` steps, the plan's
    link and step time), predicted by the accounting the table rests on and simulated; ``row``: the table's own
    prediction for ``setting`` on the plan's model and workers, which the check does not simulate."""

    setting: Setting
    workers: int
    steps: int
    predicted: float
    simulated: float
    run_dir: str
    row: Optional[Row] = None
    recommended: bool = True
    plan_model: str = ""
    plan_workers: int = 0

    @property
    def agrees(self) -> bool:
        return abs(self.predicted - self.simulated) <= 0.05


def check(plan: Plan, setting: Optional[Setting] = None, run_dir: Optional[str] = None) -> Check:
    """Simulate ``setting`` (the recommendation) on the tiny model with the plan's link and step time, and
    predict the same run."""
    import torch

    from launch.config import load_config
    from launch.data.batches import load_data
    from launch.models.transformer import Transformer, model_args_from_config
    from launch.simulate.runner import simulate_once

    recommended = setting is None and plan.cheapest is not None
    setting = setting or (plan.cheapest or max(plan.rows, key=lambda r: r.utilization)).setting
    workers = min(plan.workers, CHECK_WORKERS)
    steps = CHECK_ROUNDS * setting.inner_steps
    folder = run_dir or tempfile.mkdtemp(prefix="loco-plan-check-")
    bw = f"{plan.link.bandwidth}B/s" if plan.link.bandwidth else "null"
    overrides = [*setting.overrides(), f"sim.workers={workers}", f"sim.bandwidth={bw}",
                 f"sim.latency={plan.link.latency}", f"sim.step_time={plan.step_time}", "sim.baseline=none",
                 f"run.max_steps={steps}", "run.batch_size=1", "data.seq_len=16", "data.max_docs=40",
                 "run.eval_every=0", "eval.tokens=256", "run.checkpoint_every=0", "run.checkpoint_final=false",
                 "log.plot=false", "log.progress=off", "log.every=1000000", "run.threads=1", f"run.dir={folder}"]
    cfg, _ = load_config(["tiny"], overrides)
    data = load_data(cfg.data)
    args = model_args_from_config(cfg.model, data.vocab_size, cfg.data.seq_len)
    with torch.device("meta"):
        tiny = Transformer(args)
    parts = setting.schedule().fragments
    model = model_of("tiny", tiny, args.n_layers, [parts] if parts > 1 else [])
    predicted = timeline(setting, model, workers, plan.network, plan.step_time, steps).utilization
    summary = simulate_once(cfg, data)
    row = next((r for r in plan.rows if r.setting == setting), None)
    return Check(setting, workers, steps, predicted, summary["compute_utilization"], summary["run_dir"], row,
                 recommended, plan.model.name, plan.workers)


def format_check(c: Check) -> str:
    """What was simulated, against what: the check replays the table's accounting on a run small enough to
    simulate here, which is not the table's row unless the plan is of that very run."""
    verdict = "agree" if c.agrees else "DISAGREE"
    which = "the recommended setting" if c.recommended else "the setting of highest utilization (none is recommended)"
    same = c.plan_model == "tiny" and c.plan_workers == c.workers and c.row is not None
    lines = [f"check: {which}, {c.setting.label()} {c.setting.codec}, simulated on tiny with {c.workers} workers for "
             f"{c.steps} steps, on the same link and step time",
             f"  {'predicted utilization':<24} {100 * c.predicted:6.1f}%  (the table's accounting, for this run)",
             f"  {'simulated utilization':<24} {100 * c.simulated:6.1f}%",
             f"  they {verdict} within 5 points ({100 * abs(c.predicted - c.simulated):.2f} points apart); "
             f"run folder {c.run_dir}"]
    if c.row is not None and not same:
        lines.append(f"  the table's row is another run ({c.plan_model}, {c.plan_workers} workers, steady state): "
                     f"{100 * c.row.utilization:.1f}% predicted there, by the accounting checked here, not simulated")
    return "\n".join(lines)


__all__ = ["Check", "Plan", "candidates", "check", "format_check", "format_plan", "make_plan"]
