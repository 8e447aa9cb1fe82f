"""Checkpoints: atomic writes survive a kill mid-write, broken files are skipped, keep-last-K, RNG round trip."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import child_env, kill_when
from launch.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, rng_state,
                               save_checkpoint, set_rng_state)


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
    from launch.checkpoint import save_checkpoint
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


def test_truncated_checkpoint_is_skipped_with_a_warning(tmp_path):
    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(1000)}})
    bad = save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(1000)}})
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match="step_00000002.pt"):
        path, state = latest_checkpoint(tmp_path)
    assert state["step"] == 1
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(bad)


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
