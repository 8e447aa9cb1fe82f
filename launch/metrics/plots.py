"""Plots of runs, and the comparisons they draw: loss against tokens, bytes sent and (simulated runs) virtual
time, each run labelled by what it was (:func:`run_label`), and two runs compared at equal virtual time."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any, Iterable, Optional

from launch.config.algorithms import declared_by
from launch.store.disk import RESUME, write_file
from launch.metrics.log import count_label, read_metrics


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
    # lm-eval tasks scored in the loop (eval.tasks): their metrics against tokens, on a panel of their own
    task_keys = sorted({k for _, rows in runs for r in rows for k in r if k.startswith("tasks/")})
    panels = 1 + any_bytes + any_time + bool(task_keys)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8), squeeze=False)
    axes = list(axes[0])
    ax_tok = axes.pop(0)
    ax_bytes = axes.pop(0) if any_bytes else None
    ax_time = axes.pop(0) if any_time else None
    ax_tasks = axes.pop(0) if task_keys else None
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
            # each validation with its standard error (two of them either side: the band a gap must leave)
            ax_tok.errorbar([r["tokens"] for r in val], [r["val_loss"] for r in val], yerr=_two_se(val), fmt="o-",
                            color=color, ms=4, capsize=2, elinewidth=0.8)
        last = next((r for r in reversed(val) if r.get("val_bpb") is not None), None)
        bpb = "" if last is None else f": val {last['val_bpb']:.3f}" + (
            f" ± {last['val_bpb_se']:.3f}" if _finite(last.get("val_bpb_se")) else "") + " bits/byte"
        handles.append(Line2D([], [], color=color, lw=2, label=label + bpb))
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
    if ax_tasks is not None:
        _draw_tasks(ax_tasks, runs, task_keys, [h.get_color() for h in handles])
    keys = [Line2D([], [], color="gray", alpha=0.45, lw=1.2, label="train loss")]
    if any_val:
        keys.append(Line2D([], [], color="gray", marker="o", ms=4, label="validation loss"))
    ax_tok.legend(handles=handles + keys, fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _draw_tasks(ax, runs: list, keys: list[str], colors: list) -> None:
    """Each run's task metrics against tokens: one colour per run (as on the other panels), one marker per
    metric, named in this panel's legend."""
    from matplotlib.lines import Line2D

    markers = "os^vDP*Xh<>"
    for (_, rows), color in zip(runs, colors):
        for key, marker in zip(keys, markers * len(keys)):
            points = [(r["tokens"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if points:
                ax.plot(*zip(*points), marker=marker, ms=4, color=color, lw=1)
    ax.set_xlabel("tokens trained (all workers)")
    ax.set_ylabel("task score")
    ax.set_title("downstream tasks (lm-eval)", fontsize=9)
    ax.legend(handles=[Line2D([], [], color="gray", marker=m, ms=4, lw=1, label=k[len("tasks/"):])
                       for k, m in zip(keys, markers * len(keys))], fontsize=7)


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
    rings = sorted((loss, color) for curve, color in curves if (loss := loss_at(curve, at)) is not None)
    for i, (loss, color) in enumerate(rings):
        ax.plot([at], [loss], "o", ms=9, mfc="none", mec=color, mew=1.6)
        # the lowest label below its ring, the others above and stacked: close losses never share a line
        dy = -11 if i == 0 and len(rings) > 1 else 3 + 11 * max(0, i - 1)
        ax.annotate(f"{loss:.3f}", xy=(at, loss), xytext=(7, dy), textcoords="offset points", fontsize=8, color=color)
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


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _two_se(val: list[dict[str, Any]]) -> Optional[list[float]]:
    """Two standard errors of each validation (None where the records carry none: runs before they were kept)."""
    if not any(_finite(r.get("val_loss_se")) for r in val):
        return None
    return [2 * r["val_loss_se"] if _finite(r.get("val_loss_se")) else 0.0 for r in val]


def plot_runs(run_dirs: Iterable[str | Path], out: str | Path, title: Optional[str] = None,
              advice: str = RESUME) -> Path:
    """Loss vs tokens and loss vs bytes communicated, one line per run, into a PNG (see :func:`runs_figure`); a
    full disk is one DiskFull line that ends with ``advice``."""
    fig = runs_figure(run_dirs, title)
    import matplotlib.pyplot as plt

    try:
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
    finally:
        plt.close(fig)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_file(out, png.getvalue(), advice)
