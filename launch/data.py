"""Token data: the embedded default corpus, text files, token shards, Hugging Face datasets.

Every source becomes two *splits* (train, validation), each a list of 1-D token
arrays (one per file or shard; memory-mapped where the source is on disk). A
:class:`Batcher` cuts a split into windows of ``seq_len + 1`` tokens, shuffles
the windows per epoch from the seed, and hands worker ``w`` of ``W`` its own
block of every global batch: at worker step ``t`` the rows are global samples
``(t * W + w) * B ... + B - 1``. So the workers never share a sample, the union
of all workers' batches at a step is the batch a single worker with ``W * B``
rows would see, and a batch depends only on the step, which makes resume exact.

Text is tokenized as bytes (vocabulary 256; byte 0 separates documents), so
nothing is ever downloaded.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

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
    val_idx = {i for i, (name, _) in enumerate(docs) if _is_val(name, fraction)}
    if not val_idx:
        val_idx = {len(docs) - 1}
    if len(val_idx) == len(docs):
        val_idx.discard(0)
    train = [t for i, (_, t) in enumerate(docs) if i not in val_idx]
    val = [t for i, (_, t) in enumerate(docs) if i in val_idx]
    return [_concat_with_eos(train)], [_concat_with_eos(val)]


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


def _text_files(path: Path, pattern: str) -> tuple[Path, list[Path]]:
    if path.is_file():
        return path.parent, [path]
    files = []
    for name in sorted(glob.glob(str(path / pattern), recursive=True)):
        p = Path(name)
        rel = p.relative_to(path)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        with open(p, "rb") as fh:
            if b"\x00" in fh.read(8192):  # binary file
                continue
        files.append(p)
    if not files:
        raise DataError(f"{path}: no text files match data.pattern={pattern!r}")
    return path, files


def load_text(path: str, val_path: Optional[str], pattern: str, fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files = _text_files(Path(path), pattern)
    docs = _read_docs(root, files, max_docs)
    if not docs:
        raise DataError(f"{path}: the text files are empty")
    if val_path:
        vroot, vfiles = _text_files(Path(val_path), pattern)
        train = [_concat_with_eos([t for _, t in docs])]
        val = [_concat_with_eos([t for _, t in _read_docs(vroot, vfiles, None)])]
    else:
        train, val = _split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, "bytes", f"text {path} ({len(docs)} files)")


def load_stdlib(fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files = stdlib_files()
    if not files:
        raise DataError(f"{root}: no Python standard library source found on this interpreter; use data.source=text")
    docs = _read_docs(root, files, max_docs)
    train, val = _split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, "bytes", f"Python {sysconfig.get_python_version()} standard library ({len(docs)} files)")


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
    try:
        import datasets
    except ImportError:
        raise DataError("data.source=hf needs the Hugging Face datasets package: pip install 'loco[hf]'") from None
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
