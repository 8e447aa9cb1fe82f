"""Documents one at a time, from any text source: what ``loco tokenizer train`` and ``loco data prepare`` read.

A document is named as the in-memory loaders name it (a file's relative path, ``stdlib/...`` and ``site/...``
for the ``python`` corpus, a row's index for Hugging Face datasets), so a prepared folder splits training and
validation exactly as a run reading the same source would. Files are read when a document's text is asked for,
so a source is never held whole.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import sys
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
    bad_text: Optional[str] = None  # data.bad_text for a file the user named; None: one not UTF-8 is left out whole


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
    # a few bytes that are not UTF-8 make bad text (data.bad_text's business), not a binary file
    invalid = head.decode("utf-8", errors="replace").count("\ufffd") - head.count("\ufffd".encode())
    if invalid > len(head) // 10:
        return "more than a tenth of its first bytes are not UTF-8 text"
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


class BadText:
    """``data.bad_text`` over one load: a line that is not UTF-8 (a jsonl record, or a line of a text file) is one
    error naming its file and line (``error``), or is left out and counted by file (``skip``)."""

    def __init__(self, mode: str = "error") -> None:
        if mode not in ("error", "skip"):
            raise DataError(f"data.bad_text={mode!r}: error or skip")
        self.mode = mode
        self.skipped: dict[str, int] = {}

    def line(self, where: str, number: int, what: str) -> None:
        """A line that is not UTF-8 (``what`` says where in it): raise, or count it for the caller to leave out."""
        if self.mode == "error":
            raise DataError(f"{where} line {number}: not UTF-8 ({what}); fix the file or set data.bad_text=skip")
        self.skipped[where] = self.skipped.get(where, 0) + 1

    def report(self, when: str = "") -> Optional[str]:
        if not self.skipped:
            return None
        counts = ", ".join(f"{where} ({n} line{'' if n == 1 else 's'})" for where, n in self.skipped.items())
        return f"data.bad_text=skip: left out lines that are not UTF-8{when}: {counts}"

    def say(self, when: str = "") -> None:
        """The one stderr line of what was left out, where anything was."""
        if (line := self.report(when)) is not None:
            print(line, file=sys.stderr, flush=True)


def _byte_at(raw: bytes, at: int) -> str:
    return f"byte 0x{raw[at]:02x} at column {at + 1}"


def checked_text(data: bytes, where: str, bad: BadText) -> bytes:
    """A text file's bytes when they are UTF-8; otherwise its first bad line is an error, or (``skip``) every
    line that is not UTF-8 is left out, its newline with it. A line ends at ``\\n``, as editors number them."""
    try:
        data.decode("utf-8")
        return data
    except UnicodeDecodeError as e:
        if bad.mode == "error":  # the first bad line is known without splitting the file; bad.line raises
            start = data.rfind(b"\n", 0, e.start) + 1
            bad.line(where, data.count(b"\n", 0, e.start) + 1, _byte_at(data[start:], e.start - start))
    kept = []
    for number, line in enumerate(data.split(b"\n"), 1):
        try:
            line.decode("utf-8")
            kept.append(line)
        except UnicodeDecodeError as e:
            bad.line(where, number, _byte_at(line, e.start))
    return b"\n".join(kept)


def doc_text(doc: Doc) -> Optional[str]:
    """The document's text; None for a file that cannot be read. A file of a built-in corpus that is not UTF-8 is
    None too (left out whole, as its in-memory loader leaves it); one the user named follows ``doc.bad_text``. NUL
    bytes are removed: they separate documents in byte-level runs."""
    if doc.text is not None:
        return doc.text
    try:
        with open(doc.path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    if doc.bad_text is not None:
        data = checked_text(data, doc.path, BadText(doc.bad_text))
    try:
        return data.replace(b"\x00", b"").decode("utf-8")
    except UnicodeDecodeError:
        return None


def file_documents(source: str, path: Optional[str], pattern: str, max_docs: Optional[int],
                   bad_text: str = "error") -> tuple[str, list[Doc]]:
    """The documents of a file source (``text``, ``stdlib``, ``python``) in corpus order, and a description; the
    files of ``text`` follow ``bad_text`` (data.bad_text)."""
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
        docs = [Doc(f.relative_to(root).as_posix() if root in f.parents else f.name, str(f), None, f.stat().st_size,
                    bad_text) for f in files]
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
    one line naming the columns it has, and so is text that is not UTF-8 (pyarrow's reader finds it a block at a
    time, so it is named by the row reached: the line of a local .jsonl file is named by :func:`jsonl_texts`)."""
    rows = iter(ds.skip(start) if start and hasattr(ds, "skip") else ds)
    i = start - 1
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: row {i + 1} or one after it is not UTF-8 (byte 0x{e.object[e.start]:02x}); "
                            "fix it, or name its .jsonl file as data.path to have its line named") from None
        i += 1
        if field not in row:
            raise DataError(f"{path}: no column {field!r} (data.hf_text_field); columns: {', '.join(map(str, row))}")
        text = row[field]
        if text:
            yield i, str(text)


