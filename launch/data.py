"""Token data: the embedded default corpora, text files, token shards, Hugging Face datasets.

Every source becomes two *splits* (train, validation), each a list of 1-D token
arrays (one per file or shard; memory-mapped where the source is on disk). A
:class:`Batcher` cuts a split into windows of ``seq_len + 1`` tokens, shuffles
the windows per epoch from the seed, and hands worker ``w`` of ``W`` its own
block of every global batch: at worker step ``t`` the rows are global samples
``(t * W + w) * B ... + B - 1``. So the workers never share a sample, the union
of all workers' batches at a step is the batch a single worker with ``W * B``
rows would see, and a batch depends only on the step, which makes resume exact.

Text is tokenized as bytes (vocabulary 256; byte 0 separates documents), so
nothing is ever downloaded. The two corpora that need no path are ``stdlib`` (this
interpreter's standard library source, about 30 MB) and ``python`` (the standard
library plus the ``.py`` files of every installed package: a few hundred MB in a
virtualenv with torch, enough for a GPU).
"""

from __future__ import annotations

import glob
import os
import site
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

BYTE_VOCAB = 256
EOS = 0  # NUL never appears in text files, so it marks document boundaries
LLMC_MAGIC = 20240520  # llm.c token shards: 256 int32 header, then uint16 tokens


class DataError(ValueError):
    """A data source that cannot be used; the message names the file or key."""


@dataclass
class TokenData:
    train: list[np.ndarray]
    val: list[np.ndarray]
    vocab_size: int
    tokenizer: Optional[str]  # "bytes" when text is byte-level, else None (ids only)
    description: str

    @property
    def train_tokens(self) -> int:
        return int(sum(len(a) for a in self.train))

    @property
    def val_tokens(self) -> int:
        return int(sum(len(a) for a in self.val))


def encode_text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode_tokens(tokens: Sequence[int]) -> str:
    return bytes(int(t) for t in tokens if 0 < int(t) < 256).decode("utf-8", errors="replace")


def _is_val(name: str, fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < fraction * 10_000


def _split_documents(docs: list[tuple[str, np.ndarray]], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Deterministic split by document name; both sides get at least one document."""
    if not docs:
        raise DataError("no documents found")
    if len(docs) == 1:
        tokens = docs[0][1]
        cut = int(len(tokens) * (1 - fraction))
        return [tokens[:cut]], [tokens[cut:]]
    val_idx = _val_indices([name for name, _ in docs], fraction)
    train = [t for i, (_, t) in enumerate(docs) if i not in val_idx]
    val = [t for i, (_, t) in enumerate(docs) if i in val_idx]
    return [_concat_with_eos(train)], [_concat_with_eos(val)]


def _val_indices(names: Sequence[str], fraction: float) -> set[int]:
    """Indices of the validation documents among two or more: by name, never none and never all."""
    val_idx = {i for i, name in enumerate(names) if _is_val(name, fraction)}
    if not val_idx:
        val_idx = {len(names) - 1}
    if len(val_idx) == len(names):
        val_idx.discard(0)
    return val_idx


def _concat_with_eos(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.empty(sum(len(a) + 1 for a in arrays), dtype=np.uint8)
    pos = 0
    for a in arrays:
        out[pos:pos + len(a)] = a
        out[pos + len(a)] = EOS
        pos += len(a) + 1
    return out


def stdlib_files() -> tuple[Path, list[Path]]:
    """The .py files of this interpreter's standard library, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, sorted(files)


def _read_docs(root: Path, files: list[Path], max_docs: Optional[int]) -> list[tuple[str, np.ndarray]]:
    docs = []
    for f in files[:max_docs] if max_docs else files:
        data = f.read_bytes().replace(b"\x00", b"")
        if data:
            docs.append((f.relative_to(root).as_posix() if root in f.parents else f.name, np.frombuffer(data, dtype=np.uint8)))
    return docs


def _binary_reason(path: Path) -> Optional[str]:
    """Why ``path`` looks like a binary file rather than text (from its first 8 KiB), or None."""
    with open(path, "rb") as fh:
        head = fh.read(8192)
    if b"\x00" in head:
        return "it holds NUL bytes"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # a character cut at the 8 KiB edge is not a reason
            return f"it is not UTF-8 text (byte {e.start})"
    control = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13, 27))
    if head and control > len(head) // 10:
        return "more than a tenth of its first bytes are control characters"
    return None


