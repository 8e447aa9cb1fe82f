"""``loco data prepare``: text to token shards with a ``manifest.json``, on every core, resumable.

Documents are read in corpus order and grouped into *units* of about ``shard_mb`` MB of text; each unit becomes
one training shard and (when any of its documents is a validation one) one validation shard, split by document
name as a run reading the same source splits it. Units go to a pool of processes, each encoding with its own
single-threaded tokenizer, so the ids' conversion runs in parallel too. A unit's files are written under
temporary names and renamed, then its record; an interrupted prepare finds the records and skips those units.
A shard's record holds its token count and the XXH3-64 of the bytes written (hashed from memory, so the file is
never read back), which the manifest keeps for ``loco data verify``.
``prepare.json`` keeps the settings, so a folder is only ever continued with the settings that began it.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from launch.store.disk import write_file
from launch.data.documents import Doc, HFOptions, doc_text, documents
from launch.data.shards import CHECKSUM, MANIFEST, MANIFEST_FORMAT, TOKENIZER_FILE, shard_checksum, shard_dtype
from launch.data.ticker import Ticker
from launch.data.tokens import DataError, in_val_split, join_documents
from launch.data.tokenizer import BPETokenizer, Tokenizer, load_tokenizer

SETTINGS = "prepare.json"
UNITS = "units"  # one record per finished unit
MAX_SHARD_MB = 64
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def auto_shard_mb(total: Optional[int]) -> float:
    """Text per shard when none is asked for: a 64th of a source of known size (so every core of a large machine
    has units to take), from 1 to 64 MB; 64 MB for a stream of unknown size."""
    if total is None:
        return MAX_SHARD_MB
    return float(min(MAX_SHARD_MB, max(1, round(total / 1e6 / 64))))


AGAIN = "the shards finished so far are kept; free some space and run the same command again"


def _atomic_write(path: Path, data: bytes) -> None:
    write_file(path, data, AGAIN)


def _units(docs: Iterator[Doc], unit_bytes: int) -> Iterator[list[Doc]]:
    """Consecutive documents, about ``unit_bytes`` at a time: the same units for the same source and size."""
    unit: list[Doc] = []
    size = 0
    for doc in docs:
        unit.append(doc)
        size += doc.size
        if size >= unit_bytes:
            yield unit
            unit, size = [], 0
    if unit:
        yield unit


_TOKENIZER: Optional[Tokenizer] = None


def _die_with(parent: int) -> None:
    """Ask Linux to SIGKILL this worker when its parent ends, however it ends (``kill -9`` included); otherwise a
    worker waits on the pool's queue forever, since its siblings keep the queue's pipe open. The kernel's
    ``PR_SET_PDEATHSIG`` is chosen over a thread polling ``os.getppid()``: it needs no Python to run, so a worker
    inside one long tokenizer call holding the GIL still dies at once. It fires when the thread that forked the
    worker ends: the pool is made with fork, whose workers the creating (main) thread forks all at once. A
    worker holds nothing to clean up: a unit's files are renamed into place only when whole."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the worker outlives a killed parent, as Python's pool does
        return
    if os.getppid() != parent:  # the parent ended before the request: no signal will come
        os._exit(1)


def _start_worker(spec: Any, parent: int) -> None:
    global _TOKENIZER
    _die_with(parent)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process a core: the pool is the parallelism
    _TOKENIZER = load_tokenizer(None) if spec is None else BPETokenizer.from_json(spec, "tokenizer")


