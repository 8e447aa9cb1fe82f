"""The text sources held in memory as byte documents: a text file or folder (``text``), this interpreter's standard
library (``stdlib``, about 30 MB of source, no path needed) and Hugging Face datasets (``hf``). Token shards
(:mod:`launch.data.shards`), the ``python`` corpus (:mod:`launch.data.python_corpus`) and streamed datasets
(:mod:`launch.data.stream`) have rooms of their own."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Optional

import numpy as np

from launch.data.documents import HFOptions, text_files, open_hf, stdlib_files
from launch.data.tokens import BYTE_VOCAB, DataError, TokenData, split_documents, encode_text, join_documents
from launch.data.tokenizer import ByteTokenizer


def _read_docs(root: Path, files: list[Path], max_docs: Optional[int]) -> list[tuple[str, np.ndarray]]:
    docs = []
    for f in files[:max_docs] if max_docs else files:
        data = f.read_bytes().replace(b"\x00", b"")
        if data:
            docs.append((f.relative_to(root).as_posix() if root in f.parents else f.name, np.frombuffer(data, dtype=np.uint8)))
    return docs


def load_text(path: str, val_path: Optional[str], pattern: str, fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files, binary = text_files(Path(path), pattern)
    docs = _read_docs(root, files, max_docs)
    if not docs:
        raise DataError(f"{path}: the text files are empty")
    if val_path:
        vroot, vfiles, _ = text_files(Path(val_path), pattern)
        train = [join_documents([t for _, t in docs])]
        val = [join_documents([t for _, t in _read_docs(vroot, vfiles, None)])]
    else:
        train, val = split_documents(docs, fraction)
    skipped = f"; {binary} binary files skipped" if binary else ""
    return TokenData(train, val, BYTE_VOCAB, ByteTokenizer(), f"text {path} ({len(docs)} files{skipped})")


def load_stdlib(fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files = stdlib_files()
    if not files:
        raise DataError(f"{root}: no Python standard library source found on this interpreter; use data.source=text")
    docs = _read_docs(root, files, max_docs)
    train, val = split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, ByteTokenizer(), f"Python {sysconfig.get_python_version()} standard library ({len(docs)} files)")


def load_hf(path: str, opts: HFOptions, fraction: float, max_docs: Optional[int]) -> TokenData:
    """A Hugging Face dataset held in memory, as byte documents named by row."""
    ds = open_hf(path, opts, streaming=False)
    if opts.text_field not in ds.column_names:
        raise DataError(f"{path}: no column {opts.text_field!r} (data.hf_text_field); columns: "
                        f"{', '.join(ds.column_names)}")
    texts = ds[opts.text_field][:max_docs] if max_docs else ds[opts.text_field]
    docs = [(f"{i}", encode_text(t)) for i, t in enumerate(texts) if t]
    train, val = split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, ByteTokenizer(), f"Hugging Face dataset {path} ({len(docs)} rows)")
