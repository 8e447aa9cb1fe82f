"""torchrun across processes: 4 workers == the simulator, the 2-D node mesh, elastic restarts, stuck ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import FAST, ROOT, TINY, child_env, free_port, loco, max_diff, run_cli, simulate_and_torchrun
from conftest import torchrun_nodes as _nodes
from launch.store.checkpoint import latest_checkpoint, load_checkpoint

SMALL = ["run.batch_size=2", "run.eval_every=0", "sim.baseline=none", "sim.step_time=0.01", "log.every=2"]


def sets(*overrides: str) -> list[str]:
    return [a for s in [*FAST, *SMALL, *overrides] for a in ("--set", s)]


def torchrun(*args: str) -> list[str]:
    return ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]


# DiLoCo's own case is test_compressed's (simulated and torchrun runs with a codec, equal) and the node mesh's below
@pytest.mark.parametrize("algo", [["algo.name=demo"],
                                  ["algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2", "algo.overlap_steps=1",
                                   "optim.name=muon"]],
                         ids=["demo", "streaming-overlapped-muon"])
def test_four_processes_equal_four_simulated_workers(tmp_path, algo, capfd):
    """``loco simulate --workers 4`` and ``torchrun --nproc-per-node 4 loco train`` end with the same model, every
    worker's own parameters equal too, and the same bytes sent."""
    args = ["--config", TINY, "--max-steps", "6", "--seed", "7", *sets(*algo, "run.checkpoint_every=6")]
    a, b, sa, sb = simulate_and_torchrun(tmp_path, args, 4, capfd)
    assert max_diff(a["model"], b["model"]) < 1e-5
    assert len(a["workers"]) == len(b["workers"]) == 4
    for wa, wb in zip(a["workers"], b["workers"]):
        assert max_diff(wa["model"], wb["model"]) < 1e-5
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0


def test_two_nodes_of_two_processes_equal_two_workers_with_double_batch(tmp_path, capfd, codec="fp32", tol=1e-5):
    """--nnodes 2 --nproc-per-node 2: each node is one DiLoCo worker (DDP inside) == 2 simulated workers x batch 4.
    (A codec on the mesh: the error-feedback resume below; with one, each local rank encodes its share of the
    buffer, so the quantization differs slightly from the simulator's.)"""
    common = ["--config", TINY, "--max-steps", "6", "--seed", "11"]
    algo = ["algo.name=diloco", "algo.inner_steps=3", "run.checkpoint_every=6", f"compress.codec={codec}"]
    sim = loco(["simulate", *common, *sets(*algo, "run.batch_size=4"), "--workers", "2",
                "--run-dir", str(tmp_path / "sim")], capfd)
    assert sim.returncode == 0, sim.stderr[-3000:]
    for node in _nodes([["train", *common, *sets(*algo, "run.batch_size=2"), "--run-dir", str(tmp_path / "mesh")]] * 2,
                       per_node=2):
        assert node.returncode == 0, node.stderr[-3000:]
    a = latest_checkpoint(tmp_path / "sim" / "checkpoints")[1]
    b = latest_checkpoint(tmp_path / "mesh" / "checkpoints")[1]
    assert len(b["workers"]) == 2, "one worker per node"
    assert max_diff(a["model"], b["model"]) < tol
    assert max_diff(b["workers"][0]["model"], b["workers"][1]["model"]) == 0.0, "both nodes hold the global model"
    summary = json.loads((tmp_path / "mesh" / "summary.json").read_text())
    simulated = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["mesh"] == "2 nodes x 2 processes" and summary["intra_node_bytes"] > 0
    assert summary["tokens"] == simulated["tokens"]
    # the same validation windows, scored by a node's two processes together or by one simulated worker
    assert summary["val_tokens"] == simulated["val_tokens"]
    assert abs(summary["val_loss"] / simulated["val_loss"] - 1) < 1e-4


def test_a_node_of_two_processes_resumes_its_error_feedback_exactly(tmp_path):
    """On a node mesh each process encodes its own share of the buffer and keeps that share's error-feedback
    residual; a checkpoint holds every process's (not only the first's), so a run resumed mid-way ends as the
    unbroken one, to the bit. The inner optimizer is Muon (with AdamW), whose momenta resume as AdamW's do."""
    import shutil

    common = ["train", "--config", TINY, "--max-steps", "6", "--seed", "5",
              *sets("algo.name=diloco", "algo.inner_steps=3", "run.checkpoint_every=3", "run.batch_size=2",
                    "compress.codec=topk:0.1+int8", "optim.name=muon")]
    for node in _nodes([[*common, "--run-dir", str(tmp_path / "full")]] * 2, per_node=2):
        assert node.returncode == 0, node.stderr[-3000:]
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "full", broken)
    (broken / "checkpoints" / "step_00000006.pt").unlink()
    _, state = latest_checkpoint(broken / "checkpoints")
    assert state["step"] == 3 and all(w["algo"]["codec"]["residuals"] for w in state["workers"])
    for node in _nodes([[*common, "--run-dir", str(broken), "--resume"]] * 2, per_node=2):
        assert node.returncode == 0, node.stderr[-3000:]
    want = latest_checkpoint(tmp_path / "full" / "checkpoints")[1]
    got = latest_checkpoint(broken / "checkpoints")[1]
    assert got["step"] == want["step"] == 6
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])


