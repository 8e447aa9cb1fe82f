"""The simulator: bad input, virtual time and the network model, failures, the demo's table and plot."""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest
import torch

from conftest import FAST, ROOT, TINY, loco
from diloco.comm import TransportError
from diloco.compress.collective import all_reduce_
from diloco.sim import InProcessGroup, NetworkModel, parse_bandwidth, resolve_speeds, run_workers, sample_speeds
from launch.config import load_config
from launch.simulate.runner import simulate, simulate_once

QUICK = [*FAST, "run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none"]


@pytest.mark.parametrize("args, key", [
    (["--workers", "0"], "sim.workers"),
    (["--set", "algo.inner_steps=0"], "algo.inner_steps"),
    (["--speeds", "1,0.5"], "sim.speeds"),
    (["--speeds", "1,0,1,1"], "sim.speeds"),
    (["--speed-dist", "zipf:2"], "sim.speed_dist"),
    (["--bandwidth", "fast"], "sim.bandwidth"),
    (["--latency", "soon"], "sim.latency"),
    (["--set", "algo.name=streaming", "--set", "algo.fragments=9"], "algo.fragments"),
    (["--set", "sync.mode=time"], "sync.time_budget_s"),
])
def test_bad_input_fails_before_training(args, key, capsys, monkeypatch):
    rc, err = simulate_in_process(args, capsys, monkeypatch)
    assert rc == 2, err
    assert key in err and "Traceback" not in err
    assert "[worker" not in err, "training started before the config was checked"


def simulate_in_process(args, capsys, monkeypatch) -> tuple[int, str]:
    """``loco simulate ARGS`` in this process (the process's own exit path is tested in test_cli): its exit code
    and stderr. Training must not start: the bad input is refused first."""
    import launch.simulate.runner
    from launch.cli import main

    def started(*a, **k):
        raise AssertionError("training started before the input was checked")

    monkeypatch.setattr(launch.simulate.runner, "run_workers", started)
    rc = main(["simulate", *args])
    return rc, capsys.readouterr().err


def test_bandwidth_units():
    assert parse_bandwidth("1Gbit") == parse_bandwidth("1Gbps") == parse_bandwidth("1000Mbit/s") == 125e6
    assert parse_bandwidth("50MB/s") == 50e6 and parse_bandwidth("1e9") == 125e6
    with pytest.raises(ValueError):
        parse_bandwidth("0Gbit")


def test_speed_distributions_are_seeded_and_normalised():
    a, b = sample_speeds("lognormal:0.5", 8, seed=1), sample_speeds("lognormal:0.5", 8, seed=1)
    assert a == b and max(a) == 1.0 and min(a) < 1.0
    assert sample_speeds("lognormal:0.5", 8, seed=2) != a
    u = sample_speeds("uniform:0.25", 100, seed=0)
    assert min(u) >= 0.25 - 1e-9 and max(u) == 1.0
    assert resolve_speeds(3, None, None) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="one speed per worker"):
        resolve_speeds(3, "1,1", None)


def test_a_simulated_time_budget_is_virtual_time(tmp_path):
    """``run.max_time`` in ``loco simulate`` is the simulated workers' time: 10 virtual seconds at 0.5 s a step
    are 20 steps (DiLoCo stops at the first sync past the budget), on any machine and under any load. It was
    this machine's real time: as many steps as fitted into 10 s here."""
    cfg, _ = load_config([TINY], [*QUICK, "run.max_steps=null", "run.max_time=10s", "sim.workers=2", "algo.name=diloco",
                                  "algo.inner_steps=4", "sim.step_time=0.5", "sim.bandwidth=null", "sim.latency=0",
                                  f"run.dir={tmp_path / 'timed'}"])
    done = simulate_once(cfg)
    assert done["steps"] == 20 and done["virtual_wall_s"] == pytest.approx(10.0), done