def _encode_unit(index: int, unit: list[Doc], out: str, val_fraction: float, dtype: str) -> dict[str, Any]:
    """Tokenize one unit and write its shards; returns its record (what the manifest lists)."""
    tok = _TOKENIZER
    texts, sides = [], []
    for doc in unit:
        text = doc_text(doc)
        if text:
            texts.append(text)
            sides.append(in_val_split(doc.name, val_fraction))
    ids = tok.encode_batch(texts) if texts else []
    record: dict[str, Any] = {"unit": index, "documents": {"train": 0, "val": 0}, "bytes": {"train": 0, "val": 0}}
    folder = Path(out)
    for side, is_val in (("train", False), ("val", True)):
        parts = [a for a, v in zip(ids, sides) if v == is_val]
        record["documents"][side] = len(parts)
        record["bytes"][side] = sum(len(t.encode("utf-8")) for t, v in zip(texts, sides) if v == is_val)
        if not parts:
            continue
        tokens = join_documents(parts, tok.eos).astype(dtype, copy=False)
        name = f"{side}-{index:05d}.bin"
        data = tokens.tobytes()
        _atomic_write(folder / name, data)
        record[side] = {"file": name, "tokens": int(len(tokens)), CHECKSUM: shard_checksum(data)}
    _atomic_write(folder / UNITS / f"{index:05d}.json", json.dumps(record).encode())
    return record


def _check_out_outside(out: Path, path: Optional[str]) -> None:
    """Refuse an ``out`` at or inside the folder ``path`` reads. Refused rather than skipped when reading: the
    shards, manifest and records would otherwise be read as documents by this prepare's next run (a resume then
    reads other text than it began with), by ``loco tokenizer train`` and by a run on the same folder; telling
    loco's folders apart in every reader would make what a folder holds depend on what was prepared in it."""
    if not path or not Path(path).is_dir():
        return
    inside, outer = out.resolve(), Path(path).resolve()
    if inside == outer or outer in inside.parents:
        raise DataError(f"--out {out} is inside --path {path}: its shards would be read as text; "
                        f"name an --out outside it")


def _check_folder(out: Path, settings: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The finished manifest when ``out`` was prepared with these settings; None to (continue to) prepare it.
    A folder begun with other settings, or one that is not a prepare folder, is an error."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise DataError(f"{out}: --out names a file, not a folder")
    saved = out / SETTINGS
    if not saved.exists():
        if any(out.iterdir()):
            raise DataError(f"{out}: not empty and not a folder loco data prepare began; name a new --out")
        return None
    try:
        before = json.loads(saved.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{saved}: unreadable ({e}); remove the folder to prepare again") from None
    differ = [k for k in sorted(set(before) | set(settings)) if before.get(k) != settings.get(k)]
    if differ:
        k = differ[0]
        raise DataError(f"{out}: begun with other settings ({k}: {before.get(k)!r}, now {settings.get(k)!r}); "
                        f"continue it with the same ones, or name a new --out")
    if (out / MANIFEST).exists():
        return json.loads((out / MANIFEST).read_text())
    return None


def prepare(source: str, path: Optional[str], tokenizer: str, out: str, *, pattern: str = "**/*",
            val_fraction: float = 0.01, max_docs: Optional[int] = None, hf: Optional[HFOptions] = None,
            shard_mb: Optional[float] = None, workers: Optional[int] = None,
            say: Callable[[str], None] = print) -> dict[str, Any]:
    """Tokenize a source into ``out``; returns the manifest. Resumes an interrupted folder."""
    folder = Path(out)
    _check_out_outside(folder, path)
    tok = load_tokenizer(tokenizer)
    hf = hf or HFOptions()
    where, docs, total = documents(source, path, pattern, max_docs, hf)
    shard_mb = shard_mb or auto_shard_mb(total)
    settings = {"source": source, "path": str(Path(path).resolve()) if path and Path(path).exists() else path,
                "pattern": pattern, "val_fraction": val_fraction, "max_docs": max_docs,
                "hf": vars(hf) if source == "hf" else None, "tokenizer_sha256": tok.sha256 or tok.name,
                "shard_mb": shard_mb}
    done = _check_folder(folder, settings)
    if done is not None:
        say(f"{folder}: already prepared ({done['tokens']['train']:,} train / {done['tokens']['val']:,} val tokens)")
        return done
    (folder / UNITS).mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / SETTINGS, json.dumps(settings, indent=1).encode())
    if isinstance(tok, BPETokenizer):
        tok.save(folder / TOKENIZER_FILE)
    dtype = shard_dtype(tok.vocab_size)
    workers = workers or len(os.sched_getaffinity(0))
    records: dict[int, dict[str, Any]] = {}
    for f in (folder / UNITS).glob("*.json"):
        rec = json.loads(f.read_text())
        if all((folder / rec[s]["file"]).exists() for s in ("train", "val") if s in rec):
            records[rec["unit"]] = rec
    resumed = len(records)
    progress = _Progress(say, total, resumed)
    spec = tok.json if isinstance(tok, BPETokenizer) else None
    pending: set[Future] = set()
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"),
                             initializer=_start_worker, initargs=(spec, os.getpid())) as pool:
        for index, unit in enumerate(_units(docs, int(shard_mb * 1e6))):
            if index in records:
                progress.skipped(sum(d.size for d in unit))
                continue
            if len(pending) >= 2 * workers:  # bounded: a streamed source is never read far ahead
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    progress.add(fut.result(), records)
            pending.add(pool.submit(_encode_unit, index, unit, str(folder), val_fraction, dtype))
        for fut in pending:
            progress.add(fut.result(), records)
    if not records:
        raise DataError(f"{where}: no documents with text")
    manifest = _manifest(records, tok, dtype, settings, where)
    if manifest["tokens"]["train"] == 0:
        raise DataError(f"{where}: every document fell in the validation split; lower --val-fraction")
    _atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    progress.close(manifest)
    return manifest