def _text_files(path: Path, pattern: str) -> tuple[Path, list[Path], int]:
    """The text files named by ``path`` (a file or a folder searched with ``pattern``) and how many binaries were skipped."""
    if path.is_file():
        reason = _binary_reason(path)
        if reason:
            raise DataError(f"{path}: looks like a binary file, not text ({reason}); "
                            "name a text file or a folder of them, or use data.source=shards for token files")
        return path.parent, [path], 0
    files, binary = [], 0
    for name in sorted(glob.glob(os.path.join(glob.escape(str(path)), pattern), recursive=True)):  # [ in a name
        p = Path(name)
        rel = p.relative_to(path)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if _binary_reason(p):
            binary += 1
            continue
        files.append(p)
    if not files:
        extra = f" ({binary} binary files skipped)" if binary else ""
        raise DataError(f"{path}: no text files match data.pattern={pattern!r}{extra}")
    return path, files, binary


def load_text(path: str, val_path: Optional[str], pattern: str, fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files, binary = _text_files(Path(path), pattern)
    docs = _read_docs(root, files, max_docs)
    if not docs:
        raise DataError(f"{path}: the text files are empty")
    if val_path:
        vroot, vfiles, _ = _text_files(Path(val_path), pattern)
        train = [_concat_with_eos([t for _, t in docs])]
        val = [_concat_with_eos([t for _, t in _read_docs(vroot, vfiles, None)])]
    else:
        train, val = _split_documents(docs, fraction)
    skipped = f"; {binary} binary files skipped" if binary else ""
    return TokenData(train, val, BYTE_VOCAB, "bytes", f"text {path} ({len(docs)} files{skipped})")


def load_stdlib(fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files = stdlib_files()
    if not files:
        raise DataError(f"{root}: no Python standard library source found on this interpreter; use data.source=text")
    docs = _read_docs(root, files, max_docs)
    train, val = _split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, "bytes", f"Python {sysconfig.get_python_version()} standard library ({len(docs)} files)")


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

    Byte tokens, one document per file ending in EOS, split by file name like ``_split_documents``
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
    sides = [int(_is_val(f.name, fraction)) for f in files]
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
    if len(kept) == 1:  # one document: _split_documents cuts its tokens (without the EOS)
        (name, side, n), = kept
        train, val = _split_documents([(name, (val if side else train)[:n - 1])], fraction)
        train, val = train[0], val[0]
    elif not val.size:  # _val_indices' fallbacks: no file named for validation -> the last one goes there
        cut = len(train) - kept[-1][2]
        train, val = train[:cut], train[cut:]
    elif not train.size:  # ... and every file named for validation -> the first one trains
        cut = kept[0][2]
        train, val = val[:cut], val[cut:]
    std = sum(1 for name, _, _ in kept if name.startswith("stdlib/"))
    tokens = len(train) + len(val)
    n_sites = len({os.path.realpath(r) for r in site_roots or ()}
                  - ({os.path.realpath(stdlib_root)} if stdlib_root is not None else set()))
    desc = (f"Python {sysconfig.get_python_version()} source: standard library + {n_sites} "
            f"site-packages folder(s) ({len(kept):,} files: {std:,} stdlib, {len(kept) - std:,} site-packages; "
            f"{tokens:,} tokens")
    if skipped:
        desc += f"; {skipped:,} unreadable or non-UTF-8 files skipped"
    return TokenData([train], [val], BYTE_VOCAB, "bytes", desc + ")")


def _compact(buf: np.ndarray, used: int) -> np.ndarray:
    """``buf[:used]``, copied when the unused tail (skipped files, removed NULs) is worth giving back."""
    return buf[:used].copy() if len(buf) - used > max(1 << 20, len(buf) // 8) else buf[:used]


def open_shard(path: Path, dtype: str) -> np.ndarray:
    """Memory-map one token shard: .npy (any header) or raw .bin (uint16/uint32, or llm.c's header)."""
    try:
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
            if arr.ndim != 1 or arr.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
                raise DataError(f"{path}: expected a 1-D array of integer tokens (uint16, uint32, int32, int64), "
                                f"got {arr.dtype} with shape {arr.shape}")
            return arr
        with open(path, "rb") as fh:
            raw = fh.read(1024)
        head = np.frombuffer(raw[: len(raw) // 4 * 4], dtype=np.int32)
        if len(head) == 256 and head[0] == LLMC_MAGIC:
            return np.memmap(path, dtype=np.uint16, mode="r", offset=1024, shape=(int(head[2]),))
        np_dtype = np.uint32 if dtype == "uint32" else np.uint16
        if path.stat().st_size % np.dtype(np_dtype).itemsize:
            raise DataError(f"{path}: size {path.stat().st_size} is not a multiple of {np.dtype(np_dtype).itemsize} ({np_dtype.__name__}); check data.dtype")
        return np.memmap(path, dtype=np_dtype, mode="r")
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read token shard: {e}") from None


def _shard_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in (".bin", ".npy") and not p.name.startswith("."))
    if not files:
        raise DataError(f"{path}: no .bin or .npy token shards in this folder")
    return files


def load_shards(path: str, val_path: Optional[str], dtype: str, vocab_size: int, fraction: float) -> TokenData:
    files = _shard_files(Path(path))
    arrays = [(f.name, open_shard(f, dtype)) for f in files]
    if val_path:
        train = [a for _, a in arrays]
        val = [open_shard(f, dtype) for f in _shard_files(Path(val_path))]
    elif len(arrays) == 1 or len({_is_val(n, fraction) for n, _ in arrays}) == 1:  # all on one side: cut the tail
        *first, (_, last) = arrays
        cut = int(len(last) * (1 - fraction))
        train = [a for _, a in first] + [last[:cut]]
        val = [last[cut:]]
    else:
        train = [a for n, a in arrays if not _is_val(n, fraction)]
        val = [a for n, a in arrays if _is_val(n, fraction)]
    return TokenData(train, val, vocab_size, None, f"token shards {path} ({len(files)} files)")


def load_hf(path: str, name: Optional[str], split: str, field: str, fraction: float, max_docs: Optional[int],
            data_files: Optional[str] = None) -> TokenData:
    from diloco.extras import require

    datasets = require("datasets", "data.source=hf")
    try:
        p = Path(path)
        if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists()):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{path}: no split {split!r} (data.hf_split); splits: {', '.join(ds)}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(path, name, split=split, data_files=data_files)
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds; the user needs the message, not the trace
        raise DataError(f"{path}: cannot load Hugging Face dataset: {type(e).__name__}: {e}") from None
    if field not in ds.column_names:
        raise DataError(f"{path}: no column {field!r} (data.hf_text_field); columns: {', '.join(ds.column_names)}")
    texts = ds[field][:max_docs] if max_docs else ds[field]
    docs = [(f"{i}", encode_text(t)) for i, t in enumerate(texts) if t]
    train, val = _split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, "bytes", f"Hugging Face dataset {path} ({len(docs)} rows)")


def load_data(dcfg) -> TokenData:
    """Build the splits named by a ``DataConfig``."""
    if dcfg.source == "stdlib":
        data = load_stdlib(dcfg.val_fraction, dcfg.max_docs)
    elif dcfg.source == "python":
        data = load_python(dcfg.val_fraction, dcfg.max_docs)
    elif dcfg.source == "text":
        data = load_text(dcfg.path, dcfg.val_path, dcfg.pattern, dcfg.val_fraction, dcfg.max_docs)
    elif dcfg.source == "shards":
        data = load_shards(dcfg.path, dcfg.val_path, dcfg.dtype, dcfg.vocab_size, dcfg.val_fraction)
    elif dcfg.source == "hf":
        data = load_hf(dcfg.path, dcfg.hf_name, dcfg.hf_split, dcfg.hf_text_field, dcfg.val_fraction, dcfg.max_docs,
                       dcfg.hf_data_files)
    else:
        raise DataError(f"data.source: unknown source {dcfg.source!r}")
    for split_name, split in (("train", data.train), ("validation", data.val)):
        if sum(max(0, len(a) - 1) // dcfg.seq_len for a in split) == 0:
            raise DataError(f"{data.description}: the {split_name} split has fewer than data.seq_len+1={dcfg.seq_len + 1} tokens")
    return data


class Windows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a list of token arrays."""

    def __init__(self, arrays: list[np.ndarray], seq_len: int) -> None:
        self.arrays, self.seq_len = arrays, seq_len
        counts = np.array([max(0, len(a) - 1) // seq_len for a in arrays], dtype=np.int64)
        self.cum = np.cumsum(counts)
        self.n = int(self.cum[-1]) if len(self.cum) else 0

    def get(self, i: int) -> np.ndarray:
        a = int(np.searchsorted(self.cum, i, side="right"))
        off = (i - (int(self.cum[a - 1]) if a else 0)) * self.seq_len
        return np.asarray(self.arrays[a][off:off + self.seq_len + 1], dtype=np.int64)


class Batcher:
    """Deterministic batches for one worker: a pure function of (step, micro-batch)."""

    FULL_PERMUTATION_LIMIT = 1 << 24

    def __init__(self, data: TokenData, seq_len: int, batch_size: int, worker_index: int = 0,
                 num_workers: int = 1, seed: int = 0, grad_accum: int = 1) -> None:
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker_index {worker_index} is not in [0, {num_workers})")
        self.train, self.val = Windows(data.train, seq_len), Windows(data.val, seq_len)
        self.vocab_size, self.description = data.vocab_size, data.description
        self.batch_size, self.grad_accum = batch_size, grad_accum
        self.micro = batch_size // grad_accum
        self.worker_index, self.num_workers, self.seed = worker_index, num_workers, seed
        self._perm_epoch, self._perm = -1, None

    def _window_index(self, sample: int) -> int:
        n = self.train.n
        epoch, i = divmod(sample, n)
        if n <= self.FULL_PERMUTATION_LIMIT:
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
                self._perm_epoch = epoch
            return int(self._perm[i])
        # very large corpora: an affine bijection mod n, no O(n) table
        rng = np.random.default_rng([self.seed, epoch])
        a = int(rng.integers(1, n))
        while np.gcd(a, n) != 1:
            a += 1
        return (a * i + int(rng.integers(0, n))) % n

    def samples_before(self, step: int) -> int:
        """Global sample index where this worker's batch of ``step`` starts."""
        return (step * self.num_workers + self.worker_index) * self.batch_size

    def _stack(self, windows: Windows, indices: Sequence[int], where: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([windows.get(i) for i in indices])
        top, bottom = int(rows.max()), int(rows.min())
        if top >= self.vocab_size or bottom < 0:
            bad = top if top >= self.vocab_size else bottom
            raise DataError(f"{self.description}: token id {bad} in the {where} data is outside [0, vocab_size="
                            f"{self.vocab_size}); check data.vocab_size / data.dtype")
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def train_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.samples_before(step) + micro * self.micro
        return self._stack(self.train, [self._window_index(s) for s in range(start, start + self.micro)], "training")

    def val_batch(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k-th validation batch: sequential windows, the same on every worker."""
        start = k * self.micro
        return self._stack(self.val, [(start + j) % self.val.n for j in range(self.micro)], "validation")
