"""Atomic checkpoints: write a temp file, fsync, rename, fsync the folder; keep the newest K.

A crash at any moment leaves either the previous checkpoint set or the new one,
never a half-written file under a checkpoint's name. Loading checks that a file
is a complete loco checkpoint; ``latest_checkpoint`` skips one that is not,
printing one line, and falls back to the next newest. Pruning counts readable
checkpoints only: it keeps the newest K that load (the one just written always
among them) and never deletes a valid checkpoint because broken ones have
higher steps. A write that fails for want of space raises ``CheckpointError``
naming the file and the bytes it needs; the older checkpoints stay as they were.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from launch.store.disk import fsync_dir, space_for
from launch.errors import RunError

FORMAT = "loco-checkpoint"
VERSION = 1
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint file that is truncated, foreign or from an incompatible version."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}.pt"


def slices_folder(path: Path) -> Path:
    """Where a checkpoint of a sharded run (``run.shard: fsdp``) keeps every process's own state, beside its file:
    the file (the whole model and the run's fields) is written last, so it stands for both."""
    return path.with_name(path.name[:-len(".pt")] + ".slices")


def remove_checkpoint(path: Path) -> None:
    """A checkpoint file and its slices folder, if it has one."""
    path.unlink(missing_ok=True)
    shutil.rmtree(slices_folder(path), ignore_errors=True)


def payload_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj``: about what its checkpoint file takes."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


def write_file(path: str | Path, payload: dict[str, Any], final: Optional[Path] = None) -> None:
    """``torch.save(payload)`` into ``path`` and fsync it; a full disk becomes one CheckpointError line (the
    partial file removed)."""
    path = Path(path)
    final = final or path
    advice = ("the older checkpoints are intact; free some space (or lower run.keep_checkpoints, or choose "
              "another --run-dir) and resume")
    with space_for(final, payload_bytes(payload), advice, CheckpointError,
                   partial=path if path.is_file() or not path.exists() else None):
        with open(path, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as ``directory/step_XXXXXXXX.pt`` atomically, then prune to the newest ``keep`` valid ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    for stale in directory.glob(".step_*.tmp*"):  # left by a crash mid-write
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    for orphan in directory.glob("step_*.slices"):  # a crash after a sharded run's slices, before their file
        if orphan != slices_folder(final) and not orphan.with_name(orphan.name[:-len(".slices")] + ".pt").exists():
            shutil.rmtree(orphan, ignore_errors=True)
    tmp = directory / f".{final.name}.tmp{os.getpid()}"
    payload = {"format": FORMAT, "version": VERSION, "step": step, **state, "complete": True}
    try:
        write_file(tmp, payload, final)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(directory)
    _remember_valid(final)
    prune_checkpoints(directory, keep, final)
    return final


# (path, size, mtime) -> loads: a file once checked need not be read again at every prune
_VALID: dict[tuple[str, int, int], bool] = {}


def _key(path: Path) -> Optional[tuple[str, int, int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return str(path), st.st_size, st.st_mtime_ns


def _remember_valid(path: Path) -> None:
    key = _key(path)
    if key is not None:
        _VALID[key] = True


def is_valid_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` loads as a complete loco checkpoint (cached by size and modification time)."""
    path = Path(path)
    key = _key(path)
    if key is None:
        return False
    if key not in _VALID:
        try:
            load_checkpoint(path)
            _VALID[key] = True
        except CheckpointError:
            _VALID[key] = False
    return _VALID[key]


def prune_checkpoints(directory: str | Path, keep: int, written: Optional[Path] = None) -> list[Path]:
    """Keep the newest ``keep`` readable checkpoints (and ``written``, the one just saved); delete the rest.

    Unreadable files never count among the ``keep``: a valid checkpoint is never deleted because broken ones
    have higher steps. Unreadable files older than the oldest kept checkpoint go too; newer ones stay (a
    resume skips them). Returns the deleted files.
    """
    kept, deleted = 0, []
    for path in list_checkpoints(directory):
        if written is not None and path == written:
            kept += 1
            continue
        valid = is_valid_checkpoint(path)
        if valid and kept < keep:
            kept += 1
            continue
        if not valid and kept < keep:
            continue  # newer than the keep-th valid one: a resume skips it; maybe a human looks at it
        remove_checkpoint(path)
        deleted.append(path)
    return deleted


def step_of(path: Path) -> Optional[int]:
    """The step a checkpoint's file name says (``step_00000400.pt``: 400); None for another name."""
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files, newest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if (step := step_of(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def load_checkpoint(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=True)  # pages load on use
    except Exception as e:  # a truncated zip, a foreign pickle: all mean "not a usable checkpoint"
        raise CheckpointError(f"{path}: unreadable ({_reason(path, e)})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or not state.get("complete"):
        raise CheckpointError(f"{path}: not a complete loco checkpoint")
    if state.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: written by a newer loco (format version {state['version']} > {VERSION})")
    if "slices" in state and not (slices_folder(path) / ".metadata").is_file():
        raise CheckpointError(f"{path}: its processes' slices ({slices_folder(path).name}) are missing or incomplete")
    return state


def _reason(path: Path, e: Exception) -> str:
    """Why a file did not load, in a few words (not the zip library's paragraph)."""
    text = str(e)
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    if size == 0:
        return "an empty file"
    if "zip archive" in text or "central directory" in text or "PytorchStreamReader" in text:
        return "truncated or corrupted file" + (f", {size:,} bytes" if size is not None else "")
    if "_use_new_zipfile_serialization" in text:  # torch's mmap load of a file that is no zip archive at all
        return "not a torch checkpoint (no zip archive)" + (f", {size:,} bytes" if size is not None else "")
    first = text.splitlines()[0] if text else ""
    first = first.split(". ")[0]
    return f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__


def _print_skip(message: str) -> None:
    print(f"loco: skipping checkpoint {message}", file=sys.stderr, flush=True)


def latest_checkpoint(directory: str | Path, map_location: Any = "cpu",
                      on_skip: Optional[Callable[[str], None]] = _print_skip) -> Optional[tuple[Path, dict[str, Any]]]:
    """The newest checkpoint that loads; broken ones are skipped, each with one line on stderr (``on_skip``)."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as e:
            if on_skip is not None:
                on_skip(str(e))
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
        # one state per GPU the saving process saw: a machine with fewer (or a narrower CUDA_VISIBLE_DEVICES)
        # takes those it has (torch's set_rng_state_all would fail on the first missing one)
        for index, saved in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(saved, index)


def open_checkpoint(source: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """A checkpoint file, or a run folder's newest valid one (in its ``checkpoints/``, or the folder itself)."""
    path = Path(source)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        hit = latest_checkpoint(folder)
        if hit is None:
            raise RunError(f"{path}: no valid checkpoint found")
        return hit
    return path, load_checkpoint(path)
