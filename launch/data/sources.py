"""The text sources held in memory as byte documents: a text file or folder (``text``), this interpreter's standard
library (``stdlib``, about 30 MB of source, no path needed) and Hugging Face datasets (``hf``). Token shards
(:mod:`launch.data.shards`), the ``python`` corpus (:mod:`launch.data.python_corpus`) and streamed datasets
(:mod:`launch.data.stream`) have rooms of their own."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Optional

import numpy as np

from launch.data.documents import (BadText, HFOptions, checked_text, jsonl_texts, local_jsonl, open_hf, stdlib_files,
                                   text_files)
from launch.data.tokens import BYTE_VOCAB, DataError, TokenData, split_documents, encode_text, join_documents
from launch.data.tokenizer import ByteTokenizer


def _read_docs(root: Path, files: list[Path], max_docs: Optional[int],
               bad: Optional[BadText] = None) -> list[tuple[str, np.ndarray]]:
    """Files as byte documents; with ``bad``, each line that is not UTF-8 follows data.bad_text."""
    docs = []
    for f in files[:max_docs] if max_docs else files:
        data = f.read_bytes()
        if bad is not None:
            data = checked_text(data, str(f), bad)
        data = data.replace(b"\x00", b"")
        if data:
            docs.append((f.relative_to(root).as_posix() if root in f.parents else f.name, np.frombuffer(data, dtype=np.uint8)))
    return docs


def load_text(path: str, val_path: Optional[str], pattern: str, fraction: float, max_docs: Optional[int],
              bad_text: str = "error") -> TokenData:
    bad = BadText(bad_text)
    root, files, binary = text_files(Path(path), pattern)
    docs = _read_docs(root, files, max_docs, bad)
    if not docs:
        raise DataError(f"{path}: the text files are empty")
    if val_path:
        vroot, vfiles, _ = text_files(Path(val_path), pattern)
        train = [join_documents([t for _, t in docs])]
        val = [join_documents([t for _, t in _read_docs(vroot, vfiles, None, bad)])]
    else:
        train, val = split_documents(docs, fraction)
    bad.say()
    skipped = f"; {binary} binary files skipped" if binary else ""
    return TokenData(train, val, BYTE_VOCAB, ByteTokenizer(), f"text {path} ({len(docs)} files{skipped})")


def load_stdlib(fraction: float, max_docs: Optional[int]) -> TokenData:
    root, files = stdlib_files()
    if not files:
        raise DataError(f"{root}: no Python standard library source found on this interpreter; use data.source=text")
    docs = _read_docs(root, files, max_docs)
    train, val = split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, ByteTokenizer(), f"Python {sysconfig.get_python_version()} standard library ({len(docs)} files)")


def load_hf(path: str, opts: HFOptions, fraction: float, max_docs: Optional[int],
            bad_text: str = "error") -> TokenData:
    """A Hugging Face dataset held in memory, as byte documents named by row; a local jsonl file is read line by
    line, so a line that is not UTF-8 follows data.bad_text."""
    if local_jsonl(path):
        bad = BadText(bad_text)
        docs = []
        for i, text in jsonl_texts(path, opts.text_field, bad):
            if max_docs and i >= max_docs:
                break
            docs.append((f"{i}", encode_text(text)))
        bad.say()
    else:
        ds = open_hf(path, opts, streaming=False)
        if opts.text_field not in ds.column_names:
            raise DataError(f"{path}: no column {opts.text_field!r} (data.hf_text_field); columns: "
                            f"{', '.join(ds.column_names)}")
        texts = ds[opts.text_field][:max_docs] if max_docs else ds[opts.text_field]
        docs = [(f"{i}", encode_text(t)) for i, t in enumerate(texts) if t]
    train, val = split_documents(docs, fraction)
    return TokenData(train, val, BYTE_VOCAB, ByteTokenizer(), f"Hugging Face dataset {path} ({len(docs)} rows)")
