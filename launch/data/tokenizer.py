"""A run's tokenizer: ``bytes`` (UTF-8 bytes, 256 ids, id 0 ends a document) or a Hugging Face ``tokenizers``
JSON file (a byte-level BPE that ``loco tokenizer train`` makes, or any other).

A tokenizer is named by the SHA-256 of its canonical JSON (``Tokenizer.to_str()``), so a file saved again or
embedded in a checkpoint keeps its name. It travels with the run: the run folder holds a copy, and every
checkpoint holds its JSON, so a checkpoint moved to another machine still encodes and decodes text.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from launch.store.disk import write_file
from launch.data.ticker import Ticker
from launch.data.tokens import BYTE_VOCAB, EOS, DataError

ENCODE_CHUNK = 256  # texts per encode_batch call
# the end-of-document tokens of common tokenizers, in the order they are looked for
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


class Tokenizer:
    """Text <-> token ids. ``eos`` is the id that separates documents."""

    name: str
    vocab_size: int
    eos: int
    sha256: Optional[str]
    json: Optional[str] = None  # the file it was read from, for tokenizers that have one (a BPE's)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """How many bytes of UTF-8 text each id stands for (0 for ``eos`` and other special tokens)."""
        raise NotImplementedError

    def state(self) -> Any:
        """What a checkpoint keeps of it (:func:`tokenizer_from_state` reads it back)."""
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class ByteTokenizer(Tokenizer):
    name, vocab_size, eos, sha256 = "bytes", BYTE_VOCAB, EOS, None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(t) for t in ids if 0 < int(t) < BYTE_VOCAB).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        out = np.ones(BYTE_VOCAB, dtype=np.int64)
        out[EOS] = 0
        return out

    def state(self) -> Any:
        return "bytes"  # what checkpoints of byte-level runs have always held


class BPETokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer``; ``source`` names where it came from (a file, or a checkpoint). Its eos is the
    token named ``eos`` where given (a folder's ``tokenizer_config.json`` names it), else the first of
    :data:`EOS_NAMES` it has."""

    def __init__(self, tok: Any, source: str, eos: Optional[str] = None) -> None:
        self.tok, self.source = tok, source
        self.json = tok.to_str()
        self.sha256 = hashlib.sha256(self.json.encode("utf-8")).hexdigest()
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.name = Path(source).name
        if eos is not None:
            found = tok.token_to_id(eos)
            if found is None:
                raise DataError(f"{source}: the tokenizer has no token {eos!r}, named as its end-of-document token")
        else:
            found = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
            if found is None:
                raise DataError(f"{source}: the tokenizer has no end-of-document token (one of "
                                f"{', '.join(EOS_NAMES)}); add one as a special token")
        self.eos = int(found)
        self._bytes: Optional[np.ndarray] = None

    @classmethod
    def from_file(cls, path: str | os.PathLike, eos: Optional[str] = None) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        if not p.is_file():
            raise DataError(f"{p}: no such tokenizer file (data.tokenizer is bytes or a tokenizers JSON file; "
                            f"loco tokenizer train --out {p} makes one)")
        try:
            tok = HFTokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises plain Exceptions with serde's message
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise DataError(f"{p}: not a Hugging Face tokenizers JSON file ({first})") from None
        return cls(tok, str(p), eos)

    @classmethod
    def from_json(cls, text: str, source: str) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_str(text), source)
        except Exception as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{source}: the tokenizer it holds cannot be read ({str(e)[:160]})") from None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        out: list[np.ndarray] = []
        for i in range(0, len(texts), ENCODE_CHUNK):  # an Encoding holds each token's string too: a few at a time
            encodings = self.tok.encode_batch_fast(list(texts[i:i + ENCODE_CHUNK]), add_special_tokens=False)
            out.extend(np.asarray(e.ids, dtype=dtype) for e in encodings)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        if self._bytes is None:
            self._bytes = _token_byte_lengths(self.tok, self.vocab_size)
            self._bytes[self.eos] = 0  # an eos named by a folder's config may be a plain token of the vocabulary
        return self._bytes

    def state(self) -> Any:
        return {"kind": "tokenizers", "name": self.name, "sha256": self.sha256, "json": self.json}

    def describe(self) -> str:
        return f"{self.name} ({self.vocab_size:,} ids, sha256 {self.sha256[:12]})"

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer's JSON to ``path`` whole (a temporary file renamed)."""
        write_file(path, self.json, "free some space and train it again")


