"""`loco simulate`: N workers on one device, each running the ordinary training loop.

Every worker is a :class:`launch.trainer.Trainer` over an endpoint of one
:class:`diloco.sim.InProcessGroup`, so the algorithm code is the code that runs
under torchrun or hivemind. The run folder has the usual layout; its
summary.json adds ``bytes_sent_per_worker``, ``virtual_wall_s``,
``compute_utilization``, ``tokens_per_virtual_s`` and the virtual step time
with where it came from (``virtual_step_time_s``: ``sim.step_time``, or the
median of the run's measured steps). Unless told otherwise
(``sim.baseline: none``), a DDP run on the same tokens follows in
``RUN/baseline-ddp``, on the same virtual step time, and a table compares the two.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from diloco.sim import InProcessGroup, NetworkModel, parse_bandwidth, resolve_speeds, run_workers
from launch.config import Config
from launch.data import TokenData, load_data
from launch.metrics import human_bytes, plot_runs
from launch.trainer import STOP, Interrupted, Trainer


def network_of(cfg: Config) -> NetworkModel:
    sim = cfg.sim
    return NetworkModel(parse_bandwidth(sim.bandwidth) if sim.bandwidth else None, sim.latency)


def move_worker_state(trainer: Trainer, device: torch.device) -> None:
    """Move a worker's model and every state its algorithm keeps to ``device`` (``algo.offload_outer`` stays put)."""
    trainer.algo.to(device)


def simulate_once(cfg: Config, data: Optional[TokenData] = None, restart: bool = False) -> dict[str, Any]:
    """One simulated run; returns rank 0's summary.

    A Ctrl-C or SIGTERM (under ``launch.trainer.stop_signals``) stops every worker at the next point they all
    reach (a sync; any step for DDP), where the checkpoint of all workers is saved as usual; then
    :class:`Interrupted` is raised, and ``--resume`` continues the run as if it had not stopped.
    """
    sim = cfg.sim
    data = data or load_data(cfg.data)
    speeds = resolve_speeds(sim.workers, sim.speeds, sim.speed_dist, cfg.run.seed)
    group = InProcessGroup(sim.workers, speeds, network_of(cfg), sim.step_time)
    trainers: list[Optional[Trainer]] = [None] * sim.workers
    if sim.offload:
        def park(rank: int) -> None:
            if trainers[rank] is not None:
                move_worker_state(trainers[rank], torch.device("cpu"))

        def unpark(rank: int) -> None:
            if trainers[rank] is not None:
                move_worker_state(trainers[rank], trainers[rank].device)

        group.on_release, group.on_acquire = park, unpark

    def worker(rank: int, transport) -> Any:
        trainers[rank] = Trainer(cfg, transport=transport, data=data, restart=restart)
        trainers[rank].stop_on_request = True  # every worker checks the stop request at the same points
        try:
            return trainers[rank].fit()
        except Interrupted as e:
            if not e.clean:
                raise
            return e  # every worker stops here; raised once they all have (rank 0 may still be saving)
        finally:
            trainers[rank] = None  # free the worker's memory as soon as it is done

    results = run_workers(group, worker)
    stopped = [r for r in results if isinstance(r, Interrupted)]
    if stopped:
        raise stopped[0]  # rank 0's first: it names the checkpoint
    return results[0]


def baseline_config(cfg: Config, run_dir: Path) -> Config:
    base = copy.deepcopy(cfg)
    base.algo.name = "ddp"
    base.sync.mode = "steps"
    base.compress.codec = "fp32"  # the baseline is plain dense DDP
    base.run.dir = str(run_dir / "baseline-ddp")
    base.run.name = f"{cfg.run.name}-ddp"
    base.log.wandb = False
    return base


