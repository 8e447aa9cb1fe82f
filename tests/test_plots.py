"""Plots (``loco plot``, each run's loss.png, the simulator's compare.png): labels, byte ticks, token ticks.

The figures are rendered with matplotlib's Agg backend; the tests read the legend and the tick labels back from
the figure objects.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest

from launch.config import Config, dump_config
from launch.metrics.log import count_label
from launch.metrics.plots import binary_bytes, binary_ticks, plot_runs, run_label, runs_figure

plt = pytest.importorskip("matplotlib.pyplot")


def _run(folder: Path, *, algo: Optional[str] = "diloco", workers: Optional[int] = 4, steps: int = 10,
         tokens_per_step: int = 4096, bytes_per_step: float = 0.0, sets: Optional[dict[str, Any]] = None) -> Path:
    """A run folder as the trainer leaves it: metrics.jsonl, config.yaml (``algo`` None: none) and summary.json
    (``workers`` None: none, as while the run is still going)."""
    folder.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "tokens": step * tokens_per_step, "loss": 5.0 - 0.2 * math.log(step),
               "bytes_sent": int(step * bytes_per_step)}
        if step % 5 == 0:
            row["val_loss"] = row["loss"] - 0.1
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if algo is not None:
        cfg = Config()
        cfg.algo.name = algo
        for key, value in (sets or {}).items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
        (folder / "config.yaml").write_text(dump_config(cfg))
        if workers is not None:
            summary = {"algorithm": algo, "num_workers": workers, "codec": cfg.compress.codec, "val_loss": 4.0}
            (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def _draw(fig) -> None:
    fig.canvas.draw()  # tick labels are formatted at draw time


def _legend(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def _xticks(ax) -> list[str]:
    """The x tick labels drawn (matplotlib also lists those of ticks just outside the view)."""
    lo, hi = ax.get_xlim()
    return [t.get_text() for x, t in zip(ax.get_xticks(), ax.get_xticklabels())
            if lo <= x <= hi * (1 + 1e-9) and t.get_text()]


@pytest.mark.parametrize("algo,workers,sets,label", [
    ("ddp", 1, {}, "ddp, 1 worker"),
    ("ddp", 4, {"compress.codec": "int8"}, "ddp int8, 4 workers"),
    ("diloco", 4, {"algo.inner_steps": 50}, "diloco H=50, 4 workers"),
    ("diloco", None, {"algo.inner_steps": 50}, "diloco H=50"),  # no summary.json yet: workers unknown
    ("streaming", 8, {"algo.inner_steps": 20, "algo.fragments": 4, "compress.codec": "topk:0.1+2bit+zstd"},
     "streaming H=20 P=4 topk:0.1+2bit+zstd, 8 workers"),
    ("sparseloco", 2, {"algo.inner_steps": 30, "algo.topk_density": 0.02, "algo.value_format": "2bit"},
     "sparseloco H=30 top 2% 2bit, 2 workers"),
    ("diloco", 2, {"sync.mode": "time", "sync.time_budget_s": 30.0}, "diloco T=30s, 2 workers"),
    ("demo", 2, {}, "demo, 2 workers"),
    (None, None, {}, "my-run-20261122-175028"),  # no config: the folder name
])
def test_run_label_names_the_method_from_the_config(tmp_path, algo, workers, sets, label):
    folder = _run(tmp_path / "my-run-20261122-175028", algo=algo, workers=workers, sets=sets)
    assert run_label(folder) == label


def test_run_label_falls_back_on_summary_then_folder(tmp_path):
    folder = _run(tmp_path / "r1", algo="diloco", workers=3)
    (folder / "config.yaml").write_text("algo: [unclosed\n")  # torn: the summary still says what ran
    assert run_label(folder) == "diloco, 3 workers"
    (folder / "summary.json").write_text("{")
    assert run_label(folder) == "r1"


def test_comparison_legend_shows_methods_and_bytes_axis_has_binary_ticks(tmp_path):
    # DiLoCo sends 10 MB .. 100 MB, DDP 100 MB .. 1 GB: the old axis read "9.5 MB / 95.4 MB / 953.7 MB"
    diloco = _run(tmp_path / "simulate-20261122-175028", algo="diloco", sets={"algo.inner_steps": 50},
                  bytes_per_step=1e7)
    ddp = _run(diloco / "baseline-ddp", algo="ddp", bytes_per_step=1e8)
    fig = runs_figure([diloco, ddp], title="diloco vs DDP")
    try:
        _draw(fig)
        assert _legend(fig) == ["diloco H=50, 4 workers", "ddp, 4 workers", "train loss", "validation loss"]
        ax_tok, ax_bytes = fig.axes
        assert ax_bytes.get_xscale() == "log"
        assert _xticks(ax_bytes) == ["16 MiB", "64 MiB", "256 MiB", "1 GiB"]  # 8 MiB .. 1 GiB in view: every 4x
        assert _xticks(ax_tok) == ["0", "10k", "20k", "30k", "40k"]
    finally:
        plt.close(fig)
    out = plot_runs([diloco, ddp], tmp_path / "plots" / "compare.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wide_byte_ranges_thin_the_powers_of_two(tmp_path):
    a = _run(tmp_path / "a", algo="diloco", steps=10, bytes_per_step=2e5)  # 200 KB .. 2 MB
    b = _run(tmp_path / "b", algo="ddp", steps=10, bytes_per_step=3e9)  # 3 GB .. 30 GB
    fig = runs_figure([a, b])
    try:
        _draw(fig)
        labels = _xticks(fig.axes[1])
        assert labels == ["1 MiB", "16 MiB", "256 MiB", "4 GiB"]  # every 16x
    finally:
        plt.close(fig)


def test_bytes_within_one_octave_get_three_ticks(tmp_path):
    run = _run(tmp_path / "r", algo="diloco", steps=10, tokens_per_step=1000, bytes_per_step=1e6)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # 9.5 .. 12 MB: no power of two inside
        r["bytes_sent"] = int(9.5e6 + 2.5e5 * r["step"])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = runs_figure([run])
    try:
        _draw(fig)
        assert _xticks(fig.axes[1]) == ["8 MiB", "12 MiB", "16 MiB"]  # one octave: its middle too
    finally:
        plt.close(fig)


def test_a_short_simulated_run_gets_three_byte_ticks(tmp_path):
    # DiLoCo's rounds send 5 MiB each: 5 .. 15 MiB held only the ticks 8 and 16 MiB
    run = _run(tmp_path / "r", algo="diloco", steps=24, tokens_per_step=2048, bytes_per_step=5.3e6 / 8)
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["bytes_sent"] = int(5.3e6 * max(1, r["step"] // 8))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = runs_figure([run], title="simulate")
    try:
        _draw(fig)
        assert _xticks(fig.axes[1]) == ["4 MiB", "8 MiB", "16 MiB"]
        assert _xticks(fig.axes[0]) == ["0", "10k", "20k", "30k", "40k", "50k"]
    finally:
        plt.close(fig)


def test_single_worker_run_has_one_panel_with_several_token_ticks(tmp_path):
    # the tiny preset's 30 steps: 2,048 tokens a step, no bytes sent
    run = _run(tmp_path / "tiny-20261122-175028", algo="ddp", workers=1, steps=30, tokens_per_step=2048)
    fig = runs_figure([run], title="tiny")
    try:
        _draw(fig)
        assert len(fig.axes) == 1  # nothing crossed a network: no empty bytes panel
        assert _legend(fig) == ["ddp, 1 worker", "train loss", "validation loss"]
        assert _xticks(fig.axes[0]) == ["0", "20k", "40k", "60k"]
    finally:
        plt.close(fig)


def test_same_method_twice_names_the_folders(tmp_path):
    a = _run(tmp_path / "seed0", algo="diloco", sets={"algo.inner_steps": 50}, bytes_per_step=1e6)
    b = _run(tmp_path / "seed1", algo="diloco", sets={"algo.inner_steps": 50}, bytes_per_step=1e6)
    c = _run(tmp_path / "no-config", algo=None, bytes_per_step=1e6)
    fig = runs_figure([a, b, c])
    try:
        assert _legend(fig)[:3] == ["diloco H=50, 4 workers (seed0)", "diloco H=50, 4 workers (seed1)", "no-config"]
    finally:
        plt.close(fig)


def test_axis_label_helpers():
    assert [binary_bytes(2.0 ** e) for e in (0, 10, 20, 24, 30, 40)] == ["1 B", "1 KiB", "1 MiB", "16 MiB", "1 GiB",
                                                                         "1 TiB"]
    assert binary_bytes(1536) == "1.5 KiB" and binary_bytes(1000) == "1000 B"
    assert binary_ticks(3e6, 1e9) == [2.0 ** e for e in range(22, 30)][::2]  # 4, 16, 64, 256 MiB
    assert binary_ticks(1e3, 1e12) == [2.0 ** e for e in range(12, 40, 4)]  # 4 KiB, 64 KiB, 1 MiB ... 64 GiB
    assert binary_ticks(1e3, 1e18) == [2.0 ** e for e in range(10, 60, 10)]  # 1 KiB, 1 MiB, 1 GiB ...
    assert binary_ticks(3e6, 2e7) == [2.0 ** e for e in (22, 23, 24)]
    assert binary_ticks(0, 10) == [] and binary_ticks(5, 6) == []
    assert [count_label(x) for x in (0, 500, 2e4, 2e5, 1.2e6, 2.5e7, 3e9)] == ["0", "500", "20k", "200k", "1.2M",
                                                                                 "25M", "3B"]


def _timed_run(folder: Path, algo: str, points: list[tuple[float, float]], step_time: float = 0.5) -> Path:
    """A simulated run folder whose validation losses sit at virtual times ``points`` [(seconds, loss)]: each
    record holds network seconds and steps, priced at ``step_time`` in summary.json."""
    folder.mkdir(parents=True)
    rows = []
    for i, (t, loss) in enumerate(points, 1):
        steps = 10 * i
        rows.append({"step": steps, "tokens": steps * 1000, "loss": loss + 0.05, "val_loss": loss,
                     "bytes_sent": steps * 1000, "virtual_s": -1.0,  # the running figure: the parts win
                     "virtual_net_s": t - steps * step_time, "virtual_steps": steps})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config()
    cfg.algo.name = algo
    (folder / "config.yaml").write_text(dump_config(cfg))
    (folder / "summary.json").write_text(json.dumps({"algorithm": algo, "num_workers": 4, "codec": "fp32",
                                                     "virtual_step_time_s": step_time}))
    return folder


def test_curves_on_virtual_time_interpolate_and_say_not_reached(tmp_path):
    from launch.metrics.plots import equal_time_comparison, loss_at, time_to_reach, virtual_curve

    diloco = _timed_run(tmp_path / "run", "diloco", [(10.0, 3.0), (20.0, 2.5)])
    ddp = _timed_run(tmp_path / "run" / "baseline-ddp", "ddp", [(10.0, 3.5), (30.0, 2.5), (50.0, 2.0)])
    assert virtual_curve(diloco) == [(10.0, 3.0), (20.0, 2.5)]  # network seconds + steps x the final step time
    curve = virtual_curve(ddp)
    assert loss_at(curve, 20.0) == pytest.approx(3.0)
    assert loss_at(curve, 5.0) is None and loss_at(curve, 60.0) == 2.0
    assert time_to_reach(curve, 2.25) == pytest.approx(40.0)
    assert time_to_reach(curve, 1.0) is None and time_to_reach(curve, 9.0) == 10.0
    eq = equal_time_comparison(diloco, ddp)
    assert eq["at_s"] == 20.0 and eq["loss_at"] == [2.5, pytest.approx(3.0)]
    assert eq["time_to_other"][0] is None  # DiLoCo never reaches DDP's 2.0
    assert eq["time_to_other"][1] == pytest.approx(30.0)  # DDP reaches DiLoCo's 2.5 at 30 s


def test_simulated_runs_get_a_virtual_time_panel_marking_equal_time(tmp_path):
    diloco = _timed_run(tmp_path / "run", "diloco", [(10.0, 3.0), (20.0, 2.5)])
    ddp = _timed_run(tmp_path / "run" / "baseline-ddp", "ddp", [(10.0, 3.5), (30.0, 2.5), (50.0, 2.0)])
    fig = runs_figure([diloco, ddp], title="diloco vs DDP")
    try:
        _draw(fig)
        assert len(fig.axes) == 3
        ax_time = fig.axes[2]
        assert ax_time.get_xlabel() == "virtual time (s)"
        texts = [t.get_text() for t in ax_time.texts]
        assert "first to finish: 20 s" in texts
        assert "3.000" in texts and "2.500" in texts  # each run's loss when the first finished
        assert "reaches 2.500 at 30 s" in texts
    finally:
        plt.close(fig)


def test_two_close_losses_at_the_first_finish_get_labels_apart(tmp_path):
    """Two simulated runs whose validation losses are 0.002 apart when the first finishes: their two labels at the
    dotted line are drawn apart (one below its ring, one above), not on top of each other."""
    runs = []
    for name, points in (("a", [(10.0, 3.0), (20.0, 2.5)]), ("b", [(10.0, 3.1), (20.0, 2.502), (40.0, 2.2)])):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": i + 1, "tokens": 1000 * (i + 1), "val_loss": loss, "virtual_s": t}
                for i, (t, loss) in enumerate(points)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(folder)
    fig = runs_figure(runs)
    try:
        _draw(fig)
        renderer = fig.canvas.get_renderer()
        boxes = [t.get_window_extent(renderer) for ax in fig.axes for t in ax.texts if t.get_text() in ("2.500", "2.502")]
        assert len(boxes) == 2
        assert not boxes[0].overlaps(boxes[1]), (boxes[0], boxes[1])
    finally:
        plt.close(fig)
