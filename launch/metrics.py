"""What a run reports: metrics.jsonl, a progress bar or plain lines, optional wandb, plots.

Only the leading worker (rank 0) writes files and prints the progress; every
log line carries its context, e.g. ``[worker 0 | step 600/1000]``.

MFU is counted here for the trainer's log and ``benchmarks/train_throughput.py``
alike (:func:`mfu_basis`): 6N+attention FLOPs per token against the device's
datasheet peak at the run's precision. CPUs and unlisted devices have no peak,
and so no MFU.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from launch.algorithms import declared_by

# Datasheet peaks of accelerators, in TFLOP/s without sparsity, by the precision the matmuls run in: bf16
# (autocast), tf32 (fp32 tensors under torch.set_float32_matmul_precision("high"), which allow_tf32 also sets)
# and fp32. The first pattern found in the device's name wins, so variants come before their family. A device
# that is not listed, or a CPU, has no peak: no MFU is reported for it rather than a guess.
_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"\bGH200\b", "GH200", {"bf16": 989, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH200 NVL\b", "H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60}),
    (r"\bH200\b", "H200", {"bf16": 989, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", {"bf16": 756.5, "tf32": 378, "fp32": 51.2}),
    (r"\bH100 NVL\b", "H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60}),
    (r"\bH100\b", "H100", {"bf16": 989, "tf32": 494.7, "fp32": 66.9}),
    (r"\bB200\b", "B200", {"bf16": 2250}),
    (r"\bA100\b", "A100", {"bf16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bL40S\b", "L40S", {"bf16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", "L4", {"bf16": 121, "tf32": 60, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"\bRTX 4090\b", "RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"\bRTX 3090\b(?! Ti)", "RTX 3090", {"bf16": 71, "tf32": 35.6, "fp32": 35.6}),
    (r"\bMI300X\b", "MI300X", {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)


@dataclass(frozen=True)
class Peak:
    """A datasheet peak: ``H100 dense bf16 989 TFLOP/s``."""

    device: str
    precision: str  # bf16 | tf32 | fp32
    flops: float  # FLOP/s

    def __str__(self) -> str:
        return f"{self.device} dense {self.precision} {self.flops / 1e12:g} TFLOP/s"


def matmul_precision(device: torch.device, bf16: bool) -> str:
    """The precision a run's matmuls use: bf16 under autocast; fp32 ones run as tf32 on CUDA where torch allows it."""
    if bf16:
        return "bf16"
    if device.type == "cuda":
        return {"high": "tf32", "medium": "bf16"}.get(torch.get_float32_matmul_precision(), "fp32")
    return "fp32"


def peak_of(name: str, precision: str = "bf16") -> Optional[Peak]:
    """The datasheet peak of the accelerator named ``name`` (``torch.cuda.get_device_name``) at ``precision``;
    None for a device or precision the table does not list."""
    for pattern, label, peaks in _PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            tflops = peaks.get(precision)
            return Peak(label, precision, tflops * 1e12) if tflops else None
    return None


def device_peak(device: torch.device, precision: str = "bf16") -> Optional[Peak]:
    """The peak of a CUDA (or ROCm) device from the table; None for CPUs and unlisted devices."""
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device), precision)


def peak_flops(device: torch.device, precision: str = "bf16") -> Optional[float]:
    """FLOP/s of :func:`device_peak`, or None."""
    peak = device_peak(device, precision)
    return peak.flops if peak is not None else None


