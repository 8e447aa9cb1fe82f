"""The data sources read from files or a hub: a text file or folder (``text``), this interpreter's standard library
(``stdlib``, about 30 MB of source, no path needed), pre-tokenized shards (``shards``) and Hugging Face datasets
(``hf``). The ``python`` corpus has its own room, :mod:`launch.python_corpus`."""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Optional

import numpy as np

from launch.token_data import (BYTE_VOCAB, DataError, TokenData, _concat_with_eos, _is_val, _split_documents,
                               encode_text)

LLMC_MAGIC = 20240520  # llm.c token shards: 256 int32 header, then uint16 tokens


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
