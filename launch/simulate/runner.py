"""`loco simulate`: N workers on one device, each running the ordinary training loop.

Every worker is a :class:`launch.loop.trainer.Trainer` over an endpoint of one
:class:`diloco.sim.InProcessGroup`, so the algorithm code is the code that runs
under torchrun or hivemind. The run folder has the usual layout; its
summary.json adds ``bytes_sent_per_worker``, ``virtual_wall_s``,
``compute_utilization``, ``tokens_per_virtual_s``, where each worker's virtual
time went (``virtual_compute_s_per_worker``, ``virtual_wait_s_per_worker``,
``virtual_send_s_per_worker``) and the virtual step time with where it came
from (``virtual_step_time_s``: ``sim.step_time``, or the median of the run's
measured steps). ``sim.links`` replays a trace of per-worker links. ``sim.churn`` takes workers out
of the run and back (:mod:`diloco.sim.churn`): a worker that comes back builds a new Trainer and takes the
run's state as a ``loco join`` peer does (:meth:`Trainer.shared_state_blob` / :meth:`Trainer.join_at`, the
bytes timed on its link); ``rounds.jsonl`` then records each round's members, their weights, who left during
it and who joins after it, and the summary each worker's time away. Unless told otherwise
(``sim.baseline: none``), a DDP run on the same tokens follows in
``RUN/baseline-ddp``, on the same virtual step time, and a table compares the two.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import yaml

from diloco.sim import InProcessGroup, NetworkModel, parse_bandwidth, resolve_speeds, run_workers
from diloco.sim.churn import ChurnError, ChurnSchedule
from diloco.sim.transport import WorkerLeft
from launch.config.algorithms import algorithm_class, baseline_name
from launch.config import Config, ConfigError
from launch.data.batches import load_data
from launch.metrics.plots import equal_time_comparison, plot_runs
from launch.metrics.rounds import RoundsLog
from launch.simulate.fits import MemoryWatch, check_workers_fit
from launch.simulate.report import baseline_line, format_table, run_label
from launch.loop.signals import STOP, Interrupted
from launch.data.tokens import TokenData
from launch.loop.trainer import Hooks, Trainer


BASELINE_EVALS = 20  # the DDP baseline evaluates at least this often over its run


def network_of(cfg: Config) -> NetworkModel:
    """The network model of ``sim.*``: one link for every worker, or ``sim.links``' trace replayed over time."""
    sim = cfg.sim
    links = None
    if sim.links:
        from diloco.sim.links import LinkTrace, LinkTraceError

        try:
            links = LinkTrace.load(sim.links)
            links.check_workers(sim.workers)
        except (OSError, LinkTraceError) as e:
            raise ConfigError(f"sim.links: {e}") from None
    return NetworkModel(parse_bandwidth(sim.bandwidth) if sim.bandwidth else None, sim.latency, links)


def churn_of(cfg: Config) -> Optional[ChurnSchedule]:
    """``sim.churn`` as a schedule (None: every worker stays for the whole run)."""
    if not cfg.sim.churn:
        return None
    if cfg.run.resume:
        raise ConfigError("sim.churn: a simulation with churn cannot be resumed (its members change from round to "
                          "round); run it again with --restart, or resume it without churn: --resume --set sim.churn=")
    try:
        return ChurnSchedule.parse(cfg.sim.churn, cfg.sim.workers, cfg.run.seed)
    except (OSError, ChurnError) as e:
        raise ConfigError(f"sim.churn: {e}") from None


def move_worker_state(trainer: Trainer, device: torch.device) -> None:
    """Move a worker's model and every state its algorithm keeps to ``device`` (``algo.offload_outer`` stays put)."""
    trainer.algo.to(device)