def flop_label(x: float) -> str:
    """``7.9 MFLOP``, ``1.2 GFLOP``."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"


# the FLOP count MFU uses, in words (launch.models.flops_per_token computes it)
MFU_RULE = ("6N+attention FLOPs per token (N: the weights that multiply, the output projection included and the "
            "embedding lookup not; attention: 12 x layers x dim x seq_len, as in PaLM's appendix B)")


@dataclass(frozen=True)
class Mfu:
    """How model FLOPs utilisation is counted for one model on one device. The trainer's log and
    ``benchmarks/train_throughput.py`` both take it from :func:`mfu_basis`, so they count the same way.

    MFU = ``flops_per_token`` x tokens/s of one device / ``peak.flops``. Without a datasheet peak (CPUs, unlisted
    devices) there is no MFU: ``of`` returns None and nothing prints one.
    """

    flops_per_token: float
    weights: float  # N of 6N
    attention_flops: float  # per token
    seq_len: int
    peak: Optional[Peak]
    device: str  # what ran: "cpu", "NVIDIA H100 80GB HBM3"

    def of(self, tokens_per_s: Optional[float]) -> Optional[float]:
        if self.peak is None or not tokens_per_s:
            return None
        return self.flops_per_token * tokens_per_s / self.peak.flops

    def count(self) -> str:
        """This model's count: ``6N+attention FLOPs per token (6 x 1.05M weights + 2.36 MFLOP attention at
        seq_len 256 = 8.66 MFLOP)``."""
        six_n = f"6 x {count_label(self.weights)} weights"
        if not self.attention_flops:
            return f"6N FLOPs per token ({six_n} = {flop_label(self.flops_per_token)})"
        return (f"6N+attention FLOPs per token ({six_n} + {flop_label(self.attention_flops)} attention at seq_len "
                f"{self.seq_len} = {flop_label(self.flops_per_token)})")

    def describe(self) -> str:
        """One line for a log: which FLOP count against which peak, or why there is no MFU."""
        if self.peak is None:
            return f"mfu: not reported: no datasheet peak for {self.device}"
        return f"mfu: {self.count()} against {self.peak}"


def mfu_basis(model: torch.nn.Module, seq_len: int, device: torch.device, precision: str = "bf16") -> Mfu:
    """The one place MFU's FLOP count and peak come from (see :class:`Mfu`); ``precision`` as
    :func:`matmul_precision` gives it."""
    from launch.models import flops_per_token

    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module counts as the module it wraps
    total = flops_per_token(model, seq_len)
    six_n = flops_per_token(model, 0)  # no context: the attention term is zero
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return Mfu(flops_per_token=total, weights=six_n / 6, attention_flops=total - six_n, seq_len=seq_len,
               peak=device_peak(device, precision), device=name)


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
    """A byte count in binary units, named as such: ``512 B``, ``1.5 KiB``, ``10.7 MiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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


def _read_mapping(path: Path) -> dict[str, Any]:
    """A run folder's config.yaml or summary.json as a dict; {} when missing or unreadable."""
    import yaml

    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):  # missing, torn or hand-edited: the label falls back
        return {}
    return data if isinstance(data, dict) else {}


def run_label(run_dir: str | Path) -> str:
    """What a run was, from its config.yaml and summary.json: ``diloco H=50, 4 workers``, ``ddp, 2 workers``,
    ``streaming H=20 P=4 int8, 4 workers``; the folder name when neither says."""
    run_dir = Path(run_dir)
    cfg = _read_mapping(run_dir / "config.yaml")
    summary = _read_mapping(run_dir / "summary.json")
    algo = cfg.get("algo") if isinstance(cfg.get("algo"), dict) else {}
    name = algo.get("name") or summary.get("algorithm")
    if not isinstance(name, str) or not name:
        return run_dir.name
    parts = [name]
    declared = declared_by(name)
    sync = cfg.get("sync") if isinstance(cfg.get("sync"), dict) else {}
    if declared.round_based:
        if sync.get("mode") == "time" and sync.get("time_budget_s"):
            parts.append(f"T={float(sync['time_budget_s']):g}s")
        elif algo.get("inner_steps"):
            parts.append(f"H={algo['inner_steps']}")
    if declared.fragmented and algo.get("fragments"):
        parts.append(f"P={algo['fragments']}")
    codec = (cfg.get("compress") or {}).get("codec") if isinstance(cfg.get("compress"), dict) else None
    parts += declared.payload_label(algo, codec or summary.get("codec"))
    label = " ".join(parts)
    n = summary.get("num_workers")
    if isinstance(n, int) and n > 0:
        label += f", {n} worker{'s' if n != 1 else ''}"
    return label


def binary_bytes(n: float) -> str:
    """A byte count in binary units for an axis: ``512 B``, ``1 KiB``, ``16 MiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if n == round(n) else f"{n:.3g} {unit}"


def binary_ticks(lo: float, hi: float, most: int = 7) -> list[float]:
    """Powers of two in ``[lo, hi]``, every 1st, 2nd, 4th, 10th or 20th so at most ``most`` remain
    (1, 2, 4 MiB ... / 1, 4, 16 MiB ... / 1, 16, 256 MiB ... / 1 KiB, 1 MiB, 1 GiB)."""
    if not (lo > 0 and hi >= lo and math.isfinite(hi)):
        return []
    first, last = math.ceil(math.log2(lo) - 1e-9), math.floor(math.log2(hi) + 1e-9)
    for step in (1, 2, 4, 10, 20, 40):
        ticks = [2.0 ** e for e in range(-(-first // step) * step, last + 1, step)]
        if len(ticks) <= most:
            return ticks
    return ticks


def count_label(x: float) -> str:
    """A count for an axis: ``0``, ``500``, ``200k``, ``1.2M``, ``3B``."""
    if x == 0:
        return "0"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.4g}{suffix}"
    return f"{x:.4g}"


def virtual_curve(run_dir: str | Path, key: str = "val_loss") -> list[tuple[float, float]]:
    """(virtual seconds, ``key``) of a simulated run's records that carry both, in time order; [] for a run
    without a virtual clock. Each record's steps are priced at the run's final virtual step time
    (``virtual_step_time_s`` in summary.json), as the run's own summary prices them."""
    step = _read_mapping(Path(run_dir) / "summary.json").get("virtual_step_time_s")
    points = []
    for r in read_metrics(run_dir):
        if r.get(key) is None:
            continue
        if isinstance(step, (int, float)) and r.get("virtual_net_s") is not None and r.get("virtual_steps") is not None:
            t = r["virtual_net_s"] + r["virtual_steps"] * step
        elif r.get("virtual_s") is not None:
            t = r["virtual_s"]
        else:
            continue
        points.append((float(t), float(r[key])))
    points.sort(key=lambda p: p[0])
    return points


