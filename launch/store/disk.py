"""Every file a run writes goes through here, so that a full disk is one line wherever it strikes: the path, the
bytes the write needs and the space free there (checkpoints, metrics.jsonl, rounds.jsonl, config.yaml,
summary.json, tokenizer.json, the plots).

A whole file is written beside its name and renamed over it (a failed write leaves the old file, and no partial
one); a line is appended with unbuffered writes (nothing is left in a buffer to fail again at close). A run that
meets a full disk stops there: the checkpoints already written are untouched, and ``--resume`` continues once
space is freed (the resumed run cuts metrics.jsonl back to its checkpoint, a torn last line included).
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from launch.errors import RunError

RESUME = "the checkpoints written so far are intact; free some space (or choose another --run-dir) and continue " \
         "with --resume"


class DiskFull(RunError):
    """A write that failed for want of space (or quota, or the file size limit): the CLI prints its one line."""


def human_bytes(n: float) -> str:
    """A byte count in binary units, named as such: ``512 B``, ``1.5 KiB``, ``10.7 MiB``, ``2.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fsync_dir(path: Path) -> None:
    """Make a folder's entries durable (a rename in it); where the system cannot, nothing."""
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


def out_of_space(e: BaseException) -> bool:
    """A write that failed because the disk (or the quota, or the file size limit) is full.

    torch's zip writer reports a failed write as ``RuntimeError: [enforce fail at inline_container.cc] ...
    unexpected pos``, without the errno; the file handle's own errors are OSErrors.
    """
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    text = str(e)
    return isinstance(e, RuntimeError) and ("unexpected pos" in text or "file write failed" in text)


def free_bytes(directory: Path) -> Optional[int]:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def no_space_message(path: Path, need: int, advice: str = RESUME) -> str:
    """The one line: ``no space left on device: writing PATH needs about 1.2 KiB (1,234 bytes), 0 B free there;
    ADVICE``."""
    free = free_bytes(Path(path).parent)
    where = f", {human_bytes(free)} free there" if free is not None else ""
    return f"no space left on device: writing {path} needs about {human_bytes(need)} ({need:,} bytes){where}; {advice}"


@contextmanager
def space_for(path: Path, need: int, advice: str = RESUME, error: type[Exception] = DiskFull,
              partial: Optional[Path] = None) -> Iterator[None]:
    """Turn a full disk inside the block into ``error(no_space_message(...))``; ``partial``: a file the block was
    writing, removed first (its space counts as free)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        if not out_of_space(e):
            raise
        if partial is not None:
            Path(partial).unlink(missing_ok=True)
        raise error(no_space_message(path, need, advice)) from None


def write_file(path: str | Path, data: str | bytes, advice: str = RESUME) -> Path:
    """``data`` as the whole of ``path``: written beside it, then renamed over it."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp")  # one writer a file: the leader
    with space_for(path, len(raw), advice, partial=tmp):
        try:
            with open(tmp, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


class AppendFile:
    """A file lines are appended to (metrics.jsonl, rounds.jsonl), unbuffered: each ``write`` reaches the file or
    raises :class:`DiskFull`, and nothing waits in a buffer to fail again at ``close``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with space_for(self.path, 0):
            self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str) -> None:
        view = memoryview(text.encode())
        with space_for(self.path, len(view)):
            while view:  # a write that fills the disk returns short; the next one raises
                view = view[os.write(self._fd, view):]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def append_line(path: str | Path, text: str) -> None:
    """Append ``text`` to ``path`` (opened and closed for this one write)."""
    f = AppendFile(path)
    try:
        f.write(text)
    finally:
        f.close()
