"""Shared test helpers: small configs, subprocesses with timeouts that never outlive a test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# one thread for every process the suite starts (this one, its in-process runs and hivemind peers, and every child
# through child_env, torchrun's and simulate's included): the suite runs beside other work, and a thread that spins
# at a barrier of a parallel region while another is descheduled makes a step several times slower
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

# CI has no GPU: the Triton kernels then run in the interpreter on CPU tensors (must be set before diloco is imported)
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Checks that need a GPU carry the mark ``gpu`` (``pytest -m gpu`` runs them alone); without CUDA they are skipped
# with this reason, the only skip the CPU suite has.
NO_GPU = "needs a CUDA GPU (this machine has none; the CPU suite covers the same code in the interpreter)"

# Where the Triton kernels are checked against their references: under the interpreter on CPU tensors where
# TRITON_INTERPRET=1 (CI), and compiled on CUDA tensors where there is a GPU.
KERNEL_DEVICES = [
    pytest.param("cpu", id="interpreter",
                 marks=pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET is off: the kernels compile for "
                                                                "the GPU, and the cuda case checks them there")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

ROOT = Path(__file__).resolve().parent.parent


class HostReads:
    """Counts, while entered, the aten ops dispatched (``ops``) and the reads that make a host wait for a GPU
    (``count``): the ops that hand a value back (``item()``, ``bool()``, ``float()``, ``nonzero``...), seen as
    dispatched, and ``tolist()`` / ``numpy()``, which read memory without dispatching an op."""

    SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique", "aten.equal",
                "aten.is_nonzero")

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self
        self.ops = self.count = 0

        class _Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts.ops += 1
                counts.count += str(func).startswith(HostReads.SYNC_OPS)
                return func(*args, **(kwargs or {}))

        class _Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                counts.count += func in (torch.Tensor.tolist, torch.Tensor.numpy)
                return func(*args, **(kwargs or {}))

        self._modes = (_Reads(), _Ops())

    def __enter__(self) -> "HostReads":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


TINY = str(ROOT / "configs" / "tiny.yaml")

# fast settings for runs inside tests: a slice of the corpus, no plot, plain logs
# the CPU, named: runs compared with gloo processes or across a resume must not follow whatever GPU is present
FAST = ["data.max_docs=120", "log.plot=false", "log.progress=plain", "eval.tokens=512", "run.threads=1",
        "run.device=cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["WANDB_SILENT"] = "true"
    env.update(extra)
    return env


def run_cli(args: list[str], timeout: float = 240, env: dict[str, str] | None = None,
            module: str = "launch.cli") -> subprocess.CompletedProcess:
    """Run ``python -m launch.cli ARGS`` in its own process group; kill the whole group on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env or child_env(), cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{args} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def loco(args: list[str], capture=None) -> subprocess.CompletedProcess:
    """``loco ARGS`` run by ``launch.cli.main`` in this process: a run without a process of its own, for tests that
    neither signal nor kill it (it saves the 2 to 3 s a new process spends importing torch and loco). Its output is
    read through ``capture`` (pytest's ``capfd`` or ``capsys``; None: not kept)."""
    from launch.cli import main

    if capture is not None:
        capture.readouterr()  # what came before is not this run's
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own exits
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out, err = capture.readouterr() if capture is not None else ("", "")
    return subprocess.CompletedProcess(["loco", *args], code, out, err)


def kill_when(proc: subprocess.Popen, ready, timeout: float = 180, poll: float = 0.005) -> int:
    """SIGKILL ``proc``'s process group as soon as ``ready()`` holds (or at the timeout); its return code."""
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and not ready():
            time.sleep(poll)
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def max_diff(a: dict, b: dict) -> float:
    """The largest difference between two state dicts of the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def torchrun_nodes(args: list[list[str]], per_node: int | list[int] = 1,
           timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """One torchrun per node on this machine (``--nnodes len(args)``), node i running ``launch.cli args[i]`` in
    ``per_node`` processes (or ``per_node[i]``)."""
    port = str(free_port())
    counts = per_node if isinstance(per_node, list) else [per_node] * len(args)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(args)), "--node-rank", str(node),
         "--nproc-per-node", str(counts[node]), "--master-addr", "127.0.0.1", "--master-port", port, "-m", "launch.cli",
         *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
        start_new_session=True) for node, a in enumerate(args)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def simulate_and_torchrun(tmp_path: Path, args: list[str], workers: int, capture) -> tuple[dict, dict, dict, dict]:
    """``loco simulate --workers N`` (in this process; output through ``capture``, see :func:`loco`) and
    ``torchrun --nproc-per-node N loco train`` with the same arguments.

    Returns (simulated checkpoint, real checkpoint, simulated summary, real summary): the last of each run.
    """
    from launch.store.checkpoint import latest_checkpoint

    sim = loco(["simulate", *args, "--workers", str(workers), "--run-dir", str(tmp_path / "sim")], capture)
    assert sim.returncode == 0, sim.stderr[-3000:]
    real = run_cli(["--nproc-per-node", str(workers), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    "-m", "launch.cli", "train", *args, "--run-dir", str(tmp_path / "real")],
                   module="torch.distributed.run")
    assert real.returncode == 0, real.stderr[-3000:]
    ckpts = [latest_checkpoint(tmp_path / name / "checkpoints")[1] for name in ("sim", "real")]
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("sim", "real")]
    return ckpts[0], ckpts[1], summaries[0], summaries[1]


@pytest.fixture
def tiny_cfg(tmp_path):
    """A tiny config for in-process runs: returns a function of extra overrides."""
    from launch.config import load_config

    def make(*overrides: str, run_dir: Path | None = None):
        cfg, _ = load_config([TINY], [*FAST, f"run.dir={run_dir or tmp_path / 'run'}", *overrides])
        return cfg

    return make
