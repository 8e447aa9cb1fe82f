"""The run folder: which one a run writes (a new one, the one it resumes, the one it starts over in), the
checkpoint it resumes from, its ``config.yaml`` and ``summary.json``, and moving an earlier run aside.

Rank 0 decides and every process of the run follows its answer (one broadcast), so processes whose clocks or
files differ still agree on one folder and one checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from diloco.comm import Transport, read_slices
from diloco.reshard import join_model
from launch.store.checkpoint import checkpoint_name, latest_checkpoint, list_checkpoints, load_checkpoint, slices_folder
from launch.config import Config, dump_config
from launch.errors import RunError
from launch.store.disk import fsync_dir, write_file
from launch.metrics.log import read_metrics, truncate_metrics

# what --restart (or a new run over one that left no checkpoint) moves aside
RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", ".wandb_id")


def elastic_restart() -> int:
    """How often torchrun restarted this run's workers (--max-restarts): they continue from the checkpoint."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class RunDir:
    """A run's folder, as every process of the run agreed on it.

    ``restart``: start over from step 0 in ``run.dir``, moving its checkpoints and metrics aside.
    ``joined``: the folder of a run in progress that this worker joins (a simulated worker coming back): it is
    taken as it is, without the start-up collectives.
    """

    def __init__(self, cfg: Config, transport: Transport, restart: bool = False,
                 joined: Optional[Path] = None) -> None:
        self.cfg, self.transport, self.restart = cfg, transport, restart
        self.joined = joined is not None
        self.leader = transport.is_leader
        self.path = Path(joined) if joined is not None else self._agree()
        self.checkpoints = self.path / "checkpoints"

    # ---- a sharded run's checkpoints: every process's own state beside the file ----------------------
    def save_slices(self, step: int, state: dict[str, Any]) -> None:
        """Every process's own ``state`` (its slices: its share of the model, the optimizer's and the algorithm's
        state, its RNG) into the slices folder of step ``step``'s checkpoint (a collective of every process),
        through a temporary folder the leader renames once all have written: the checkpoint's file, written after,
        stands for both."""
        final = slices_folder(self.checkpoints / checkpoint_name(step))
        tmp = final.with_name(f".{final.name}.tmp")
        if self.leader:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.transport.barrier()
        self.transport.save_slices(tmp, state)
        if self.leader:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_dir(final.parent)
        self.transport.barrier()

    def load_slices(self, path: Path) -> dict[str, Any]:
        """This process's own state in the checkpoint ``path`` of a sharded run laid out as this one."""
        return self.transport.load_slices(slices_folder(path))

    @staticmethod
    def whole_worker(path: Path, written: dict[str, int], worker: int, algorithm: type) -> dict[str, Any]:
        """Worker ``worker``'s state held whole, from the checkpoint ``path`` of a sharded run laid out as
        ``written`` (nodes, processes a node): the parts its processes kept, joined (:mod:`diloco.reshard`);
        ValueError where they cannot be."""
        parts = [read_slices(slices_folder(path), worker * written["per_node"] + q) for q in range(written["per_node"])]
        return {**parts[0], "model": join_model([p["model"] for p in parts], parts[0].get("cut_keys", [])),
                "algo": algorithm.whole_state([p["algo"] for p in parts])}

    def _agree(self) -> Path:
        run = self.cfg.run
        if self.restart:  # starts over, whatever the run's config.yaml says (a resume attempt wrote resume: true)
            run.resume = False
        if elastic_restart() and not run.resume:
            if not run.dir:
                raise RunError("torchrun restarted the workers, but the run has no fixed folder to continue from: "
                               "pass --run-dir DIR (needed with --max-restarts)")
            run.resume = True
        chosen = None
        if self.leader:
            if run.dir:
                chosen = run.dir
            elif run.resume:
                chosen = ""
            else:
                chosen = f"runs/{run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        chosen = self.transport.broadcast_object(chosen)
        if not chosen:
            raise RunError("run.resume needs the run folder to continue: pass --run-dir DIR")
        path = Path(chosen)
        if self.leader:
            self._prepare(path)
        return path

    def _prepare(self, path: Path) -> None:
        run = self.cfg.run
        if self.restart:
            discard_run(path)
        if not run.resume and any((path / "checkpoints").glob("step_*.pt")):
            raise RunError(f"{path} already holds checkpoints of an earlier run; "
                           f"pass --resume to continue it, --restart to start it over from step 0 "
                           f"(its checkpoints and metrics are moved aside), or choose another --run-dir")
        if not run.resume and not self.restart and (path / "metrics.jsonl").exists():
            # an earlier run without checkpoints (a crash before the first, checkpoint_every=0): its curve
            # would be appended to, and its wandb run continued; both are moved aside, nothing is lost
            discard_run(path, "an earlier run's metrics (no checkpoints)")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"{path}: the run folder cannot be made: {e.strerror or e}") from None

    def resume_state(self, rank: int) -> Optional[tuple[Path, dict[str, Any]]]:
        """The checkpoint to resume from and its state, as every process of the run agreed on it (``run.resume``);
        None where there is none. A folder whose checkpoints all fail to load is a RunError: starting over
        would lose the run (and prune its files)."""
        if not self.cfg.run.resume or self.joined:
            return None
        found = None
        if self.leader:
            skipped: list[str] = []
            hit = latest_checkpoint(self.checkpoints, map_location="cpu", on_skip=skipped.append)
            if hit is not None:
                for line in skipped:
                    print(f"[worker {rank}] skipping checkpoint {line}", file=sys.stderr, flush=True)
                found = str(hit[0])
            elif skipped:
                found = ("error", unreadable_message(self.path, self.checkpoints))
        found = self.transport.broadcast_object(found)
        if isinstance(found, tuple):
            raise RunError(found[1])
        if found is None:
            if self.leader:
                print(f"[worker {rank}] no checkpoint in {self.checkpoints}: starting from step 0", flush=True)
                self.truncate_metrics(0)  # an earlier attempt's lines would repeat
            return None
        # every process reads the file; processes on another machine without it get the leader's copy
        have = self.transport.all_gather_object(Path(found).is_file())
        if all(have):
            state = load_checkpoint(found, map_location="cpu")
        else:
            state = self.transport.broadcast_object(load_checkpoint(found, map_location="cpu") if self.leader else None)
        return Path(found), state

    def truncate_metrics(self, step: int) -> None:
        truncate_metrics(self.path / "metrics.jsonl", step)

    def write_tokenizer(self, tokenizer: Any) -> None:
        """A copy of a BPE tokenizer's file (the checkpoints hold it too), for tools that read the folder."""
        if self.leader and getattr(tokenizer, "json", None):
            self._write("tokenizer.json", tokenizer.json)

    def write_config(self, cfg: Config) -> None:
        """The run's settings, for --resume (written once the run starts: a refused resume leaves them alone)."""
        if self.leader:
            self._write("config.yaml", dump_config(cfg))

    def write_summary(self, summary: dict[str, Any]) -> Path:
        return self._write("summary.json", json.dumps(summary, indent=2) + "\n")

    def _write(self, name: str, text: str) -> Path:
        return write_file(self.path / name, text)  # a full disk: one DiskFull line

    def final_line_logged(self, step: int) -> bool:
        """Whether metrics.jsonl already ends ``step`` with a final validation line (leader; False elsewhere)."""
        if not self.leader or not (self.path / "metrics.jsonl").is_file():
            return False
        return any(r.get("step") == step and "val_loss" in r and "loss" not in r for r in read_metrics(self.path))


