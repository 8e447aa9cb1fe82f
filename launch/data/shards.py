"""Token shards (``data.source: shards``): a folder ``loco data prepare`` made, with its ``manifest.json``, or
plain ``.bin``/``.npy`` files (llm.c's header too) whose vocabulary the run names.

A manifest names everything a run needs: the shards of each split, their dtype, the vocabulary and the
tokenizer (its SHA-256, and its file beside the shards). A run whose ``data.tokenizer`` names another
tokenizer is refused: its ids would mean other text.

Each shard's entry holds its token count and, where ``loco data prepare`` recorded one, the XXH3-64 of its bytes.
Every load compares each shard's size with its count (a stat, cheap at any size); ``loco data verify`` reads every
byte and compares the checksums too, which a start cannot afford on large data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import xxhash

from launch.data.ticker import Ticker
from launch.data.tokens import DataError, TokenData, in_val_split
from launch.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

LLMC_MAGIC = 20240520  # llm.c token shards: 256 int32 header, then uint16 tokens
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "loco-shards-1"
TOKENIZER_FILE = "tokenizer.json"
CHECKSUM = "xxh3_64"  # a shard entry's key: the XXH3-64 of the shard's bytes, in hex
AGAIN = "copy it again or run loco data prepare again"


def shard_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_checksum(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


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
            raise DataError(f"{path}: size {path.stat().st_size} is not a multiple of {np.dtype(np_dtype).itemsize} "
                            f"({np_dtype.__name__}); check data.dtype")
        return np.memmap(path, dtype=np_dtype, mode="r")
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read token shard: {e}") from None


def _shard_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"{path}: no such file or folder (data.path)")
    files = sorted(p for p in path.iterdir() if p.suffix in (".bin", ".npy") and not p.name.startswith("."))
    if not files:
        raise DataError(f"{path}: no .bin or .npy token shards in this folder")
    return files


def read_manifest(path: Path) -> Optional[dict[str, Any]]:
    """The manifest of a shard folder, or None where there is none."""
    f = path / MANIFEST if path.is_dir() else None
    if f is None or not f.exists():
        return None
    try:
        manifest = json.loads(f.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        for key in ("vocab_size", "dtype", "shards", "tokenizer"):
            if key not in manifest:
                raise ValueError(f"no {key!r}")
        if manifest["dtype"] not in ("uint16", "uint32"):
            raise ValueError(f"dtype {manifest['dtype']!r}, expected uint16 or uint32")
        for side in ("train", "val"):
            if not isinstance(manifest["shards"].get(side), list):
                raise ValueError(f"no list of {side} shards")
    except (OSError, ValueError) as e:
        raise DataError(f"{f}: not a loco shard manifest ({e})") from None
    return manifest


def _entry(folder: Path, entry: Any) -> tuple[Path, int]:
    """A manifest's shard entry as its file and its token count."""
    if (not isinstance(entry, dict) or not isinstance(entry.get("file"), str)
            or type(entry.get("tokens")) is not int or entry["tokens"] < 0):
        raise DataError(f"{folder / MANIFEST}: a shard entry without a file and a token count ({entry!r}); "
                        f"run loco data prepare again")
    return folder / entry["file"], entry["tokens"]


def size_problem(path: Path, tokens: int, itemsize: int) -> Optional[str]:
    """What is wrong with a shard's size for the manifest's token count; None when it is that count's."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing, the manifest says {tokens:,} tokens"
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror}), the manifest says {tokens:,} tokens"
    if size == tokens * itemsize:
        return None
    extra = f" and {size % itemsize} byte" if size % itemsize else ""
    return f"{path}: {size // itemsize:,} tokens{extra} on disk, the manifest says {tokens:,}"


def manifest_tokenizer(folder: Path, manifest: dict[str, Any]) -> Tokenizer:
    info = manifest["tokenizer"]
    if info.get("file"):
        return BPETokenizer.from_file(folder / info["file"])
    return ByteTokenizer()


def _tail_split(arrays: list[np.ndarray], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every shard trains but the last one's tail, which validates."""
    *first, last = arrays
    cut = int(len(last) * (1 - fraction))
    return first + [last[:cut]], [last[cut:]]


def load_shards(path: str, val_path: Optional[str], dtype: str, vocab_size: Optional[int], fraction: float,
                tokenizer: Optional[Tokenizer] = None) -> TokenData:
    """Shards with a manifest take their vocabulary, dtype and tokenizer from it; ``tokenizer`` (the run's
    ``data.tokenizer``, when set) must be the manifest's. Shards without one need ``vocab_size``."""
    folder = Path(path)
    manifest = read_manifest(folder)
    if manifest is not None:
        return _load_manifest(folder, manifest, val_path, vocab_size, fraction, tokenizer)
    if not vocab_size:
        raise DataError(f"{path}: no {MANIFEST} and no data.vocab_size: name the vocabulary of these token ids, "
                        f"or make the shards with loco data prepare")
    files = _shard_files(folder)
    arrays = [(f.name, open_shard(f, dtype)) for f in files]
    if val_path:
        train = [a for _, a in arrays]
        val = [open_shard(f, dtype) for f in _shard_files(Path(val_path))]
    elif len(arrays) == 1 or len({in_val_split(n, fraction) for n, _ in arrays}) == 1:  # all on one side: cut the tail
        train, val = _tail_split([a for _, a in arrays], fraction)
    else:
        train = [a for n, a in arrays if not in_val_split(n, fraction)]
        val = [a for n, a in arrays if in_val_split(n, fraction)]
    return TokenData(train, val, vocab_size, tokenizer, f"token shards {path} ({len(files)} files)")


