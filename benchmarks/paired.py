"""Runs of the benchmarks compared over the same validation windows.

A run's result (the JSON that ``benchmarks/convergence.py`` and ``benchmarks/demo.py`` save) carries its loss's
standard error and each window's summed loss (``nll``, from the run folder's ``val_windows.json``), so runs of
one seed saved by different invocations still pair window by window. Older results have none of these: their
cells stay blank.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    from launch.eval.validation import Gap


def window_fields(run_dir: Path) -> dict[str, Any]:
    """What a result keeps of its run's ``val_windows.json``: each window's summed loss, and what fixes which
    windows they are (runs pair where all three agree). None for each where the run wrote none."""
    from launch.eval.validation import read_windows

    windows = read_windows(run_dir) or {}
    return {"nll": windows.get("nll"), "val_seq_len": windows.get("seq_len"),
            "val_split_windows": windows.get("split_windows")}


def _pairs(a: dict, b: dict) -> bool:
    """Both runs were scored on the same windows (the spread's windows follow from these three)."""
    return (a.get("nll") is not None and b.get("nll") is not None and len(a["nll"]) == len(b["nll"])
            and a.get("val_seq_len") == b.get("val_seq_len") and a.get("val_split_windows") == b.get("val_split_windows"))


def seed_gap(runs: list[dict], refs: list[dict]) -> Optional[tuple[Gap, int]]:
    """The loss of ``runs`` against ``refs``, each seed paired with the same seed over the same windows, and the
    number of seeds that paired (None: none did).

    The gap is the mean of the per-seed paired gaps. Its error adds in quadrature the windows' error (the root
    mean square of the per-seed paired errors) and the seeds' (the standard deviation of the per-seed gaps over
    the square root of the seeds; none with one seed, which then understates it)."""
    from launch.eval.validation import Gap, paired_gap

    by_seed = {r["seed"]: r for r in refs}
    gaps = []
    for r in runs:
        ref = by_seed.get(r["seed"])
        if ref is not None and _pairs(r, ref):
            g = paired_gap(np.asarray(r["nll"]), np.asarray(ref["nll"]), int(r["val_seq_len"]))
            if g is not None:
                gaps.append(g)
    if not gaps:
        return None
    n = len(gaps)
    windows = math.sqrt(sum(g.se ** 2 for g in gaps) / n)
    seeds = statistics.stdev(g.gap for g in gaps) / math.sqrt(n) if n > 1 else 0.0
    return Gap(sum(g.gap for g in gaps) / n, math.hypot(windows, seeds)), n


def gap_cell(runs: list[dict], refs: list[dict]) -> str:
    """:func:`seed_gap` as a table cell: blank where no seed pairs, the seeds counted where not all did."""
    found = seed_gap(runs, refs)
    if found is None:
        return ""
    gap, n = found
    return gap.describe() + ("" if n == len(runs) else f", {n} of {len(runs)} seeds")


def loss_cell(runs: list[dict], key: str = "val_loss") -> str:
    """The median over seeds, with the median of the seeds' standard errors where the runs carry them."""
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "n/a"
    ses = [r[f"{key}_se"] for r in runs if r.get(f"{key}_se") is not None]
    return f"{statistics.median(values):.4f}" + (f" ± {statistics.median(ses):.4f}" if ses else "")


def validation_line(settings: dict[str, Any], results: list[dict]) -> str:
    """What the losses were scored on, and what the ± and the paired gap mean."""
    tokens = settings.get("eval_tokens")
    if tokens is None:
        return (f"- validation: the first {settings.get('eval_batches', '?')} batches of the split (runs scored "
                f"before eval.tokens: no standard errors, no paired gaps)")
    scored = next((r for r in results if r.get("nll") is not None), None)
    if scored is None:
        where = "windows spread over the split"
    elif len(scored["nll"]) == scored["val_split_windows"]:
        where = f"the whole split, {len(scored['nll']):,} windows of {scored['val_seq_len']}"
    else:
        where = (f"{len(scored['nll']):,} windows of {scored['val_seq_len']} spread over the split's "
                 f"{scored['val_split_windows']:,}")
    return (f"- validation: eval.tokens={tokens:,}: {where}; a loss's ± is its standard error over those windows "
            f"(median over seeds). The paired gap is the method's loss minus the reference's over the same windows, "
            f"seed by seed: the mean over seeds ± an error that adds in quadrature the windows' error (root mean "
            f"square of the per-seed paired errors) and the seeds' (standard deviation of the per-seed gaps / "
            f"sqrt(seeds)); level: |gap| <= 2 x error")
