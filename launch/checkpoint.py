"""Atomic checkpoints: write a temp file, fsync, rename, fsync the folder; keep the newest K.

A crash at any moment leaves either the previous checkpoint set or the new one,
never a half-written file under a checkpoint's name. Loading checks that a file
is a complete loco checkpoint; ``latest_checkpoint`` skips one that is not,
with a warning, and falls back to the next newest.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

FORMAT = "loco-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint file that is truncated, foreign or from an incompatible version."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as ``directory/step_XXXXXXXX.pt`` atomically, then prune to the newest ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(".step_*.tmp*"):  # left by a crash mid-write
        stale.unlink(missing_ok=True)
    final = directory / checkpoint_name(step)
    tmp = directory / f".{final.name}.tmp{os.getpid()}"
    payload = {"format": FORMAT, "version": VERSION, "step": step, **state, "complete": True}
    try:
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files, newest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)  # pages load on use
    except Exception as e:  # a truncated zip, a foreign pickle: all mean "not a usable checkpoint"
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or not state.get("complete"):
        raise CheckpointError(f"{path}: not a complete loco checkpoint")
    if state.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: written by a newer loco (format version {state['version']} > {VERSION})")
    return state


def latest_checkpoint(directory: str | Path, map_location: Any = "cpu") -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest checkpoint that loads; broken ones are skipped with a warning."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {e}", stacklevel=2)
    return None


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "python": list(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
