"""Documents one at a time, from any text source: what ``loco tokenizer train`` and ``loco data prepare`` read.

A document is named as the in-memory loaders name it (a file's relative path, ``stdlib/...`` and ``site/...``
for the ``python`` corpus, a row's index for Hugging Face datasets), so a prepared folder splits training and
validation exactly as a run reading the same source would. Files are read when a document's text is asked for,
so a source is never held whole.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

from launch.data.python_corpus import python_files
from launch.data.tokens import DataError

# data.path as one file of a format ``datasets`` has a builder for
HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class Doc(NamedTuple):
    name: str
    path: Optional[str]  # a file to read, or None when ``text`` is given
    text: Optional[str]
    size: int  # bytes (files) or characters (rows): what groups documents into shards


@dataclass
class HFOptions:
    """The ``data.hf_*`` keys."""

    name: Optional[str] = None
    split: str = "train"
    text_field: str = "text"
    data_files: Optional[str] = None


def stdlib_files() -> tuple[Path, list[Path]]:
    """The .py files of this interpreter's standard library, sorted, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, sorted(files)


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


def text_files(path: Path, pattern: str) -> tuple[Path, list[Path], int]:
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


def doc_text(doc: Doc) -> Optional[str]:
    """The document's text; None for a file that cannot be read or is not UTF-8 (it is skipped, as the
    in-memory loaders skip it). NUL bytes are removed: they separate documents in byte-level runs."""
    if doc.text is not None:
        return doc.text
    try:
        with open(doc.path, "rb") as fh:
            return fh.read().replace(b"\x00", b"").decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def file_documents(source: str, path: Optional[str], pattern: str, max_docs: Optional[int]) -> tuple[str, list[Doc]]:
    """The documents of a file source (``text``, ``stdlib``, ``python``) in corpus order, and a description."""
    if source == "stdlib":
        root, files = stdlib_files()
        docs = [Doc(f.relative_to(root).as_posix(), str(f), None, f.stat().st_size) for f in files]
        where = f"the standard library at {root}"
    elif source == "python":
        docs = [Doc(f.name, f.path, None, f.size) for f in python_files()]
        where = "this interpreter's Python source"
    elif source == "text":
        if not path:
            raise DataError("source 'text' needs a path (--path or data.path)")
        root, files, _ = text_files(Path(path), pattern)
        docs = [Doc(f.relative_to(root).as_posix() if root in f.parents else f.name, str(f), None, f.stat().st_size)
                for f in files]
        where = str(path)
    else:
        raise DataError(f"source {source!r}: not a file source (text, stdlib, python)")
    if not docs:
        raise DataError(f"{where}: no documents")
    return where, docs[:max_docs] if max_docs else docs


def open_hf(path: str, opts: HFOptions, streaming: bool) -> Any:
    """A Hugging Face dataset split: a folder saved with ``save_to_disk``, one local file (jsonl, json, parquet,
    csv, arrow), or a name ``datasets.load_dataset`` knows (a hub name needs the network)."""
    from diloco.extras import require

    datasets = require("datasets", "data.source=hf")
    p = Path(path)
    try:
        if p.is_dir() and ((p / "dataset_dict.json").exists() or (p / "dataset_info.json").exists()):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if opts.split not in ds:
                    raise DataError(f"{path}: no split {opts.split!r} (data.hf_split); splits: {', '.join(ds)}")
                ds = ds[opts.split]
            return ds.to_iterable_dataset() if streaming else ds
        if p.is_file() and p.suffix.lower() in HF_FILE_BUILDERS:
            return datasets.load_dataset(HF_FILE_BUILDERS[p.suffix.lower()], data_files=str(p), split=opts.split,
                                         streaming=streaming)
        return datasets.load_dataset(path, opts.name, split=opts.split, data_files=opts.data_files,
                                     streaming=streaming)
    except DataError:
        raise
    except Exception as e:  # datasets raises many kinds; the user needs the message, not the trace
        raise DataError(f"{path}: cannot load Hugging Face dataset: {type(e).__name__}: {e}") from None


def hf_texts(ds: Any, path: str, field: str, start: int = 0) -> Iterator[tuple[int, str]]:
    """(row index, text) of a dataset's rows from ``start``, empty texts left out; a row without ``field`` is
    one line naming the columns it has."""
    rows = ds.skip(start) if start and hasattr(ds, "skip") else ds
    for i, row in enumerate(rows, start):
        if field not in row:
            raise DataError(f"{path}: no column {field!r} (data.hf_text_field); columns: {', '.join(map(str, row))}")
        text = row[field]
        if text:
            yield i, str(text)


def hf_documents(path: str, opts: HFOptions, max_docs: Optional[int]) -> Iterator[Doc]:
    """The rows of a Hugging Face dataset as documents, streamed (bounded memory whatever its size)."""
    ds = open_hf(path, opts, streaming=True)
    for i, text in hf_texts(ds, path, opts.text_field):
        if max_docs and i >= max_docs:
            return
        yield Doc(str(i), None, text, len(text))


def documents(source: str, path: Optional[str], pattern: str = "**/*", max_docs: Optional[int] = None,
              hf: Optional[HFOptions] = None) -> tuple[str, Iterator[Doc], Optional[int]]:
    """A source's documents: (what it is, the documents, their total size where known before reading)."""
    if source == "hf":
        if not path:
            raise DataError("source 'hf' needs a path (--path or data.path): a dataset folder, file or name")
        return path, hf_documents(path, hf or HFOptions(), max_docs), None
    where, docs = file_documents(source, path, pattern, max_docs)
    return where, iter(docs), sum(d.size for d in docs)