def discard_run(path: Path, why: str = "--restart") -> Optional[Path]:
    """Move a run folder's checkpoints, metrics and wandb run id into ``path/discarded-<time>/`` (``--restart``,
    or a new run in the folder of one that left no checkpoint).

    Nothing is deleted: the unreadable (or unwanted) files stay there for a look, and go with ``rm -r``.
    """
    movable = list_checkpoints(path / "checkpoints")
    movable += [f for f in map(slices_folder, movable) if f.exists()]
    movable += [path / n for n in RUN_FILES if (path / n).exists()]
    if not movable:
        return None
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    dest, n = path / f"discarded-{stamp}", 1
    while dest.exists():
        n += 1
        dest = path / f"discarded-{stamp}-{n}"
    (dest / "checkpoints").mkdir(parents=True)
    for p in movable:
        shutil.move(str(p), str(dest / p.relative_to(path)))
    print(f"loco: {why}: moved {len(movable)} file(s) of the earlier run to {dest}", file=sys.stderr, flush=True)
    return dest


def unreadable_message(run_dir: Path, ckpt_dir: Path) -> str:
    """The one line that refuses to resume from a folder whose checkpoints are all unreadable."""
    names = [p.name for p in list_checkpoints(ckpt_dir)]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"{ckpt_dir}: none of its {len(names)} checkpoint(s) can be read ({shown}: truncated, corrupted or "
            f"not loco checkpoints), so there is nothing to resume from; remove them, or pass --restart instead "
            f"of --resume to start over from step 0 in {run_dir} (they are moved to {run_dir}/discarded-<time>/)")