def _manifest(records: dict[int, dict[str, Any]], tok: Tokenizer, dtype: str, settings: dict[str, Any],
              where: str) -> dict[str, Any]:
    ordered = [records[i] for i in sorted(records)]
    shards = {s: [r[s] for r in ordered if s in r] for s in ("train", "val")}
    return {
        "format": MANIFEST_FORMAT,
        "tokenizer": {"name": tok.name, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos": tok.eos,
                      "file": TOKENIZER_FILE if isinstance(tok, BPETokenizer) else None},
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "source": {**settings, "description": where},
        "documents": {s: sum(r["documents"][s] for r in ordered) for s in ("train", "val")},
        "bytes": {s: sum(r["bytes"][s] for r in ordered) for s in ("train", "val")},
        "tokens": {s: sum(x["tokens"] for x in shards[s]) for s in ("train", "val")},
        "shards": shards,
    }


class _Progress:
    """The progress line of a prepare: shards, tokens, tokens per second."""

    def __init__(self, say: Callable[[str], None], total: Optional[int], resumed: int) -> None:
        self.say, self.total, self.resumed = say, total, resumed
        self.ticker = Ticker(say)
        self.tokens = self.units = 0
        self.read = 0  # bytes of text behind finished units, skipped ones included
        if resumed:
            say(f"continuing: {resumed} shard(s) already prepared")

    def skipped(self, size: int) -> None:
        self.read += size

    def add(self, rec: dict[str, Any], records: dict[int, dict[str, Any]]) -> None:
        records[rec["unit"]] = rec
        self.units += 1
        self.tokens += sum(rec[s]["tokens"] for s in ("train", "val") if s in rec)
        self.read += rec["bytes"]["train"] + rec["bytes"]["val"]
        if (seconds := self.ticker.due()) is not None:
            share = f" ({100 * self.read / self.total:.0f}% of the text)" if self.total else ""
            self.ticker.show(f"{self.units + self.resumed} shard(s){share}: {self.tokens / 1e6:,.1f}M tokens, "
                             f"{self.tokens / max(seconds, 1e-9) / 1e6:.2f}M tokens/s")

    def close(self, manifest: dict[str, Any]) -> None:
        took = self.ticker.close()
        self.say(f"{manifest['tokens']['train']:,} train / {manifest['tokens']['val']:,} val tokens from "
                 f"{manifest['documents']['train'] + manifest['documents']['val']:,} documents in "
                 f"{len(manifest['shards']['train']) + len(manifest['shards']['val'])} shard(s), "
                 f"{manifest['dtype']}; {self.tokens / max(took, 1e-9) / 1e6:.2f}M tokens/s")

