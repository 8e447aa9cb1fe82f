"""Saving and resuming a worker's training state, in every layout a run has: one replicated state (DDP, DeMo),
every worker's state gathered to the leader (DiLoCo's family, the simulator), or each process's own slices beside
the checkpoint (``run.shard: fsdp``); and the clocks a checkpoint carries (wall time, the time budget spent, the
simulator's virtual time).

A resume takes any of these layouts into any other: its own slices where the checkpoint's processes were laid out
as this run's are, else its worker's state held whole (joined from the slices, or as written) and cut for this
process (:mod:`diloco.reshard`). Rank 0 finds the checkpoint and every process follows its answer.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn

from diloco import Algorithm
from diloco.comm import Transport, read_slices
from diloco.reshard import cut_model, join_model, sharded_keys
from diloco.state import like_sharded, local_tree
from launch.config import Config, changed_settings
from launch.data.batches import Batches
from launch.errors import RunError
from launch.loop.rundir import RunDir, discard_run
from launch.loop.report import Window
from launch.loop.schedule import Progress, RunClock
from launch.loop.shared_state import host_copy
from launch.loop.signals import STOP, save_waiting_for_it
from launch.models.base import RunModel
from launch.store.checkpoint import (checkpoint_name, is_valid_checkpoint, latest_checkpoint, list_checkpoints,
                                     load_checkpoint, rng_state, set_rng_state, slices_folder)
from launch.store.disk import fsync_dir


@dataclass
class WorkerObjects:
    """What a worker's checkpoint is made of and restored into."""

    model: nn.Module
    algo: Algorithm
    batcher: Batches
    progress: Progress
    clock: RunClock
    window: Window
    tokenizer: Any = None
    model_args: Any = None