def _load_manifest(folder: Path, manifest: dict[str, Any], val_path: Optional[str], vocab_size: Optional[int],
                   fraction: float, tokenizer: Optional[Tokenizer]) -> TokenData:
    where = folder / MANIFEST
    info = manifest["tokenizer"]
    if tokenizer is not None and (tokenizer.sha256 or tokenizer.name) != (info.get("sha256") or info.get("name")):
        raise DataError(f"{where}: made with tokenizer {info.get('name')} (sha256 {str(info.get('sha256'))[:12]}), "
                        f"but data.tokenizer is {tokenizer.describe()}; use the manifest's tokenizer or prepare again")
    if vocab_size and vocab_size != manifest["vocab_size"]:
        raise DataError(f"{where}: vocab_size {manifest['vocab_size']}, but data.vocab_size is {vocab_size}; "
                        f"leave data.vocab_size empty to take the manifest's")
    tok = tokenizer or manifest_tokenizer(folder, manifest)
    dtype = manifest["dtype"]
    itemsize = np.dtype(dtype).itemsize

    def opened(entry: Any) -> np.ndarray:
        file, tokens = _entry(folder, entry)
        if (problem := size_problem(file, tokens, itemsize)) is not None:  # a half-copied shard would train quietly
            raise DataError(f"{problem}; {AGAIN}")
        return open_shard(file, dtype)

    train = [opened(s) for s in manifest["shards"]["train"]]
    val = [opened(s) for s in manifest["shards"]["val"]]
    if val_path:
        train += val
        val = [open_shard(f, dtype) for f in _shard_files(Path(val_path))]
    elif not val:  # no document fell in validation: the last shard's tail validates
        train, val = _tail_split(train, fraction)
    if not train:
        raise DataError(f"{where}: lists no training shards")
    docs = manifest.get("documents", {})
    return TokenData(train, val, int(manifest["vocab_size"]), tok,
                     f"token shards {folder} ({len(train)} + {len(val)} shards, "
                     f"{sum(docs.values()) if docs else '?'} documents, tokenizer {tok.describe()})")


def verify_shards(path: str, say: Callable[[str], None] = print) -> bool:
    """``loco data verify``: every shard a manifest lists, its size against its token count and its bytes against
    its checksum; one line per bad shard, then a summary. True when every shard matches."""
    folder = Path(path)
    manifest = read_manifest(folder)
    if manifest is None:
        raise DataError(f"{folder}: no {MANIFEST}; loco data verify checks a folder loco data prepare made")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    entries = [(*_entry(folder, e), e.get(CHECKSUM)) for side in ("train", "val") for e in manifest["shards"][side]]
    progress = _Reading(say, sum(tokens * itemsize for _, tokens, _ in entries), len(entries))
    bad = unknown = 0
    for file, tokens, expected in entries:
        problem = size_problem(file, tokens, itemsize)
        if problem is None and expected is None:
            unknown += 1
        elif problem is None:
            problem = progress.check(file, expected)
        progress.done(tokens * itemsize)
        if problem is not None:
            bad += 1
            progress.say(problem)
    progress.close()
    tokens = sum(t for _, t, _ in entries)
    unsummed = "their checksums unknown (the manifest records none)"
    if bad:
        by_size = f"; {unknown} checked by size only, {unsummed}" if unknown else ""
        say(f"{folder}: {bad} of {len(entries)} shard(s) differ from the manifest; copy them again or run "
            f"loco data prepare again{by_size}")
    elif unknown:
        which = "all" if unknown == len(entries) else f"{unknown} of them"
        say(f"{folder}: {len(entries)} shard(s), {tokens:,} tokens, match the manifest; {which} by size only, "
            f"{unsummed}")
    else:
        say(f"{folder}: {len(entries)} shard(s), {tokens:,} tokens, match the manifest (sizes and checksums)")
    return bad == 0


class _Reading:
    """The progress line of a verify: shards and bytes read, and how fast."""

    CHUNK = 16 << 20

    def __init__(self, say: Callable[[str], None], total: int, shards: int) -> None:
        self.ticker, self.total, self.shards = Ticker(say), total, shards
        self.finished = self.passed = self.read = 0  # passed: bytes of finished shards, read or not
        self.shown = False
        self.buffer = bytearray(self.CHUNK)

    def check(self, path: Path, expected: str) -> Optional[str]:
        """What is wrong with a shard's bytes for the manifest's checksum; None when they hash to it."""
        h = xxhash.xxh3_64()
        view = memoryview(self.buffer)
        got = 0
        try:
            with open(path, "rb") as fh:
                while n := fh.readinto(view):
                    h.update(view[:n])
                    got += n
                    self.read += n
                    self.tick(got)
        except OSError as e:
            return f"{path}: cannot read it ({e.strerror})"
        if h.hexdigest() != expected:
            return f"{path}: checksum {h.hexdigest()} on disk, the manifest says {expected}"
        return None

    def tick(self, within: int = 0) -> None:
        if (seconds := self.ticker.due()) is not None:
            self.shown = True
            self.ticker.show(f"{self.finished} of {self.shards} shard(s), {(self.passed + within) / 1e9:,.2f} of "
                             f"{self.total / 1e9:,.2f} GB: {self.read / max(seconds, 1e-9) / 1e6:,.0f} MB/s")

    def done(self, size: int) -> None:
        self.finished += 1
        self.passed += size
        self.tick()

    def say(self, line: str) -> None:
        if self.ticker.live and self.shown:  # the line in place ends first, so that this one starts a line
            print(file=sys.stderr)
            self.shown = False
        self.ticker.say(line)

    def close(self) -> None:
        if self.shown:
            self.ticker.close()
