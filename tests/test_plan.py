"""`loco plan`: predictions that match the simulator's accounting, measured penalties with their source, the
recommendation, `--check`, and input errors as one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import FAST, TINY
from diloco.sim import NetworkModel
from launch.plan import planner
from launch.cli import main
from launch.config import load_config
from launch.plan.planner import format_plan, make_plan
from launch.plan.settings import MEASURED, PlanError, Setting, resolve_model
from launch.plan.timeline import exchange, predict, timeline
from launch.simulate.runner import simulate_once

ROOT = Path(__file__).resolve().parent.parent


def _simulated(tmp_path, setting: Setting, workers: int, steps: int, bandwidth: str, latency: float, step: float):
    cfg, _ = load_config([TINY], [*FAST, *setting.overrides(), f"sim.workers={workers}", f"sim.bandwidth={bandwidth}",
                                  f"sim.latency={latency}", f"sim.step_time={step}", "sim.baseline=none",
                                  f"run.max_steps={steps}", "run.batch_size=1", "data.seq_len=16",
                                  "run.eval_every=0", "run.checkpoint_every=0", "run.checkpoint_final=false",
                                  f"run.dir={tmp_path / setting.label().replace(' ', '_')}"])
    return simulate_once(cfg)


@pytest.mark.parametrize("setting, steps", [
    (Setting("ddp"), 3),
    (Setting("diloco", 3, "fp32"), 6),
    (Setting("diloco", 3, "int8"), 7),  # a partial last round is synced at the end
    (Setting("streaming", 4, "fp4", 2, 1), 8),  # exchanges hidden behind one step, and the end of training
    (Setting("sparseloco", 3, "2bit", density=0.02), 7),  # every worker's own payload to every other worker
    (Setting("demo", codec="dct", topk=8), 3),  # its own payload, every step
])
def test_predicted_bytes_and_time_are_the_simulators(tmp_path, setting, steps):
    workers, bw, lat, step = 3, 8e6 / 8, 0.05, 0.2  # 8 Mbit/s: the exchanges of tiny take a good part of a step
    summary = _simulated(tmp_path, setting, workers, steps, "8Mbit", lat, step)
    model = resolve_model("tiny")
    t = timeline(setting, model, workers, NetworkModel(bw, lat), step, steps)
    assert t.bytes_sent == summary["bytes_sent"]
    assert t.wall_s == pytest.approx(summary["virtual_wall_s"], rel=1e-9)
    assert t.utilization == pytest.approx(summary["compute_utilization"], rel=1e-9)
    assert t.utilization < 0.97  # the network mattered: a wrong exchange time would show


def test_overlap_hides_what_the_link_can_carry():
    model = resolve_model("150m")
    net = NetworkModel(1e9 / 8, 0.02)
    blocking = predict(Setting("streaming", 100, "fp32", 4, 0), model, 8, net, 1.0)
    hidden = predict(Setting("streaming", 100, "fp32", 4, 5), model, 8, net, 1.0)
    diloco = predict(Setting("diloco", 100, "fp32"), model, 8, net, 1.0)
    assert hidden.bytes_per_round == pytest.approx(diloco.bytes_per_round, rel=0.01)
    assert hidden.utilization > blocking.utilization
    assert blocking.round_s > diloco.round_s  # four exchanges pay four times the latency, nothing hides them


def test_named_sizes_and_parameter_counts():
    assert resolve_model("tiny").params == 885888
    big = resolve_model("1.1e9")
    assert big.params == 1_100_000_000
    assert sum(map(sum, big.fragment_pieces(4))) == big.params
    assert resolve_model("150m").name == "150m"  # a named size wins over the count "150m"
    assert resolve_model("200m").params == 200_000_000
    for bad in ("huge", "-3", "0", "1e999"):
        with pytest.raises(PlanError, match="--model"):
            resolve_model(bad)


def test_the_table_names_utilization_penalties_and_their_sources():
    plan = make_plan("150m", 8, "100Mbit", "40ms", "0.5")
    text = format_plan(plan)
    assert "utilization" in text and "unmeasured" in text
    assert "diloco H=50" in text and "streaming H=100 P=4 tau=5" in text
    sources = re.findall(r"benchmarks/results/(\S+):", text)
    assert sources and all((ROOT / "benchmarks" / "results" / s).is_file() for s in sources)
    row = next(r for r in plan.rows if r.setting == Setting("diloco", 50))
    assert row.measured is MEASURED[Setting("diloco", 50)]


@pytest.mark.parametrize("setting", sorted(MEASURED, key=str))
def test_every_measured_penalty_is_in_its_file(setting):
    m = MEASURED[setting]
    text = (ROOT / "benchmarks" / "results" / m.source).read_text()
    assert f"{100 * m.penalty:+.1f}%" in text, f"{setting.label()} {setting.codec}: not in {m.source}"


def test_the_recommendation_is_the_fewest_bytes_at_95_percent():
    plan = make_plan("150m", 8, "100Mbit", "40ms", "0.5")
    best = plan.cheapest
    assert best is not None and best.utilization >= 0.95
    assert all(r.bytes_per_step >= best.bytes_per_step for r in plan.rows if r.utilization >= 0.95)
    assert plan.nearest.bytes_per_step >= best.bytes_per_step
    assert "recommended" in format_plan(plan)
    fast = make_plan("tiny", 2, "100Gbit", "0s", "1")
    assert fast.nearest.setting == Setting("ddp")  # an ample link: DDP itself is fully used
    slow = make_plan("1b", 64, "1Mbit", "200ms", "0.1")
    assert slow.cheapest is None and "no setting reaches 95%" in format_plan(slow)


def test_run_it_line_runs_the_planned_model_setting_and_link():
    import shlex

    from launch.cli.commands import _load, build_parser

    plan = make_plan("1b", 8, "10Gbit", "10ms", "2")
    line = next(x for x in format_plan(plan).splitlines() if "run it:" in x).split("run it: ")[1]
    argv = shlex.split(line)
    assert argv[:2] == ["loco", "simulate"]
    cfg = _load(build_parser().parse_args(argv[1:]))
    assert cfg.model.size == "1b" and cfg.algo.name == plan.cheapest.setting.algo
    assert cfg.algo.inner_steps == plan.cheapest.setting.inner_steps
    assert (cfg.sim.workers, cfg.sim.bandwidth, cfg.sim.latency, cfg.sim.step_time) == (8, "10Gbit", 0.01, 2.0)


def test_check_agrees_with_the_simulator():
    plan = make_plan("tiny", 3, "4Mbit", "30ms", "0.1")
    c = planner.check(plan, Setting("diloco", 4, "int8"))
    assert c.steps == 4 and c.workers == 3
    assert c.simulated < 0.95  # the link matters in this run
    assert abs(c.predicted - c.simulated) < 1e-6 and c.agrees


def test_cli_plan_check_prints_both(capsys, monkeypatch):
    monkeypatch.setattr(planner, "candidates", lambda model: [Setting("ddp"), Setting("diloco", 3, "fp4")])
    assert main(["plan", "--model", "tiny", "--workers", "2", "--bandwidth", "2Mbit", "--latency", "10ms",
                 "--step-time", "0.2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "utilization" in out and "predicted utilization" in out and "simulated utilization" in out
    assert "agree within 5 points" in out


def test_cli_plan_check_says_what_it_simulated(capsys, monkeypatch):
    """The check runs tiny on at most 4 workers: for a plan of another model or more workers it names the setting
    it ran and says the table's row (which it printed "they agree" beside) is another run, not simulated."""
    monkeypatch.setattr(planner, "candidates", lambda model: [Setting("ddp"), Setting("diloco", 3, "fp4")])
    assert main(["plan", "--model", "150m", "--workers", "8", "--bandwidth", "100Gbit", "--latency", "0s",
                 "--step-time", "0.2", "--check"]) == 0
    out = capsys.readouterr().out
    recommended = re.search(r"recommended .*?: (.*?): ", out).group(1)
    assert f"check: the recommended setting, {recommended}, simulated on tiny with 4 workers" in out
    assert "the table's row is another run (150m, 8 workers, steady state)" in out
    assert main(["plan", "--model", "150m", "--workers", "8", "--bandwidth", "1Mbit", "--latency", "1s",
                 "--step-time", "0.2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "no setting reaches 95%" in out and "the setting of highest utilization (none is recommended)" in out


def test_plan_costs_the_same_for_any_model_or_number_of_workers():
    """Buckets alike are priced once, and a parameter count is cut in at most MAX_TENSORS tensors: a model of
    10^15 parameters or 10,000 workers plan like 150m on 8 (before: minutes, and 72 s for 10,000 workers)."""
    from launch.plan.settings import MAX_TENSORS

    huge = resolve_model("1e15")
    assert huge.params == 10 ** 15 and len(huge.tensors) <= MAX_TENSORS + 1
    assert all(len(f) <= MAX_TENSORS for f in huge.fragment_pieces(4))
    big = make_plan("1e15", 10_000, "1Gbit", "80ms", "1")
    assert big.cheapest is None and all(r.bytes_per_round > 0 for r in big.rows)
    # the prediction of a bucket priced once and counted is the one of every bucket priced (10 GB in 4M tensors)
    model = resolve_model("1e10")
    for codec in ("fp32", "int8"):
        x = exchange(model.tensors, codec, 3, NetworkModel(1e9, 0.01), True)
        per_bucket = [exchange(model.tensors[i:i + 2], codec, 3, NetworkModel(1e9, 0.01), i + 2 >= len(model.tensors))
                      for i in range(0, len(model.tensors), 2)]
        assert x.bytes_sent == sum(b.bytes_sent for b in per_bucket)
        assert x.total_s == pytest.approx(sum(b.total_s for b in per_bucket), rel=1e-12)


@pytest.mark.parametrize("argv, expected", [
    (["--model", "enormous", "--workers", "4", "--bandwidth", "1Gbit", "--latency", "1ms"], "--model"),
    (["--model", "tiny", "--workers", "0", "--bandwidth", "1Gbit", "--latency", "1ms"], "--workers"),
    (["--model", "tiny", "--workers", "4", "--bandwidth", "fast", "--latency", "1ms"], "--bandwidth"),
    (["--model", "tiny", "--workers", "4", "--bandwidth", "1Gbit", "--latency", "soon"], "--latency"),
    (["--model", "tiny", "--workers", "4", "--bandwidth", "1Gbit"], "--latency"),
    (["--model", "tiny", "--workers", "4", "--bandwidth", "1Gbit", "--latency", "1ms", "--step-time", "0"],
     "--step-time"),
    (["--model", "tiny", "--workers", "4", "--links", "no-such-file.csv"], "--links"),
])
def test_bad_input_is_one_line(capsys, argv, expected):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("loco plan: error:") and expected in err and "\n" not in err


def test_plan_with_a_link_trace_sees_the_slowest_link_over_time_as_the_simulator_does(tmp_path):
    """A trace's link for the plan is what an exchange of the plan's workers sees, as the simulator times it: at
    each moment the slowest member's link, its bandwidth averaged over the period as transfer time (harmonic,
    weighted by duration), its latency by duration. A plain median of the rows made one worker on 10 Mbit/s among
    1 Gbit/s ones a 505 Mbit/s link, 50x faster than the simulator's."""
    trace = tmp_path / "links.csv"
    trace.write_text("time,worker,bandwidth,latency\n0,*,10Mbit,10ms\n1h,*,30Mbit,30ms\n2h,*,20Mbit,20ms\n")
    plan = make_plan("tiny", 4, None, None, "0.2", str(trace))
    assert plan.link.bandwidth == pytest.approx(3 / (1 / 10 + 1 / 30 + 1 / 20) * 1e6 / 8)
    assert plan.link.latency == pytest.approx(0.02)
    assert "the slowest member's link" in format_plan(plan)
    one_slow = tmp_path / "slow.csv"
    one_slow.write_text("time,worker,bandwidth,latency\n0,*,1Gbit,20ms\n0,3,10Mbit,20ms\n")
    assert make_plan("tiny", 4, None, None, "0.2", str(one_slow)).link.bandwidth == pytest.approx(10e6 / 8)
    assert make_plan("tiny", 3, None, None, "0.2", str(trace)).link.bandwidth < 20e6 / 8
    with pytest.raises(PlanError, match="rows for worker 3, but there are 2 workers"):
        make_plan("tiny", 2, None, None, "0.2", str(one_slow))
    late = tmp_path / "late.csv"  # before its first row a worker has that row's link: 10 Mbit/s for 200 of 300 s
    late.write_text("time,worker,bandwidth,latency\n100s,*,10Mbit,10ms\n200s,*,1Gbit,10ms\n")
    assert make_plan("tiny", 2, None, None, "0.2", str(late)).link.bandwidth == \
        pytest.approx(300 / (200 / 10 + 100 / 1000) * 1e6 / 8)
    shipped = make_plan("150m", 8, None, None, "1", str(ROOT / "configs" / "links-home-uplink.csv"))
    assert 20e6 / 8 < shipped.link.bandwidth < 100e6 / 8