class Checkpointer:
    """The checkpoints of one process of a run: where they are (``folder.checkpoints``), what they hold, and the
    step of the one this process last wrote or loaded (``saved_step``)."""

    def __init__(self, cfg: Config, transport: Transport, folder: RunDir, worker: WorkerObjects,
                 processes: Optional[int] = None) -> None:
        """``processes``: the processes a sharded worker is cut among (None: unsharded)."""
        self.cfg, self.transport, self.folder, self.worker = cfg, transport, folder, worker
        self.rank, self.world, self.leader = transport.rank, transport.world_size, transport.is_leader
        self.processes = processes
        self.saved_step: Optional[int] = None
        self.signalled_while_saving = False  # by the last save (leader)
        self.resume_changes: Optional[str] = None  # settings changed since the checkpoint (set by a resume)
        # (the run's tokens, this worker's) as the checkpoint counted them; None where it kept no count
        self.resumed_tokens: tuple[Optional[int], Optional[int]] = (None, None)

    @property
    def sharded(self) -> bool:
        return self.processes is not None

    @property
    def slice_layout(self) -> Optional[dict[str, int]]:
        """How a sharded run's processes are laid out (its slices are cut for them); None unsharded."""
        return {"nodes": self.world, "per_node": self.processes} if self.sharded else None

    # ---- what a checkpoint holds --------------------------------------------------------------
    def worker_state(self) -> dict[str, Any]:
        """What differs between workers: local model, algorithm (inner and outer optimizer), data, RNG."""
        w = self.worker
        return {
            "step": w.progress.step,
            "model": w.model.state_dict(),
            "algo": w.algo.state_dict(),
            "data": {"samples": w.batcher.samples_before(w.progress.step), "worker_index": self.rank,
                     "num_workers": self.world, "seed": self.cfg.run.seed},
            "rng": rng_state(),
            "comm": self.transport.stats.as_dict(),
            "log_window": w.window.state(),
            "followed": w.progress.followed,
            "tokens": w.progress.my_tokens(),
        }

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: shared fields, then the worker state (replicated algorithms) or all workers' states."""
        w = self.worker
        shared: dict[str, Any] = {
            "wall_s": w.clock.wall_s(),
            "budget_s": w.clock.budget_spent_s(),
            "config": self.cfg.to_dict(),
            "tokens": w.progress.tokens_seen(),
            "model_args": vars(w.model_args) if w.model_args is not None else None,
            "hf_config": w.model.config_dict() if isinstance(w.model, RunModel) else None,
            "tokenizer": w.tokenizer.state() if w.tokenizer is not None else None,
            "num_workers": self.world,
        }
        if w.batcher.keeps_position:  # each worker's stream position, by worker (churn leaves gaps)
            shared["streams"] = self.transport.gather_object((self.rank, w.batcher.state_dict()))
        if self.sharded:  # every process's own state goes into the slices folder (save); here the whole model
            with w.algo.evaluation_weights():
                whole = self.transport.whole_model_state(w.model)
            return {**shared, "model": whole, "slices": self.slice_layout, **self._clock_state()} if self.leader else {}
        if w.algo.replicated_state:
            mine = self.worker_state()
            return {**shared, **mine, **self._clock_state()}
        mine = host_copy(self.worker_state())
        states = self.transport.gather_object(mine)  # on the leader only
        clock = self._clock_state()
        if states is None:
            return {}
        with w.algo.evaluation_weights():  # the global model, for sampling and evaluation
            global_model = host_copy(w.model.state_dict())
        return {**shared, "model": global_model, "workers": states, **clock}

    def _clock_state(self) -> dict[str, Any]:
        """The transport's clock (the simulator's virtual time), read after the workers' states: an exchange in
        flight that a state waits for moves it."""
        clock = self.transport.clock_state()
        return {} if clock is None else {"clock": clock}

    def save(self) -> Optional[Path]:
        """Rank 0 writes; algorithms whose workers differ first gather every worker's state (a collective). A
        sharded worker's processes first write their own states together (:meth:`save_slices`). The path written,
        on the leader; None elsewhere."""
        step = self.worker.progress.step
        if self.sharded:
            mine = self.worker_state()
            self.save_slices(step, {**local_tree(mine), "cut_keys": sharded_keys(mine["model"])})
        state = self.state_dict()
        self.saved_step = step
        if not self.leader:
            return None
        before = STOP.signum
        path = save_waiting_for_it(self.folder.checkpoints, step, state, keep=self.cfg.run.keep_checkpoints)
        # a first signal that came during a save outside the loop (the final one) waited for it, and stops there
        self.signalled_while_saving = before is None and STOP.signum is not None and STOP.listening == 0
        return path

    # ---- resuming -------------------------------------------------------------------------------
    def resume(self) -> Optional[Path]:
        """Load the run's latest checkpoint (``run.resume``), whatever its layout; the path, or None."""
        found = self.find()
        if found is None:
            return None
        path, state = found
        self.resume_changes = changed_settings(state.get("config"), self.cfg)
        try:
            if "slices" in state or self.sharded:
                state = {**state, "mine": self._process_state(path, state)}
            self.load_state(state)
        except (ValueError, RuntimeError) as e:  # another algorithm, model shape or fragment layout
            text = str(e).strip()
            text = text if len(text) <= 600 else text[:600] + " ..."
            changed = f"\nSettings changed since it was saved: {self.resume_changes}" if self.resume_changes else ""
            raise RunError(f"{path}: cannot resume this run from it: {text}{changed}") from None
        if self.leader:
            self.folder.truncate_metrics(self.worker.progress.step)
        self.saved_step = self.worker.progress.step
        return path

    def find(self) -> Optional[tuple[Path, dict[str, Any]]]:
        """The checkpoint to resume from and its state, as every process of the run agreed on it (``run.resume``);
        None where there is none. A folder whose checkpoints all fail to load is a RunError: starting over
        would lose the run (and prune its files)."""
        folder = self.folder
        if not self.cfg.run.resume or folder.joined:
            return None
        found = None
        chosen = self.cfg.run.resume_from
        if self.leader and chosen:  # --resume-from: this checkpoint, or one line saying why not
            found = str(chosen) if is_valid_checkpoint(chosen) else \
                ("error", f"--resume-from {chosen}: not a complete loco checkpoint (cut short, or another file); "
                          f"name another, or --resume for the newest valid one")
        elif self.leader:
            skipped: list[str] = []
            hit = latest_checkpoint(folder.checkpoints, map_location="cpu", on_skip=skipped.append)
            if hit is not None:
                for line in skipped:
                    print(f"[worker {self.rank}] skipping checkpoint {line}", file=sys.stderr, flush=True)
                found = str(hit[0])
            elif skipped:
                found = ("error", unreadable_message(folder.path, folder.checkpoints))
        found = self.transport.broadcast_object(found)
        if isinstance(found, tuple):
            raise RunError(found[1])
        if found is None:
            if self.leader:
                print(f"[worker {self.rank}] no checkpoint in {folder.checkpoints}: starting from step 0", flush=True)
                folder.truncate_metrics(0)  # an earlier attempt's lines would repeat
            return None
        # every process reads the file; processes on another machine without it get the leader's copy
        have = self.transport.all_gather_object(Path(found).is_file())
        if all(have):
            state = load_checkpoint(found, map_location="cpu")
        else:
            state = self.transport.broadcast_object(load_checkpoint(found, map_location="cpu") if self.leader else None)
        if chosen and self.leader:  # the branch after it is not this run's any more; nothing is deleted
            discard_run(folder.path, f"--resume-from step {state['step']}", after_step=int(state["step"]))
        return Path(found), state

    def load_state(self, state: dict[str, Any]) -> None:
        w = self.worker
        self._same_workers(state)
        mine = self._my_state(state)
        w.model.load_state_dict(mine["model"])
        w.algo.load_state_dict(mine["algo"])
        set_rng_state(mine["rng"])
        w.progress.step, w.progress.followed = int(mine["step"]), int(mine.get("followed", 0))
        self.resumed_tokens = (state.get("tokens"), mine.get("tokens"))
        if w.batcher.keeps_position:
            w.batcher.load_state_dict(dict(state.get("streams") or []).get(self.rank))
        w.clock.wall_prior = float(state.get("wall_s", 0.0))
        w.clock.budget_prior = float(state["budget_s"])  # the time budget spent before (virtual in the simulator)
        w.window.load(mine.get("log_window", {}))
        comm = mine.get("comm", {})
        stats = self.transport.stats
        stats.bytes_sent = int(comm.get("bytes_sent", 0))
        stats.bytes_received = int(comm.get("bytes_received", 0))
        stats.peak_bytes = int(comm.get("peak_bytes", 0))
        if "clock" in state:
            self.transport.load_clock_state(state["clock"])

    def _same_workers(self, state: dict[str, Any]) -> None:
        if state.get("num_workers", 1) != self.world:
            raise RunError(f"the checkpoint was written by {state.get('num_workers', 1)} workers and this run has "
                           f"{self.world}; resume with the same number of workers")

    def _process_state(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """This process's state where the checkpoint or this run is sharded: its own slices where both are laid
        out alike; else its worker's state held whole (joined from the slices of the processes that wrote it, or
        as an unsharded run wrote it), cut for this process (:mod:`diloco.reshard`)."""
        written = state.get("slices")
        if written == self.slice_layout:
            return self.transport.load_slices(slices_folder(path))
        self._same_workers(state)
        w = self.worker
        whole = self.whole_worker(path, written, self.rank, type(w.algo)) if written else self._my_state(state)
        return {**whole, "model": cut_model(w.model.state_dict(), whole["model"]),
                "algo": w.algo.cut_state(whole["algo"])}

    def _my_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This worker's part of a checkpoint. A worker a simulation with churn had away when it was written has
        none: it comes back as a joining worker would, on worker 0's state (the run's model, at the run's step).
        A sharded run's process takes its own state, its slices made its model's layout again."""
        if "mine" in state:
            mine = state["mine"]
            return {**mine, "model": like_sharded(self.worker.model.state_dict(), mine["model"])}
        if "workers" not in state:
            return state
        workers = {int(w["data"]["worker_index"]): w for w in state["workers"]}
        if self.rank in workers:
            return workers[self.rank]
        print(f"[worker {self.rank}] away when the checkpoint was written: it starts from worker 0's state",
              file=sys.stderr, flush=True)
        return workers[0]

    # ---- a sharded run's slices: every process's own state beside the checkpoint's file ------------------
    def save_slices(self, step: int, state: dict[str, Any]) -> None:
        """Every process's own ``state`` (its slices: its share of the model, the optimizer's and the algorithm's
        state, its RNG) into the slices folder of step ``step``'s checkpoint (a collective of every process),
        through a temporary folder the leader renames once all have written: the checkpoint's file, written after,
        stands for both."""
        checkpoints = self.folder.checkpoints
        final = slices_folder(checkpoints / checkpoint_name(step))
        tmp = final.with_name(f".{final.name}.tmp")
        if self.leader:
            checkpoints.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.transport.barrier()
        self.transport.save_slices(tmp, state)
        if self.leader:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_dir(final.parent)
        self.transport.barrier()

    @staticmethod
    def whole_worker(path: Path, written: dict[str, int], worker: int, algorithm: type[Algorithm]) -> dict[str, Any]:
        """Worker ``worker``'s state held whole, from the checkpoint ``path`` of a sharded run laid out as
        ``written`` (nodes, processes a node): the slices its processes kept, joined (:mod:`diloco.reshard`);
        ValueError where they cannot be."""
        kept = [read_slices(slices_folder(path), worker * written["per_node"] + q) for q in range(written["per_node"])]
        return {**kept[0], "model": join_model([k["model"] for k in kept], kept[0].get("cut_keys", [])),
                "algo": algorithm.whole_state([k["algo"] for k in kept])}


def unreadable_message(run_dir: Path, ckpt_dir: Path) -> str:
    """The one line that refuses to resume from a folder whose checkpoints are all unreadable."""
    names = [p.name for p in list_checkpoints(ckpt_dir)]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{ckpt_dir}: none of its {len(names)} checkpoint(s) can be read ({shown}: truncated, corrupted or "
            f"not loco checkpoints), so there is nothing to resume from; remove them, or pass --restart instead "
            f"of --resume to start over from step 0 in {run_dir} (they are moved to {run_dir}/discarded-<time>/)")
