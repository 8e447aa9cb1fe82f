"""Token data for training: the splits a ``DataConfig`` names (:func:`load_data`), and the batches cut from them.

A :class:`Batcher` cuts a split into windows of ``seq_len + 1`` tokens, shuffles
the windows per epoch from the seed, and hands worker ``w`` of ``W`` its own
block of every global batch: at worker step ``t`` the rows are global samples
``(t * W + w) * B ... + B - 1``. So the workers never share a sample, the union
of all workers' batches at a step is the batch a single worker with ``W * B``
rows would see, and a batch depends only on the step, which makes resume exact.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

from launch.data.sources import load_hf, load_stdlib, load_text
from launch.data.documents import HFOptions
from launch.data.python_corpus import load_python
from launch.data.shards import load_shards
from launch.data.stream import StreamBatcher, load_stream
from launch.data.tokens import EOS, DataError, TokenData, Windows, check_ids, join_documents
from launch.data.ticker import Ticker
from launch.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


def load_data(dcfg, tokenizer: Optional[Tokenizer] = None, val_only: bool = False) -> TokenData:
    """Build the splits named by a ``DataConfig``, in the run's tokens (``data.tokenizer``; ``tokenizer``, where
    given, stands for it: a model scored on text in its own tokens). ``val_only``: the training split of text
    sources is left unencoded and empty (scoring reads only the validation split)."""
    named = tokenizer is not None or bool(dcfg.tokenizer)
    tokenizer = tokenizer or load_tokenizer(dcfg.tokenizer)
    hf = HFOptions(dcfg.hf_name, dcfg.hf_split, dcfg.hf_text_field, dcfg.hf_data_files)
    if dcfg.streaming:
        data = load_stream(dcfg.path, hf, tokenizer, dcfg.val_docs, dcfg.max_docs, dcfg.bad_text)
    elif dcfg.source == "shards":
        data = load_shards(dcfg.path, dcfg.val_path, dcfg.dtype, dcfg.vocab_size, dcfg.val_fraction,
                           tokenizer if named else None)
    else:
        raw = _load_bytes(dcfg, hf)
        if val_only:
            raw = TokenData([], raw.val, raw.vocab_size, raw.tokenizer, raw.description)
        data = encoded(raw, tokenizer)
    for split_name, split in (("train", data.train), ("validation", data.val)):
        if (data.stream is not None or val_only) and split_name == "train":
            continue
        if sum(max(0, len(a) - 1) // dcfg.seq_len for a in split) == 0:
            raise DataError(f"{data.description}: the {split_name} split has fewer than data.seq_len+1={dcfg.seq_len + 1} tokens")
    return data


def _load_bytes(dcfg, hf: HFOptions) -> TokenData:
    if dcfg.source == "stdlib":
        data = load_stdlib(dcfg.val_fraction, dcfg.max_docs)
    elif dcfg.source == "python":
        data = load_python(dcfg.val_fraction, dcfg.max_docs)
    elif dcfg.source == "text":
        data = load_text(dcfg.path, dcfg.val_path, dcfg.pattern, dcfg.val_fraction, dcfg.max_docs,
                         dcfg.bad_text)
    elif dcfg.source == "hf":
        data = load_hf(dcfg.path, hf, dcfg.val_fraction, dcfg.max_docs, dcfg.bad_text)
    else:
        raise DataError(f"data.source: unknown source {dcfg.source!r}")
    return data


LARGE_TEXT = 64_000_000  # bytes of text whose encoding at start is announced and followed by a progress line
ENCODE_BYTES = 8_000_000  # text encoded between two looks at the progress line


def encoded(data: TokenData, tokenizer: Tokenizer) -> TokenData:
    """Byte documents (each ending in byte 0) in ``tokenizer``'s ids; byte-level data as it is."""
    if isinstance(tokenizer, ByteTokenizer):
        return data
    size = sum(len(a) for a in data.train + data.val)
    progress = _EncodeProgress(size, tokenizer) if size > LARGE_TEXT else None
    splits = []
    for arrays in (data.train, data.val):
        out = []
        for a in arrays:
            ends = np.flatnonzero(np.asarray(a) == EOS)
            starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else np.zeros(0, dtype=np.int64)
            texts = [bytes(a[s:e]).decode("utf-8", errors="replace") for s, e in zip(starts, ends)]
            if len(ends) == 0 or ends[-1] != len(a) - 1:  # a tail without its separator (a cut document)
                texts.append(bytes(a[(ends[-1] + 1) if len(ends) else 0:]).decode("utf-8", errors="replace"))
            parts = []
            for first, last in _runs(texts, ENCODE_BYTES):
                parts.extend(tokenizer.encode_batch(texts[first:last]))
                if progress:
                    progress.add(sum(len(t) + 1 for t in texts[first:last]), parts[-(last - first):])
            out.append(join_documents(parts, tokenizer.eos, closed=len(ends) > 0 and ends[-1] == len(a) - 1))
        splits.append(out)
    result = TokenData(splits[0], splits[1], tokenizer.vocab_size, tokenizer,
                       f"{data.description}, encoded with {tokenizer.describe()}")
    if progress:
        progress.close(result)
    return result


