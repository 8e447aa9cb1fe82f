"""The ``python`` corpus: the standard library plus the ``.py`` files of every installed package, read as byte
tokens (a few hundred MB in a virtualenv with torch, enough for a GPU; no download)."""

from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np

from launch.data.tokens import BYTE_VOCAB, EOS, DataError, TokenData, in_val_split, split_documents
from launch.data.tokenizer import ByteTokenizer


class PyFile(NamedTuple):
    name: str  # "stdlib/<relpath>" or "site/<relpath>": what orders and splits the corpus
    path: str
    size: int


def python_roots() -> tuple[Path, list[Path]]:
    """This interpreter's standard library folder and its site-packages folders, as real paths.

    The site folders are ``sysconfig``'s purelib and platlib, then ``site.getsitepackages()``, in that
    order, deduplicated by real path; folders that do not exist and the standard library folder itself
    are left out.
    """
    paths = sysconfig.get_paths()
    stdlib = Path(os.path.realpath(paths["stdlib"]))
    candidates = [paths.get("purelib"), paths.get("platlib")]
    try:
        candidates += list(site.getsitepackages())
    except AttributeError:  # some embedded or old virtualenv site modules lack it
        pass
    sites: list[Path] = []
    for c in candidates:
        if not c:
            continue
        real = Path(os.path.realpath(c))
        if real != stdlib and real not in sites and real.is_dir():
            sites.append(real)
    return stdlib, sites


def _walk_py(root: Path, skip_paths: frozenset[str], skip_dir_names: frozenset[str],
             skip_file_prefix: Optional[str] = None) -> list[tuple[tuple[str, ...], str, int, str]]:
    """(relative parts, path, size, real path) of every ``.py`` file under ``root``.

    Symlinked directories are not entered (so a symlink loop cannot trap the walk); symlinked files are
    read through the link. Entries that cannot be listed or stat-ed (broken links, looping links, no
    permission) are skipped. Folders named in ``skip_dir_names`` and folders whose path is in
    ``skip_paths`` (real paths of the other roots) are not entered.
    """
    out = []
    stack: list[tuple[str, tuple[str, ...]]] = [(str(root), ())]
    while stack:
        folder, rel = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.name not in skip_dir_names and e.path not in skip_paths:
                        stack.append((e.path, rel + (e.name,)))
                elif e.name.endswith(".py") and e.is_file():
                    if skip_file_prefix and not rel and e.name.startswith(skip_file_prefix):
                        continue
                    st = e.stat()
                    # the real path names the file: inode numbers from a listing are not stable on every
                    # file system (overlays), and a symlink must count as the file it points to
                    out.append((rel + (e.name,), e.path, st.st_size, os.path.realpath(e.path)))
            except OSError:
                continue
    return out


def python_files(stdlib_root: Optional[Path] = None, site_roots: Optional[Sequence[Path]] = None) -> list[PyFile]:
    """The ``.py`` files of the ``python`` source, in corpus order (this interpreter's folders by default).

    First the standard library (its ``site-packages`` / ``dist-packages`` folders excluded, as for the
    ``stdlib`` source), named ``stdlib/<relpath>``; then every site-packages folder, named ``site/<relpath>``.
    Each part is sorted by the parts of the relative path (a file that exists under the same relative
    path in two site folders appears once per folder, in folder order), so the order does not depend on
    the listing order of the file system or on where the interpreter is installed. ``__pycache__`` is
    skipped, so are setuptools' generated ``__editable__*`` finders at the top of a site folder (they hold
    absolute paths), and a file reached twice (a symlink to a file already listed, a root nested in another
    root) is listed once, the first time.
    """
    if stdlib_root is None and site_roots is None:
        stdlib_root, site_roots = python_roots()
    roots = [Path(os.path.realpath(stdlib_root))] if stdlib_root is not None else []
    for r in site_roots or ():
        real = Path(os.path.realpath(r))
        if real not in roots:
            roots.append(real)
    nested = frozenset(str(r) for r in roots)
    parts: list[list[tuple[tuple[str, ...], str, int, str]]] = []
    for i, root in enumerate(roots):
        others = nested - {str(root)}
        if i == 0 and stdlib_root is not None:
            found = _walk_py(root, others, frozenset(("site-packages", "dist-packages", "__pycache__")))
        else:
            found = _walk_py(root, others, frozenset(("__pycache__",)), skip_file_prefix="__editable__")
        parts.append(found)
    entries = []  # (part, relative parts, root index) sorts the corpus
    for i, found in enumerate(parts):
        part = 0 if (i == 0 and stdlib_root is not None) else 1
        entries.extend(((part, rel, i), path, size, key) for rel, path, size, key in found)
    entries.sort(key=lambda e: e[0])
    files, seen = [], set()
    for (part, rel, _), path, size, key in entries:
        if key in seen:
            continue
        seen.add(key)
        files.append(PyFile(("stdlib/" if part == 0 else "site/") + "/".join(rel), path, size))
    return files