def loss_at(curve: list[tuple[float, float]], t: float) -> Optional[float]:
    """The loss a curve of (time, loss) had reached at time ``t``, interpolated linearly between points; its last
    loss once it has ended; None before its first point."""
    if not curve or t < curve[0][0]:
        return None
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return curve[-1][1]


def time_to_reach(curve: list[tuple[float, float]], target: float) -> Optional[float]:
    """When a curve of (time, loss) first reaches ``target`` or below, interpolated linearly between points (its
    first point's time when that point is already there); None when it never does."""
    for i, (t, l) in enumerate(curve):
        if l <= target:
            if i == 0:
                return t
            t0, l0 = curve[i - 1]
            return t0 + (t - t0) * (l0 - target) / (l0 - l) if l0 != l else t
    return None


def equal_time_comparison(run_dir: str | Path, baseline_dir: str | Path) -> Optional[dict[str, Any]]:
    """Two simulated runs at equal virtual time, from their validation losses:

    ``at_s``: the virtual time the first of them finished; ``loss_at``: each run's validation loss then
    (interpolated; None before its first evaluation); ``time_to_other``: the virtual time each needed to reach
    the other's final loss (None: not reached). None when a run has no validation loss on a virtual clock."""
    curves = [virtual_curve(run_dir), virtual_curve(baseline_dir)]
    if not all(curves):
        return None
    at = min(c[-1][0] for c in curves)
    return {"at_s": at, "loss_at": [loss_at(c, at) for c in curves],
            "final_loss": [c[-1][1] for c in curves], "final_s": [c[-1][0] for c in curves],
            "time_to_other": [time_to_reach(curves[0], curves[1][-1][1]), time_to_reach(curves[1], curves[0][-1][1])]}