class Membership:
    """Rank 0's view of a run with churn: at each round boundary (each step for DDP) it records the round's
    members in ``rounds.jsonl`` and lets the workers whose time to come back has come join the next round."""

    def __init__(self, group: InProcessGroup, churn: ChurnSchedule) -> None:
        self.group, self.churn = group, churn
        self.log: Optional[RoundsLog] = None
        # what joiners admitted at the latest boundary take: worker 0's state then, its step and run folder (taken
        # at the boundary: by the time a joiner runs, worker 0 may have begun its next step, and DeMo's weight
        # decay, for one, changes the parameters before the step's exchange)
        self.snapshot: Optional[tuple[bytes, int, Path]] = None

    def start(self, trainer: Trainer) -> None:
        self.log = RoundsLog(trainer.run_dir, fresh=True)

    def boundary(self, rank: int, trainer: Trainer, synced: bool, info: dict[str, Any]) -> None:
        """The end of a step of ``rank``: at a round boundary (an exchange: DiLoCo's rounds, Streaming's fragment
        syncs, DDP's steps) it counts the worker's round; worker 0 also records the round and admits joiners."""
        g = self.group
        if trainer.algo.round_based and not synced:
            return
        g.rounds[rank] += 1
        if rank != 0:
            return
        members = list(g.last_members)
        weights = g.contributions if g.contributions is not None else {str(m): 1.0 for m in members}
        g.contributions = None
        now = g.clock[0]
        joining = [w for w in g.parked() if self.churn.joins_now(w, g.seconds(now), g.rounds[0])]
        if joining:
            self.snapshot = (trainer.shared_state_blob(), trainer.step, trainer.run_dir)
        for w in joining:
            g.admit(w, now, trainer.step)
        self.log.write(round=g.rounds[0], step=trainer.step, members=members, weights=weights,
                       virtual_s=round(g.seconds(now), 4), left=sorted(g.left_now), joining=joining,
                       **trainer.algo.figures())
        g.left_now = []
        g.members_per_round.append(len(members))