def test_nodes_started_with_different_settings_stop_at_once_naming_them(tmp_path):
    """Two nodes whose settings differ (another codec, another H) would hang at their first differing collective;
    every process stops before training instead, naming each key with its value on each rank; so do nodes that
    cut the processes into workers otherwise. Settings a node may choose for itself (threads, progress display,
    the run folder, which rank 0 decides) do not count."""
    common = ["train", "--config", TINY, "--max-steps", "4", *sets("algo.name=diloco", "algo.inner_steps=2")]
    parted = _nodes([[*common, "--run-dir", str(tmp_path / "a")],
                     [*common, *sets("compress.codec=int8", "algo.inner_steps=4"), "--run-dir", str(tmp_path / "a")]],
                    timeout=120)
    for node in parted:
        assert node.returncode != 0
        assert "were started with different settings" in node.stderr, node.stderr[-3000:]
        assert "compress.codec: 'fp32' on rank 0 (" in node.stderr and "; 'int8' on rank 1 (" in node.stderr
        assert "algo.inner_steps: 2 on rank 0 (" in node.stderr and "; 4 on rank 1 (" in node.stderr
        assert "run.threads" not in node.stderr and "Traceback (most recent call last):\n  File \"/" not in \
            node.stderr.split("torch.distributed.elastic")[0]  # the message, not a traceback of loco's
    assert not (tmp_path / "a").exists(), "nothing was started"
    # one node of 1 process, one of 2, cut into nodes: each sees another layout (they would hang making groups)
    uneven = [*common, *sets("transport.mesh=nodes"), "--run-dir", str(tmp_path / "c")]
    for node in _nodes([uneven, uneven], per_node=[1, 2], timeout=120):
        assert node.returncode != 0 and "torchrun layout: '3 node(s) x 1 process(es)" in node.stderr, node.stderr[-3000:]
    agreed = _nodes([[*common, "--run-dir", str(tmp_path / "b")],
                     [*common, *sets("run.threads=2", "log.progress=off"), "--run-dir", str(tmp_path / "elsewhere")]],
                    timeout=180)
    for node in agreed:
        assert node.returncode == 0, node.stderr[-3000:]
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["steps"] == 4


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_a_killed_worker_restarts_from_the_last_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
         *torchrun(), "-m", "launch.cli", "train", "--config", TINY, "--max-steps", "24", "--seed", "2",
         *sets("algo.name=diloco", "algo.inner_steps=4", "run.checkpoint_every=8"), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not list((run_dir / "checkpoints").glob("step_00000008.pt")):
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # one worker dies mid-run
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    assert "restart" in err.lower()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 24
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]  # training lines (the last step also has a val_loss line)
    assert steps == sorted(steps) and len(steps) == len(set(steps)), f"the curve continues from the checkpoint: {steps}"
    for ckpt in (run_dir / "checkpoints").glob("step_*.pt"):
        load_checkpoint(ckpt)  # none is corrupt
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_sigterm_to_torchrun_saves_and_resume_continues_exactly(tmp_path, capfd):
    """torchrun forwards SIGTERM (SLURM, Kubernetes) to every rank: they stop together at a round end, save, and
    resume exactly (DDP stops the same way, through the same broadcast, at a log.every-th step)."""
    run_dir = tmp_path / "real"
    args = ["--config", TINY, "--max-steps", "12", "--seed", "3",
            *sets("algo.name=diloco", "algo.inner_steps=4", "run.checkpoint_every=0")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *torchrun(), "-m", "launch.cli",
         "train", *args[:3], "400", *args[4:], "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT, start_new_session=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 180
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # to torchrun, which sends it on to both ranks
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = list((run_dir / "checkpoints").glob("step_*.pt"))
    assert len(saved) == 1, err[-3000:]
    step = load_checkpoint(saved[0])["step"]
    assert 0 < step < 12, step
    assert f"stopped by SIGTERM: saved {saved[0]}" in err
    # the rest of the run with --resume (a 12-step budget, as the unbroken run below), then the same run unbroken
    resumed = run_cli(["--nproc-per-node", "2", *torchrun(), "-m", "launch.cli", "train", "--run-dir", str(run_dir),
                       "--resume", "--max-steps", "12"], module="torch.distributed.run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved[0]}" in resumed.stderr
    whole = loco(["simulate", *args, "--workers", "2", "--run-dir", str(tmp_path / "sim")], capfd)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a = latest_checkpoint(run_dir / "checkpoints")[1]
    b = latest_checkpoint(tmp_path / "sim" / "checkpoints")[1]
    assert a["step"] == b["step"] == 12
    assert max_diff(a["model"], b["model"]) < 1e-6


OVERLAP = textwrap.dedent("""
    import time, torch
    from pathlib import Path
    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress.collective import all_reduce_async_
    out = Path({out!r})
    t = TorchDistTransport("gloo", timeout=60)
    all_reduce_async_(t, [torch.zeros(3)]).wait()  # the first overlapped exchange makes its process groups on every rank
    x = torch.full((1000,), float(t.rank + 1))
    if t.rank == 0:
        handle = all_reduce_async_(t, [x], op="sum")  # rank 1 has not started its part yet
        (out / "started").write_text("")
        said = t.broadcast_object("from the training thread")  # control plane while the exchange is in flight
    else:
        deadline = time.time() + 30
        while not (out / "started").exists() and time.time() < deadline:
            time.sleep(0.02)
        print("rank 0 returned from all_reduce_async_" if (out / "started").exists() else "rank 0 blocked")
        said = t.broadcast_object(None)
        handle = all_reduce_async_(t, [x], op="sum")
    handle.wait()
    torch.save({{"x": x, "said": said}}, out / f"rank{{t.rank}}.pt")
    t.close()
""")


def test_an_overlapped_exchange_runs_beside_the_training_thread(tmp_path):
    """gloo: all_reduce_async_ returns before the peers take part, and control-plane calls go on meanwhile."""
    script = tmp_path / "overlap.py"
    script.write_text(OVERLAP.format(out=str(tmp_path)))
    proc = run_cli([*torchrun("--nproc-per-node", "2"), str(script)], module="torch.distributed.run", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 returned from all_reduce_async_" in proc.stdout, proc.stdout
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["x"], torch.full((1000,), 3.0))
        assert got["said"] == "from the training thread"


CRASH = textwrap.dedent("""
    import time, torch
    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress.collective import all_reduce_async_
    t = TorchDistTransport("gloo", timeout=120)
    all_reduce_async_(t, [torch.zeros(3)]).wait()  # the exchange thread and its groups exist on both ranks
    if t.rank == 1:
        time.sleep(110)  # hung: never joins rank 0's next exchange
    else:
        handle = all_reduce_async_(t, [torch.ones(1000)])  # in flight, waiting for rank 1
        try:
            raise RuntimeError("the training thread failed at step 7")
        except BaseException:
            t.abort()  # what launch.loop.trainer.train does when fit() raises
            raise
""")


def test_a_failing_training_thread_ends_the_process_with_an_exchange_in_flight(tmp_path):
    """The exchange thread must not keep a failing rank alive until the collective times out (120 s here)."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    start = time.monotonic()
    proc = run_cli([*torchrun("--nproc-per-node", "2"), str(script)], module="torch.distributed.run", timeout=200)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert "the training thread failed at step 7" in proc.stderr, proc.stderr[-3000:]
    assert took < 60, f"the failing rank lived on for {took:.0f}s"


STUCK = textwrap.dedent("""
    import os, sys, time, torch
    from diloco.comm.base import TransportError
    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress.collective import all_reduce_
    t = TorchDistTransport("gloo", timeout=3)
    if t.rank == 2:
        time.sleep(20)  # never answers in time
        sys.exit(0)
    try:
        all_reduce_(t, [torch.ones(10)])
    except TransportError as e:
        os.write(1, f"ERROR {t.rank} {e}\\n"[:3000].encode())  # one write: lines of two processes do not mix
    start = time.monotonic()  # a collective on a group of its own (the size exchange of an overlapped one)
    try:
        t.all_gather_bytes_start(b"x" * 10).wait()
    except TransportError as e:
        os.write(1, f"SIDE {t.rank} {time.monotonic() - start:.1f} {e}\\n"[:3000].encode())
    sys.exit(3)
""")


def test_a_stuck_worker_is_named_within_the_timeout(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    start = time.time()
    proc = run_cli([*torchrun("--nproc-per-node", "3"), str(script)], module="torch.distributed.run", timeout=120)
    assert proc.returncode != 0
    assert time.time() - start < 60
    mine = [line for line in proc.stdout.splitlines() if line.startswith("ERROR 0 ")]
    assert mine and "Ranks 2 failed to pass monitoredBarrier" in mine[0], proc.stdout
    # every group the transport makes times out as the transport says (new_group alone waits 30 minutes)
    side = [line.split(" ", 3) for line in proc.stdout.splitlines() if line.startswith("SIDE ")]
    assert {rank for _, rank, _, _ in side} == {"0", "1"}, proc.stdout
    assert all(float(took) < 10 and "timeout 3s" in msg for _, _, took, msg in side), side