def _token_byte_lengths(tok: Any, vocab_size: int) -> np.ndarray:
    """Bytes per id. A byte-level vocabulary spells each byte as one character, so a token's length is its byte
    count; any other vocabulary is measured by decoding each id alone."""
    out = np.zeros(vocab_size, dtype=np.int64)
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    special = {int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i in special or i >= vocab_size:
            continue
        out[i] = len(token) if byte_level else len(tok.decode([i]).encode("utf-8"))
    return out


def byte_chars() -> list[str]:
    """The character byte-level BPE spells each byte with (GPT-2's table, which ``tokenizers``' ByteLevel uses):
    printable Latin-1 bytes stand for themselves, the others take the characters from U+0100 on, in order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)}
    moved = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(moved)) for b in range(BYTE_VOCAB)]


def bytes_as_file() -> BPETokenizer:
    """``bytes`` as a ``tokenizers`` file (what an export of a byte-level run carries): a byte-level BPE without
    merges whose vocabulary is each byte numbered by its value, so a text encodes to its UTF-8 bytes; id 0 is
    ``<|endoftext|>``, the end-of-document token, as it is for ``bytes``.

    Byte 0 has no token of its own: in loco's data it is the document separator, never text. A NUL in a text
    therefore encodes to nothing (a BPE without an unknown token skips what its vocabulary lacks), where
    :class:`ByteTokenizer` gives id 0; and the text ``<|endoftext|>`` encodes to id 0, as in every tokenizer
    with that special token. Any other text encodes as :class:`ByteTokenizer` encodes it."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    chars = byte_chars()
    vocab = {EOS_NAMES[0]: EOS, **{chars[b]: b for b in range(BYTE_VOCAB) if b != EOS}}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_NAMES[0], special=True, normalized=False)])
    return BPETokenizer(tok, "bytes")


def load_tokenizer(spec: Optional[str]) -> Tokenizer:
    """``data.tokenizer``: ``bytes`` (or empty) or a tokenizers JSON file."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    return BPETokenizer.from_file(spec)


def tokenizer_from_state(state: Any, source: str) -> Optional[Tokenizer]:
    """The tokenizer a checkpoint holds: None for a run on token ids without one."""
    if state == "bytes":
        return ByteTokenizer()
    if isinstance(state, dict) and state.get("json"):
        return BPETokenizer.from_json(state["json"], source)
    return None


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | os.PathLike, total_bytes: Optional[int] = None,
              say: Callable[[str], None] = print) -> BPETokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids on ``texts`` and write it to ``out``.

    Id 0 is ``<|endoftext|>``, the document separator (as byte 0 is for ``bytes``); the 256 byte symbols are
    always in the vocabulary, so any text encodes. Reading the texts shows a progress line.
    """
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < BYTE_VOCAB + 1:
        raise DataError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {BYTE_VOCAB + 1} ids "
                        f"(the 256 bytes and the end-of-document token)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_NAMES[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_counted(texts, total_bytes, say), trainer=trainer)
    bpe = BPETokenizer(tok, str(out))
    if bpe.vocab_size < vocab_size:
        say(f"the text has no more pairs seen twice: the vocabulary stops at {bpe.vocab_size:,} of {vocab_size:,} ids")
    bpe.save(out)
    return bpe


def _counted(texts: Iterable[str], total_bytes: Optional[int], say: Callable[[str], None]) -> Iterator[str]:
    """``texts``, with a progress line while they are read (counted in UTF-8 bytes)."""
    ticker = Ticker(say)
    done = docs = 0
    for text in texts:
        done += len(text.encode("utf-8"))
        docs += 1
        yield text
        if (seconds := ticker.due()) is not None:
            part = f" of {total_bytes / 1e6:,.0f}" if total_bytes else ""
            ticker.show(f"read {done / 1e6:,.1f}{part} MB ({docs:,} documents, {done / 1e6 / seconds:.1f} MB/s)")
    ticker.close()
    say(f"read {done / 1e6:,.1f} MB in {docs:,} documents")