def simulate_once(cfg: Config, data: Optional[TokenData] = None, restart: bool = False) -> dict[str, Any]:
    """One simulated run; returns rank 0's summary.

    A Ctrl-C or SIGTERM (under ``launch.loop.signals.stop_signals``) stops every worker at the next point they all
    reach (a sync; any step for DDP), where the checkpoint of all workers is saved as usual; then
    :class:`Interrupted` is raised, and ``--resume`` continues the run as if it had not stopped.
    """
    sim = cfg.sim
    churn = churn_of(cfg)
    data = data or load_data(cfg.data)
    check_workers_fit(cfg, data)
    memory = MemoryWatch(sim.workers, sim.offload)
    speeds = resolve_speeds(sim.workers, sim.speeds, sim.speed_dist, cfg.run.seed)
    group = InProcessGroup(sim.workers, speeds, network_of(cfg), sim.step_time, churn=churn)
    membership = Membership(group, churn) if churn is not None else None
    trainers: list[Optional[Trainer]] = [None] * sim.workers
    if sim.offload:
        def park(rank: int) -> None:
            if trainers[rank] is not None:
                move_worker_state(trainers[rank], torch.device("cpu"))

        def unpark(rank: int) -> None:
            if trainers[rank] is not None:
                move_worker_state(trainers[rank], trainers[rank].device)

        group.on_release, group.on_acquire = park, unpark

    def boundaries(rank: int) -> Optional[Callable[[bool, dict], None]]:
        """The end of each step of worker ``rank``, where a run with churn records its rounds."""
        if membership is None:
            return None
        return lambda synced, info: membership.boundary(rank, trainers[rank], synced, info)

    def come_back(rank: int, transport) -> Trainer:
        """A worker that left joins again: a new Trainer on the run's state, downloaded from worker 0."""
        blob, step, run_dir = membership.snapshot
        group.download(rank, len(blob))
        trainer = Trainer(cfg, transport=transport, data=data, join_run=run_dir,
                          hooks=Hooks(on_step_end=boundaries(rank)))
        trainer.join_at(blob, step, "worker 0")
        return trainer

    def worker(rank: int, transport) -> Any:
        # parked from its first wait on (the start-up collectives that find the run folder and the checkpoint)
        def built(t: Trainer) -> None:
            trainers[rank] = t
            memory.built(t.model, t.device)  # N models in one process: refused in one line if they cannot fit

        hooks = Hooks(on_built=built, on_step_end=boundaries(rank))
        trainer = Trainer(cfg, transport=transport, data=data, restart=restart, hooks=hooks)
        if membership is not None and rank == 0:
            membership.start(trainer)
        try:
            while True:
                trainers[rank] = trainer
                try:
                    return trainer.fit()
                except WorkerLeft:
                    trainers[rank] = trainer = None
                    if not group.wait_to_join(rank):
                        return None  # the run ended while this worker was away
                    trainer = come_back(rank, transport)
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
    base.algo.name = baseline_name()
    base.sync.mode = "steps"
    base.compress.codec = "fp32"  # the baseline is plain dense DDP
    base.run.dir = str(run_dir / "baseline-ddp")
    base.run.name = f"{cfg.run.name}-ddp"
    base.log.wandb = False
    run = base.run
    if run.eval_every and run.max_steps:
        # about 20 evaluations: the comparison reads the baseline's loss at the time the run finished
        run.eval_every = min(run.eval_every, max(1, run.max_steps // BASELINE_EVALS))
    if cfg.sim.churn and not str(cfg.sim.churn).strip().startswith("poisson:"):
        base.sim.churn = _churn_for_baseline(cfg, Path(base.run.dir))
    return base


def _churn_for_baseline(cfg: Config, folder: Path) -> str:
    """``sim.churn`` as the DDP baseline reads it: DDP's round is one step, so an event keyed by the run's round r
    is keyed by its step there (r x the algorithm's steps per round for rounds of fixed steps: H for DiLoCo, H/P
    for Streaming's staggered fragments; r x sync.time_budget_s of virtual time for time-budgeted ones, which
    leaves out each round's exchange), and both runs lose and regain workers at about the same point of
    training. A trace keyed by time, or by the rounds of an algorithm that meets every step, is the run's own."""
    sched = ChurnSchedule.load(cfg.sim.churn)
    algo = algorithm_class(cfg.algo.name)
    if not algo.round_based or not any(e.round is not None for e in sched.events):
        return str(cfg.sim.churn)
    timed = cfg.sync.mode == "time"
    rows = []
    for e in sched.events:
        row: dict[str, Any] = {"worker": e.worker, "event": e.kind}
        if e.round is None:
            row["time"] = f"{e.time}s"
        elif timed:
            row["time"] = f"{e.round * cfg.sync.time_budget_s}s"
        else:
            row["round"] = round(e.round * algo.steps_per_round(cfg))
        rows.append(row)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "churn-as-steps.yaml"
    path.write_text(yaml.safe_dump({"churn": rows}, sort_keys=False))
    return str(path)


def simulate(cfg: Config, restart: bool = False) -> dict[str, Any]:
    """The main job of ``loco simulate``: the configured run, the DDP baseline, a table and a plot."""
    data = load_data(cfg.data)
    summary = simulate_once(cfg, data, restart)
    run_dir = Path(summary["run_dir"])
    rows = [(run_label(cfg), summary)]
    if cfg.sim.baseline != "none" and not algorithm_class(cfg.algo.name).baseline:
        if STOP.signum is not None:  # a signal came as the run ended: it is saved; --resume runs the baseline
            raise Interrupted(STOP.signum, clean=True)
        base_cfg = baseline_config(cfg, run_dir)
        print(baseline_line(cfg, base_cfg, summary), file=sys.stderr, flush=True)
        if base_cfg.sim.step_time is None and summary.get("virtual_step_time_s"):
            # the same model on the same device: one compute time for both, so the comparison is of the networks
            base_cfg.sim.step_time = summary["virtual_step_time_s"]
        base = simulate_once(base_cfg, data, restart)
        rows.append((run_label(base_cfg), base))
        plot_runs([run_dir, Path(base["run_dir"])], run_dir / "compare.png", title=f"{run_label(cfg)} vs DDP")
        equal = equal_time_comparison(run_dir, Path(base["run_dir"]))
        if equal is not None:
            summary["equal_time"] = equal
        (run_dir / "comparison.json").write_text(json.dumps({label: s for label, s in rows}, indent=2) + "\n")
    print(format_table(rows, network_of(cfg), cfg.sim.step_time_note))
    return summary
