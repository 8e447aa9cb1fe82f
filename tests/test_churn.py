"""Churn in the simulator: schedules (files and distributions), membership per round, joiners taking the run's
state, and the errors a user sees for a bad schedule."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FAST, TINY, loco
from diloco.sim import InProcessGroup, run_workers
from diloco.sim.churn import ChurnError, ChurnEvent, ChurnSchedule
from diloco.sim.transport import WorkerLeft
from launch.config import ConfigError, load_config
from launch.simulate.runner import simulate_once

QUICK = [*FAST, "run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none",
         "sim.step_time=1"]

TRACE = """# round-keyed: worker 1 misses rounds 1 and 2, worker 2 misses round 2 and is away at the end
round,worker,event
1,1,leave
3,1,join
2,2,leave
"""


def _metrics(run_dir) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rounds(run_dir) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "rounds.jsonl").read_text().splitlines()]


# ---- schedules --------------------------------------------------------------------------------------
def test_a_trace_reads_from_csv_and_yaml_alike(tmp_path):
    (tmp_path / "c.csv").write_text(TRACE)
    (tmp_path / "c.yaml").write_text("churn:\n  - {round: 1, worker: 1, event: leave}\n"
                                     "  - {round: 3, worker: 1, event: join}\n  - {round: 2, worker: 2, event: leave}\n")
    a, b = ChurnSchedule.parse(str(tmp_path / "c.csv"), 3), ChurnSchedule.parse(str(tmp_path / "c.yaml"), 3)
    assert [e.describe() for e in a.events] == [e.describe() for e in b.events] == [
        "worker 1 leaves at round 1", "worker 1 joins at round 3", "worker 2 leaves at round 2"]
    # replay: a leave is due from its round on, once; a join only once the worker is away
    assert not a.leaves_now(1, 0.0, 0) and a.leaves_now(1, 0.0, 1) and not a.leaves_now(1, 0.0, 1)
    assert not a.joins_now(1, 0.0, 2) and a.joins_now(1, 0.0, 3)
    assert not a.leaves_now(0, 99.0, 99)  # worker 0 has no events
    timed = tmp_path / "t.csv"
    timed.write_text("time,worker,event\n90s,2,leave\n2m,2,join\n")
    t = ChurnSchedule.parse(str(timed), 3)
    assert not t.leaves_now(2, 89.9, 5) and t.leaves_now(2, 90.0, 0) and not t.joins_now(2, 119.0, 9)
    assert t.joins_now(2, 120.0, 0)


def test_the_shipped_example_trace_reads():
    from conftest import ROOT

    sched = ChurnSchedule.parse(str(ROOT / "configs" / "churn-example.csv"), 8)
    assert len(sched.events) == 6 and sched.leaves_now(3, 120.0, 0) and sched.joins_now(3, 360.0, 0)
    with pytest.raises(ChurnError, match="worker 7"):
        ChurnSchedule.parse(str(ROOT / "configs" / "churn-example.csv"), 6)


@pytest.mark.parametrize("text, expected", [
    ("round,worker,event\n1,0,leave\n", "worker 0 keeps the run's log"),
    ("round,worker,event\n1,5,leave\n", "an event for worker 5, but there are 3 workers"),
    ("round,worker,event\n1,1,leave\n2,1,leave\n", "worker 1 leaves at round 2, but it is already away"),
    ("round,worker,event\n1,1,join\n", "worker 1 joins at round 1, but it is already in the run"),
    ("round,worker,event\n1,1,vanish\n", "row 2: event 'vanish' must be leave or join"),
    ("round,worker,event\n-1,1,leave\n", "row 2: round '-1' must be an integer >= 0"),
    ("time,worker,event\nsoon,1,leave\n", "row 2: time:"),
    ("worker,event\n1,leave\n", "the header must name worker, event and time or round"),
    ("round,time,worker,event\n1,5s,1,leave\n", "row 2: give either a time or a round"),
    ("round,worker,event\n", "no events"),
    ("# workers that come and go\nround,worker,event\n\n# the first\n1,1,vanish\n", "row 5: event 'vanish'"),
])
def test_a_bad_trace_names_its_file_and_row(tmp_path, text, expected):
    path = tmp_path / "churn.csv"
    path.write_text(text)
    with pytest.raises(ChurnError) as e:
        ChurnSchedule.parse(str(path), 3)
    assert expected in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("spec, expected", [
    ("poisson:mtbf=0s", "mtbf"),
    ("poisson:rejoin=5m", "mtbf"),
    ("poisson:mtbf=2h,every=5", "expected poisson:mtbf=DURATION"),
    ("poisson:mtbf=later", "mtbf"),
    ("nowhere.csv", "no such file"),
])
def test_a_bad_distribution_or_missing_file_says_what_it_expects(spec, expected):
    with pytest.raises(ChurnError, match=expected):
        ChurnSchedule.parse(spec, 4)


def test_a_distribution_is_seeded_per_worker_and_spares_worker_0():
    def replay(seed):
        s = ChurnSchedule.parse("poisson:mtbf=10s,rejoin=5s", 4, seed)
        seen, away = [], {w: False for w in range(4)}
        for t in range(0, 200):
            for w in range(4):
                if not away[w] and s.leaves_now(w, float(t), 0):
                    seen.append((t, w, "leave"))
                    away[w] = True
                elif away[w] and s.joins_now(w, float(t), 0):
                    seen.append((t, w, "join"))
                    away[w] = False
        return seen

    a = replay(1)
    assert a == replay(1) and a != replay(2)
    assert all(w != 0 for _, w, _ in a)
    leaves = [e for e in a if e[2] == "leave"]
    assert 20 <= len(leaves) <= 80  # 3 workers, about 200 / 15 cycles each
    # up-times follow the mean: an exponential of mean 10 s, measured from each (re)join
    assert {w for _, w, _ in a} == {1, 2, 3}


# ---- the group: a collective goes on without a worker that left ---------------------------------------
def test_a_worker_that_leaves_while_the_others_wait_completes_their_collective():
    sched = ChurnSchedule([ChurnEvent(2, "leave", round=1), ChurnEvent(2, "join", round=3)], "test")
    group = InProcessGroup(3, churn=sched, step_time=1.0)
    seen: dict[int, list] = {0: [], 1: [], 2: []}

    def body(rank, transport):
        rnd = 0
        while rnd < 5:
            group.rounds[rank] = rnd  # what a round boundary does in a run
            if rank == 0:
                for w in group.parked():
                    if sched.joins_now(w, transport.now(), rnd):
                        group.admit(w, group.clock[0])
            try:
                transport.advance_compute(0.0)
            except WorkerLeft:
                if not group.wait_to_join(rank):
                    return "away at the end"
                rnd = group.rounds[rank]  # back in the run: the round the others are in
                continue
            got = transport.all_gather_bytes(bytes([rank]))
            seen[rank].append((rnd, sorted(b[0] for b in got)))
            rnd += 1
        return "done"

    results = run_workers(group, body)
    assert results == ["done", "done", "done"]
    # worker 2 left in round 1 (its collective went on without it) and came back for round 3
    assert seen[0] == [(0, [0, 1, 2]), (1, [0, 1]), (2, [0, 1]), (3, [0, 1, 2]), (4, [0, 1, 2])]
    assert seen[2] == [(0, [0, 1, 2]), (3, [0, 1, 2]), (4, [0, 1, 2])]
    assert group.leaves == [0, 0, 1] and group.joins == [0, 0, 1]
    assert group.summary()["virtual_away_s_per_worker"][2] > 0


# ---- whole runs -----------------------------------------------------------------------------------------
def test_diloco_with_a_scripted_trace_records_its_members_and_joiners_take_the_state(tmp_path):
    trace = tmp_path / "churn.csv"
    trace.write_text(TRACE)
    cfg, _ = load_config([TINY], [*QUICK, "run.max_steps=40", "sim.workers=3", "algo.name=diloco",
                                  "algo.inner_steps=10", f"sim.churn={trace}", f"run.dir={tmp_path / 'run'}",
                                  "log.every=5"])
    summary = simulate_once(cfg)
    rounds = _rounds(tmp_path / "run")
    assert [r["members"] for r in rounds] == [[0, 1, 2], [0, 2], [0], [0, 1]]
    assert [r["left"] for r in rounds] == [[], [1], [2], []]
    assert [r["joining"] for r in rounds] == [[], [], [1], []]
    tokens_per_round = 10 * 4 * cfg.data.seq_len  # H steps of batch 4: every member's weight in a full round
    assert all(set(r["weights"].values()) == {float(tokens_per_round)} for r in rounds)
    assert summary["leaves_per_worker"] == [0, 1, 1] and summary["joins_per_worker"] == [0, 1, 0]
    assert summary["membership"] == {"rounds": 4, "mean_members": 2.0, "fewest_members": 1}
    # steps: worker 1 trained round 0, one step of round 1 (lost), rounds 3; worker 2 rounds 0, 1 and a step of 2
    assert summary["steps_per_worker"] == [40, 21, 21]
    assert summary["tokens"] == 82 * 4 * cfg.data.seq_len
    # between rounds too, where worker 0 logs before the others take their turn: they count as far as its step
    # while they are members (before, step 5 counted worker 0's 5 steps alone); a sync step counts what they ran,
    # and worker 2, the last to reach the sync of step 20, runs first in round 2 and leaves at its first step
    lines = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    assert [(r["step"], r["tokens"] // (4 * cfg.data.seq_len)) for r in lines] == [
        (5, 15), (10, 30), (15, 45), (20, 51), (25, 57), (30, 62), (35, 72), (40, 82)]
    away = summary["virtual_away_s_per_worker"]
    assert away[0] == 0 and away[1] > 0 and away[2] > away[1]  # worker 2 is still away at the end
    # the joiner took the run's state: at the end it evaluates the very model worker 0 holds
    losses = {w["worker"]: w["val_loss"] for w in summary["workers"]}
    assert sorted(losses) == [0, 1] and losses[0] == losses[1]
    # each worker's own entry counts what it trained, not the run's steps while it was away (it said 40 for 1)
    assert {w["worker"]: w["steps"] for w in summary["workers"]} == {0: 40, 1: 21}
    assert {w["worker"]: w["tokens"] for w in summary["workers"]} == {0: 40 * 4 * cfg.data.seq_len,
                                                                     1: 21 * 4 * cfg.data.seq_len}
    assert torch.isfinite(torch.tensor(summary["val_loss"]))
    # the joiner downloaded the state over its link: bytes received, time not counted as compute
    assert summary["bytes_received_per_worker"][1] > summary["bytes_received_per_worker"][2]


def test_ddp_with_churn_keeps_one_replica_and_a_time_keyed_trace(tmp_path):
    trace = tmp_path / "churn.csv"
    trace.write_text("time,worker,event\n3s,1,leave\n6s,1,join\n")
    cfg, _ = load_config([TINY], [*QUICK, "run.max_steps=12", "sim.workers=2", "algo.name=ddp",
                                  f"sim.churn={trace}", "sim.bandwidth=null", "sim.latency=0",
                                  f"run.dir={tmp_path / 'run'}"])
    summary = simulate_once(cfg)
    members = [r["members"] for r in _rounds(tmp_path / "run")]
    # one step a virtual second: worker 1 leaves after its 3rd step (lost) and is back from step 7 on
    assert members == [[0, 1]] * 2 + [[0]] * 4 + [[0, 1]] * 6
    losses = [w["val_loss"] for w in summary["workers"]]
    assert len(losses) == 2 and losses[0] == losses[1]  # the joiner took the weights and the AdamW moments


def test_poisson_churn_runs_to_the_end_and_the_table_says_so(tmp_path, capfd):
    res = loco(["simulate", "--config", TINY, *[a for kv in QUICK for a in ("--set", kv)], "--max-steps", "40",
                "--workers", "4", "--set", "algo.name=diloco", "--set", "algo.inner_steps=5",
                "--churn", "poisson:mtbf=6s,rejoin=4s", "--run-dir", str(tmp_path / "run")], capfd)
    assert res.returncode == 0, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sum(summary["leaves_per_worker"]) >= 2 and summary["leaves_per_worker"][0] == 0
    assert summary["membership"]["fewest_members"] < 4
    assert "churn poisson:mtbf=6s,rejoin=4s:" in res.stdout and "away" in res.stdout
    assert len(_rounds(tmp_path / "run")) == 8


def test_a_bad_churn_setting_is_one_line_before_training(capfd):
    res = loco(["simulate", "--config", TINY, "--workers", "3", "--churn", "nowhere.csv"], capfd)
    assert res.returncode == 2, res.stderr
    assert "sim.churn" in res.stderr and "nowhere.csv: no such file" in res.stderr
    assert "Traceback" not in res.stderr and "[worker" not in res.stderr


@pytest.mark.parametrize("sets, expected", [
    (["sim.churn=poisson:mtbf=soon"], "sim.churn: churn 'poisson:mtbf=soon': mtbf"),
    (["sim.churn=poisson:mtbf=1h", "algo.name=streaming", "algo.overlap_steps=2"], "algo.overlap_steps=0"),
])
def test_the_config_check_refuses_a_bad_churn_setting(sets, expected):
    with pytest.raises(ConfigError) as e:
        load_config([TINY], ["sim.workers=3", *sets])
    assert expected in str(e.value)


def test_a_run_with_churn_is_not_resumed(tmp_path):
    cfg, _ = load_config([TINY], [*QUICK, "sim.churn=poisson:mtbf=1h", "run.resume=true",
                                  f"run.dir={tmp_path}"])
    with pytest.raises(ConfigError, match="cannot be resumed"):
        simulate_once(cfg)


def test_a_run_with_churn_resumes_without_it(tmp_path, capfd):
    """What the refusal above suggests: --resume --set sim.churn= goes on with every worker, the one away when the
    checkpoint was written on worker 0's state (before: an IndexError, and worker 1 took worker 2's state)."""
    trace = tmp_path / "churn.csv"
    trace.write_text(TRACE)
    run_dir = tmp_path / "run"
    sets = [*QUICK, "sim.workers=3", "algo.name=diloco", "algo.inner_steps=10", f"sim.churn={trace}"]
    res = loco(["simulate", "--config", TINY, *[a for kv in sets for a in ("--set", kv)], "--max-steps", "20",
                "--run-dir", str(run_dir)], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["leaves_per_worker"] == [0, 1, 0]  # 1 away at 20
    res = loco(["simulate", "--run-dir", str(run_dir), "--resume", "--set", "sim.churn=", "--max-steps", "40"], capfd)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "[worker 1] away when the checkpoint was written: it starts from worker 0's state" in res.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and "churn" not in summary
    losses = [w["val_loss"] for w in summary["workers"]]
    assert len(losses) == 3 and len(set(losses)) == 1 and torch.isfinite(torch.tensor(losses[0]))
    # worker 1 was away from step 11 to step 20: that time is away time, not compute or waiting
    assert summary["virtual_compute_s_per_worker"] == [40.0, 31.0, 40.0]


def test_demo_with_churn_keeps_every_worker_on_one_model(tmp_path):
    """A DeMo joiner takes the parameters worker 0 held at the boundary (DeMo's weight decay changes them at the
    start of the next step, before its exchange), so every worker ends on the same model."""
    trace = tmp_path / "churn.csv"
    trace.write_text("round,worker,event\n3,1,leave\n6,1,join\n")
    cfg, _ = load_config([TINY], [*QUICK, "run.max_steps=10", "sim.workers=3", "algo.name=demo",
                                  f"sim.churn={trace}", f"run.dir={tmp_path / 'run'}"])
    summary = simulate_once(cfg)
    assert [r["members"] for r in _rounds(tmp_path / "run")][2:7] == [[0, 1, 2], [0, 2], [0, 2], [0, 2], [0, 1, 2]]
    losses = [w["val_loss"] for w in summary["workers"]]
    assert len(losses) == 3 and len(set(losses)) == 1, losses


def test_streaming_with_a_joiner_at_the_last_boundary_finishes_in_step(tmp_path):
    """Streaming DiLoCo's last exchange sends the fragments with unsent steps; a worker admitted at the very end
    has trained none, and still takes part (weight 0): which fragments go follows the schedule, not its own
    counters, so every worker makes the same collectives."""
    trace = tmp_path / "churn.csv"
    trace.write_text("round,worker,event\n1,1,leave\n4,1,join\n")
    cfg, _ = load_config([TINY], [*QUICK, "run.max_steps=20", "sim.workers=3", "algo.name=streaming",
                                  "algo.inner_steps=10", "algo.fragments=2", f"sim.churn={trace}",
                                  f"run.dir={tmp_path / 'run'}"])
    summary = simulate_once(cfg)
    rounds = _rounds(tmp_path / "run")
    assert [r["members"] for r in rounds] == [[0, 1, 2], [0, 2], [0, 2], [0, 2]]
    assert rounds[-1]["joining"] == [1]
    losses = [w["val_loss"] for w in summary["workers"]]
    assert len(losses) == 3 and len(set(losses)) == 1, losses


@pytest.mark.parametrize("sets, expected", [
    (["algo.inner_steps=5"], [("leave", 10, None), ("join", 20, None), ("leave", None, 90.0)]),
    (["algo.name=streaming", "algo.inner_steps=8", "algo.fragments=2"],  # a round: one fragment's, every 4 steps
     [("leave", 8, None), ("join", 16, None), ("leave", None, 90.0)]),
    (["sync.mode=time", "sync.time_budget_s=30s"], [("leave", None, 60.0), ("join", None, 120.0),
                                                     ("leave", None, 90.0)]),
], ids=["steps", "streaming", "time"])
def test_the_ddp_baseline_reads_a_round_keyed_trace_at_the_same_point_of_training(tmp_path, sets, expected):
    """DDP's round is one step: a trace keyed by DiLoCo's rounds (round 2 of H=5 is step 10) is handed to the
    baseline keyed by steps (or, for time-budgeted rounds, by the virtual time the round starts at), so both runs
    lose and regain workers at the same point; before, the baseline lost worker 1 at its step 2. Events keyed by
    time stay as they are."""
    from launch.simulate.runner import baseline_config

    trace = tmp_path / "churn.csv"
    trace.write_text("worker,event,round,time\n1,leave,2,\n1,join,4,\n2,leave,,90s\n")
    cfg, _ = load_config([TINY], [*FAST, "algo.name=diloco", "sim.workers=3", f"sim.churn={trace}",
                                  f"run.dir={tmp_path / 'run'}", *sets])  # a later algo.name wins
    base = baseline_config(cfg, tmp_path / "run")
    assert base.sim.churn != str(trace)
    got = ChurnSchedule.parse(base.sim.churn, 3).events
    assert [(e.kind, e.round, e.time) for e in got] == expected
    plain = tmp_path / "time.csv"
    plain.write_text("time,worker,event\n30s,1,leave\n")
    cfg, _ = load_config([TINY], [*FAST, "algo.name=diloco", "sim.workers=3", f"sim.churn={plain}"])
    assert baseline_config(cfg, tmp_path / "run2").sim.churn == str(plain)
