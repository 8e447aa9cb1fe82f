"""Checkpoints written by an earlier loco resume bit for bit on this one.

tests/compat/data holds, for each layout (the simulator's replicated workers, a torchrun node of two processes, the
same sharded with FSDP), a run folder as an earlier tree left it at a checkpoint, and what that tree's resume
produced after it: each step's loss, the final validation loss and a SHA-256 of every tensor of the final checkpoint's
model, of its workers' models and global parameters, and of its slices. Each case resumes a copy of the folder with
this tree through the command line, as a user would, and asks for the same numbers to the bit: the checkpoint format,
the state a resume restores (model, optimizers, outer momenta, an exchange in flight, RNG, data position) and the
training arithmetic all unchanged.

Remake the fixture (only when a change of results is meant) with the tree that should write it:

    python tests/compat/make_checkpoints.py --tree <old checkout> --out tests/compat/data
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from compat.make_checkpoints import CORPUS, LAYOUTS, RUN, evidence, resume_args
from conftest import loco, torchrun_nodes

DATA = Path(__file__).resolve().parent / "compat" / "data"


def _resume(root: Path, layout: str, expected: dict) -> tuple[dict, str]:
    """Resume a copy of ``layout``'s run folder to its end: (its evidence, why the run failed or "")."""
    run_dir = root / layout
    shutil.copytree(DATA / layout / RUN, run_dir)
    args = resume_args(expected["command"], run_dir, DATA / CORPUS)
    if expected["processes"]:
        for node in torchrun_nodes([args], per_node=expected["processes"]):
            if node.returncode != 0:
                return {}, node.stderr[-3000:]
    elif loco(args).returncode != 0:
        return {}, "the run failed: its output is in this fixture's captured stderr"
    return evidence(run_dir, expected["saved"]), ""


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, tuple[dict, dict, str]]:
    """Every layout resumed at once, layout -> (expected, evidence, failure): a torchrun job waits on imports and its
    rendezvous much of the time, so the jobs side by side, and the in-process run meanwhile (in this thread, where
    it sets its signal handlers as a command does), take little more than the longest alone."""
    root = tmp_path_factory.mktemp("compat")
    expected = {layout: json.loads((DATA / layout / "expected.json").read_text()) for layout in LAYOUTS}
    spawned = [layout for layout in LAYOUTS if expected[layout]["processes"]]
    with ThreadPoolExecutor(max(1, len(spawned))) as pool:
        jobs = {layout: pool.submit(_resume, root, layout, expected[layout]) for layout in spawned}
        got = {layout: _resume(root, layout, expected[layout]) for layout in LAYOUTS if layout not in jobs}
        got.update({layout: job.result() for layout, job in jobs.items()})
    return {layout: (expected[layout], *got[layout]) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_earlier_trees_checkpoint_resumes_bit_for_bit(layout, resumed):
    expected, got, failed = resumed[layout]
    assert not failed, failed
    assert got["step"] == expected["step"]
    # not val_loss (which windows are scored is this tree's choice), nor the printed training loss of a worker of
    # several processes (now its whole batch's, where the earlier tree printed process 0's share)
    if not expected["processes"]:
        assert got["losses"] == expected["losses"]
    assert got["tensors"].keys() == expected["tensors"].keys()
    differ = [k for k, digest in expected["tensors"].items() if got["tensors"][k] != digest]
    assert not differ, f"{len(differ)} of {len(expected['tensors'])} tensors differ: {differ[:8]}"
