"""A run that is stopped (killed, or Ctrl-C) and resumed gives the same loss curve as one that was not."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from conftest import FAST, ROOT, TINY, child_env, kill_when, run_cli
from launch.checkpoint import list_checkpoints
from launch.metrics import read_metrics
from launch.trainer import RunError, train

STEPS = 60
ARGS = ["train", "--config", TINY, "--max-steps", str(STEPS), *[a for s in FAST for a in ("--set", s)],
        "--set", "log.every=5", "--set", "run.eval_every=20", "--set", "run.checkpoint_every=10"]
COMPARED = ("step", "tokens", "loss", "lr", "val_loss", "grad_norm")


def _curve(run_dir):
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    res = run_cli([*ARGS, "--run-dir", str(run_dir)])
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


def test_killed_run_resumes_exactly(reference, tmp_path):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *ARGS, "--run-dir", str(run_dir)], cwd=ROOT,
                            env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kill_when(proc, (run_dir / "checkpoints" / "step_00000020.pt").exists, poll=0.01)
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    newest = list_checkpoints(run_dir / "checkpoints")[0].name
    assert newest < f"step_{STEPS:08d}.pt", "the kill came too late to test a resume"

    res = run_cli(["train", "--run-dir", str(run_dir), "--resume"])  # settings come from the run's config.yaml
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr
    assert _curve(run_dir) == _curve(reference)
    assert json.loads((run_dir / "summary.json").read_text())["val_loss"] == \
        json.loads((reference / "summary.json").read_text())["val_loss"]


def test_ctrl_c_saves_and_resumes_exactly(reference, tmp_path, tiny_cfg):
    run_dir = tmp_path / "interrupted"
    extra = ["log.every=5", "run.eval_every=20", "run.checkpoint_every=10", f"run.max_steps={STEPS}"]

    def interrupt(step, record):
        if step == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(*extra, run_dir=run_dir), on_step=interrupt)
    assert list_checkpoints(run_dir / "checkpoints")[0].name == "step_00000025.pt"
    summary = train(tiny_cfg(*extra, "run.resume=true", run_dir=run_dir))
    assert summary["steps"] == STEPS
    assert _curve(run_dir) == _curve(reference)


def test_fresh_run_refuses_a_folder_with_checkpoints(reference, tiny_cfg):
    with pytest.raises(RunError, match="--resume"):
        train(tiny_cfg(run_dir=reference))
    res = run_cli([*ARGS, "--run-dir", str(reference)])
    assert res.returncode == 2 and "already holds checkpoints" in res.stderr and "Traceback" not in res.stderr
