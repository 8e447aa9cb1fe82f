"""Streamed Hugging Face datasets (``data.source: hf`` with ``data.streaming: true``): bounded memory whatever
the dataset's size.

The first ``data.val_docs`` documents of the stream are the validation split, the same for every worker. The
documents after them are dealt out in turn: worker ``w`` of ``W`` trains on documents ``w, w + W, ...``. A
background thread reads this worker's documents, tokenizes them with the run's tokenizer and cuts them into
windows of ``seq_len + 1`` tokens, a few micro-batches ahead of the loop. When the stream ends it starts again
(a new epoch). The *position* after each micro-batch (epoch, document, row, token offset in it) is what a
checkpoint keeps, so a resumed run reads the very tokens an unbroken one would.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from launch.data.documents import BadText, HFOptions, stream_texts
from launch.data.tokens import DataError, TokenData, Windows, join_documents

AHEAD = 4  # micro-batches the reader keeps ready
BATCH_DOCS = 64  # documents tokenized together (one encode_batch call)


@dataclass
class StreamSpec:
    path: str
    opts: HFOptions
    tokenizer: Any
    val_docs: int
    max_docs: Optional[int] = None  # documents (validation ones included) read of the stream before it starts again
    bad_text: str = "error"  # data.bad_text: a line of a local jsonl file that is not UTF-8


def load_stream(path: str, opts: HFOptions, tokenizer: Any, val_docs: int, max_docs: Optional[int] = None,
                bad_text: str = "error") -> TokenData:
    """The validation documents (read now) and what the batchers read the rest with. Lines left out by
    data.bad_text=skip are told now for the lines read so far, and by worker 0 at the end of each pass."""
    bad = BadText(bad_text)
    texts: list[str] = []
    for _, text in stream_texts(path, opts, bad):
        texts.append(text)
        if len(texts) == val_docs + 1:  # one more: the stream has something to train on
            break
    bad.say(" in the rows read at load")
    if len(texts) <= val_docs:
        raise DataError(f"{path}: the stream has {len(texts)} documents, so none are left to train on after "
                        f"data.val_docs={val_docs}")
    val = join_documents(tokenizer.encode_batch(texts[:val_docs]), tokenizer.eos)
    spec = StreamSpec(path, opts, tokenizer, val_docs, max_docs, bad_text)
    return TokenData([], [val], tokenizer.vocab_size, tokenizer,
                     f"streamed Hugging Face dataset {path} (the first {val_docs} documents validate)", stream=spec)


class _Stop(Exception):
    pass


def share_docs(spec: StreamSpec, share: int, shares: int, position: Optional[dict[str, int]],
               stopped: Optional[threading.Event] = None) -> Iterator[tuple[int, int, int, np.ndarray, int]]:
    """(epoch, document, row, tokens with their EOS, tokens already used) of one share, from ``position``,
    epoch after epoch."""
    epoch = position["epoch"] if position else 0
    while True:
        first = position is not None and position["epoch"] == epoch
        start_row = position["row"] if first else 0
        doc = position["doc"] if first else -spec.val_docs  # the validation documents come first, below 0
        found = False
        batch: list[tuple[int, int, str]] = []
        bad = BadText(spec.bad_text)
        for row, text in stream_texts(spec.path, spec.opts, bad, start_row):
            if stopped is not None and stopped.is_set():
                raise _Stop
            if spec.max_docs and doc + spec.val_docs >= spec.max_docs:
                break
            if doc >= 0 and doc % shares == share:
                batch.append((doc, row, text))
            doc += 1
            if len(batch) == BATCH_DOCS:
                yield from _encoded(spec.tokenizer, epoch, batch, position if first else None)
                batch, found = [], True
        if batch:
            yield from _encoded(spec.tokenizer, epoch, batch, position if first else None)
            found = True
        if share == 0:  # every share reads every line: one of them tells
            bad.say(f" in pass {epoch + 1} of the stream")
        if not found and not first:
            raise DataError(f"{spec.path}: worker {share} of {shares} has no documents to train on (the stream has "
                            f"fewer than data.val_docs + {shares} = {spec.val_docs + shares} documents)")
        epoch += 1


def _encoded(tok: Any, epoch: int, batch: list[tuple[int, int, str]],
             position: Optional[dict[str, int]]) -> Iterator[tuple[int, int, int, np.ndarray, int]]:
    for (doc, row, _), ids in zip(batch, tok.encode_batch([t for _, _, t in batch])):
        tokens = np.empty(len(ids) + 1, dtype=np.int64)
        tokens[:-1] = ids
        tokens[-1] = tok.eos
        used = position["offset"] if position is not None and doc == position["doc"] else 0
        yield epoch, doc, row, tokens, used


class StreamReader:
    """This share's micro-batches, in order, from a position; a daemon thread fills a short queue."""

    def __init__(self, spec: StreamSpec, need: int, rows: int, share: int, shares: int,
                 position: Optional[dict[str, int]]) -> None:
        self.spec, self.need, self.rows, self.share, self.shares = spec, need, rows, share, shares
        self.queue: queue.Queue = queue.Queue(maxsize=AHEAD)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(position,), name="loco-stream", daemon=True)
        self.thread.start()

    def next(self) -> tuple[np.ndarray, dict[str, int]]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stopped.set()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.05)
            except queue.Empty:
                pass

    def _put(self, item: Any) -> None:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        raise _Stop

    def _run(self, position: Optional[dict[str, int]]) -> None:
        try:
            block = np.empty((self.rows, self.need), dtype=np.int64)
            filled, row_i = 0, 0
            for epoch, doc, row, tokens, used in share_docs(self.spec, self.share, self.shares, position,
                                                            self.stopped):
                while used < len(tokens):
                    take = min(self.need - filled, len(tokens) - used)
                    block[row_i, filled:filled + take] = tokens[used:used + take]
                    filled, used = filled + take, used + take
                    if filled == self.need:
                        filled, row_i = 0, row_i + 1
                        if row_i == self.rows:
                            self._put((block, {"epoch": epoch, "doc": doc, "row": row, "offset": used}))
                            block, row_i = np.empty((self.rows, self.need), dtype=np.int64), 0
        except _Stop:
            return
        except BaseException as e:  # the loop raises it at its next batch
            try:
                self._put(e)
            except _Stop:
                return