def runs_figure(run_dirs: Iterable[str | Path], title: Optional[str] = None):
    """The figure ``plot_runs`` saves: loss vs tokens, loss vs bytes sent and, for simulated runs, loss vs virtual
    time, one colour per run, labelled with :func:`run_label`; thin lines are the training loss, dots the
    validation loss. On the time panel a dotted line marks when the first run finished, with each run's
    validation loss then. Close it when done."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

    run_dirs = [Path(d) for d in run_dirs]
    runs = [(d, read_metrics(d)) for d in run_dirs]  # every folder is checked before anything is drawn
    methods = [run_label(d) for d in run_dirs]
    labels = [f"{m} ({d.name})" if methods.count(m) > 1 and m != d.name else m  # the same method twice: which folder
              for m, d in zip(methods, run_dirs)]
    # the bytes axis is logarithmic: a run that has sent nothing yet has no point there
    any_bytes = any(r.get("bytes_sent") and (r.get("loss") is not None or r.get("val_loss") is not None)
                    for _, rows in runs for r in rows)
    # simulated runs: loss against virtual time too, where the runs' speed and their networks show
    timed = [(virtual_curve(d, "loss"), virtual_curve(d, "val_loss")) for d, _ in runs]
    any_time = any(train or val for train, val in timed)
    panels = 1 + any_bytes + any_time
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8), squeeze=False)
    axes = list(axes[0])
    ax_tok = axes.pop(0)
    ax_bytes = axes.pop(0) if any_bytes else None
    ax_time = axes.pop(0) if any_time else None
    timed_val: list[tuple[list[tuple[float, float]], Any]] = []  # (validation curve, colour) on the time panel
    handles, any_val = [], False
    sent_range = [math.inf, 0.0]
    for (run_dir, rows), label in zip(runs, labels):
        train = [r for r in rows if r.get("loss") is not None]
        val = [r for r in rows if r.get("val_loss") is not None]
        any_val = any_val or bool(val)
        line, = ax_tok.plot([r["tokens"] for r in train], [r["loss"] for r in train], alpha=0.45, lw=1.2)
        color = line.get_color()
        if val:
            ax_tok.plot([r["tokens"] for r in val], [r["val_loss"] for r in val], "o-", color=color, ms=4)
        handles.append(Line2D([], [], color=color, lw=2, label=label))
        sent = [r for r in train if r.get("bytes_sent")]
        sent_val = [r for r in val if r.get("bytes_sent")]
        for r in sent + sent_val:
            sent_range[0], sent_range[1] = min(sent_range[0], r["bytes_sent"]), max(sent_range[1], r["bytes_sent"])
        if sent:
            ax_bytes.plot([r["bytes_sent"] for r in sent], [r["loss"] for r in sent], alpha=0.45, lw=1.2, color=color)
        if sent_val:
            ax_bytes.plot([r["bytes_sent"] for r in sent_val], [r["val_loss"] for r in sent_val], "o-", color=color,
                          ms=4)
        if ax_time is not None:
            train_t, val_t = timed[len(handles) - 1]
            if train_t:
                ax_time.plot(*zip(*train_t), alpha=0.45, lw=1.2, color=color)
            if val_t:
                ax_time.plot(*zip(*val_t), "o-", color=color, ms=4)
                timed_val.append((val_t, color))
    ax_tok.set_xlabel("tokens trained (all workers)")
    ax_tok.set_xlim(left=0)
    ax_tok.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10], min_n_ticks=3))
    ax_tok.xaxis.set_major_formatter(FuncFormatter(lambda x, _: count_label(x)))
    if ax_bytes is not None:
        ax_bytes.set_xlabel("bytes sent per worker")
        ax_bytes.set_xscale("log", base=2)
        lo, hi = ax_bytes.get_xlim()
        if len(binary_ticks(lo, hi)) < 3:  # a short run: widen to the powers of two around the data
            lo, hi = 2.0 ** math.floor(math.log2(sent_range[0])), 2.0 ** math.ceil(math.log2(sent_range[1]))
            ax_bytes.set_xlim(lo, hi if hi > lo else 2 * lo)
        ticks = binary_ticks(*ax_bytes.get_xlim())
        if len(ticks) < 3:  # a single octave: its middle too (8, 12, 16 MiB)
            ticks = sorted(ticks + [1.5 * t for t in ticks[:-1]])
        ax_bytes.xaxis.set_major_locator(FixedLocator(ticks))
        ax_bytes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: binary_bytes(x)))
        ax_bytes.xaxis.set_minor_locator(NullLocator())
    if ax_time is not None:
        ax_time.set_xlabel("virtual time (s)")
        ax_time.set_xlim(left=0)
        _mark_equal_time(ax_time, timed_val)
    for ax in fig.axes:
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    keys = [Line2D([], [], color="gray", alpha=0.45, lw=1.2, label="train loss")]
    if any_val:
        keys.append(Line2D([], [], color="gray", marker="o", ms=4, label="validation loss"))
    ax_tok.legend(handles=handles + keys, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _mark_equal_time(ax, curves: list[tuple[list[tuple[float, float]], Any]]) -> None:
    """With several runs' validation curves (with their colours) on a virtual clock: a dotted line where the first
    of them finished, each run's validation loss there (a ring, labelled), and where the others later reach the
    final loss of the first (a cross at the end of a dashed line)."""
    if len(curves) < 2:
        return
    at = min(c[-1][0] for c, _ in curves)
    ax.axvline(at, color="0.35", ls=":", lw=1.2)
    ax.annotate(f"first to finish: {at:.3g} s", xy=(at, 1.0), xycoords=("data", "axes fraction"),
                xytext=(4, -12), textcoords="offset points", fontsize=8, color="0.25")
    for curve, color in curves:
        loss = loss_at(curve, at)
        if loss is None:
            continue
        ax.plot([at], [loss], "o", ms=9, mfc="none", mec=color, mew=1.6)
        ax.annotate(f"{loss:.3f}", xy=(at, loss), xytext=(7, 3), textcoords="offset points", fontsize=8, color=color)
    # when the others reach the final loss of the first to finish: a dashed line across, a cross where they do
    first, first_color = min(curves, key=lambda cc: cc[0][-1][0])
    target = first[-1][1]
    for curve, color in curves:
        t = time_to_reach(curve, target) if curve is not first else None
        if t is None or t <= at:
            continue
        ax.plot([at, t], [target, target], ls="--", lw=1.0, color=first_color, alpha=0.8)
        ax.plot([t], [target], "x", ms=8, mew=1.8, color=color)
        ax.annotate(f"reaches {target:.3f} at {t:.3g} s", xy=(t, target), xytext=(-10, -15),
                    textcoords="offset points", fontsize=8, color=color, ha="center",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1))


def plot_runs(run_dirs: Iterable[str | Path], out: str | Path, title: Optional[str] = None) -> Path:
    """Loss vs tokens and loss vs bytes communicated, one line per run, into a PNG (see :func:`runs_figure`)."""
    fig = runs_figure(run_dirs, title)
    import matplotlib.pyplot as plt

    try:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
