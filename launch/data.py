"""Token data for training: the splits a ``DataConfig`` names (:func:`load_data`), and the batches cut from them.

A :class:`Batcher` cuts a split into windows of ``seq_len + 1`` tokens, shuffles
the windows per epoch from the seed, and hands worker ``w`` of ``W`` its own
block of every global batch: at worker step ``t`` the rows are global samples
``(t * W + w) * B ... + B - 1``. So the workers never share a sample, the union
of all workers' batches at a step is the batch a single worker with ``W * B``
rows would see, and a batch depends only on the step, which makes resume exact.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from launch.data_sources import load_hf, load_shards, load_stdlib, load_text
from launch.python_corpus import load_python
from launch.token_data import DataError, TokenData


def load_data(dcfg) -> TokenData:
    """Build the splits named by a ``DataConfig``."""
    if dcfg.source == "stdlib":
        data = load_stdlib(dcfg.val_fraction, dcfg.max_docs)
    elif dcfg.source == "python":
        data = load_python(dcfg.val_fraction, dcfg.max_docs)
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


__all__ = ["Batcher", "Windows", "load_data"]