class StreamBatcher:
    """A worker's batches from a stream: ``train_batch`` hands out the next micro-batch (the loop asks for them in
    order); ``state_dict`` is the position after the last one handed out."""

    keeps_position = True

    def __init__(self, data: TokenData, seq_len: int, batch_size: int, worker_index: int = 0,
                 num_workers: int = 1, grad_accum: int = 1) -> None:
        self.spec: StreamSpec = data.stream
        self.val = Windows(data.val, seq_len)
        self.vocab_size, self.description = data.vocab_size, data.description
        self.seq_len, self.batch_size, self.micro = seq_len, batch_size, batch_size // grad_accum
        self.worker_index, self.num_workers = worker_index, num_workers
        self.position: Optional[dict[str, int]] = None  # None: the start of the stream
        self.reader: Optional[StreamReader] = None

    def samples_before(self, step: int) -> int:
        return (step * self.num_workers + self.worker_index) * self.batch_size

    def train_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reader is None:
            self.reader = StreamReader(self.spec, self.seq_len + 1, self.micro, self.worker_index, self.num_workers,
                                       self.position)
        block, self.position = self.reader.next()
        t = torch.from_numpy(block)
        return t[:, :-1], t[:, 1:]

    def state_dict(self) -> Optional[dict[str, int]]:
        return dict(self.position) if self.position is not None else None

    def load_state_dict(self, position: Optional[dict[str, int]]) -> None:
        self.close()
        self.position = dict(position) if position is not None else None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
