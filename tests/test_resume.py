"""A run that is stopped (killed, Ctrl-C or SIGTERM) and resumed gives the same loss curve as one that was not.

Also: a folder whose checkpoints are all unreadable is refused (and --restart starts it over), and a resumed
--max-time run gets its budget afresh.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import shutil
import time

import pytest

from conftest import FAST, ROOT, TINY, child_env, kill_when, loco
from launch.store.checkpoint import checkpoint_name, latest_checkpoint, list_checkpoints
from launch.metrics.log import read_metrics
from launch.errors import RunError
from launch.loop.trainer import Hooks, train

STEPS = 40
SHORT = ["run.batch_size=4", "data.seq_len=64"]  # exactness does not need a full batch: a step is 8x cheaper
ARGS = ["train", "--config", TINY, "--max-steps", str(STEPS), *[a for s in FAST + SHORT for a in ("--set", s)],
        "--set", "log.every=5", "--set", "run.eval_every=20", "--set", "run.checkpoint_every=10"]
COMPARED = ("step", "tokens", "loss", "lr", "val_loss", "grad_norm")


def _curve(run_dir):
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    res = loco([*ARGS, "--run-dir", str(run_dir)])
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


def test_killed_run_resumes_exactly(reference, tmp_path, capfd):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *ARGS, "--run-dir", str(run_dir)], cwd=ROOT,
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kill_when(proc, (run_dir / "checkpoints" / "step_00000020.pt").exists, poll=0.01)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    newest = list_checkpoints(run_dir / "checkpoints")[0].name
    assert newest < f"step_{STEPS:08d}.pt", "the kill came too late to test a resume"

    res = loco(["train", "--run-dir", str(run_dir), "--resume"], capfd)  # settings come from the run's config.yaml
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr
    assert _curve(run_dir) == _curve(reference)
    assert json.loads((run_dir / "summary.json").read_text())["val_loss"] == \
        json.loads((reference / "summary.json").read_text())["val_loss"]


def test_ctrl_c_saves_and_resumes_exactly(reference, tmp_path, tiny_cfg):
    run_dir = tmp_path / "interrupted"
    extra = [*SHORT, "log.every=5", "run.eval_every=20", "run.checkpoint_every=10", f"run.max_steps={STEPS}"]

    def interrupt(step, record):
        if step == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(*extra, run_dir=run_dir), hooks=Hooks(on_step=interrupt))
    assert list_checkpoints(run_dir / "checkpoints")[0].name == "step_00000025.pt"
    summary = train(tiny_cfg(*extra, "run.resume=true", run_dir=run_dir))
    assert summary["steps"] == STEPS
    assert _curve(run_dir) == _curve(reference)


def test_fresh_run_refuses_a_folder_with_checkpoints(reference, tiny_cfg, capfd):
    with pytest.raises(RunError, match="--resume"):
        train(tiny_cfg(run_dir=reference))
    res = loco([*ARGS, "--run-dir", str(reference)], capfd)
    assert res.returncode == 2 and "already holds checkpoints" in res.stderr and "Traceback" not in res.stderr


def _logged_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    steps = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def _signals_as_at_a_terminal() -> None:
    """In the child: SIGINT and SIGTERM at their defaults, as for a command typed at a terminal. A suite started as
    a shell's background job (``cmd &``) hands its children SIGINT ignored, and loco leaves an ignored signal
    ignored (as ``nohup`` asks), so the Ctrl-C would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_with(signum, args, run_dir, after_step, watch=None):
    """Start ``loco ARGS``, send ``signum`` once a metrics line of ``after_step`` is written (in the folder ``watch``,
    default the run's); (rc, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *args, "--run-dir", str(run_dir)], cwd=ROOT,
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_signals_as_at_a_terminal)
    watch = watch or run_dir
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and after_step not in _logged_steps(watch):
            time.sleep(0.01)
        os.kill(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def test_sigterm_saves_and_resumes_exactly(reference, tmp_path, capfd):
    """SIGTERM (a scheduler's preemption, systemd, kill) saves at the current step like Ctrl-C; exit 143."""
    run_dir = tmp_path / "terminated"
    rc, err = _stop_with(signal.SIGTERM, ARGS, run_dir, after_step=15)
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("loco train: stopped by SIGTERM; saved")
    step = load_checkpoint_step(run_dir)
    assert 15 <= step < STEPS, "the stop must save the step it reached"
    res = loco(["train", "--run-dir", str(run_dir), "--resume"], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _curve(run_dir) == _curve(reference)


def load_checkpoint_step(run_dir) -> int:
    hit = latest_checkpoint(run_dir / "checkpoints", on_skip=None)
    assert hit is not None, "no checkpoint was saved"
    return hit[1]["step"]


def test_unreadable_checkpoints_refuse_resume_and_restart_starts_over(tmp_path, capfd):
    run_dir = tmp_path / "broken"
    short = [a if a != str(STEPS) else "20" for a in ARGS]
    res = loco([*short, "--run-dir", str(run_dir)], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    ckpts = list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000020.pt", "step_00000010.pt"]
    for p in ckpts:
        os.truncate(p, 1000)
    metrics = (run_dir / "metrics.jsonl").read_bytes()

    res = loco(["train", "--run-dir", str(run_dir), "--resume"], capfd)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stderr.count("\n") == 1, res.stderr
    assert "step_00000020.pt, step_00000010.pt" in res.stderr and "--restart" in res.stderr and "remove" in res.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics, "a refused resume must not touch the metrics"
    assert [p.stat().st_size for p in list_checkpoints(run_dir / "checkpoints")] == [1000, 1000]

    res = loco(["train", "--run-dir", str(run_dir), "--restart", "--max-steps", "10"], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000010.pt"]
    assert _logged_steps(run_dir) == [5, 10, 10], "a new curve from step 0"
    aside, = run_dir.glob("discarded-*")
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_00000010.pt", "step_00000020.pt"]
    assert (aside / "metrics.jsonl").read_bytes() == metrics


def test_resumed_max_time_run_gets_a_fresh_budget(tmp_path, capfd):
    run_dir = tmp_path / "timed"
    timed = ["train", "--config", TINY, *[a for s in FAST + SHORT for a in ("--set", s)], "--max-steps", "100000",
             "--max-time", "2s", "--set", "log.every=1", "--set", "run.eval_every=0", "--run-dir", str(run_dir)]
    res = loco(timed, capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    first = json.loads((run_dir / "summary.json").read_text())["steps"]
    for again in ([], ["--max-time", "1s"]):  # the original budget again, or the one given on the resume
        res = loco(["train", "--run-dir", str(run_dir), "--resume", *again], capfd)
        assert res.returncode == 0, res.stderr[-3000:]
        steps = json.loads((run_dir / "summary.json").read_text())["steps"]
        assert steps > first, f"the resumed run trained no step ({first} -> {steps})"
        first = steps
    finals = [s for s, r in zip(_logged_steps(run_dir), read_metrics(run_dir)) if "loss" not in r]
    assert len(finals) == len(set(finals)) == 3, "one final validation line per segment, none twice"
    lines = [(r["step"], "loss" in r) for r in read_metrics(run_dir)]
    assert len(lines) == len(set(lines)), "no duplicate metrics lines"


@pytest.mark.parametrize("algo, changed, check", [
    ("diloco", ["algo.outer_lr=0.5", "optim.weight_decay=0.02", "optim.lr=0.0005"],
     lambda algo: (algo.outer_optimizers[0].param_groups[0]["lr"] == 0.5
                   and algo.optimizer.param_groups[0]["weight_decay"] == 0.02
                   and algo.optimizer.param_groups[0]["initial_lr"] == 0.0005  # the peak the schedule scales
                   and all("momentum_buffer" in st for st in algo.outer_optimizers[0].state.values()))),
    ("demo", ["algo.compression_chunk=32", "algo.compression_topk=8"],
     lambda algo: (algo.optimizer.param_groups[0]["compression_chunk"] == 32
                   and algo.optimizer.param_groups[0]["compression_topk"] == 8
                   and {st["block"] for st in algo.optimizer.state.values() if "block" in st} <= {(32, 32), (1, 32)})),
])
def test_a_resume_goes_on_with_the_runs_settings_and_says_which_changed(tmp_path, tiny_cfg, capsys, algo, changed,
                                                                         check):
    """The optimizers take their state from the checkpoint and their settings from the resumed run (torch's load
    would bring the checkpoint's back, silently); the resume's log line names what changed."""
    from launch.loop.trainer import Trainer

    run_dir = tmp_path / algo
    base = [*SHORT, f"algo.name={algo}", "algo.inner_steps=5", "run.checkpoint_every=10", "run.eval_every=0"]
    train(tiny_cfg(*base, "run.max_steps=10", run_dir=run_dir))
    trainer = Trainer(tiny_cfg(*base, *changed, "run.max_steps=14", "run.resume=true", run_dir=run_dir))
    assert trainer.step == 10 and check(trainer.algo)
    for setting in changed:
        key, value = setting.split("=")
        assert f"{key} " in trainer.resume_changes and f"-> {value}" in trainer.resume_changes
    assert "run.max_steps 10 -> 14" in trainer.resume_changes
    capsys.readouterr()
    try:
        summary = trainer.fit()
    finally:
        trainer.transport.close()
    assert summary["steps"] == 14 and math.isfinite(summary["val_loss"])
    assert "settings changed since it was saved: " in capsys.readouterr().err


SIM = ["simulate", "--config", TINY, *[a for s in FAST + SHORT for a in ("--set", s)], "--workers", "2",
       "--baseline", "none", "--max-steps", "30", "--set", "algo.name=diloco", "--set", "algo.inner_steps=5",
       "--set", "log.every=5", "--set", "run.eval_every=10", "--set", "run.checkpoint_every=100"]


def test_simulator_ctrl_c_saves_every_worker_and_resumes_exactly(tmp_path, capfd):
    """Ctrl-C in `loco simulate` stops all workers at the next sync, saves them all, exits 130; --resume continues."""
    ref = tmp_path / "reference"
    res = loco([*SIM, "--run-dir", str(ref)], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "interrupted"
    rc, err = _stop_with(signal.SIGINT, SIM, run_dir, after_step=5)
    assert rc == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err and "loco simulate: stopped by the user (Ctrl-C); saved" in err, err[-3000:]
    _, state = latest_checkpoint(run_dir / "checkpoints", on_skip=None)
    assert state["step"] in (5, 10, 15, 20, 25) and len(state["workers"]) == 2, "every worker, at a sync"
    res = loco(["simulate", "--run-dir", str(run_dir), "--resume"], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _curve(run_dir) == _curve(ref)
    assert json.loads((run_dir / "summary.json").read_text())["val_loss"] == \
        json.loads((ref / "summary.json").read_text())["val_loss"]


# the demo's comparison (DiLoCo against the DDP baseline) on a fixed step time: only the virtual clock differs if a
# resume loses it
COMPARE = ["simulate", "--config", TINY, *[a for s in FAST + SHORT for a in ("--set", s)], "--workers", "2",
           "--max-steps", "20", "--step-time", "0.1", "--set", "algo.name=diloco", "--set", "algo.inner_steps=5",
           "--set", "log.every=5", "--set", "run.eval_every=10", "--set", "run.checkpoint_every=100"]
VIRTUAL = ("virtual_wall_s", "compute_utilization", "tokens_per_virtual_s", "virtual_compute_s_per_worker",
           "virtual_wait_s_per_worker", "virtual_send_s_per_worker", "bytes_sent_per_worker", "tokens", "val_loss",
           "equal_time", "virtual_step_time_s")


def _compared(run_dir, stdout):
    from launch.metrics.plots import virtual_curve

    runs = json.loads((run_dir / "comparison.json").read_text())
    table = stdout[stdout.index("simulated network"):].replace(str(run_dir), "RUN")
    curves = [virtual_curve(d, key) for d in (run_dir, run_dir / "baseline-ddp") for key in ("loss", "val_loss")]
    return ([{k: s.get(k) for k in VIRTUAL} for s in runs.values()],
            {k: json.loads((run_dir / "summary.json").read_text()).get(k) for k in VIRTUAL}, table, curves)


def test_a_resumed_simulation_keeps_its_virtual_clock(tmp_path, capfd):
    """SIGTERM in the run or in its DDP baseline, then --resume: the table, summary and the curves the plot draws
    are an unbroken run's (the virtual clocks go on where they stopped, not from 0)."""
    ref = tmp_path / "reference"
    res = loco([*COMPARE, "--run-dir", str(ref)], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    expected = _compared(ref, res.stdout)
    for where in ("run", "baseline"):
        run_dir = tmp_path / f"stopped-in-{where}"
        watch = run_dir if where == "run" else run_dir / "baseline-ddp"
        rc, err = _stop_with(signal.SIGTERM, COMPARE, run_dir, after_step=10, watch=watch)
        assert rc == 128 + signal.SIGTERM, err[-3000:]
        assert load_checkpoint_step(watch) < 20, "the signal came too late to test a resume"
        res = loco(["simulate", "--run-dir", str(run_dir), "--resume"], capfd)
        assert res.returncode == 0, res.stderr[-3000:]
        got = _compared(run_dir, res.stdout)
        assert got[0] == expected[0] and got[1] == expected[1], where
        assert got[2] == expected[2], where
        assert got[3] == expected[3], where


def test_tokens_are_counted_across_a_resume_with_another_batch_size(tmp_path, tiny_cfg):
    """4 steps of 4 x 64 tokens, then 2 more of 2 x 64: the count goes on from 1,024 to 1,280 (not 6 x 128)."""
    from launch.loop.trainer import train

    run_dir = tmp_path / "run"
    base = ["data.seq_len=64", "run.eval_every=0", "log.every=1", "run.checkpoint_every=4"]
    train(tiny_cfg(*base, "run.batch_size=4", "run.max_steps=4", run_dir=run_dir))
    summary = train(tiny_cfg(*base, "run.batch_size=2", "run.max_steps=6", "run.resume=true", run_dir=run_dir))
    tokens = {r["step"]: r["tokens"] for r in read_metrics(run_dir) if r.get("loss") is not None}
    assert tokens == {1: 256, 2: 512, 3: 768, 4: 1024, 5: 1152, 6: 1280}
    assert summary["tokens"] == 1280 and summary["workers"][0]["tokens"] == 1280


def test_resume_from_a_chosen_checkpoint_moves_the_later_ones_aside(reference, tmp_path, capfd):
    """--resume-from step 20 of a finished run: the run folder is the checkpoint's, the later checkpoints move into
    discarded-<time>/, the metrics are cut at step 20, and the run ends where the unbroken one did."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    chosen = run_dir / "checkpoints" / checkpoint_name(20)
    assert chosen.is_file() and (run_dir / "checkpoints" / checkpoint_name(STEPS)).is_file()
    res = loco(["train", "--resume-from", str(chosen)], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--resume-from step 20: moved" in res.stderr
    moved = sorted(p.name for p in run_dir.glob("discarded-*/checkpoints/*.pt"))
    assert moved == [checkpoint_name(30), checkpoint_name(STEPS)]
    assert _curve(run_dir) == _curve(reference)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    res = loco(["train", "--resume-from", str(bad), "--run-dir", str(run_dir)], capfd)
    assert res.returncode == 2 and "not a complete loco checkpoint" in res.stderr, res.stderr[-2000:]