def _read_utf8(path: str) -> Optional[bytes]:
    """The file's bytes with NUL removed (NUL is the document separator), or None when it cannot be
    read or is not valid UTF-8."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return data.replace(b"\x00", b"") if b"\x00" in data else data


def load_python(fraction: float, max_docs: Optional[int], stdlib_root: Optional[Path] = None,
                site_roots: Optional[Sequence[Path]] = None) -> TokenData:
    """The ``python`` source: the standard library and every installed package's ``.py`` files.

    Byte tokens, one document per file ending in EOS, split by file name like ``split_documents``
    (the same names give the same two arrays), but read straight into one preallocated array per
    split so the corpus is held once, not twice. Files that cannot be read or are not UTF-8 are skipped
    and counted; empty files are left out like in the ``stdlib`` source.
    """
    if stdlib_root is None and site_roots is None:
        stdlib_root, site_roots = python_roots()
    files = python_files(stdlib_root, site_roots)
    if max_docs:
        files = files[:max_docs]
    if not files:
        raise DataError(f"{stdlib_root}: no Python source found on this interpreter; use data.source=text")
    sides = [int(in_val_split(f.name, fraction)) for f in files]
    bufs = [np.empty(sum(f.size + 1 for f, v in zip(files, sides) if v == side), dtype=np.uint8) for side in (0, 1)]
    pos = [0, 0]
    kept: list[tuple[str, int, int]] = []  # (name, side, length with its EOS)
    skipped = 0
    for f, side in zip(files, sides):
        data = _read_utf8(f.path)
        if data is None:
            skipped += 1
            continue
        if not data:
            continue
        n, p = len(data), pos[side]
        if p + n + 1 > len(bufs[side]):  # the file grew after it was listed
            grown = np.empty(max(p + n + 1, len(bufs[side]) + len(bufs[side]) // 4), dtype=np.uint8)
            grown[:p] = bufs[side][:p]
            bufs[side] = grown
        bufs[side][p:p + n] = np.frombuffer(data, dtype=np.uint8)
        bufs[side][p + n] = EOS
        pos[side] = p + n + 1
        kept.append((f.name, side, n + 1))
    if not kept:
        raise DataError(f"{stdlib_root}: none of the {len(files)} Python files could be read as UTF-8")
    train, val = (_compact(bufs[side], pos[side]) for side in (0, 1))
    if len(kept) == 1:  # one document: split_documents cuts its tokens (without the EOS)
        (name, side, n), = kept
        train, val = split_documents([(name, (val if side else train)[:n - 1])], fraction)
        train, val = train[0], val[0]
    elif not val.size:  # _val_indices' fallbacks: no file named for validation -> the last one goes there
        cut = len(train) - kept[-1][2]
        train, val = train[:cut], train[cut:]
    elif not train.size:  # ... and every file named for validation -> the first one trains
        cut = kept[0][2]
        train, val = val[:cut], val[cut:]
    std = sum(1 for name, _, _ in kept if name.startswith("stdlib/"))
    size = len(train) + len(val)  # bytes: the tokens of a byte-level run only, so the description says bytes
    n_sites = len({os.path.realpath(r) for r in site_roots or ()}
                  - ({os.path.realpath(stdlib_root)} if stdlib_root is not None else set()))
    desc = (f"Python {sysconfig.get_python_version()} source: standard library + {n_sites} "
            f"site-packages folder(s) ({len(kept):,} files: {std:,} stdlib, {len(kept) - std:,} site-packages; "
            f"{size:,} bytes")
    if skipped:
        desc += f"; {skipped:,} unreadable or non-UTF-8 files skipped"
    return TokenData([train], [val], BYTE_VOCAB, ByteTokenizer(), desc + ")")


def _compact(buf: np.ndarray, used: int) -> np.ndarray:
    """``buf[:used]``, copied when the unused tail (skipped files, removed NULs) is worth giving back."""
    return buf[:used].copy() if len(buf) - used > max(1 << 20, len(buf) // 8) else buf[:used]
