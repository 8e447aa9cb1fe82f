"""Write the checkpoint-compatibility fixture that tests/test_compat.py resumes.

    python tests/compat/make_checkpoints.py --tree <old checkout> --out tests/compat/data

For each layout (the simulator's replicated workers, one torchrun node of two processes, the same sharded with FSDP)
it trains a tiny model for TOTAL steps with the code of ``--tree``, keeps what a resume from step SAVED reads (the run
folder's config.yaml and that checkpoint, with its slices folder), resumes a copy of that to TOTAL and writes what the
resumed steps produced into ``<layout>/expected.json``: each step's loss, the final validation loss and a SHA-256 of
every tensor of the final checkpoint's model, of its workers' models and global parameters, and of its slices. The
resume must end bit for bit where the unbroken run did, or nothing is written.

loco runs only through its command line, in subprocesses whose ``PYTHONPATH`` is the tree, so that the tree's own
``launch`` package runs (checked before any run). They run in a scratch folder holding the corpus, and every path a
run records is relative to it (``corpus.txt``, ``run``): no path of the machine that made the fixture lands in it. A
resume names the corpus again (``--set data.path=...``), so it may run from any folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SAVED, TOTAL = 4, 8  # the fixture's checkpoint, and the step its resume reaches (rounds end at 6 and 8)
RUN = "run"  # each layout's run folder inside the fixture
CORPUS = "corpus.txt"

# a model of a few thousand parameters on 16-byte sequences: the three layouts' checkpoints together stay well
# under 2 MB, and every run takes seconds. The sim.* settings are read by the simulator only; sim.step_time fixes its
# virtual clock (otherwise the median of measured step times, which differs from run to run).
COMMON = ["data.source=text", f"data.path={CORPUS}", "data.seq_len=16", "run.batch_size=2", "model.dim=8",
          "model.n_layers=2", "model.n_heads=2", "model.ffn_dim=16", "optim.warmup_steps=2", "run.device=cpu",
          "run.threads=1", "log.plot=false", "log.progress=plain", "log.every=1", "run.eval_every=0",
          "run.eval_batches=1", f"run.checkpoint_every={SAVED}", "sim.baseline=none", "sim.step_time=0.01"]
DILOCO = ["algo.name=diloco", "algo.inner_steps=2"]
# as tests/test_fsdp.py: fragments synced on staggered rounds, one in flight across the checkpoint
STREAMING = ["algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2", "algo.overlap_steps=1"]

# layout: (command, processes under torchrun (0: none), settings)
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "replicated": ("simulate", 0, ["sim.workers=2", *DILOCO]),
    "nodes": ("train", 2, ["transport.mesh=nodes", *DILOCO]),
    "fsdp": ("train", 2, ["transport.mesh=nodes", "run.shard=fsdp", *STREAMING]),
}


def tensor_digest(t: Any) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def evidence(run_dir: Path, after: int) -> dict[str, Any]:
    """What a run folder's steps after ``after`` produced: the losses logged (by step), the final validation loss,
    and the digests of the newest checkpoint's model, of each worker's model and global parameters where the file
    holds them, and of every tensor of its slices folder where it has one (a sharded run keeps its workers' state
    there)."""
    import torch

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {str(r["step"]): r["loss"] for r in records if "loss" in r and r["step"] > after}
    val = [r["val_loss"] for r in records if "val_loss" in r and r["step"] > after]
    newest = max((run_dir / "checkpoints").glob("step_*.pt"))
    state = torch.load(newest, map_location="cpu", weights_only=True)
    tensors = {f"model/{k}": tensor_digest(v) for k, v in state["model"].items()}
    for i, worker in enumerate(state.get("workers", [])):
        tensors.update({f"workers/{i}/model/{k}": tensor_digest(v) for k, v in worker["model"].items()})
        tensors.update({f"workers/{i}/global_params/{j}": tensor_digest(v)
                        for j, v in enumerate(worker["algo"].get("global_params", []))})
    slices = newest.with_suffix(".slices")
    if slices.is_dir():
        tensors.update({f"slices/{k}": tensor_digest(v) for k, v in slice_tensors(slices).items()})
    return {"step": state["step"], "checkpoint": newest.name, "losses": losses, "val_loss": val, "tensors": tensors}


def slice_tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of a sharded checkpoint's slices folder (a torch.distributed.checkpoint of every process's
    model, optimizer and algorithm slices), by its key there, read in this one process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
               if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # one process reads them all, as meant
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder))
    return tensors


def resume_args(command: str, run_dir: Path, corpus: Path) -> list[str]:
    """A resume of the run in ``run_dir``: its settings come from its config.yaml; the corpus is named again, as
    the folder the resume runs in need not hold it."""
    return [command, "--run-dir", str(run_dir), "--resume", "--set", f"data.path={corpus}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loco(tree: Path, cwd: Path, processes: int, args: list[str], timeout: float = 300) -> None:
    """``python -m launch.cli ARGS``, or under torchrun in ``processes`` processes, with the code of ``tree``."""
    launcher = [sys.executable, "-m", "launch.cli"]
    if processes:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                    "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "launch.cli"]
    proc = subprocess.Popen([*launcher, *args], cwd=cwd, env=_env(tree), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}):\n{out[-4000:]}")


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}


def _check_tree(tree: Path, cwd: Path) -> None:
    found = subprocess.run([sys.executable, "-c", "import launch; print(launch.__file__)"], cwd=cwd, env=_env(tree),
                           capture_output=True, text=True, check=True).stdout.strip()
    if Path(found).resolve().parent != tree / "launch":
        raise SystemExit(f"PYTHONPATH={tree} imports launch from {found}, not from the tree")


def write_corpus(path: Path) -> None:
    """About 10 kB of text from a fixed generator: the data does not depend on the interpreter or the machine."""
    words = ("the a loco worker round step sends gathers averages model outer inner momentum shard node mesh "
             "checkpoint resumes bit exactly").split()
    x, lines = 12345, []
    for _ in range(200):
        sentence = []
        for _ in range(8):
            x = (x * 1103515245 + 12345) % 2 ** 31
            sentence.append(words[x % len(words)])
        lines.append(" ".join(sentence) + ".")
    path.write_text("\n".join(lines) + "\n")


def make_layout(tree: Path, out: Path, work: Path, name: str) -> dict[str, Any]:
    command, processes, settings = LAYOUTS[name]
    cwd = work / name
    cwd.mkdir()
    shutil.copy(out / CORPUS, cwd / CORPUS)
    sets = [a for s in [*COMMON, *settings] for a in ("--set", s)]
    _loco(tree, cwd, processes, [command, "--config", str(tree / "configs" / "tiny.yaml"), "--seed", "5",
                                 "--max-steps", str(TOTAL), "--run-dir", RUN, *sets])
    unbroken = evidence(cwd / RUN, SAVED)

    # the fixture: what a resume reads (config.yaml, the checkpoint of step SAVED and its slices folder, if any)
    fixture = out / name / RUN
    shutil.rmtree(out / name, ignore_errors=True)
    (fixture / "checkpoints").mkdir(parents=True)
    shutil.copy(cwd / RUN / "config.yaml", fixture / "config.yaml")
    for saved in (cwd / RUN / "checkpoints").glob(f"step_{SAVED:08d}.*"):
        (shutil.copytree if saved.is_dir() else shutil.copy)(saved, fixture / "checkpoints" / saved.name)

    resumed = cwd / "resumed"
    shutil.copytree(fixture, resumed)
    _loco(tree, cwd, processes, resume_args(command, resumed, (out / CORPUS).resolve()))
    got = evidence(resumed, SAVED)
    if got != unbroken:
        raise SystemExit(f"{name}: the resumed run does not end where the unbroken one did:\n{got}\n{unbroken}")
    if sorted(got["losses"]) != [str(s) for s in range(SAVED + 1, TOTAL + 1)] or got["step"] != TOTAL:
        raise SystemExit(f"{name}: expected steps {SAVED + 1}..{TOTAL} logged and a checkpoint at {TOTAL}: {got}")
    expected = {"command": command, "processes": processes, "saved": SAVED, **got}
    (out / name / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return expected


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, default=here.parent.parent, help="the checkout whose code writes the fixture")
    p.add_argument("--out", type=Path, default=here / "data", help="the fixture's folder (its layouts are replaced)")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = p.parse_args(argv)
    tree, out = args.tree.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_corpus(out / CORPUS)
    (out / ".gitignore").write_text("# the fixture's checkpoints are committed (the top .gitignore leaves *.pt out)\n"
                                    "!*.pt\n")
    with tempfile.TemporaryDirectory(prefix="loco-compat-") as tmp:
        _check_tree(tree, Path(tmp))
        for name in args.layouts:
            made = make_layout(tree, out, Path(tmp), name)
            print(f"{name}: step {made['saved']} -> {made['step']}, {len(made['tensors'])} tensors", flush=True)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