def local_jsonl(path: str) -> bool:
    """Whether data.path is one local JSON-lines file: loco reads those itself (:func:`jsonl_texts`)."""
    p = Path(path)
    return p.suffix.lower() == ".jsonl" and p.is_file()


def jsonl_texts(path: str, field: str, bad: BadText, start: int = 0) -> Iterator[tuple[int, str]]:
    """(row, text) of a local JSON-lines file from row ``start``, empty texts left out. Read line by line here, not
    by pyarrow, whose reader fails on a line that is not UTF-8 without naming it: such a line follows ``bad``.
    Rows are the non-blank lines, numbered as ``datasets`` numbers them; a line left out keeps its number, so
    every other row keeps its document name."""
    row, has_field, columns = -1, False, set()
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            row += 1
            if row < start:
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.line(path, number, _byte_at(raw, e.start))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {number}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number}: a JSON {type(record).__name__}, not an object of columns")
            if field not in record:
                columns.update(record)
                continue
            has_field, text = True, record[field]
            if not text:
                continue
            text = str(text)
            if "\\u" in line:  # an escaped lone surrogate is no character, so it has no UTF-8
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    bad.line(path, number, f"an escaped lone surrogate \\u{ord(text[e.start]):04x}")
                    continue
            yield row, text
    if not has_field and columns:
        raise DataError(f"{path}: no column {field!r} (data.hf_text_field); columns: {', '.join(sorted(columns))}")


def stream_texts(path: str, opts: HFOptions, bad: BadText, start: int = 0) -> Iterator[tuple[int, str]]:
    """(row, text) of a dataset read as a stream from row ``start``, empty texts left out: a local jsonl file by
    :func:`jsonl_texts`, anything else by ``datasets``."""
    if local_jsonl(path):
        return jsonl_texts(path, opts.text_field, bad, start)
    return hf_texts(open_hf(path, opts, streaming=True), path, opts.text_field, start)


def hf_documents(path: str, opts: HFOptions, max_docs: Optional[int], bad_text: str = "error") -> Iterator[Doc]:
    """The rows of a Hugging Face dataset as documents, streamed (bounded memory whatever its size)."""
    bad = BadText(bad_text)
    for i, text in stream_texts(path, opts, bad):
        if max_docs and i >= max_docs:
            break
        yield Doc(str(i), None, text, len(text))
    bad.say()


def documents(source: str, path: Optional[str], pattern: str = "**/*", max_docs: Optional[int] = None,
              hf: Optional[HFOptions] = None, bad_text: str = "error") -> tuple[str, Iterator[Doc], Optional[int]]:
    """A source's documents: (what it is, the documents, their total size where known before reading)."""
    if source == "hf":
        if not path:
            raise DataError("source 'hf' needs a path (--path or data.path): a dataset folder, file or name")
        return path, hf_documents(path, hf or HFOptions(), max_docs, bad_text), None
    where, docs = file_documents(source, path, pattern, max_docs, bad_text)
    return where, iter(docs), sum(d.size for d in docs)