def _runs(texts: Sequence[str], size: int) -> list[tuple[int, int]]:
    """``texts`` cut into consecutive runs of about ``size`` characters, as (first, end) indices."""
    runs, first, total = [], 0, 0
    for i, t in enumerate(texts):
        total += len(t)
        if total >= size:
            runs.append((first, i + 1))
            first, total = i + 1, 0
    if first < len(texts):
        runs.append((first, len(texts)))
    return runs


class _EncodeProgress:
    """What a run encoding a large text at start says on stderr: what it does, how far it is (the progress line
    of ``loco data prepare``), and the tokens it made."""

    def __init__(self, size: int, tokenizer: Tokenizer) -> None:
        self.size, self.done, self.tokens = size, 0, 0
        self.ticker = Ticker(self.say)
        self.say(f"encoding {size / 1e6:,.0f} MB of text with {tokenizer.describe()} (loco data prepare does it "
                 f"once for every run)")

    @staticmethod
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def add(self, chars: int, parts: Sequence[np.ndarray]) -> None:
        self.done += chars  # characters, about the bytes for the mostly ASCII text of code and the web
        self.tokens += sum(len(p) for p in parts)
        if (seconds := self.ticker.due()) is not None:
            self.ticker.show(f"encoding: {100 * self.done / self.size:.0f}% of the text, "
                             f"{self.tokens / 1e6:,.1f}M tokens, {self.done / 1e6 / max(seconds, 1e-9):.1f} MB/s")

    def close(self, data: TokenData) -> None:
        took = self.ticker.close()
        self.say(f"encoded {self.size / 1e6:,.0f} MB of text into {data.train_tokens:,} train / "
                 f"{data.val_tokens:,} val tokens in {took:.0f}s")


def one_block(x: torch.Tensor, y: torch.Tensor) -> Optional[torch.Tensor]:
    """The contiguous ``(B, T + 1)`` block whose ``[:, :-1]`` is ``x`` and ``[:, 1:]`` is ``y`` (as the batcher cuts
    inputs and targets), or None."""
    block = x._base
    if (block is None or y._base is not block or block.dim() != 2 or not block.is_contiguous()
            or x.shape != (block.shape[0], block.shape[1] - 1) or y.shape != x.shape):
        return None
    if x.data_ptr() != block.data_ptr() or y.data_ptr() != block.data_ptr() + block.element_size():
        return None
    return block


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch on ``device``. On a GPU it goes from pinned memory, so the copy does not wait for the queued
    kernels; a pinned tensor keeps its strides, and a strided one would be staged through pageable memory (a copy
    the host waits for). Batches and validation windows are cut as inputs and targets from one block one token
    longer: that block goes over once, whole, and is cut again on the device."""
    if device.type != "cuda":
        return x.to(device), y.to(device)
    block = one_block(x, y)
    if block is not None:
        on = block.pin_memory().to(device, non_blocking=True)
        return on[:, :-1], on[:, 1:]
    return x.contiguous().pin_memory().to(device, non_blocking=True), \
        y.contiguous().pin_memory().to(device, non_blocking=True)


class Batches(Protocol):
    """What the loop asks of a worker's batches, from arrays (:class:`Batcher`) or a stream (``StreamBatcher``)."""

    #: whether a checkpoint must carry the batcher's position (a stream's), or the step alone places it
    keeps_position: bool
    #: the validation split's windows (:mod:`launch.eval.validation` picks the scored ones)
    val: Windows

    def samples_before(self, step: int) -> int: ...

    def train_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> Optional[dict[str, Any]]: ...

    def load_state_dict(self, position: Optional[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def make_batcher(data: TokenData, seq_len: int, batch_size: int, worker_index: int = 0, num_workers: int = 1,
                 seed: int = 0, grad_accum: int = 1) -> "Batcher | StreamBatcher":
    """A worker's batcher: windows cut from splits held in memory or on disk, or read from a stream."""
    if data.stream is not None:
        return StreamBatcher(data, seq_len, batch_size, worker_index, num_workers, grad_accum)
    return Batcher(data, seq_len, batch_size, worker_index, num_workers, seed, grad_accum)


class Batcher:
    """Deterministic batches for one worker: a pure function of (step, micro-batch)."""

    FULL_PERMUTATION_LIMIT = 1 << 24
    keeps_position = False  # the step places every batch

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
        check_ids(rows, self.vocab_size, self.description, where)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def train_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.samples_before(step) + micro * self.micro
        return self._stack(self.train, [self._window_index(s) for s in range(start, start + self.micro)], "training")

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, position: Optional[dict[str, Any]]) -> None:
        """Nothing to take: the step places every batch."""

    def close(self) -> None:
        """Nothing to stop: the windows are read as asked."""


__all__ = ["Batcher", "Batches", "Windows", "encoded", "load_data", "make_batcher", "one_block", "to_device"]
