"""Token data: every source becomes two *splits* (train, validation), each a list of 1-D token arrays (one per
file or shard; memory-mapped where the source is on disk).

Text sources read bytes (vocabulary 256; byte 0 separates documents); a run with a BPE tokenizer encodes those
documents again (:func:`launch.data.batches.load_data`). Documents
are split between training and validation by their names, so the same corpus always splits alike.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

BYTE_VOCAB = 256
EOS = 0  # NUL never appears in text files, so it marks document boundaries


class DataError(ValueError):
    """A data source that cannot be used; the message names the file or key."""


@dataclass
class TokenData:
    train: list[np.ndarray]
    val: list[np.ndarray]
    vocab_size: int
    tokenizer: Any  # a launch.data.tokenizer.Tokenizer, or None for token ids without one
    description: str
    stream: Any = None  # a launch.data.stream.StreamSpec: the training split is read as it is needed (train is empty)

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


def in_val_split(name: str, fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < fraction * 10_000


def split_documents(docs: list[tuple[str, np.ndarray]], fraction: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
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
    return [join_documents(train)], [join_documents(val)]


def _val_indices(names: Sequence[str], fraction: float) -> set[int]:
    """Indices of the validation documents among two or more: by name, never none and never all."""
    val_idx = {i for i, name in enumerate(names) if in_val_split(name, fraction)}
    if not val_idx:
        val_idx = {len(names) - 1}
    if len(val_idx) == len(names):
        val_idx.discard(0)
    return val_idx


def join_documents(parts: Sequence[np.ndarray], eos: int = EOS, closed: bool = True) -> np.ndarray:
    """``parts`` one after another, each followed by ``eos`` (the last one only when ``closed``), in their dtype."""
    dtype = parts[0].dtype if len(parts) else np.uint8
    out = np.empty(sum(len(a) + 1 for a in parts) - (0 if closed or not len(parts) else 1), dtype=dtype)
    pos = 0
    for a in parts:
        out[pos:pos + len(a)] = a
        pos += len(a)
        if pos < len(out):
            out[pos] = eos
            pos += 1
    return out


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


def check_ids(rows: np.ndarray, vocab_size: int, description: str, where: str) -> None:
    """Refuse token ids outside ``[0, vocab_size)`` in one line naming the data and the split."""
    top, bottom = int(rows.max()), int(rows.min())
    if top >= vocab_size or bottom < 0:
        bad = top if top >= vocab_size else bottom
        raise DataError(f"{description}: token id {bad} in the {where} data is outside [0, vocab_size="
                        f"{vocab_size}); check data.vocab_size / data.dtype")
