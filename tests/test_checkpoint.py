"""Checkpoints: atomic writes survive a kill mid-write, broken files are skipped, keep-last-K, RNG round trip."""

from __future__ import annotations

import collections
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import FAST, ROOT, TINY, child_env, kill_when
from launch.store.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, rng_state,
                               save_checkpoint, set_rng_state, write_file)
from launch.metrics.log import read_metrics


def test_save_load_and_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.full((3,), float(step))}}, keep=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000004.pt", "step_00000003.pt"]
    path, state = latest_checkpoint(tmp_path)
    assert state["step"] == 4 and torch.equal(state["model"]["w"], torch.full((3,), 4.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp files left behind"


WRITER = textwrap.dedent("""
    import sys, torch
    from launch.store.checkpoint import save_checkpoint
    d = sys.argv[1]
    save_checkpoint(d, 1, {"model": {"w": torch.ones(4)}})
    print("first-saved", flush=True)
    big = {"model": {f"w{i}": torch.randn(4_000_000) for i in range(40)}}  # ~640 MB: slow enough to kill mid-write
    save_checkpoint(d, 2, big)
    print("second-saved", flush=True)
""")


def test_kill_mid_write_leaves_previous_checkpoint_readable(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    ckpt = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, str(script), str(ckpt)], stdout=subprocess.PIPE, text=True,
                            env=child_env(), start_new_session=True)
    assert proc.stdout.readline().strip() == "first-saved"

    def writing_second() -> bool:  # the second checkpoint's temp file exists and is being filled
        tmp = next((p for p in ckpt.iterdir() if p.name.startswith(".step_00000002")), None)
        return tmp is not None and tmp.stat().st_size > 1 << 20

    kill_when(proc, writing_second, timeout=120)
    assert proc.returncode == -signal.SIGKILL, "the writer finished before it could be killed"
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000001.pt"]
    path, state = latest_checkpoint(ckpt)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(4))
    # the next save sweeps the half-written temp file away
    save_checkpoint(ckpt, 3, {"model": {}})
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]


def test_truncated_checkpoint_is_skipped_with_one_clean_line(tmp_path, capsys):
    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(1000)}})
    bad = save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(1000)}})
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    path, state = latest_checkpoint(tmp_path)
    assert state["step"] == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipping checkpoint" in err and "step_00000002.pt" in err, err
    assert "truncated or corrupted" in err and "miniz" not in err and "Warning" not in err, err
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(bad)