def simulate(cfg: Config, restart: bool = False) -> dict[str, Any]:
    """The main job of ``loco simulate``: the configured run, the DDP baseline, a table and a plot."""
    data = load_data(cfg.data)
    summary = simulate_once(cfg, data, restart)
    run_dir = Path(summary["run_dir"])
    rows = [(_label(cfg), summary)]
    if cfg.sim.baseline == "ddp" and cfg.algo.name != "ddp":
        if STOP.signum is not None:  # a signal came as the run ended: it is saved; --resume runs the baseline
            raise Interrupted(STOP.signum, clean=True)
        print(f"[simulate] baseline: DDP with {cfg.sim.workers} workers on the same tokens", file=sys.stderr, flush=True)
        base_cfg = baseline_config(cfg, run_dir)
        if base_cfg.sim.step_time is None and summary.get("virtual_step_time_s"):
            # the same model on the same device: one compute time for both, so the comparison is of the networks
            base_cfg.sim.step_time = summary["virtual_step_time_s"]
        base = simulate_once(base_cfg, data, restart)
        rows.append((_label(base_cfg), base))
        plot_runs([run_dir, Path(base["run_dir"])], run_dir / "compare.png", title=f"{_label(cfg)} vs DDP")
        (run_dir / "comparison.json").write_text(json.dumps({label: s for label, s in rows}, indent=2) + "\n")
    print(format_table(rows, network_of(cfg)))
    return summary


def _label(cfg: Config) -> str:
    a, w = cfg.algo, cfg.sim.workers
    codec = "" if cfg.compress.codec == "fp32" else f" {cfg.compress.codec}"
    if a.name in ("ddp", "demo"):
        return f"{a.name} x{w}{codec}"
    extra = f", P={a.fragments}" if a.name == "streaming" else ""
    return f"{a.name} x{w} (H={a.inner_steps}{extra}){codec}"


def _step_time_line(summary: dict[str, Any]) -> list[str]:
    """How long a step takes in virtual time, and why: ``virtual compute: 0.0213 s per step at speed 1 (...)``."""
    step = summary.get("virtual_step_time_s")
    if not step:
        return []
    if summary.get("virtual_step_time_source") == "sim.step_time":
        why = "fixed: sim.step_time, or --step-time"
    else:
        why = f"the median of {summary.get('measured_steps', 0)} measured steps; fix it with --step-time"
    return [f"virtual compute: {step:.4g} s per step at speed 1 ({why})"]


def format_table(rows: list[tuple[str, dict[str, Any]]], network: NetworkModel) -> str:
    width = max(28, *(len(label) for label, _ in rows))
    head = f"{'run':<{width}} {'val loss':>9} {'tokens':>9} {'sent/worker':>12} {'virtual wall':>13} {'compute util':>13}"
    lines = ["", f"simulated network: {network.describe()} per worker", *_step_time_line(rows[0][1]), head,
             "-" * len(head)]
    for label, s in rows:
        per_worker = s.get("bytes_sent_per_worker") or [s["bytes_sent"]]
        util = s.get("compute_utilization")
        lines.append(f"{label:<{width}} {s['val_loss']:>9.4f} {s['tokens'] / 1e6:>8.2f}M {human_bytes(max(per_worker)):>12} "
                     f"{s.get('virtual_wall_s', 0):>12.1f}s {'' if util is None else f'{100 * util:.1f}%':>13}")
    if len(rows) == 2:
        (_, a), (_, b) = rows
        ratio = (max(b["bytes_sent_per_worker"]) / max(1, max(a["bytes_sent_per_worker"])))
        speed = b["virtual_wall_s"] / a["virtual_wall_s"] if a.get("virtual_wall_s") else float("nan")
        lines.append(f"{rows[0][0]} sends {ratio:.0f}x fewer bytes than DDP and finishes {speed:.1f}x sooner in "
                     f"virtual time; val loss {100 * (a['val_loss'] / b['val_loss'] - 1):+.1f}% vs DDP.")
        lines.append(f"plot: {Path(a['run_dir']) / 'compare.png'}")
    return "\n".join(lines)
