"""The run folder: which one a run writes (a new one, the one it resumes, the one it starts over in), its
``config.yaml``, ``summary.json`` and ``tokenizer.json``, and moving an earlier run aside. What its checkpoints
hold and how a run resumes from them is :mod:`launch.loop.checkpointer`'s.

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

from diloco.comm import Transport
from launch.store.checkpoint import list_checkpoints, slices_folder, step_of
from launch.config import Config, dump_config
from launch.data.tokenizer import Tokenizer
from launch.errors import RunError
from launch.store.disk import write_file
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

    def truncate_metrics(self, step: int) -> None:
        truncate_metrics(self.path / "metrics.jsonl", step)

    def write_tokenizer(self, tokenizer: Optional[Tokenizer]) -> None:
        """A copy of a BPE tokenizer's file (the checkpoints hold it too), for tools that read the folder."""
        if self.leader and tokenizer is not None and tokenizer.json:
            self._write("tokenizer.json", tokenizer.json)

    def write_config(self, cfg: Config) -> None:
        """The run's settings, for --resume (written once the run starts: a refused resume leaves them alone)."""
        if self.leader:
            self._write("config.yaml", dump_config(cfg))

    def write_summary(self, summary: dict[str, Any]) -> Path:
        return self._write("summary.json", json.dumps(summary, indent=2) + "\n")

    def write_windows(self, record: dict[str, Any]) -> Path:
        """``val_windows.json``: what each validation window summed at the end, so that runs scored on the same
        windows compare with a paired error (:func:`launch.eval.validation.paired_gap`)."""
        return self._write("val_windows.json", json.dumps(record) + "\n")

    def _write(self, name: str, text: str) -> Path:
        return write_file(self.path / name, text)  # a full disk: one DiskFull line

    def final_line_logged(self, step: int) -> bool:
        """Whether metrics.jsonl already ends ``step`` with a final validation line (leader; False elsewhere)."""
        if not self.leader or not (self.path / "metrics.jsonl").is_file():
            return False
        return any(r.get("step") == step and "val_loss" in r and "loss" not in r for r in read_metrics(self.path))


def discard_run(path: Path, why: str = "--restart", after_step: Optional[int] = None) -> Optional[Path]:
    """Move a run folder's checkpoints, metrics and wandb run id into ``path/discarded-<time>/`` (``--restart``,
    or a new run in the folder of one that left no checkpoint); ``after_step``: only the checkpoints of later
    steps (``--resume-from`` an earlier one: the metrics are cut at its step as at any resume).

    Nothing is deleted: the unreadable (or unwanted) files stay there for a look, and go with ``rm -r``.
    """
    movable = [c for c in list_checkpoints(path / "checkpoints") if after_step is None or step_of(c) > after_step]
    movable += [f for f in map(slices_folder, movable) if f.exists()]
    movable += [path / n for n in RUN_FILES if after_step is None and (path / n).exists()]
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
