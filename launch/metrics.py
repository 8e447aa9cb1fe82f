"""What a run reports: metrics.jsonl, a progress bar or plain lines, optional wandb, plots.

Only the leading worker (rank 0) writes files and prints the progress; every
log line carries its context, e.g. ``[worker 0 | step 600/1000]``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

# dense bf16 peak FLOP/s of common accelerators, for the MFU estimate
_GPU_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
             "L4": 121e12, "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12}
_cpu_peak: Optional[float] = None


def peak_flops(device: torch.device) -> Optional[float]:
    """Best-effort peak FLOP/s: a table for GPUs, a short fp32 matmul measurement on CPU."""
    global _cpu_peak
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _GPU_PEAK.items() if k in name), None)
    if device.type == "cpu":
        if _cpu_peak is None:
            a = torch.randn(512, 512)
            torch.mm(a, a)
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.1:
                torch.mm(a, a)
                n += 1
            _cpu_peak = 2 * 512**3 * n / (time.perf_counter() - start)
        return _cpu_peak
    return None


def _wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


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
        self.mode = log_cfg.progress
        if self.mode == "auto":
            self.mode = "bar" if sys.stderr.isatty() else "plain"
        if not self.active:
            return
        self._file = open(self.path, "a", buffering=1)
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr)
        if log_cfg.wandb:
            import wandb

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

    def log(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None and k != "step"}, step=record["step"])
        text = _format(record)
        if self._bar is not None:
            self._bar.n = record["step"]
            self._bar.set_postfix_str(text, refresh=True)
        elif self.mode == "plain":
            print(f"{self.prefix(record['step'])} {text}", file=sys.stderr, flush=True)

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
    f.write_text(rid)
    return rid


def _format(r: dict[str, Any]) -> str:
    parts = [f"loss {r['loss']:.4f}" if r.get("loss") is not None else None]
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
    parts.append(f"lr {r['lr']:.2e}" if r.get("lr") is not None else None)
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s'] / 1e3:.1f}k tok/s")
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    if r.get("bytes_sent"):
        parts.append(f"sent {human_bytes(r['bytes_sent'])}")
    return " | ".join(p for p in parts if p)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop lines logged after ``after_step`` (a resumed run logs them again)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= after_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(l + "\n" for l in keep))
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a loco run folder?)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def plot_runs(run_dirs: Iterable[str | Path], out: str | Path, title: Optional[str] = None) -> Path:
    """Loss vs tokens and loss vs bytes communicated, one line per run, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, (ax_tok, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    any_bytes = False
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        label = Path(run_dir).name
        train = [r for r in rows if r.get("loss") is not None]
        val = [r for r in rows if r.get("val_loss") is not None]
        line, = ax_tok.plot([r["tokens"] for r in train], [r["loss"] for r in train], alpha=0.5, label=f"{label} train")
        color = line.get_color()
        if val:
            ax_tok.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", color=color, label=f"{label} val")
        # bytes axis is logarithmic: a run that has sent nothing yet has no point there
        sent = [r for r in train if r.get("bytes_sent")]
        sent_val = [r for r in val if r.get("bytes_sent")]
        if sent or sent_val:
            any_bytes = True
            ax_bytes.plot([r["bytes_sent"] for r in sent], [r["loss"] for r in sent], alpha=0.5, color=color,
                          label=f"{label} train")
            if sent_val:
                ax_bytes.plot([r["bytes_sent"] for r in sent_val], [r["val_loss"] for r in sent_val], "o-",
                              color=color, label=f"{label} val")
    ax_tok.set_xlabel("tokens trained (all workers)")
    ax_bytes.set_xlabel("bytes sent per worker")
    if any_bytes:
        ax_bytes.set_xscale("log")
        ax_bytes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_bytes(x)))
        ax_bytes.xaxis.set_minor_formatter(NullFormatter())
        ax_bytes.legend(fontsize=8)
    else:
        ax_bytes.text(0.5, 0.5, "no bytes communicated\n(single worker)", ha="center", va="center",
                      transform=ax_bytes.transAxes, color="gray")
        ax_bytes.set_xticks([])
    for ax in (ax_tok, ax_bytes):
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
