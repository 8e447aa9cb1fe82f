"""How far a run is and what follows from it: the run's clock, the learning-rate schedule, and where the loop
stops and saves.

Workers of one run must take the same decisions at the same points: replicas that must stay equal (DDP's,
DeMo's, a node's processes) take one lr, and every worker stops where every other one can stop too. So the
decisions read what the workers agreed on (the tokens of the averages, rank 0's clock in a broadcast), not
each worker's own count.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch

from diloco import Algorithm
from diloco.comm import Transport
from launch.config import Config
from launch.loop.signals import STOP


def lr_factor(step: int, warmup: int, progress: float, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr: linear warmup over ``warmup`` steps, then decay by ``progress`` in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


class Progress:
    """This worker's step counts, and the run's progress and tokens as the workers agreed on them.

    With time-budgeted rounds (``time_rounds``) workers' step counts differ: they meet only after syncs, and the
    run is as far as the tokens they agreed on in the averages.
    """

    def __init__(self, algo: Algorithm, transport: Transport, tokens_per_step: int, time_rounds: bool) -> None:
        self.algo, self.transport = algo, transport
        self.tokens_per_step, self.world, self.time_rounds = tokens_per_step, transport.world_size, time_rounds
        self.step = 0
        self.start_step = 0  # where this segment of the run began (a resume, a join)
        self.synced_step = 0  # the step of this worker's latest sync
        self.followed = 0  # steps taken from the run's progress (a join, a resync), not trained by this worker
        # tokens are counted, not recomputed from today's batch: a resume with another batch size goes on from
        # the count its checkpoint kept (:meth:`begin`)
        self.tokens_before = 0  # the run's tokens at start_step
        self.mine_before = 0  # this worker's own tokens at start_step
        self.own_start = 0  # this worker's own steps at start_step (step - followed)

    def begin(self, step: int, tokens: Optional[int] = None, mine: Optional[int] = None) -> None:
        """This segment of the run starts at ``step``, after ``tokens`` of the run and ``mine`` of this worker's
        (None: as many steps of this run's batch, for a checkpoint that kept no count, or a worker joining)."""
        self.step = self.start_step = step
        self.own_start = step - self.followed
        self.tokens_before = step * self.tokens_per_step * self.world if tokens is None else int(tokens)
        self.mine_before = self.own_start * self.tokens_per_step if mine is None else int(mine)

    def my_tokens(self) -> int:
        """Tokens this worker trained itself (the steps it followed from others' progress are not its own)."""
        return self.mine_before + (self.step - self.followed - self.own_start) * self.tokens_per_step

    def stepped(self, synced: bool) -> None:
        self.step += 1
        if synced:
            self.synced_step = self.step

    def run_step(self) -> float:
        """How far the run is, in steps of ``run.max_steps``: this worker's step, except with time-budgeted rounds:
        then the agreed tokens as steps of every worker, plus this worker's steps since that agreement. The lr
        schedule follows it, so a slow worker ends its decay with the run instead of stopping part-way through it
        (and a fast one does not spend the run's end at the floor)."""
        if not self.time_rounds:
            return self.step
        agreed = self.algo.tokens_agreed / max(1, self.tokens_per_step * self.world)
        return agreed + (self.step - self.synced_step)

    def tokens_seen(self) -> int:
        """Tokens trained by all workers (with time-budgeted rounds: as agreed at the last sync)."""
        if self.time_rounds:
            return int(self.algo.tokens_agreed)
        steps = self.transport.steps_trained()
        if steps is not None:  # the members changed (a simulation with churn)
            return steps * self.tokens_per_step
        return self.tokens_before + (self.step - self.start_step) * self.tokens_per_step * self.world


class RunClock:
    """Seconds a run spent: on the wall over all its segments (``wall_s``), and of ``run.max_time`` (``budget_s``):
    a resumed run gets its budget afresh, counted from the resume. In the simulator (``virtual``) the budget is
    this worker's virtual seconds, as its rounds and network count them: a simulated run of 10 minutes is the
    run 10 minutes of those workers would train, whatever this machine's load.

    ``solo``: one process is the whole run, and its own clock decides; elsewhere the processes decide on rank
    0's clock as it was at their latest agreement (:meth:`agree`)."""

    def __init__(self, transport: Transport, virtual: bool, solo: bool) -> None:
        self.transport, self.virtual, self.solo = transport, virtual, solo
        self.wall_prior = 0.0  # training seconds of earlier segments of a resumed run
        self.budget_prior = 0.0  # seconds of run.max_time they spent (virtual ones in the simulator)
        self._t0: Optional[float] = None
        self._mark: Any = None
        self.agreed = (0, 0.0)  # (step, budget_s) as rank 0 saw it at the latest agreement

    def start(self, step: int) -> None:
        self._t0 = time.perf_counter()
        self._mark = self.transport.mark() if self.virtual else None
        self.agreed = (step, 0.0)

    def wall_s(self) -> float:
        return self.wall_prior + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def budget_s(self) -> float:
        """Seconds of this segment spent of ``run.max_time``."""
        if self._mark is not None:
            return self.transport.seconds_since(self._mark)
        return self.wall_s() - self.wall_prior

    def budget_spent_s(self) -> float:
        """The budget spent over every segment (what a checkpoint keeps)."""
        return self.budget_prior + (self.budget_s() if self._t0 is not None else 0.0)

    def agree(self, step: int, spent: float) -> None:
        self.agreed = (step, float(spent))

    def agreed_budget_s(self, step: int, start_step: int) -> float:
        """:meth:`budget_s` as every process of the run counts it alike: rank 0's clock at the latest agreement,
        moved on by the steps since at the rate seen until then; one process alone reads its own clock."""
        if self.solo:
            return self.budget_s()
        at, spent = self.agreed
        rate = spent / (at - start_step) if at > start_step else 0.0
        return spent + (step - at) * rate


class LrSchedule:
    """The lr of every param group: ``initial_lr`` (the peak) times :func:`lr_factor`, by the run's progress in
    steps (``run.max_steps``) or in time (``run.max_time``: the schedule ends where this segment's budget does,
    stretched on a resume)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config, progress: Progress, clock: RunClock) -> None:
        self.optimizer, self.cfg, self.progress, self.clock = optimizer, cfg, progress, clock
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]

    def apply(self) -> float:
        """Set this step's lr; returns the first group's."""
        run, o, p = self.cfg.run, self.cfg.optim, self.progress
        if run.max_steps:
            fraction = (p.run_step() - o.warmup_steps) / max(1, run.max_steps - o.warmup_steps)
        else:
            c = self.clock
            fraction = (c.budget_prior + c.agreed_budget_s(p.step, p.start_step)) / (c.budget_prior + run.max_time)
        factor = lr_factor(p.step, o.warmup_steps, fraction, o.schedule, o.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        return self.optimizer.param_groups[0]["lr"]


class StopRule:
    """Where the loop stops, and where it saves: points every worker reaches together. DDP's workers meet at any
    step; round-based algorithms' after a sync. With time-budgeted rounds ``run.max_steps`` is a token budget
    (max_steps x batch tokens x workers) checked against the tokens all workers agreed on in the averages.

    The clock (``run.max_time``) and a stop signal (``on_request``: see :mod:`launch.loop.signals`) are decided by
    one process alone, or by every process on rank 0's view in one broadcast, where all of them are (round-based:
    a sync; else every ``log.every``-th step). ``stopped_by``: the signal that stopped the loop."""

    def __init__(self, cfg: Config, progress: Progress, clock: RunClock, on_request: bool) -> None:
        self.cfg, self.progress, self.clock, self.on_request = cfg, progress, clock, on_request
        self.algo, self.transport = progress.algo, progress.transport
        self.stopped_by: Optional[int] = None

    def __call__(self, synced: bool) -> bool:
        run, p = self.cfg.run, self.progress
        if p.time_rounds:
            stop = synced and bool(run.max_steps) and \
                self.algo.tokens_agreed >= run.max_steps * p.tokens_per_step * p.world
        else:
            stop = bool(run.max_steps and p.step >= run.max_steps)
        timed = run.max_time is not None
        if stop or not (timed or self.on_request):
            return stop
        if self.clock.solo:
            spent, signum = self.clock.budget_s(), STOP.signum
        elif synced if self.algo.round_based else p.step % self.cfg.log.every == 0:
            spent, signum = self.transport.broadcast_object((self.clock.budget_s(), STOP.signum))
            self.clock.agree(p.step, spent)
        else:
            return False
        if timed and spent >= run.max_time:
            return True
        if self.on_request and signum is not None:
            self.stopped_by = int(signum)
            return True
        return False

    def checkpoint_due(self, synced: bool) -> bool:
        every = self.cfg.run.checkpoint_every
        if not every:
            return False
        if self.progress.time_rounds:  # a round count every worker shares
            rounds = max(1, -(-every // self.cfg.algo.inner_steps))
            return synced and self.algo.round % rounds == 0
        return self.progress.step % every == 0
