"""The one training loop. It drives ``algo.step()`` and knows nothing of which algorithm runs.

Per step: ``grad_accum`` micro-batches forward/backward (bf16 autocast on CUDA), then ``algo.step()`` (exchange,
clip, inner step, maybe a round), then ``algo.zero_grad()``. Around it: the learning-rate schedule, metrics every
``log.every`` steps, validation every ``run.eval_every``, checkpoints every ``run.checkpoint_every``, and the stop
conditions ``run.max_steps`` and ``run.max_time`` (a resumed run gets the budget afresh: it counts from the
resume). At the end: a last validation, a checkpoint, summary.json and a plot. A signal stops the loop where it
can save (:mod:`launch.loop.signals`).

The rooms it holds are its wing's (``launch/loop/``): checkpoints and resume are the :class:`Checkpointer`'s.
What ``loco join`` and ``loco simulate`` add comes in through :class:`Hooks` and the constructor.

Python API::

    from launch.config import load_config
    from launch.trainer import Trainer
    cfg, _ = load_config(["configs/tiny.yaml"], ["run.max_steps=200"])
    summary = Trainer(cfg, model=my_module).fit()   # model: ids [B, T] -> logits [B, T, V]
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from diloco.comm import Transport, make_transport
from launch.config import Config, shared_settings
from launch.data.batches import Batches, load_data, make_batcher
from launch.data.tokens import TokenData
from launch.errors import RunError
from launch.eval.harness import RunTasks
from launch.eval.validation import RunValidation, Score
from launch.loop.build import build_algorithm, build_model, build_optimizer
from launch.loop.checkpointer import Checkpointer, WorkerObjects
from launch.loop.compute import StepCompute
from launch.loop.report import Reporter, Window, run_sources, start_lines
from launch.loop.rundir import RunDir
from launch.loop.runtime import seed_everything, settle_threads, start_process
from launch.loop.schedule import LrSchedule, Progress, RunClock, StopRule
from launch.loop.shared_state import load_shared_blob, shared_blob, shared_later
from launch.loop.signals import STOP, Interrupted
from launch.metrics.log import Metrics
from launch.metrics.mfu import matmul_precision, mfu_basis
from launch.metrics.plots import plot_runs
from launch.models.base import model_args
from launch.models.transformer import count_params
from launch.store.checkpoint import checkpoint_name


@dataclass
class Hooks:
    """What a caller adds to the loop (all optional).

    ``on_built(trainer)``: once the model and algorithm exist, before the start-up collectives that find the run
    folder and the checkpoint (the simulator parks the worker while it waits in them). ``on_round(info)``: after
    every round's sync (``loco join``). ``on_step(step, record)``: at every metrics line. ``on_step_end(synced,
    info)``: at the end of every step, where every worker's next collective is the same (the simulator admits
    joining workers there)."""

    on_built: Optional[Callable[["Trainer"], None]] = None
    on_round: Optional[Callable[[dict], None]] = None
    on_step: Optional[Callable[[int, dict], None]] = None
    on_step_end: Optional[Callable[[bool, dict], None]] = None


class Trainer:
    def __init__(self, cfg: Config, model: Optional[nn.Module] = None, transport: Optional[Transport] = None,
                 data: Optional[TokenData] = None, *, batcher: Optional[Batches] = None, restart: bool = False,
                 join_run: Optional[Path] = None, hooks: Optional[Hooks] = None) -> None:
        """``batcher``: this worker's batches (default: its share of the run's, by rank). ``restart``: start over
        from step 0 in ``run.dir``, moving its checkpoints and metrics aside. ``join_run``: the folder of a run in
        progress that this worker joins (a simulated worker coming back): it starts without the start-up
        collectives, and the caller loads the run's state (:meth:`join_at`)."""
        self.cfg, self.hooks, self.joining = cfg, hooks or Hooks(), join_run is not None
        run = cfg.run
        self.device = start_process(run.threads, run.device, run.deterministic)
        self.transport = transport or make_transport(cfg.transport.backend, cfg.transport.dist_backend,
                                                     cfg.transport.timeout, self.device, cfg.transport.mesh,
                                                     shard=cfg.run.shard,
                                                     settings={**shared_settings(cfg), "--restart": restart})
        self.rank, self.world, self.leader = self.transport.rank, self.transport.world_size, self.transport.is_leader
        # a worker may be several processes (a node of a torchrun mesh): each takes its share of the worker's batch
        self.inner: Optional[Transport] = self.transport.inner
        procs = self.inner.world_size if self.inner is not None else 1
        self.micro_offset = (self.inner.rank if self.inner is not None else 0) * run.grad_accum
        seed_everything(run.seed)
        self.data = data or load_data(cfg.data)
        if self.data.stream is not None and procs > 1:
            raise RunError(f"data.streaming: one process a worker reads a stream, and a worker here is {procs}; " + (
                "prepare shards with loco data prepare, or stream with run.shard: none and transport.mesh: flat "
                "(every process a worker of its own)" if cfg.run.shard == "fsdp" else "set transport.mesh: flat "
                "(every process a worker of its own), run torchrun with --nproc-per-node 1, or prepare shards "
                "with loco data prepare"))
        self.batcher = batcher or make_batcher(self.data, cfg.data.seq_len, run.batch_size * procs, self.rank,
                                               self.world, run.seed, run.grad_accum * procs)
        built_here = model is None  # from the run's seed (a model handed in may differ from worker to worker)
        if built_here:
            model, self.model_args = build_model(cfg, self.data, self.device)
        else:
            self.model_args = model_args(model)
        self.model = model.to(self.device)
        self.threads = settle_threads(run.threads, self.device, count_params(self.model))  # (count, why) or None
        self.bf16 = run.precision == "bf16" or (run.precision == "auto" and self.device.type == "cuda")
        # every worker starts from rank 0's parameters (and DiLoCo's copy), which models built alike already are
        if not self.joining:
            with torch.no_grad():
                self.transport.share_initial_([p.data for p in self.model.parameters()], seeded=built_here)
        self.sharded = run.shard != "none"
        if self.sharded:
            self.model = self.transport.shard(self.model, self.bf16)  # a worker of one process refuses
        self.compute = StepCompute(self.model, self.device, self.bf16, run.compile,
                                   say=lambda message: self.metrics.info(message, self.step))
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device, transport=self.transport, cfg=cfg)
        self.tokens_per_step = run.batch_size * procs * cfg.data.seq_len  # per worker
        self.algo = build_algorithm(cfg, self.model, self.optimizer, self.transport, self.tokens_per_step, self.inner)
        if self.hooks.on_built is not None:
            self.hooks.on_built(self)
        # rounds that end on a time budget: workers' step counts differ, so they meet only after syncs
        self.progress = Progress(self.algo, self.transport, self.tokens_per_step,
                                 self.algo.round_based and cfg.sync.mode == "time")
        self.clock = RunClock(self.transport, virtual=self.transport.caps.measures_compute,
                              solo=self.world == 1 and self.inner is None)
        self.schedule = LrSchedule(self.optimizer, cfg, self.progress, self.clock)
        # MFU's FLOP count and datasheet peak, as benchmarks/train_throughput.py counts them (none on a CPU)
        self.mfu = mfu_basis(self.model, cfg.data.seq_len, self.device, matmul_precision(self.device, self.bf16))
        self.window = Window()
        self.validation = RunValidation(cfg, self.batcher.val, self.data.tokenizer, self.device, self.inner,
                                        self.data.vocab_size, self.data.description)
        self.tasks = RunTasks(cfg.eval, cfg.data.seq_len, self.data.tokenizer, self.device, self.rank == 0)
        self.last_val: Optional[tuple[int, Score]] = None  # (step, score) of the latest evaluation
        self.folder = RunDir(cfg, self.transport, restart, join_run)
        self.run_dir = self.folder.path
        tokenizer = self.data.tokenizer
        self.checkpoints = Checkpointer(cfg, self.transport, self.folder, WorkerObjects(
            self.model, self.algo, self.batcher, self.progress, self.clock, self.window, tokenizer, self.model_args),
            processes=self.inner.world_size if self.sharded else None)
        self.resumed_from = self.checkpoints.resume()
        self.folder.write_config(cfg)
        self.folder.write_tokenizer(self.data.tokenizer)
        self.progress.begin(self.step, *self.checkpoints.resumed_tokens)
        # a signal stops the loop where every process can save: one worker at any step end; several where a
        # broadcast spans them all (round ends, or every log.every-th step)
        self.stop_rule = StopRule(cfg, self.progress, self.clock,
                                  on_request=self.world == 1 or self.transport.caps.shared_stop)
        self.metrics = Metrics(self.run_dir, cfg.log, self.leader, run.max_steps, self.step, self.rank,
                               cfg.to_dict(), run.name)
        self.report = Reporter(cfg, self.algo, self.transport, self.progress, self.clock, self.metrics, self.mfu)

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def resume_changes(self) -> Optional[str]:
        """The settings changed since the checkpoint this run resumed from (None: none, or no resume)."""
        return self.checkpoints.resume_changes

    # ---- state ------------------------------------------------------------------------------
    def shared_state_blob(self, **extra: Any) -> bytes:
        """What every worker shares, and ``extra``, as bytes (:func:`launch.loop.shared_state.shared_blob`)."""
        return shared_blob(self.algo, **extra)

    def shared_state_later(self, **extra: Any) -> Callable[[], bytes]:
        """:meth:`shared_state_blob`, made when called (:func:`launch.loop.shared_state.shared_later`)."""
        return shared_later(self.algo, **extra)

    def load_shared_blob(self, blob: bytes, source: str = "a peer",
                         check: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
        """Take a :meth:`shared_state_blob`, whole or not at all (:func:`launch.loop.shared_state.load_shared_blob`)."""
        return load_shared_blob(self.algo, blob, source, check)

    def join_at(self, blob: bytes, step: int, source: str) -> None:
        """A worker joining a run in progress (``join_run``): the run's state, at the run's step."""
        self.load_shared_blob(blob, source)
        self.progress.begin(step)
        self.algo.steps = step  # step-keyed schedules follow the run

    def follow_run(self, step: int) -> None:
        """This worker takes the run's step (``loco join`` after taking another peer's state): its lr schedule and
        ``run.max_steps`` follow the run's progress; the steps it skips are not this worker's tokens."""
        self.progress.followed += step - self.progress.step
        self.progress.step = step

    def save(self) -> Optional[Path]:
        """A checkpoint of this step (:meth:`Checkpointer.save`, a collective); the path, on the leader."""
        path = self.checkpoints.save()
        if path is not None and self.checkpoints.signalled_while_saving:
            self.metrics.info(f"stopped by {signal.Signals(STOP.signum).name}: saved {path}; continue with --resume "
                              f"--run-dir {self.run_dir}", self.step)
            self.metrics.close()
            raise Interrupted(STOP.signum, path, clean=True)
        return path

    # ---- the loop ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> Score:
        """The validation of the model the algorithm stands for (DiLoCo: the global parameters): the run's
        windows, whatever its layout (:mod:`launch.eval.validation`); a collective among a worker's processes."""
        self.model.eval()
        with self.algo.evaluation_weights():
            score = self.validation.score(self.compute.row_nll)
        self.model.train()
        return score

    def score_tasks(self) -> dict[str, float]:
        """``eval.tasks`` on the model the algorithm stands for (worker 0; {} elsewhere)."""
        with self.algo.evaluation_weights():
            return self.tasks.run(self.model, self.step)

    def close_data(self) -> None:
        """Stop a stream's reader (a batcher cut from arrays has nothing to stop)."""
        self.batcher.close()

    def fit(self) -> dict[str, Any]:
        if self.leader:
            self._announce()
        self.clock.start(self.step)
        self.progress.synced_step = self.step  # the run's progress counts from this worker's latest sync
        self.window.restart()
        # a worker that joins does so where the others' last step synced (round-based) or at any step (DDP)
        synced = self.joining and self.algo.round_based
        with STOP.listened(self.stop_rule.on_request):
            try:
                while not self.stop_rule(synced):
                    synced = self.train_step()
            except KeyboardInterrupt as e:
                # a plain KeyboardInterrupt (the Python API without stop_signals) saves at this step; an Interrupted
                # here is a second signal, or one the loop could not wait for (torchrun): it stops without saving
                if self.world == 1 and self.step > 0 and not isinstance(e, Interrupted):
                    path = self.save()
                    self.metrics.info(f"interrupted: saved {path}; continue with --resume --run-dir {self.run_dir}",
                                      self.step)
                self.metrics.close()
                raise
        if self.stop_rule.stopped_by is not None:
            self._stop(self.stop_rule.stopped_by)
        return self._finish()

    def train_step(self) -> bool:
        """One step, and what follows it (metrics, validation, checkpoint, hooks); whether it synced."""
        run, hooks = self.cfg.run, self.hooks
        lr = self.schedule.apply()
        with self.transport.computing(self.device):  # the simulator's virtual time measures the compute
            step_loss = self.compute.accumulate(self.batcher, self.step, self.micro_offset, run.grad_accum)
        info = self.algo.step()
        synced = bool(info.get("synced"))
        self.algo.zero_grad()
        self.progress.stepped(synced)
        if synced and hooks.on_round is not None:
            hooks.on_round(info)
        self.window.add(step_loss)
        evaluate = run.eval_every and self.step % run.eval_every == 0
        tasks = self.tasks.due(self.step)
        if self.step % self.cfg.log.every == 0 or evaluate or tasks:
            record = self.report.line(self.window, lr, info)
            if evaluate:
                score = self.evaluate()
                record.update(score.record())
                self.last_val = (self.step, score)
            if tasks:
                record.update(self.score_tasks())
            self.metrics.log(record)
            if hooks.on_step is not None:
                hooks.on_step(self.step, record)
            self.window.restart()
        if self.stop_rule.checkpoint_due(synced):
            self.save()
        if hooks.on_step_end is not None:
            hooks.on_step_end(synced, info)
        return synced

    def _announce(self) -> None:
        for line in start_lines(self):  # what runs where, the validation, the device's peak, slices, the resume
            self.metrics.info(line, self.step if line.startswith("resumed from") else None)

    def _stop(self, signum: int) -> None:
        """Save where a signal stopped the loop (every worker is here), then raise Interrupted."""
        m = self.metrics
        path = None
        if self.step != self.checkpoints.saved_step and self.step > 0:
            path = self.save()
        elif self.leader and self.step > 0:
            path = self.folder.checkpoints / checkpoint_name(self.step)
        name = signal.Signals(signum).name
        if self.leader:
            if path is not None:
                m.info(f"stopped by {name}: saved {path}; continue with --resume --run-dir {self.run_dir}", self.step)
            else:
                m.info(f"stopped by {name} before the first step: nothing to save", self.step)
        m.close()
        raise Interrupted(signum, path, clean=True)

    def _finish(self) -> dict[str, Any]:
        m = self.metrics
        self.algo.finalize()
        # resumed from the run's final checkpoint: nothing trained since, and its last lines are already there
        at_end = self.resumed_from is not None and self.step == self.progress.start_step
        tasks = self.score_tasks() if self.tasks.last_step != self.step and not at_end else {}
        if self.last_val is not None and self.last_val[0] == self.step and not self.algo.round_based:
            val = self.last_val[1]
            if tasks:  # the step's line has its validation: the tasks get a line of their own
                m.log({"step": self.step, "tokens": self.progress.tokens_seen(), **tasks}, show=False)
        else:
            val = self.evaluate()
            if not (at_end and self.folder.final_line_logged(self.step)):
                # the done line below prints it
                m.log({**self.report.final_line(val, self.optimizer.param_groups[0]["lr"]), **tasks}, show=False)
        if self.cfg.run.checkpoint_final:  # again at_end too: the checkpoint there may predate algo.finalize()
            self.save()
        summary = self.report.summary(val, self.run_dir)
        summary.update(run_sources(self.data.tokenizer, self.cfg.model.init_from), **tasks)
        if self.leader:
            path = self.folder.write_summary(summary)
            self.folder.write_windows(val.windows_record(self.validation.set))
            if self.cfg.log.plot:
                plot_runs([self.run_dir], self.run_dir / "loss.png", title=self.cfg.run.name)
            m.info(f"done at step {self.step}: val_loss {val.loss:.4f} ± {val.loss_se:.4f} after "
                   f"{summary['tokens']:,} tokens in {summary['wall_s']:.1f}s; summary in {path}")
        m.close()
        return summary


def train(cfg: Config, model: Optional[nn.Module] = None, **kwargs: Any) -> dict[str, Any]:
    """Train from a config; returns the summary. ``kwargs``: :class:`Trainer`'s."""
    trainer = Trainer(cfg, model=model, **kwargs)
    owned = kwargs.get("transport") is None
    try:
        summary = trainer.fit()
    except BaseException as e:
        trainer.close_data()
        if owned:  # a failing run ends now, with its error: it does not wait for exchanges other ranks won't finish
            if isinstance(e, Interrupted) and e.clean:
                trainer.transport.close()  # every worker stopped here together, after the save
            else:
                trainer.transport.abort()
        raise
    trainer.close_data()
    if owned:
        trainer.transport.close()
    return summary