def test_virtual_time_follows_compute_and_network(tmp_path):
    steps, H, W = 12, 4, 2
    common = [*QUICK, f"run.max_steps={steps}", f"sim.workers={W}", "algo.name=diloco", f"algo.inner_steps={H}",
              "sim.step_time=0.5"]
    cfg, _ = load_config([TINY], [*common, "sim.bandwidth=null", "sim.latency=0", f"run.dir={tmp_path / 'free'}"])
    free = simulate_once(cfg)
    assert free["virtual_wall_s"] == pytest.approx(steps * 0.5)
    assert free["compute_utilization"] == pytest.approx(1.0)

    cfg, _ = load_config([TINY], [*common, "sim.bandwidth=8Mbit", "sim.latency=100ms", f"run.dir={tmp_path / 'net'}"])
    net = simulate_once(cfg)
    wire_per_round = net["bytes_sent"] / (steps // H)  # what each link carries in one ring all-reduce
    round_s = 2 * (W - 1) * 0.1 + wire_per_round / 1e6  # 2(W-1) latency-bound phases + bytes at 1 MB/s
    assert net["virtual_wall_s"] == pytest.approx(steps * 0.5 + (steps // H) * round_s, rel=1e-3)
    assert net["compute_utilization"] == pytest.approx(steps * 0.5 / net["virtual_wall_s"])
    assert net["tokens_per_virtual_s"] == pytest.approx(net["tokens"] / net["virtual_wall_s"])
    assert len(net["bytes_sent_per_worker"]) == W and net["bytes_sent_per_worker"][0] == net["bytes_sent"]


def test_payloads_of_unknown_size_cost_a_size_exchange_each(tmp_path):
    """A torchrun process exchanges payload sizes before a byte collective unless the codec fixes them (no zstd):
    the simulator charges that collective's latency-bound phases too. DiLoCo's compressed round is an all-to-all
    and an all-gather per bucket (tiny: one bucket), so zstd adds 2 x (W-1) latencies a round, int8 nothing."""
    steps, H, W, latency = 12, 4, 3, 0.1
    common = [*QUICK, f"run.max_steps={steps}", f"sim.workers={W}", "algo.name=diloco", f"algo.inner_steps={H}",
              "sim.step_time=0.5", "sim.bandwidth=null", f"sim.latency={latency}"]
    walls = {}
    for chain in ("int8", "int8+zstd"):
        cfg, _ = load_config([TINY], [*common, f"compress.codec={chain}", f"run.dir={tmp_path / chain}"])
        walls[chain] = simulate_once(cfg)["virtual_wall_s"]
    rounds = steps // H
    assert walls["int8"] == pytest.approx(steps * 0.5 + rounds * 2 * (W - 1) * latency)
    assert walls["int8+zstd"] - walls["int8"] == pytest.approx(rounds * 2 * (W - 1) * latency)


def test_a_failing_worker_stops_the_others_without_a_hang():
    group = InProcessGroup(3)
    unwound = []

    def body(rank, transport):
        try:
            if rank == 1:
                raise ValueError("worker 1 ran out of data")
            all_reduce_(transport, [torch.ones(4)])  # would wait forever for worker 1
            return rank
        finally:
            unwound.append(rank)

    with pytest.raises(ValueError, match="ran out of data"):
        run_workers(group, body)
    # worker 0 was waiting in the all-reduce and unwound; worker 2 had not started and never will
    assert sorted(unwound) == [0, 1]


def test_a_worker_that_never_arrives_is_named_at_once():
    group = InProcessGroup(3)

    def body(rank, transport):
        if rank != 2:
            all_reduce_(transport, [torch.ones(2)])

    start = time.monotonic()
    with pytest.raises(TransportError, match=r"workers \[2\] did not reach a collective that workers \[0, 1\]"):
        run_workers(group, body)
    assert time.monotonic() - start < 5


def test_workers_keep_their_own_grad_mode_across_collectives():
    group = InProcessGroup(2)

    def body(rank, transport):
        if rank == 0:
            with torch.no_grad():
                transport.barrier()  # worker 1 starts while worker 0 sits inside no_grad
                inside = torch.is_grad_enabled()
            return inside, torch.is_grad_enabled()
        started = torch.is_grad_enabled()
        with torch.no_grad():
            transport.barrier()
        return started, torch.is_grad_enabled()

    assert run_workers(group, body) == [(False, True), (True, True)]
    assert torch.is_grad_enabled()


def test_main_demo_prints_a_table_and_plots(tmp_path, capfd):
    res = loco(["simulate", "--max-steps", "12", "--set", "algo.inner_steps=4", "--set", "run.eval_every=6",
                *[a for s in FAST for a in ("--set", s)], "--set", "run.batch_size=4",
                "--run-dir", str(tmp_path / "demo")], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "diloco x4 (H=4)" in out and "ddp x4" in out and "fewer bytes than DDP" in out
    assert "at equal virtual time" in out and "to reach the other's final loss" in out
    # the preset's step time, named: the same story on any machine
    assert "virtual compute: 0.0235 s per step at speed 1 (fixed: a step of small on one H100" in out
    assert "[simulate] baseline: DDP with 4 workers on the same tokens and 13 evaluations; about " in res.stderr
    assert (tmp_path / "demo" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    comparison = json.loads((tmp_path / "demo" / "comparison.json").read_text())
    diloco, ddp = comparison.values()
    assert diloco["tokens"] == ddp["tokens"]
    assert max(ddp["bytes_sent_per_worker"]) > 3 * max(diloco["bytes_sent_per_worker"])
    assert diloco["virtual_wall_s"] < ddp["virtual_wall_s"]
    equal = diloco["equal_time"]
    assert equal["at_s"] == pytest.approx(diloco["virtual_wall_s"])
    assert equal["loss_at"][1] is not None  # the baseline evaluated before DiLoCo finished
    assert equal["loss_at"][1] > ddp["val_loss"]  # and was still above its own final loss then
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    for key in ("bytes_sent_per_worker", "virtual_wall_s", "compute_utilization", "tokens_per_virtual_s"):
        assert key in summary


def test_the_baseline_estimate_counts_its_evaluations(tmp_path):
    from launch.simulate.report import baseline_line
    from launch.simulate.runner import baseline_config

    def seconds(cfg, base) -> int:
        m, s = re.search(r"; about (\d+)m(\d\d)s at the pace", baseline_line(cfg, base, run)).groups()
        return 60 * int(m) + int(s)

    run = {"wall_s": 600.0, "tokens": 819_200}
    cfg, _ = load_config(["simulate"], [f"run.dir={tmp_path}"])  # 200 steps, evaluated every 50
    same = baseline_config(cfg, tmp_path)
    same.run.eval_every = cfg.run.eval_every
    assert seconds(cfg, same) == 600  # the run's own evaluations: its own time
    base = baseline_config(cfg, tmp_path)  # evaluated every 10 steps: 16 evaluations more
    assert "on the same tokens and 21 evaluations" in baseline_line(cfg, base, run)
    assert seconds(cfg, base) > 660
    cfg.eval.tokens *= 4
    assert seconds(cfg, base) > seconds(cfg, same) + 2 * (660 - 600)


@pytest.mark.parametrize("algo", [["algo.name=diloco", "algo.inner_steps=3", "sim.step_time=1"],
                                  ["algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2",
                                   "algo.overlap_steps=2", "sim.step_time=1", "sim.bandwidth=1Mbit"]],
                         ids=["diloco", "streaming-overlap"])
def test_offload_paths_run_and_change_nothing_on_cpu(tmp_path, algo, monkeypatch):
    """Parking idle workers changes neither the numbers nor the virtual times: a worker parked with a Streaming
    exchange in flight does not wait for it (which would move its clock to the exchange's end). Every worker is
    parked from its first wait, at start-up, not from its first exchange: N workers' models never meet on the
    device."""
    from launch.simulate import runner as sim_module

    moves = []  # (rank, step) of every park and unpark
    real_move = sim_module.move_worker_state
    monkeypatch.setattr(sim_module, "move_worker_state",
                        lambda trainer, device: (moves.append((trainer.rank, trainer.step)),
                                                 real_move(trainer, device)))
    common = [*QUICK, "run.max_steps=8", "sim.workers=3", *algo]
    runs = {}
    for name, extra in (("plain", []), ("offload", ["sim.offload=true", "algo.offload_outer=true"])):
        cfg, _ = load_config([TINY], [*common, *extra, f"run.dir={tmp_path / name}"])
        runs[name] = simulate_once(cfg)
    for key in ("val_loss", "bytes_sent", "virtual_wall_s", "virtual_wait_s_per_worker"):
        assert runs["plain"][key] == runs["offload"][key], key
    first = {rank: step for rank, step in reversed(moves)}  # each worker's first move
    # workers 0 and 1 wait for worker 2 in the start-up collectives, parked; worker 2 completes them without a wait
    assert first[0] == first[1] == 0 and first[2] > 0, moves


@pytest.mark.parametrize("algo", [["algo.name=ddp"],
                                  ["algo.name=diloco", "algo.inner_steps=2"],
                                  ["algo.name=diloco", "algo.inner_steps=2", "compress.codec=topk:0.1+int8"],
                                  ["algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2",
                                   "algo.overlap_steps=1"]],
                         ids=["ddp", "diloco", "diloco-topk", "streaming-overlap"])
def test_an_offloaded_worker_leaves_the_device_once_an_exchange_not_once_a_bucket(tmp_path, algo, monkeypatch):
    """With ``sim.offload`` a worker that waits in an exchange of many buckets is parked at its first wait and
    brought back when the exchange ends, not at every bucket (a 1B model's exchange has over a hundred, each of
    which moved the whole worker both ways). Its exchange goes on with the tensors it began with, and the run ends
    as without offload. There is no second device here: a stand-in move gives every moved tensor new storage, as
    a move to the host does, so a result written into a copy the worker no longer reads would show."""
    import diloco.algorithm as algorithm_module
    import diloco.outer as outer_module
    from diloco.sim.transport import InProcessTransport
    from launch.simulate import runner as sim_module

    monkeypatch.setattr(InProcessTransport, "bucket_bytes", 16 << 10)  # tiny's exchange in dozens of buckets
    moved, waits = [0] * 3, [0] * 3  # per worker: moves of its state, collectives it joined
    exchanges = []  # (collectives, moves) of each exchange, per worker
    real_move, real_rendezvous = sim_module.move_worker_state, InProcessGroup.rendezvous
    real_scope = InProcessTransport.exchange_scope

    def counted_move(trainer, device):
        moved[trainer.rank] += 1
        real_move(trainer, device)

    def counted_rendezvous(self, rank, *args, **kwargs):
        waits[rank] += 1
        return real_rendezvous(self, rank, *args, **kwargs)

    @contextlib.contextmanager
    def counted_scope(self, barrier=True):
        r, before = self.rank, (waits[self.rank], moved[self.rank])
        with real_scope(self, barrier):
            yield
        exchanges.append((waits[r] - before[0], moved[r] - before[1]))

    common = [*QUICK, "run.max_steps=6", "sim.workers=3", "sim.step_time=1", *algo]
    runs = {}
    for name, extra in (("plain", []), ("offload", ["sim.offload=true"])):
        if name == "offload":
            monkeypatch.setattr(sim_module, "move_worker_state", counted_move)
            monkeypatch.setattr(InProcessGroup, "rendezvous", counted_rendezvous)
            monkeypatch.setattr(InProcessTransport, "exchange_scope", counted_scope)
            fresh = lambda t, device: t.clone()  # noqa: E731 (the stand-in: new storage, same device)
            monkeypatch.setattr(algorithm_module, "move_tensor", fresh)
            monkeypatch.setattr(outer_module, "move_tensor", fresh)
        cfg, _ = load_config([TINY], [*common, *extra, f"run.dir={tmp_path / name}"])
        runs[name] = simulate_once(cfg)
    for key in ("val_loss", "bytes_sent", "virtual_wall_s"):
        assert runs["plain"][key] == runs["offload"][key], key
    many = [moves for collectives, moves in exchanges if collectives >= 10]
    assert len(many) >= 6 and max(many) <= 2, exchanges  # parked and brought back once, however many buckets


def _timed_run(step_time, measured):
    """Two workers at speeds 1 and 0.5: three steps each (``measured[rank]``: what their compute took), a 1 MB
    all-reduce on a 1 MB/s link with 100 ms latency (1.2 s), three steps more. The group's summary."""
    group = InProcessGroup(2, speeds=[1.0, 0.5], network=NetworkModel(1e6, 0.1), step_time=step_time)

    def body(rank, transport):
        seconds = iter(measured[rank])
        for _ in range(3):
            transport.advance_compute(next(seconds))
        all_reduce_(transport, [torch.ones(250_000)])
        for _ in range(3):
            transport.advance_compute(next(seconds))

    run_workers(group, body)
    return group.summary()


def test_virtual_step_time_is_the_median_of_the_measured_steps():
    # one step of worker 0 took 50 times longer (the machine was busy): the virtual clock does not follow it
    summary = _timed_run(None, [[0.1, 0.1, 5.0, 0.1, 0.1, 0.1], [0.1] * 6])
    assert summary["virtual_step_time_s"] == pytest.approx(0.1)
    assert summary["virtual_step_time_source"] == "median of measured steps"
    assert summary["measured_step_time_s"] == pytest.approx(0.1) and summary["measured_steps"] == 12
    # worker 1 (speed 0.5) arrives last at the all-reduce after 3 x 0.2 s and finishes 3 x 0.2 s after its end
    assert summary["virtual_wall_s"] == pytest.approx(6 * 0.2 + 1.2)
    assert summary["virtual_compute_s_per_worker"] == pytest.approx([0.6, 1.2])


def test_steps_timed_on_a_device_join_the_median_once_the_device_is_past_them():
    """On a GPU a step's compute is a DeviceSpan (two CUDA events), read once the device has passed it: spans join
    the median in order as they complete, and the median waits for the oldest only when it has nothing else.
    Here spans are stood in for by objects that say when they are done (CUDA events are not on this machine; the
    GPU-marked test below times real ones)."""
    from diloco.sim.clock import RunningMedian

    class Span:
        def __init__(self, seconds: float) -> None:
            self.value, self.finished, self.read = seconds, False, False

        def done(self) -> bool:
            return self.finished

        def seconds(self) -> float:
            self.read = True
            return self.value

    median = RunningMedian()
    spans = [Span(s) for s in (0.3, 0.1, 0.2, 5.0)]
    for span in spans:
        median.add_later(span)
    assert median.median() == 0.3 and spans[0].read and not spans[1].read  # nothing else: waits for the oldest
    spans[1].finished = spans[3].finished = True
    assert median.median() == pytest.approx(0.2) and spans[1].read  # 0.3 and 0.1; 5.0 waits behind 0.2
    assert not spans[3].read
    assert len(median) == 4 and spans[3].read  # the length counts every span: it waits for them all
    assert median.median() == pytest.approx(0.25)


@pytest.mark.gpu
def test_simulated_steps_on_a_gpu_are_timed_on_the_device(tmp_path):
    """A simulated step on a GPU is timed by CUDA events around its compute (the host's clock would see the
    launches only): the median measured step is a real share of the loop's time, and no more than all of it."""
    from conftest import FAST, TINY
    from launch.config import load_config
    from launch.simulate.runner import simulate_once

    cfg, _ = load_config([TINY], [*FAST, "run.device=cuda", "run.max_steps=30", "sim.workers=2", "sim.baseline=none",
                                  "algo.name=diloco", "algo.inner_steps=10", "run.eval_every=0",
                                  f"run.dir={tmp_path / 'run'}"])
    summary = simulate_once(cfg)
    measured, steps = summary["measured_step_time_s"], summary["measured_steps"]
    assert steps == 60 and measured > 0
    assert measured * steps <= summary["wall_s"]


def test_a_fixed_step_time_makes_virtual_time_independent_of_the_machine():
    quiet = _timed_run(0.25, [[0.01] * 6, [0.01] * 6])
    busy = _timed_run(0.25, [[0.3, 2.0, 0.01, 9.0, 0.5, 0.02], [1.0, 0.01, 3.0, 0.2, 0.2, 7.0]])
    for summary in (quiet, busy):
        assert summary["virtual_step_time_s"] == 0.25 and summary["virtual_step_time_source"] == "sim.step_time"
        assert summary["virtual_wall_s"] == pytest.approx(6 * 0.5 + 1.2)
    for key in ("virtual_wall_s", "virtual_compute_s_per_worker", "compute_utilization"):
        assert quiet[key] == busy[key]


def test_step_time_flag_sets_sim_step_time():
    from launch.cli.commands import _load, build_parser

    cfg = _load(build_parser().parse_args(["simulate", "--step-time", "0.25"]))
    assert cfg.sim.step_time == 0.25 and cfg.sim.step_time_note is None  # the preset's note named its own figure
    demo = _load(build_parser().parse_args(["simulate"])).sim  # the demo's step is a stated GPU figure
    assert demo.step_time == 0.0235 and "H100" in demo.step_time_note
    assert _load(build_parser().parse_args(["simulate", "--config", "tiny"])).sim.step_time is None


def test_a_measured_step_time_that_moved_with_the_host_says_so():
    """A step time measured while other jobs came and went moves over the run: the table says so in one line and
    suggests a fixed one; one slow step among many is no such move."""
    from launch.simulate.runner import format_table

    def run(seconds):
        group = InProcessGroup(1)
        run_workers(group, lambda rank, transport: [transport.advance_compute(s) for s in seconds])
        return {"val_loss": 2.0, "tokens": 1e6, "run_dir": "runs/x", **group.summary()}

    steady, busy = run([0.1] * 63 + [5.0]), run([0.1] * 32 + [0.4] * 32)  # busy: other jobs from half-way on
    assert steady["measured_step_time_range_s"] == pytest.approx((0.1, 0.1))
    assert busy["measured_step_time_range_s"] == pytest.approx((0.1, 0.4))
    assert "moved" not in format_table([("diloco x1", steady)], NetworkModel())
    text = format_table([("diloco x1", busy)], NetworkModel())
    assert "the measured step time moved during the run (0.1 s to 0.4 s" in text and "--step-time 0.1" in text


def test_the_baseline_runs_on_the_measured_step_time_of_the_run(tmp_path):
    cfg, _ = load_config([TINY], [*FAST, "run.batch_size=2", "run.eval_every=0", "run.checkpoint_every=0",
                                  "run.max_steps=4", "sim.workers=2", "algo.name=diloco", "algo.inner_steps=2",
                                  "sim.baseline=ddp",
                                  f"run.dir={tmp_path / 'run'}"])
    summary = simulate(cfg)
    assert summary["virtual_step_time_source"] == "median of measured steps"
    assert summary["virtual_step_time_s"] == summary["measured_step_time_s"] > 0
    assert summary["measured_steps"] == 4 * 2
    assert summary["virtual_compute_s_per_worker"] == pytest.approx([4 * summary["virtual_step_time_s"]] * 2)
    base = json.loads((tmp_path / "run" / "baseline-ddp" / "summary.json").read_text())
    assert base["virtual_step_time_s"] == summary["virtual_step_time_s"]
    assert base["virtual_step_time_source"] == "sim.step_time"


def test_the_table_compares_at_equal_time_too():
    from launch.simulate.runner import format_table

    run = {"val_loss": 2.5, "tokens": 1e6, "bytes_sent_per_worker": [1 << 20], "virtual_wall_s": 20.0,
           "compute_utilization": 0.9, "run_dir": "runs/x", "virtual_step_time_s": 0.5,
           "virtual_step_time_source": "sim.step_time",
           "equal_time": {"at_s": 20.0, "loss_at": [2.5, 3.0], "final_loss": [2.5, 2.0], "final_s": [20.0, 50.0],
                          "time_to_other": [None, 30.0]}}
    ddp = {"val_loss": 2.0, "tokens": 1e6, "bytes_sent_per_worker": [50 << 20], "virtual_wall_s": 50.0,
           "compute_utilization": 0.4, "run_dir": "runs/x/baseline-ddp"}
    text = format_table([("diloco x4 (H=50)", run), ("ddp x4", ddp)], NetworkModel(125e6, 0.08))
    assert "0.5 s per step at speed 1 (fixed" in text  # which step time the virtual clock used
    assert "loss at 20.0s" in text and "not reached" in text and "30.0s" in text
    assert "at equal tokens: diloco x4 (H=50) sends 50x fewer bytes than DDP and finishes 2.5x sooner" in text
    assert ("at equal virtual time (20.0s, when diloco x4 (H=50) finished): DDP's val loss was 3.0000, "
            "diloco x4 (H=50)'s 2.5000 (-16.7%)") in text
    assert "DDP reaches diloco x4 (H=50)'s final 2.5000 at 30.0s" in text
    assert "diloco x4 (H=50) never reaches DDP's final 2.0000" in text


def _trace(tmp_path, text: "str | bytes", name: str = "links.csv"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_link_traces_read_csv_and_yaml_and_repeat(tmp_path):
    from diloco.sim.links import LinkTrace

    csv = _trace(tmp_path, "# a comment\ntime,worker,bandwidth,latency\n0,*,8Mbit,10ms\n1h,*,80Mbit,20ms\n"
                           "0,1,1MB/s,50ms\n")
    yml = _trace(tmp_path, "links:\n  - {time: 0, worker: '*', bandwidth: 8Mbit, latency: 10ms}\n"
                           "  - {time: 1h, worker: '*', bandwidth: 80Mbit, latency: 20ms}\n"
                           "  - {time: 0, worker: 1, bandwidth: 1MB/s, latency: 50ms}\n", "links.yaml")
    for path in (csv, yml):
        t = LinkTrace.load(path)
        assert t.at(0, 0) == (1e6, 0.01) and t.at(0, 3599) == (1e6, 0.01) and t.at(0, 3600) == (1e7, 0.02)
        assert t.at(1, 5000) == (1e6, 0.05)  # worker 1's own row wins over *
        assert t.period == 7200 and t.at(0, 7200 + 10) == (1e6, 0.01)  # the trace repeats
    shipped = LinkTrace.load(ROOT / "configs" / "links-home-uplink.csv")
    bws = [shipped.at(0, h * 3600)[0] * 8 / 1e6 for h in range(24)]
    assert min(bws) == 20 and max(bws) == 100 and shipped.period == 24 * 3600


@pytest.mark.parametrize("text, expected", [
    ("time,worker,bandwidth\n0,*,1Gbit\n", "lacks latency"),
    ("time,worker,bandwidth,latency\n0,*,fast,1ms\n", "row 2"),
    ("time,worker,bandwidth,latency\n0,*,1Gbit,soon\n", "row 2"),
    # the line in the file, comments and blank lines counted; a byte-order mark (a spreadsheet's export) is no
    # part of the header; a file that is not text is one line
    ("# a comment\n\ntime,worker,bandwidth,latency\n# another\n0,*,1Gbit,1ms\n\n60,*,fast,1ms\n", "row 7: "),
    ("\ufefftime,worker,bandwidth,latency\n0,*,fast,1ms\n", "row 2: "),
    (b"time,worker\xff\xfe\n", "not a text file (not UTF-8)"),
    ("time,worker,bandwidth,latency\n0,9,1Gbit,1ms\n", "worker 9"),
    ("time,worker,bandwidth,latency\n0,0,1Gbit,1ms\n", "worker 1 has no rows"),
])
def test_a_bad_link_trace_fails_before_training(tmp_path, text, expected, capsys, monkeypatch):
    path = _trace(tmp_path, text)
    rc, err = simulate_in_process(["--workers", "2", "--links", str(path)], capsys, monkeypatch)
    assert rc == 2, err
    assert "sim.links" in err and expected in err and "Traceback" not in err
    assert "[worker" not in err


def test_links_change_over_virtual_time_and_the_slowest_link_bounds_a_collective(tmp_path):
    from diloco.sim.links import LinkTrace

    # worker 1 has 1 MB/s until t=5 s, then 10 MB/s; worker 0 always 10 MB/s; no latency
    path = _trace(tmp_path, "time,worker,bandwidth,latency\n0,0,10MB/s,0\n0,1,1MB/s,0\n5s,1,10MB/s,0\n")
    group = InProcessGroup(2, speeds=[1.0, 0.5], network=NetworkModel(links=LinkTrace.load(path)), step_time=1.0)

    def body(rank, transport):
        for _ in range(2):  # worker 0 arrives at 2 s, worker 1 at 4 s
            transport.advance_compute(0.0)
        all_reduce_(transport, [torch.ones(250_000)])  # 1 MB: 1 MB on each link, at 1 MB/s (t=4: before 5 s)
        for _ in range(2):  # 2 s and 4 s of compute: worker 1 arrives at 9 s
            transport.advance_compute(0.0)
        all_reduce_(transport, [torch.ones(250_000)])  # now 10 MB/s: 0.1 s

    run_workers(group, body)
    s = group.summary()
    assert s["virtual_wall_s"] == pytest.approx(4 + 1 + 4 + 0.1)
    assert s["virtual_compute_s_per_worker"] == pytest.approx([4.0, 8.0])
    assert s["virtual_send_s_per_worker"] == pytest.approx([1.1, 1.1])
    assert s["virtual_wait_s_per_worker"] == pytest.approx([2 + 2 + 0, 0.0])  # worker 0 waits for worker 1
    for c, w, x in zip(s["virtual_compute_s_per_worker"], s["virtual_wait_s_per_worker"],
                       s["virtual_send_s_per_worker"]):
        assert c + w + x == pytest.approx(s["virtual_wall_s"])


def test_simulate_with_links_reports_where_time_went(tmp_path):
    path = _trace(tmp_path, "time,worker,bandwidth,latency\n0,*,4Mbit,20ms\n")
    cfg, _ = load_config([TINY], [*QUICK, "run.max_steps=4", "sim.workers=2", "algo.name=diloco",
                                  "algo.inner_steps=2", "sim.step_time=0.1", f"sim.links={path}",
                                  f"run.dir={tmp_path / 'run'}"])
    s = simulate_once(cfg)
    assert "links from" in s["network"]
    assert all(x > 0 for x in s["virtual_send_s_per_worker"])
    for c, w, x in zip(s["virtual_compute_s_per_worker"], s["virtual_wait_s_per_worker"],
                       s["virtual_send_s_per_worker"]):
        assert c + w + x == pytest.approx(s["virtual_wall_s"])
    same, _ = load_config([TINY], [*QUICK, "run.max_steps=4", "sim.workers=2", "algo.name=diloco",
                                   "algo.inner_steps=2", "sim.step_time=0.1", "sim.bandwidth=4Mbit",
                                   "sim.latency=20ms", f"run.dir={tmp_path / 'fixed'}"])
    assert simulate_once(same)["virtual_wall_s"] == pytest.approx(s["virtual_wall_s"])  # a constant trace


@pytest.mark.parametrize("ddp_s, words", [(20.5, "finishes about as fast"), (19.5, "finishes about as fast"),
                                          (21.5, "finishes 1.1x sooner"), (18.0, "takes 1.1x longer")])
def test_the_table_says_about_as_fast_where_a_ratio_would_read_1_0x(ddp_s, words):
    from launch.simulate.runner import format_table

    run = {"val_loss": 2.5, "tokens": 1e6, "bytes_sent_per_worker": [1 << 20], "virtual_wall_s": 20.0,
           "compute_utilization": 0.9, "run_dir": "runs/x", "virtual_step_time_s": 0.5,
           "virtual_step_time_source": "sim.step_time"}
    ddp = {"val_loss": 2.4, "tokens": 1e6, "bytes_sent_per_worker": [4 << 20], "virtual_wall_s": ddp_s,
           "compute_utilization": 0.8, "run_dir": "runs/x/baseline-ddp"}
    text = format_table([("diloco x4 (H=50)", run), ("ddp x4", ddp)], NetworkModel(125e6, 0.08))
    assert f"sends 4x fewer bytes than DDP and {words} in virtual time" in text, text
    assert "1.0x" not in text


def test_workers_that_cannot_fit_in_memory_are_refused_in_one_line(tmp_path, capfd):
    """N simulated workers hold N models: too many are refused before anything is built (a lower bound: 8 bytes a
    parameter a worker), or after a few, by what they took (before: --workers 2000 was killed for memory)."""
    import torch

    from launch.loop.runtime import available_memory

    sets = [a for s in QUICK for a in ("--set", s)]
    res = loco(["simulate", "--config", TINY, *sets, "--workers", "1000000", "--run-dir", str(tmp_path / "a")], capfd)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-3000:]
    assert "simulating 1000000 workers needs at least" in res.stderr and "[worker" not in res.stderr
    # between the bound and what a worker takes: tiny's DiLoCo worker holds about 17 MiB, the bound says 6.8
    workers = int(available_memory(torch.device("cpu")) / (10 << 20))
    res = loco(["simulate", "--config", TINY, *sets, "--workers", str(workers), "--run-dir", str(tmp_path / "b")],
               capfd)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"simulating {workers} workers needs about" in res.stderr.splitlines()[-1]
    assert re.search(r"as measured on the first \d+ built", res.stderr)  # 4 or more: per-build noise moves it