def test_pruning_keeps_the_newest_valid_checkpoints(tmp_path):
    """Broken files with higher steps never count among the K kept, nor push out the checkpoint just written."""
    for step in (100, 120):
        (tmp_path / f"step_{step:08d}.pt").write_bytes(b"\0" * 1000)  # e.g. truncated by a full disk
    for step in (20, 40, 60, 80):
        save_checkpoint(tmp_path, step, {"model": {"w": torch.full((3,), float(step))}}, keep=2)
        assert (tmp_path / f"step_{step:08d}.pt").is_file(), "the checkpoint just written was pruned"
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_00000120.pt", "step_00000100.pt", "step_00000080.pt", "step_00000060.pt"]
    path, state = latest_checkpoint(tmp_path, on_skip=None)
    assert state["step"] == 80
    # an old broken file below the kept ones goes with the next prune; the valid ones stay the newest K
    (tmp_path / "step_00000010.pt").write_bytes(b"junk")
    save_checkpoint(tmp_path, 90, {"model": {}}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == \
        ["step_00000120.pt", "step_00000100.pt", "step_00000090.pt", "step_00000080.pt"]


def test_full_disk_is_one_line_with_the_bytes_needed(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does (torch reports it as 'unexpected pos')."""
    payload = {"model": {"w": torch.ones(250_000)}}
    with pytest.raises(CheckpointError) as info:
        write_file("/dev/full", payload, tmp_path / "step_00000007.pt")
    message = str(info.value)
    assert message.startswith("no space left on device") and "step_00000007.pt" in message, message
    assert "1,000,000 bytes" in message and "\n" not in message and "enforce fail" not in message, message


def test_foreign_file_is_not_a_checkpoint(tmp_path):
    f = tmp_path / "step_00000009.pt"
    torch.save({"weights": torch.ones(2)}, f)
    with pytest.raises(CheckpointError, match="not a complete loco checkpoint"):
        load_checkpoint(f)
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_rng_state_round_trip(tmp_path):
    torch.manual_seed(1); np.random.seed(1); random.seed(1)
    save_checkpoint(tmp_path, 1, {"rng": rng_state()})
    expect = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(99); np.random.seed(99); random.seed(99)
    set_rng_state(load_checkpoint(tmp_path / "step_00000001.pt")["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expect[0], got[0]) and np.array_equal(expect[1], got[1]) and expect[2] == got[2]


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k none /tmp"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged user namespaces (unshare -rm) for a tiny tmpfs")
def test_training_on_a_full_disk_stops_with_one_line(tmp_path):
    """A 16 MB filesystem (a tmpfs in a user namespace, no root needed) holds one 10.7 MB checkpoint, not two."""
    run_dir, copy = tmp_path / "run", tmp_path / "kept"
    (run_dir / "checkpoints").mkdir(parents=True)
    train = [sys.executable, "-m", "launch.cli", "train", "--config", TINY, "--max-steps", "10",
             *[a for s in FAST for a in ("--set", s)], "--set", "run.checkpoint_every=5", "--run-dir", str(run_dir)]
    script = (f"mount -t tmpfs -o size=16m none {run_dir / 'checkpoints'} || exit 99; "
              f"{shlex.join(train)}; rc=$?; cp -a {run_dir / 'checkpoints'} {copy}; exit $rc")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                         env=child_env(), cwd=ROOT)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("loco train: error: no space left on device: writing "), res.stderr[-3000:]
    assert re.search(r"step_00000010\.pt needs about [\d.]+ MiB \([\d,]+ bytes\), [\d.]+ MiB free there", last), last
    assert "Traceback" not in res.stderr and "enforce fail" not in res.stderr
    assert [p.name for p in list_checkpoints(copy)] == ["step_00000005.pt"], "the older checkpoint must stay"
    assert load_checkpoint(copy / "step_00000005.pt")["step"] == 5
    assert not [p for p in copy.iterdir() if p.name.startswith(".")], "the temp file must be removed"


class _Signals:
    """Pickled inside a checkpoint: sends this process ``count`` SIGTERMs in the middle of the write."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __reduce__(self):
        for _ in range(self.count):
            os.kill(os.getpid(), signal.SIGTERM)
        return (collections.OrderedDict, ())  # an empty mapping, which a weights-only load accepts


@pytest.mark.parametrize("count", [1, 2])
def test_a_signal_in_the_middle_of_a_checkpoint_write(tmp_path, count):
    """The first signal waits for the write (the run stops after it, saved); a second stops at once, reported as
    the signal it was (never as a full disk), with the older checkpoint intact."""
    from launch.loop.signals import STOP, Interrupted, save_waiting_for_it, stop_signals

    save_checkpoint(tmp_path, 1, {"model": {"w": torch.zeros(3)}})
    state = {"model": {"w": torch.ones(100_000)}, "extra": _Signals(count)}
    with stop_signals():
        if count == 1:
            path = save_waiting_for_it(tmp_path, 2, state, keep=3)
            assert STOP.signum == signal.SIGTERM, "the signal must be remembered, to stop after the write"
        else:
            with pytest.raises(Interrupted) as info:
                save_waiting_for_it(tmp_path, 2, state, keep=3)
            assert info.value.signum == signal.SIGTERM
    if count == 1:
        assert load_checkpoint(path)["step"] == 2 and torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(100_000))
    else:
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001.pt"]
        assert not list(tmp_path.glob(".step_*")), "the partial file stays behind"
    assert STOP.signum is None and STOP.writing == 0


def test_a_signal_during_the_final_checkpoint_stops_after_it_is_written(tmp_path, monkeypatch):
    """SIGTERM while the last checkpoint is written (after the loop): the write completes, the run stops with
    Interrupted naming it, and the checkpoint loads."""
    from launch.config import load_config
    from launch.loop.signals import Interrupted, stop_signals
    from launch.loop.checkpointer import Checkpointer
    from launch.loop.trainer import train

    state_dict = Checkpointer.state_dict

    def with_a_signal(self):
        state = state_dict(self)
        if self.worker.progress.step == 4:  # only the final save's state carries it
            state["extra"] = _Signals(1)
        return state

    monkeypatch.setattr(Checkpointer, "state_dict", with_a_signal)
    cfg, _ = load_config([TINY], [*FAST, "run.max_steps=4", "run.checkpoint_every=0", "run.eval_every=0",
                                  f"run.dir={tmp_path / 'run'}", "log.plot=false"])
    with stop_signals():
        with pytest.raises(Interrupted) as info:
            train(cfg)
    assert info.value.signum == signal.SIGTERM and info.value.clean
    assert info.value.saved is not None and info.value.saved.name == "step_00000004.pt"
    assert load_checkpoint(info.value.saved)["step"] == 4


FULL_LINE = re.compile(r"^no space left on device: writing (\S+) needs about [\d.]+ (B|KiB|MiB) \([\d,]+ bytes\), "
                       r"[\d.]+ (B|KiB|MiB|GiB|TiB) free there; ")


def test_appended_lines_on_a_full_disk_are_one_line(tmp_path):
    """metrics.jsonl and rounds.jsonl on /dev/full (every write fails with ENOSPC): one DiskFull line naming the
    file, the bytes and the space free, the same line a checkpoint gives; closing afterwards raises nothing."""
    from types import SimpleNamespace

    from launch.store.disk import DiskFull
    from launch.metrics.log import Metrics
    from launch.metrics.rounds import RoundsLog

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    (tmp_path / "rounds.jsonl").symlink_to("/dev/full")
    metrics = Metrics(tmp_path, SimpleNamespace(progress="off", wandb=False), True, 10)
    with pytest.raises(DiskFull) as info:
        metrics.log({"step": 1, "tokens": 4096, "loss": 5.25})
    metrics.close()
    line = str(info.value)
    assert FULL_LINE.match(line) and "metrics.jsonl" in line and "\n" not in line, line
    assert "--resume" in line, line
    with pytest.raises(DiskFull) as info:
        RoundsLog(tmp_path).write(round=1, step=5, members=[0, 1], weights={0: 1.0, 1: 1.0})
    assert FULL_LINE.match(str(info.value)) and "rounds.jsonl" in str(info.value), info.value


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged user namespaces (unshare -rm) for a tiny tmpfs")
def test_a_run_on_a_full_disk_stops_with_one_line_and_resumes_once_space_is_freed(tmp_path):
    """A run folder on a 34 MB tmpfs (three 10.1 MB checkpoints: a resumed run maps the one it loaded): 5 steps
    and their checkpoint; the disk filled; --resume stops at its first write (metrics.jsonl cut back to the
    checkpoint, or config.yaml) with one line and the checkpoint intact; the filler removed, --resume trains on to step 12 with every step's line once in metrics.jsonl."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    out.mkdir()
    sets = [a for s in [*FAST, "run.checkpoint_every=5", "run.keep_checkpoints=1", "log.every=1", "run.eval_every=0"]
            for a in ("--set", s)]
    train = [sys.executable, "-m", "launch.cli", "train", "--config", TINY, *sets, "--run-dir", str(run_dir)]
    steps = lambda n: ["--max-steps", str(n)]  # noqa: E731
    script = (f"mount -t tmpfs -o size=34m none {run_dir} || exit 99; "
              f"{shlex.join(train + steps(5))} 2> {out / 'first.err'} || exit 98; "
              f"dd if=/dev/zero of={run_dir / 'filler'} bs=64k 2>/dev/null; "
              f"{shlex.join(train + steps(12) + ['--resume'])} 2> {out / 'full.err'}; echo $? > {out / 'rc'}; "
              f"cp -a {run_dir / 'checkpoints'} {out / 'kept'}; rm {run_dir / 'filler'}; "
              f"{shlex.join(train + steps(12) + ['--resume'])} 2> {out / 'again.err'}; rc=$?; "
              f"cp -a {run_dir}/. {out / 'run'}; exit $rc")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=400,
                         env=child_env(), cwd=ROOT)
    full = (out / "full.err").read_text() if (out / "full.err").exists() else res.stderr
    assert (out / "rc").read_text().strip() == "2", full[-3000:]
    last = full.strip().splitlines()[-1]
    assert last.startswith("loco train: error: "), full[-3000:]
    assert FULL_LINE.match(last.removeprefix("loco train: error: ")), last
    assert "Traceback" not in full and "Errno" not in full, full[-3000:]
    assert [p.name for p in list_checkpoints(out / "kept")] == ["step_00000005.pt"]
    assert load_checkpoint(out / "kept" / "step_00000005.pt")["step"] == 5
    assert res.returncode == 0, (out / "again.err").read_text()[-3000:]
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["steps"] == 12
    logged = [r["step"] for r in read_metrics(out / "run") if "loss" in r]
    assert logged == list(range(1, 13)), logged
