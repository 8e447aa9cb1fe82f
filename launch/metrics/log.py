"""What a run reports: metrics.jsonl, a progress bar or plain lines, optional wandb.

Only the leading worker (rank 0) writes files and prints the progress; every
log line carries its context, e.g. ``[worker 0 | step 600/1000]``. Model FLOPs
utilisation is counted in :mod:`launch.metrics.mfu`; plots of runs are drawn by
:mod:`launch.metrics.plots`.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections import deque
from pathlib import Path
from typing import Any, Optional

from launch.store.disk import AppendFile, human_bytes, write_file

__all__ = ["Metrics", "human_bytes", "read_metrics", "truncate_metrics", "count_label"]


def _wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


# records whose tokens/s (and mfu) the progress line's moving median spans
RATE_WINDOW = 8


class Metrics:
    """Writes metrics.jsonl and shows progress. Inactive (no output) on non-leading workers."""

    def __init__(self, run_dir: Optional[Path], log_cfg, active: bool, total_steps: Optional[int],
                 start_step: int = 0, rank: int = 0, run_config: Optional[dict] = None, run_name: str = "loco") -> None:
        self.active = active and run_dir is not None
        self.rank, self.total = rank, total_steps
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl" if run_dir else None
        self._file = None
        self._bar = None
        self._wandb = None
        self._rates: deque[tuple[float, Optional[float]]] = deque(maxlen=RATE_WINDOW)  # (tokens/s, mfu) per record
        self._pace: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW + 1)  # (step, wall_s) per record, for the ETA
        self.mode = log_cfg.progress
        if self.mode == "auto":
            self.mode = "bar" if sys.stderr.isatty() else "plain"
        if not self.active:
            return
        self._file = AppendFile(self.path)  # a full disk: one DiskFull line, the run stops
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)
        if log_cfg.wandb:
            from diloco.extras import require

            wandb = require("wandb", "log.wandb=true")

            mode = _wandb_mode(log_cfg.wandb_mode)
            self._wandb = wandb.init(project=log_cfg.wandb_project, entity=log_cfg.wandb_entity, name=run_name,
                                     dir=str(run_dir), config=run_config, mode=mode, resume="allow",
                                     id=_wandb_id(run_dir))
            self.info(f"wandb {mode} run in {run_dir / 'wandb'}")

    def prefix(self, step: Optional[int] = None) -> str:
        where = f"worker {self.rank}"
        if step is not None:
            where += f" | step {step}" + (f"/{self.total}" if self.total else "")
        return f"[{where}]"

    def info(self, message: str, step: Optional[int] = None) -> None:
        if not self.active:
            return
        line = f"{self.prefix(step)} {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def log(self, record: dict[str, Any], show: bool = True) -> None:
        """Write ``record`` to metrics.jsonl (and wandb); ``show``: also print it as a progress line.

        The progress line shows tok/s and mfu as moving medians over the last :data:`RATE_WINDOW` records that
        carry them (one slow or fast interval does not swing the figure); metrics.jsonl keeps each interval's own.
        """
        if not self.active:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None and k != "step"}, step=record["step"])
        if clean.get("tokens_per_s"):
            self._rates.append((clean["tokens_per_s"], clean.get("mfu")))
            mfus = [m for _, m in self._rates if m is not None]
            clean["tokens_per_s"] = statistics.median(t for t, _ in self._rates)
            clean["mfu"] = statistics.median(mfus) if clean.get("mfu") is not None else None
        if not show:
            return
        text = _format(clean)
        eta = self._eta(record)
        if eta is not None and self._bar is None:  # a bar shows its own
            text += f" | eta {format_seconds(eta)}"
        if self._bar is not None:
            self._bar.n = record["step"]
            self._bar.set_postfix_str(text, refresh=True)
        elif self.mode == "plain":
            print(f"{self.prefix(record['step'])} {text}", file=sys.stderr, flush=True)

    def _eta(self, record: dict[str, Any]) -> Optional[float]:
        """Seconds until ``total_steps`` at the pace of the last :data:`RATE_WINDOW` lines (None: no step budget,
        or a single line so far)."""
        if record.get("wall_s") is None or not self.total:
            return None
        self._pace.append((record["step"], record["wall_s"]))
        (s0, t0), (s1, t1) = self._pace[0], self._pace[-1]
        if s1 <= s0:
            return None
        return max(0.0, (self.total - s1) * (t1 - t0) / (s1 - s0))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """One wandb run per run folder, kept across resumes."""
    f = run_dir / ".wandb_id"
    if f.is_file():
        return f.read_text().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    write_file(f, rid)
    return rid


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _format(r: dict[str, Any]) -> str:
    parts = [f"loss {r['loss']:.4f}" if r.get("loss") is not None else None]
    if r.get("val_loss") is not None:
        se = f" ± {r['val_loss_se']:.4f}" if _finite(r.get("val_loss_se")) else ""
        bpb = f" ({r['val_bpb']:.3f} bpb)" if r.get("val_bpb") is not None else ""
        parts.append(f"val {r['val_loss']:.4f}{se}{bpb}")
    parts.append(f"lr {r['lr']:.2e}" if r.get("lr") is not None else None)
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s'] / 1e3:.1f}k tok/s")
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    if r.get("bytes_sent"):
        parts.append(f"sent {human_bytes(r['bytes_sent'])}")
    return " | ".join(p for p in parts if p)


def _lines(path: Path) -> list[tuple[str, Any]]:
    """Each line of ``path`` with its JSON record, None for one that is not (cut by a crash or a full disk, or
    not UTF-8)."""
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            out.append((raw.decode(), json.loads(raw)))
        except ValueError:  # UnicodeDecodeError and JSONDecodeError both
            out.append(("", None))
    return out


def format_seconds(s: float) -> str:
    """A duration to read at a glance: ``45s``, ``12m30s``, ``3h05m``."""
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop lines logged after ``after_step`` (a resumed run logs them again), and lines that do not read."""
    if not path.is_file():
        return
    keep = [line for line, r in _lines(path) if isinstance(r, dict) and r.get("step", 0) <= after_step]
    write_file(path, "".join(l + "\n" for l in keep))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run folder's metrics.jsonl; lines that do not read are left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a loco run folder?)")
    return [r for _, r in _lines(path) if isinstance(r, dict)]


def count_label(x: float) -> str:
    """A count for an axis: ``0``, ``500``, ``200k``, ``1.2M``, ``3B``."""
    if x == 0:
        return "0"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.4g}{suffix}"
    return f"{x:.4g}"
