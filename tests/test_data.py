"""Data sources (stdlib, python, text, shards, hf) and the deterministic per-worker Batcher."""

from __future__ import annotations

import itertools
import mmap
from collections import Counter
from pathlib import Path

import os
import shutil
import sys

import numpy as np
import pytest
import torch

from launch.config import ConfigError, load_config
from launch.config.schema import DataConfig
from launch.data.batches import Batcher, load_data
from launch.data.documents import _binary_reason, stdlib_files
from launch.data.shards import LLMC_MAGIC
from launch.data.python_corpus import load_python, python_files, python_roots
from launch.data.tokens import BYTE_VOCAB, EOS, DataError, TokenData, in_val_split, split_documents


# ---- helpers ----------------------------------------------------------------------------------

def _docs(arrays: list[np.ndarray]) -> list[bytes]:
    """Split EOS-joined byte arrays back into documents (text sources end every document with EOS)."""
    out = []
    for a in arrays:
        out.extend(d for d in bytes(np.asarray(a, dtype=np.uint8)).split(bytes([EOS])) if d)
    return out


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]) if arrays else np.empty(0, np.int64)


def _is_mmapped(a: np.ndarray) -> bool:
    """True when the array (or an array it is a view of) is backed by a memory map, not a heap copy."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ---- stdlib -----------------------------------------------------------------------------------

def test_stdlib_is_deterministic_byte_level():
    cfg = DataConfig(source="stdlib", max_docs=300, seq_len=64)
    a, b = load_data(cfg), load_data(cfg)
    assert a.vocab_size == BYTE_VOCAB == 256 and a.tokenizer.name == "bytes"
    assert len(a.train) == len(b.train) and len(a.val) == len(b.val)
    for x, y in zip(a.train + a.val, b.train + b.val):
        assert x.dtype == np.uint8
        assert np.array_equal(x, y)
    assert 0 < a.val_tokens < a.train_tokens
    assert not np.array_equal(a.train[0][: len(a.val[0])], a.val[0])


def test_stdlib_val_share_is_small_and_grows_with_val_fraction():
    full = load_data(DataConfig(source="stdlib", seq_len=64))
    share = full.val_tokens / (full.train_tokens + full.val_tokens)
    assert 0.005 <= share <= 0.10, share
    more = load_data(DataConfig(source="stdlib", seq_len=64, val_fraction=0.3))
    assert more.val_tokens > 3 * full.val_tokens
    assert more.train_tokens + more.val_tokens == full.train_tokens + full.val_tokens


def test_stdlib_splits_by_whole_files():
    n = 250
    data = load_data(DataConfig(source="stdlib", max_docs=n, seq_len=64))
    _, files = stdlib_files()
    contents = [f.read_bytes().replace(b"\x00", b"") for f in files[:n]]
    contents = [c for c in contents if c]
    train_docs, val_docs = _docs(data.train), _docs(data.val)
    assert val_docs and train_docs
    # every file lands whole on exactly one side: the documents are exactly the files
    assert Counter(train_docs) + Counter(val_docs) == Counter(contents)
    assert data.train_tokens + data.val_tokens == sum(len(c) + 1 for c in contents)  # + one EOS each
    # no file content in both splits (identical files could legitimately repeat; the stdlib has few)
    both = set(train_docs) & set(val_docs)
    assert sum(len(d) for d in both) < 0.01 * data.val_tokens


# ---- python (standard library + site-packages) --------------------------------------------------

def _expected_doc(path: str) -> bytes | None:
    """What the python source makes of one file: None when skipped (not UTF-8), else its bytes without NUL."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data.replace(b"\x00", b"")


def _parts(name: str) -> tuple[str, ...]:
    return tuple(name.split("/")[1:])


def test_python_files_lists_stdlib_then_site_packages_in_a_stable_order():
    files = python_files()
    names = [f.name for f in files]
    assert python_files() == files  # the same listing twice
    std = [n for n in names if n.startswith("stdlib/")]
    site = [n for n in names if n.startswith("site/")]
    assert len(std) + len(site) == len(names) and std and site
    assert names == std + site  # the standard library first, then the site-packages
    assert std == sorted(std, key=_parts) and site == sorted(site, key=_parts)
    # the stdlib part is what the stdlib source reads, each real file once (Debian links one _sysconfigdata
    # module to another); installed packages add to it
    root, stdlib = stdlib_files()
    first: dict[str, str] = {}
    for name in sorted(("stdlib/" + f.relative_to(root).as_posix() for f in stdlib), key=_parts):
        first.setdefault(os.path.realpath(root / name[len("stdlib/"):]), name)
    assert set(first.values()) == set(std)
    assert {"stdlib/os.py", "site/numpy/__init__.py", "site/torch/__init__.py"} <= set(names)
    assert len(site) > len(std)
    assert not any("__pycache__" in n or n.rsplit("/", 1)[-1].startswith("__editable__") for n in names)
    assert all(n.endswith(".py") for n in names)
    real = [os.path.realpath(f.path) for f in files]
    assert len(set(real)) == len(real)  # no file read twice
    stdlib_root, sites = python_roots()
    assert sites and stdlib_root not in sites and len(set(sites)) == len(sites)
    assert all(f.size == os.stat(f.path).st_size for f in files[:50] + files[-50:])


def _tree(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A small standard library and two site folders with every case the listing handles."""
    std, site, site2 = tmp_path / "std", tmp_path / "site", tmp_path / "site2"
    _write(std / "abc.py", "import os\n")
    _write(std / "pkg" / "__init__.py", "")  # empty: listed, then left out of the corpus
    _write(std / "pkg" / "mod.py", "x = 1\n")
    _write(std / "pkg" / "__pycache__" / "mod.cpython-311.py", "cached = True\n")
    _write(std / "site-packages" / "installed.py", "not stdlib\n")
    _write(std / "notes.txt", "not python\n")
    # relative links, so a copy of the tree links within the copy
    (std / "pkg_link").symlink_to("pkg", target_is_directory=True)  # symlinked folders are not entered
    (std / "pkg" / "loop").symlink_to("..", target_is_directory=True)  # a folder symlink loop
    _write(site / "a.py", "print('a')\n")
    _write(site / "a-b" / "c.py", "c = 'with a NUL\x00 inside'\n")
    _write(site / "z" / "b.py", "b = 2\n")
    _write(site / "latin1.py", "s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8
    _write(site / "__editable___demo_0_1_finder.py", "MAPPING = {'demo': '/abs/path'}\n")
    _write(site / "inner" / "nested.py", "nested = 1\n")  # its own root too: listed once
    _write(site / "__pycache__" / "a.cpython-311.py", "cached\n")
    (site / "alias.py").symlink_to("a.py")  # a second name for a.py: read once
    (site / "broken.py").symlink_to("missing.py")
    (site / "loop1.py").symlink_to("loop2.py")  # a file symlink loop
    (site / "loop2.py").symlink_to("loop1.py")
    _write(site2 / "a.py", "print('another a')\n")  # the same relative path in a second site folder
    _write(std / "vendored" / "v.py", "v = 5\n")  # a site folder inside the stdlib tree: read as site only
    return std, [site, site / "inner", site2, site, std / "vendored"]  # site twice: deduplicated


def test_python_files_rules_on_a_temporary_tree(tmp_path):
    std, sites = _tree(tmp_path)
    files = python_files(std, sites)
    assert [f.name for f in files] == [
        "stdlib/abc.py", "stdlib/pkg/__init__.py", "stdlib/pkg/mod.py",
        "site/a-b/c.py", "site/a.py", "site/a.py", "site/latin1.py", "site/nested.py", "site/v.py", "site/z/b.py",
    ]
    by_name = [(f.name, Path(f.path)) for f in files]
    assert by_name[4] == ("site/a.py", (tmp_path / "site" / "a.py").resolve())  # first folder first
    assert by_name[5] == ("site/a.py", (tmp_path / "site2" / "a.py").resolve())
    # a listing of only a site folder names nothing stdlib/
    assert [f.name for f in python_files(None, [tmp_path / "site2"])] == ["site/a.py"]
    # the same tree somewhere else gives the same names and the same tokens: no absolute path matters
    shutil.copytree(tmp_path, tmp_path.parent / (tmp_path.name + "_moved"), symlinks=True)
    moved = tmp_path.parent / (tmp_path.name + "_moved")
    msites = [moved / s.relative_to(tmp_path) for s in sites]
    assert [f.name for f in python_files(moved / "std", msites)] == [f.name for f in files]
    a, b = load_python(0.3, None, std, sites), load_python(0.3, None, moved / "std", msites)
    assert np.array_equal(a.train[0], b.train[0]) and np.array_equal(a.val[0], b.val[0])


def test_python_source_documents_and_skips_on_a_temporary_tree(tmp_path):
    std, sites = _tree(tmp_path)
    files = python_files(std, sites)
    data = load_python(0.02, None, std, sites)
    expected = [(f.name, _expected_doc(f.path)) for f in files]
    assert ("site/latin1.py", None) in expected and ("stdlib/pkg/__init__.py", b"") in expected
    kept = [(n, d) for n, d in expected if d]
    assert Counter(_docs(data.train) + _docs(data.val)) == Counter(d for _, d in kept)
    assert b"c = 'with a NUL inside'\n" in _docs(data.train) + _docs(data.val)  # NUL removed, file kept
    assert data.train_tokens + data.val_tokens == sum(len(d) + 1 for _, d in kept)
    assert "+ 4 site-packages folder(s) (8 files: 2 stdlib, 6 site-packages" in data.description
    assert f"{data.train_tokens + data.val_tokens:,} bytes" in data.description
    assert "1 unreadable or non-UTF-8 files skipped" in data.description
    assert data.vocab_size == BYTE_VOCAB and data.tokenizer.name == "bytes"


@pytest.mark.parametrize("n_files,fraction", [(1, 0.3), (3, 1e-9), (3, 0.9999), (8, 0.3), (8, 0.5)])
def test_python_source_split_matches_split_documents(tmp_path, n_files, fraction):
    """Streaming into one array per split gives what split_documents gives, its fallbacks included."""
    for i in range(n_files):
        _write(tmp_path / "lib" / f"m{i}.py", f"value_{i} = {i * 7}\n" * (i + 2))
    files = python_files(tmp_path / "lib", [])
    docs = [(f.name, np.frombuffer(_expected_doc(f.path), dtype=np.uint8)) for f in files]
    want_train, want_val = split_documents(docs, fraction)
    got = load_python(fraction, None, tmp_path / "lib", [])
    assert len(got.train) == len(got.val) == 1
    assert np.array_equal(got.train[0], want_train[0]) and np.array_equal(got.val[0], want_val[0])
    assert got.train[0].dtype == got.val[0].dtype == np.uint8 and got.train_tokens > 0 and got.val_tokens > 0


def test_python_source_is_deterministic_and_splits_by_whole_files():
    files = python_files()
    n_std = sum(f.name.startswith("stdlib/") for f in files)
    cfg = DataConfig(source="python", max_docs=n_std + 60, seq_len=64)  # the whole stdlib + 60 site files
    a, b = load_data(cfg), load_data(cfg)
    for x, y in zip(a.train + a.val, b.train + b.val, strict=True):
        assert x.dtype == np.uint8 and np.array_equal(x, y)
    docs = [(f.name, d) for f in files[: n_std + 60] if (d := _expected_doc(f.path))]
    site_docs = [d for n, d in docs if n.startswith("site/")]
    assert len(site_docs) >= 30  # installed packages contribute documents
    # every file lands whole on the side its name picks, in corpus order: none is on both sides
    assert _docs(a.train) == [d for n, d in docs if not in_val_split(n, cfg.val_fraction)]
    assert _docs(a.val) == [d for n, d in docs if in_val_split(n, cfg.val_fraction)]
    assert 0 < a.val_tokens < 0.1 * a.train_tokens
    assert f"{a.train_tokens + a.val_tokens:,} bytes" in a.description
    assert f"{len(docs) - len(site_docs):,} stdlib, {len(site_docs):,} site-packages" in a.description


def test_python_source_max_docs_takes_a_prefix_of_the_files():
    small = load_data(DataConfig(source="python", max_docs=80, seq_len=64))
    big = load_data(DataConfig(source="python", max_docs=200, seq_len=64))
    s_docs, b_docs = _docs(small.train) + _docs(small.val), _docs(big.train) + _docs(big.val)
    assert len(s_docs) <= 80 < len(b_docs) <= 200
    assert not Counter(s_docs) - Counter(b_docs)  # the first 80 files are among the first 200
    want = [d for f in python_files()[:80] if (d := _expected_doc(f.path))]
    assert Counter(s_docs) == Counter(want)
    assert small.train_tokens + small.val_tokens < big.train_tokens + big.val_tokens


def test_python_source_in_config_and_presets():
    cfg, _ = load_config(overrides=["data.source=python"])
    assert cfg.data.source == "python" and cfg.data.path is None  # needs no path
    with pytest.raises(ConfigError, match="allowed: stdlib, text, shards, hf, python"):
        load_config(overrides=["data.source=pyhton"])
    assert load_config()[0].data.source == "stdlib"
    assert load_config(["tiny"])[0].data.source == "stdlib"
    for preset in ("small", "150m", "1b"):
        assert load_config([preset])[0].data.source == "python", preset


# ---- text -------------------------------------------------------------------------------------

def test_text_single_file_split_by_token_tail(tmp_path):
    body = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))
    f = _write(tmp_path / "corpus.txt", body)
    data = load_data(DataConfig(source="text", path=str(f), val_fraction=0.1, seq_len=16))
    raw = np.frombuffer(body.encode(), dtype=np.uint8)
    assert len(data.train) == len(data.val) == 1
    cut = int(len(raw) * 0.9)
    assert np.array_equal(data.train[0], raw[:cut])
    assert np.array_equal(data.val[0], raw[cut:])
    assert data.vocab_size == 256 and data.tokenizer.name == "bytes"


def _make_tree(root: Path) -> dict[str, bytes]:
    """Text files in nested folders plus files that must be skipped; returns the ones that count."""
    keep = {
        "a.txt": b"alpha document " * 40,
        "sub/b.txt": b"bravo document " * 40,
        "sub/deeper/c.txt": b"charlie document " * 40,
        "sub/deeper/deepest/d.txt": "delta \u00e9t\u00e9 ".encode() * 40,
    }
    for rel, body in keep.items():
        _write(root / rel, body)
    _write(root / ".hidden.txt", b"hidden file " * 40)
    _write(root / ".git" / "e.txt", b"in a hidden folder " * 40)
    _write(root / "sub" / "blob.txt", b"binary\x00\x01\x02 data " * 40)
    _write(root / "notes.md", b"markdown, not matched by the pattern " * 40)
    return keep


def test_text_folder_nested_skips_hidden_and_binary(tmp_path):
    keep = _make_tree(tmp_path / "corpus")
    data = load_data(DataConfig(source="text", path=str(tmp_path / "corpus"), pattern="**/*.txt",
                                val_fraction=0.2, seq_len=16))
    train_docs, val_docs = _docs(data.train), _docs(data.val)
    assert sorted(train_docs + val_docs) == sorted(keep.values())
    assert train_docs and val_docs
    assert "(4 files; 1 binary files skipped)" in data.description
    # pattern **/* would also take notes.md, still not the hidden or binary files
    wide = load_data(DataConfig(source="text", path=str(tmp_path / "corpus"), val_fraction=0.2, seq_len=16))
    assert sorted(_docs(wide.train) + _docs(wide.val)) == sorted([*keep.values(), b"markdown, not matched by the pattern " * 40])


def test_a_folder_whose_name_has_glob_characters_is_read(tmp_path):
    """``[``, ``*`` and ``?`` in the folder's own path are its name, not a pattern: ``runs/data[1]`` was reported
    as holding no text."""
    corpus = tmp_path / "corpus[1]*?"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"one text file, long enough for a few windows " * 20)
    data = load_data(DataConfig(source="text", path=str(corpus), val_fraction=0.1, seq_len=16))
    assert "(1 files" in data.description or "1 file" in data.description, data.description


@pytest.mark.parametrize("body, reason", [
    (bytes(range(256)) * 64, "NUL bytes"),
    (b"\x7fELF" + bytes([0xFF, 0xFE, 0x80]) * 500, "not UTF-8"),
    (b"\x01\x02\x03\x04 ab" * 400, "control characters"),
])
def test_a_binary_file_named_directly_is_refused(tmp_path, body, reason):
    path = tmp_path / "program"
    path.write_bytes(body)
    with pytest.raises(DataError) as info:
        load_data(DataConfig(source="text", path=str(path), seq_len=16))
    assert str(path) in str(info.value) and "binary" in str(info.value) and reason in str(info.value)


def test_an_executable_named_directly_is_refused_and_text_with_accents_is_not(tmp_path):
    with pytest.raises(DataError, match="binary"):
        load_data(DataConfig(source="text", path=sys.executable, seq_len=16))
    # UTF-8 text cut in the middle of a character at the 8 KiB edge is still text
    text = tmp_path / "accents.txt"
    text.write_bytes(b"a" * 8191 + "\u00e9t\u00e9 ".encode() * 100)
    assert _binary_reason(text) is None
    text.write_bytes(b"a" * 8000 + b"\xff" + b"a" * 100)  # a stray byte is bad text (data.bad_text), not a binary
    assert _binary_reason(text) is None
    text.write_bytes(b"a" * 100 + b"\xff" * 1000)
    assert "not UTF-8" in _binary_reason(text)


def test_a_folder_of_only_binaries_names_them(tmp_path):
    _write(tmp_path / "bin" / "a.txt", b"\x00\x01" * 100)
    with pytest.raises(DataError, match=r"no text files .*1 binary files skipped"):
        load_data(DataConfig(source="text", path=str(tmp_path / "bin"), seq_len=16))


def test_text_val_path_is_used(tmp_path):
    keep = _make_tree(tmp_path / "train")
    _write(tmp_path / "val" / "v1.txt", b"validation one " * 30)
    _write(tmp_path / "val" / "nested" / "v2.txt", b"validation two " * 30)
    data = load_data(DataConfig(source="text", path=str(tmp_path / "train"), val_path=str(tmp_path / "val"),
                                pattern="**/*.txt", seq_len=16))
    assert sorted(_docs(data.train)) == sorted(keep.values())  # all training files, none held out
    assert sorted(_docs(data.val)) == sorted([b"validation one " * 30, b"validation two " * 30])


def test_text_empty_folder_and_no_match_raise_naming_path(tmp_path):
    empty = tmp_path / "empty_corpus"
    empty.mkdir()
    with pytest.raises(DataError, match="empty_corpus"):
        load_data(DataConfig(source="text", path=str(empty), seq_len=16))
    only_md = tmp_path / "only_md"
    _write(only_md / "readme.md", b"no txt here " * 20)
    with pytest.raises(DataError) as e:
        load_data(DataConfig(source="text", path=str(only_md), pattern="**/*.txt", seq_len=16))
    assert "only_md" in str(e.value) and "**/*.txt" in str(e.value)
    blank = tmp_path / "blank"
    _write(blank / "a.txt", b"")
    with pytest.raises(DataError, match="blank"):
        load_data(DataConfig(source="text", path=str(blank), seq_len=16))


def test_text_too_short_for_seq_len_raises(tmp_path):
    f = _write(tmp_path / "short.txt", b"just a few bytes of text")
    with pytest.raises(DataError, match="seq_len"):
        load_data(DataConfig(source="text", path=str(f), seq_len=64))


# ---- shards -----------------------------------------------------------------------------------

def _write_memmap(path: Path, tokens: np.ndarray) -> None:
    m = np.memmap(path, dtype=tokens.dtype, mode="w+", shape=tokens.shape)
    m[:] = tokens
    m.flush()
    del m


def _write_llmc(path: Path, tokens: np.ndarray) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = LLMC_MAGIC, 1, len(tokens)
    with open(path, "wb") as fh:
        fh.write(header.tobytes())
        fh.write(tokens.astype(np.uint16).tobytes())


RNG = np.random.default_rng(0)
U16 = RNG.integers(0, 50_000, size=5_000).astype(np.uint16)
U32 = RNG.integers(0, 120_000, size=5_000).astype(np.uint32)
U32[:10] = 100_000  # ids that only survive as uint32


@pytest.mark.parametrize("kind", ["bin16", "bin32", "npy16", "npy32", "llmc"])
def test_shards_read_back_exactly_and_memory_mapped(tmp_path, kind):
    dtype, tokens = "auto", U16
    if kind == "bin16":
        path = tmp_path / "tok.bin"
        _write_memmap(path, U16)
    elif kind == "bin32":
        path, dtype, tokens = tmp_path / "tok.bin", "uint32", U32
        _write_memmap(path, U32)
    elif kind == "npy16":
        path = tmp_path / "tok.npy"
        np.save(path, U16)
    elif kind == "npy32":
        path, tokens = tmp_path / "tok.npy", U32
        np.save(path, U32)
    else:
        path = tmp_path / "tok.bin"
        _write_llmc(path, U16)
    data = load_data(DataConfig(source="shards", path=str(path), dtype=dtype, vocab_size=200_000,
                                val_fraction=0.1, seq_len=32))
    assert data.vocab_size == 200_000 and data.tokenizer is None
    assert np.array_equal(_cat(data.train + data.val), tokens.astype(np.int64))
    assert len(data.val[0]) == len(tokens) - int(len(tokens) * 0.9)
    for a in data.train + data.val:
        assert _is_mmapped(a), f"{kind}: {type(a)} is not memory-mapped"
    # and the batches carry the same ids
    b = Batcher(data, 32, 4)
    x, y = b.train_batch(0)
    assert int(x.max()) < 200_000 and torch.equal(x[:, 1:], y[:, :-1])


def test_shards_uint32_bin_needs_dtype(tmp_path):
    path = tmp_path / "tok.bin"
    _write_memmap(path, U32)
    as16 = load_data(DataConfig(source="shards", path=str(path), vocab_size=200_000, seq_len=32))
    assert as16.train_tokens + as16.val_tokens == 2 * len(U32)  # read as uint16: twice as many (wrong) ids
    assert not np.array_equal(_cat(as16.train + as16.val)[: len(U32)], U32.astype(np.int64))


def test_shards_folder_and_val_path(tmp_path):
    parts = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.uint16) for i in range(4)]
    folder = tmp_path / "train"
    folder.mkdir()
    for i, p in enumerate(parts):
        _write_memmap(folder / f"shard_{i:03d}.bin", p)
    _write(folder / "README.txt", b"ignored")
    _write_memmap(folder / ".hidden.bin", np.full(1000, 7, dtype=np.uint16))
    (tmp_path / "val").mkdir()
    vals = np.arange(5000, 5600, dtype=np.uint16)
    np.save(tmp_path / "val" / "v.npy", vals)
    data = load_data(DataConfig(source="shards", path=str(folder), val_path=str(tmp_path / "val"),
                                vocab_size=6000, seq_len=32))
    assert len(data.train) == 4
    for got, want in zip(data.train, parts):
        assert np.array_equal(got, want)
    assert np.array_equal(_cat(data.val), vals.astype(np.int64))
    # without val_path: every token is in exactly one split
    split = load_data(DataConfig(source="shards", path=str(folder), vocab_size=6000, seq_len=32, val_fraction=0.3))
    assert np.array_equal(np.sort(_cat(split.train + split.val)), np.sort(_cat(parts)))
    assert split.val_tokens > 0 and split.train_tokens > 0
    # with several shards, some held out by name: each split holds whole shards
    assert len(split.train) + len(split.val) == 4
    for a in split.train + split.val:
        assert any(np.array_equal(a, p) for p in parts)


def test_shards_size_not_multiple_of_itemsize_raises_naming_file(tmp_path):
    odd16 = _write(tmp_path / "odd16.bin", b"\x01" * 4097)  # odd byte length, uint16
    with pytest.raises(DataError) as e:
        load_data(DataConfig(source="shards", path=str(odd16), vocab_size=1000, seq_len=8))
    assert "odd16.bin" in str(e.value) and "multiple" in str(e.value)
    half32 = _write(tmp_path / "half32.bin", b"\x01" * 4098)  # multiple of 2, not of 4
    with pytest.raises(DataError) as e:
        load_data(DataConfig(source="shards", path=str(half32), dtype="uint32", vocab_size=1000, seq_len=8))
    assert "half32.bin" in str(e.value) and "uint32" in str(e.value)
    tiny = _write(tmp_path / "tiny32.bin", b"\x01" * 10)  # shorter than an llm.c header, too
    with pytest.raises(DataError, match="tiny32.bin"):
        load_data(DataConfig(source="shards", path=str(tiny), dtype="uint32", vocab_size=1000, seq_len=2))


def test_shards_bad_npy_raises(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(DataError, match="f.npy"):
        load_data(DataConfig(source="shards", path=str(tmp_path / "f.npy"), vocab_size=10, seq_len=8))
    np.save(tmp_path / "m.npy", np.zeros((10, 10), dtype=np.uint16))
    with pytest.raises(DataError, match="m.npy"):
        load_data(DataConfig(source="shards", path=str(tmp_path / "m.npy"), vocab_size=10, seq_len=8))


def test_shards_token_beyond_vocab_raises_in_batcher(tmp_path):
    path = tmp_path / "big.bin"
    _write_memmap(path, np.full(2000, 600, dtype=np.uint16))
    data = load_data(DataConfig(source="shards", path=str(path), vocab_size=500, seq_len=16))
    b = Batcher(data, 16, 4)
    with pytest.raises(DataError) as e:
        b.train_batch(0)
    assert "vocab_size" in str(e.value) and "600" in str(e.value)
    from launch.eval.validation import ValidationSet

    with pytest.raises(DataError, match="validation data is outside"):
        ValidationSet.spread(b.val, 64).check_ids(500, b.description)
    edge = Batcher(load_data(DataConfig(source="shards", path=str(path), vocab_size=600, seq_len=16)), 16, 4)
    with pytest.raises(DataError, match="vocab_size"):  # ids run 0 .. vocab_size - 1
        edge.train_batch(0)
    ok = Batcher(load_data(DataConfig(source="shards", path=str(path), vocab_size=601, seq_len=16)), 16, 4)
    assert int(ok.train_batch(0)[0].max()) == 600


def test_shards_folder_without_shards_raises(tmp_path):
    _write(tmp_path / "nothing" / "notes.txt", b"text, not tokens")
    with pytest.raises(DataError, match="nothing"):
        load_data(DataConfig(source="shards", path=str(tmp_path / "nothing"), vocab_size=10, seq_len=8))


# ---- Hugging Face (local only) ----------------------------------------------------------------

@pytest.fixture
def hf(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    import datasets  # in the dev extra: CI runs these tests
    # the env vars are read at import time; datasets may already be imported by another test
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache", raising=False)
    return datasets


TEXTS = [f"document number {i} says {'hello ' * (5 + i % 7)}".strip() for i in range(40)]


def test_hf_saved_dataset(hf, tmp_path):
    rows = [*TEXTS, "", None]  # empty rows are skipped
    hf.Dataset.from_dict({"text": rows, "id": list(range(len(rows)))}).save_to_disk(str(tmp_path / "ds"))
    data = load_data(DataConfig(source="hf", path=str(tmp_path / "ds"), val_fraction=0.1, seq_len=16))
    assert data.vocab_size == 256 and data.tokenizer.name == "bytes"
    train_docs, val_docs = _docs(data.train), _docs(data.val)
    assert train_docs and val_docs
    assert sorted(train_docs + val_docs) == sorted(t.encode() for t in TEXTS)
    assert "(40 rows)" in data.description
    few = load_data(DataConfig(source="hf", path=str(tmp_path / "ds"), max_docs=10, seq_len=16))
    assert sorted(_docs(few.train) + _docs(few.val)) == sorted(t.encode() for t in TEXTS[:10])


def test_hf_saved_dataset_dict_split(hf, tmp_path):
    test_texts = [f"held out text {i} " * 4 for i in range(12)]
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": TEXTS}),
                    "test": hf.Dataset.from_dict({"text": test_texts})}).save_to_disk(str(tmp_path / "dd"))
    data = load_data(DataConfig(source="hf", path=str(tmp_path / "dd"), seq_len=16))
    assert sorted(_docs(data.train) + _docs(data.val)) == sorted(t.encode() for t in TEXTS)
    other = load_data(DataConfig(source="hf", path=str(tmp_path / "dd"), hf_split="test", seq_len=16))
    assert sorted(_docs(other.train) + _docs(other.val)) == sorted(t.encode() for t in test_texts)
    with pytest.raises(DataError) as e:
        load_data(DataConfig(source="hf", path=str(tmp_path / "dd"), hf_split="validation", seq_len=16))
    assert "validation" in str(e.value) and "train" in str(e.value) and "test" in str(e.value)


def test_hf_builder_with_data_files(hf, tmp_path):
    import json

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    data = load_data(DataConfig(source="hf", path="json", hf_data_files=str(path), seq_len=16))
    assert sorted(_docs(data.train) + _docs(data.val)) == sorted(t.encode() for t in TEXTS)


def test_hf_local_jsonl_folder(hf, tmp_path):
    # a folder of JSON-lines files: datasets infers the json builder; split "train" comes from the file name
    import json

    folder = tmp_path / "jsonl"
    folder.mkdir()
    with open(folder / "train.jsonl", "w") as fh:
        for t in TEXTS:
            fh.write(json.dumps({"text": t, "n": len(t)}) + "\n")
    data = load_data(DataConfig(source="hf", path=str(folder), seq_len=16))
    assert sorted(_docs(data.train) + _docs(data.val)) == sorted(t.encode() for t in TEXTS)


def test_hf_wrong_text_field_lists_columns(hf, tmp_path):
    hf.Dataset.from_dict({"content": TEXTS, "label": [0] * len(TEXTS)}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError) as e:
        load_data(DataConfig(source="hf", path=str(tmp_path / "ds"), seq_len=16))
    msg = str(e.value)
    assert "'text'" in msg and "content" in msg and "label" in msg and "hf_text_field" in msg
    data = load_data(DataConfig(source="hf", path=str(tmp_path / "ds"), hf_text_field="content", seq_len=16))
    assert data.train_tokens + data.val_tokens == sum(len(t) + 1 for t in TEXTS)


def test_hf_missing_local_path_raises(hf, tmp_path):
    with pytest.raises(DataError, match="cannot load"):
        load_data(DataConfig(source="hf", path=str(tmp_path / "no_such_dataset"), seq_len=16))


# ---- data.bad_text: a line that is not UTF-8 ---------------------------------------------------

ROWS = [f"row {i} of a small file, long enough for a window or two" for i in range(12)]


def _bad_line(path: Path, line: int, column: int) -> str:
    return f"{path} line {line}: not UTF-8 (byte 0xe9 at column {column}); fix the file or set data.bad_text=skip"


def _bad_jsonl(path: Path, row: int = 1) -> Path:
    """ROWS as JSON lines, a blank second line, and a Latin-1 byte in ``row`` (line ``row + 2``, column 15)."""
    import json

    lines = [json.dumps({"text": t}).encode() for t in ROWS]
    lines[row] = lines[row].replace(f"row {row}".encode(), "row \u00e9".encode("latin-1"))
    lines.insert(1, b"")
    return _write(path, b"\n".join(lines) + b"\n")


def _bad_text(path: Path) -> Path:
    """ROWS as lines of a text file, a Latin-1 byte on line 3 (column 2)."""
    lines = [t.encode() for t in ROWS]
    lines[2] = lines[2].replace(b"row", "r\u00e9w".encode("latin-1"))
    return _write(path, b"\n".join(lines) + b"\n")


def _cli_error(capsys, argv: list[str], started: bool = False) -> str:
    """The message of the one error line a command ends with (after a run's start lines, if ``started``)."""
    from launch.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (started or len(err) == 1) and "Traceback" not in "".join(err) and " error: " in err[-1], err
    return err[-1].split(" error: ", 1)[1]


def test_a_line_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path, capsys):
    from conftest import FAST, TINY

    jsonl, late = _bad_jsonl(tmp_path / "bad.jsonl"), _bad_jsonl(tmp_path / "late.jsonl", 2)
    text = _bad_text(tmp_path / "bad.txt")

    def train(*sets: str) -> list[str]:
        return ["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), "--max-steps", "1",
                *(a for kv in (*FAST, "data.seq_len=8", *sets) for a in ("--set", kv))]

    assert _cli_error(capsys, train("data.source=hf", f"data.path={jsonl}")) == _bad_line(jsonl, 3, 15)
    assert _cli_error(capsys, train("data.source=hf", f"data.path={jsonl}",
                                    "data.streaming=true")) == _bad_line(jsonl, 3, 15)
    assert _cli_error(capsys, train("data.source=text", f"data.path={text}")) == _bad_line(text, 3, 2)
    # past the validation documents a stream meets the line in its reader thread: the same one line
    assert _cli_error(capsys, train("data.source=hf", f"data.path={late}", "data.streaming=true",
                                    "data.val_docs=1"), started=True) == _bad_line(late, 4, 15)
    for source, path, column in (("hf", jsonl, 15), ("text", text, 2)):
        prepare = ["data", "prepare", "--source", source, "--path", str(path), "--tokenizer", "bytes",
                   "--out", str(tmp_path / f"shards-{source}"), "--workers", "1"]
        assert _cli_error(capsys, prepare) == _bad_line(path, 3, column)


def test_bad_text_skip_leaves_out_the_line_and_says_how_many(tmp_path, capsys, tiny_cfg):
    from launch.data.stream import share_docs
    from launch.loop.trainer import train

    jsonl, text = _bad_jsonl(tmp_path / "bad.jsonl"), _bad_text(tmp_path / "bad.txt")
    rows = load_data(DataConfig(source="hf", path=str(jsonl), seq_len=8, bad_text="skip"))
    assert sorted(_docs(rows.train) + _docs(rows.val)) == sorted(t.encode() for t in ROWS if t != ROWS[1])
    assert capsys.readouterr().err == f"data.bad_text=skip: left out lines that are not UTF-8: {jsonl} (1 line)\n"
    lines = load_data(DataConfig(source="text", path=str(text), seq_len=8, bad_text="skip"))
    kept = "".join(t + "\n" for t in ROWS if t != ROWS[2]).encode()
    assert b"".join(bytes(a) for a in lines.train + lines.val) == kept
    assert capsys.readouterr().err == f"data.bad_text=skip: left out lines that are not UTF-8: {text} (1 line)\n"
    stream = load_data(DataConfig(source="hf", path=str(jsonl), seq_len=8, streaming=True, val_docs=1,
                                  bad_text="skip"))
    docs = [d[1:3] for d in itertools.takewhile(lambda d: d[0] == 0, share_docs(stream.stream, 0, 1, None))]
    assert docs == [(row - 2, row) for row in range(2, len(ROWS))]  # row 1 left out; every other keeps its number
    assert f"in pass 1 of the stream: {jsonl} (1 line)" in capsys.readouterr().err
    summary = train(tiny_cfg("data.source=hf", f"data.path={jsonl}", "data.seq_len=8", "run.max_steps=2",
                             "data.bad_text=skip"))
    assert summary["steps"] == 2 and f"not UTF-8: {jsonl} (1 line)" in capsys.readouterr().err


def test_bad_text_leaves_a_valid_file_as_datasets_reads_it(hf, tmp_path, capsys):
    import json

    rows = [*TEXTS[:20], "", None, "caf\u00e9 \u6771\u4eac, valid UTF-8"]
    path = tmp_path / "good.jsonl"
    lines = (json.dumps({"text": t, "n": i}, ensure_ascii=False) if i != 5 else "" for i, t in enumerate(rows))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")  # a blank line, empty rows, raw UTF-8
    hf.load_dataset("json", data_files=str(path), split="train").save_to_disk(str(tmp_path / "ds"))
    want = load_data(DataConfig(source="hf", path=str(tmp_path / "ds"), val_fraction=0.2, seq_len=16))
    capsys.readouterr()
    for mode in ("error", "skip"):
        got = load_data(DataConfig(source="hf", path=str(path), val_fraction=0.2, seq_len=16, bad_text=mode))
        assert [bytes(a) for a in got.train + got.val] == [bytes(a) for a in want.train + want.val]
    assert capsys.readouterr().err == ""


def test_shards_all_named_for_validation_fall_back_to_a_tail_cut(tmp_path, monkeypatch):
    import launch.data.shards as data_mod

    folder = tmp_path / "shards"
    folder.mkdir()
    for name in ("s1.bin", "s2.bin"):
        np.arange(1000, dtype=np.uint16).tofile(folder / name)
    monkeypatch.setattr(data_mod, "in_val_split", lambda name, fraction: True)
    data = load_data(DataConfig(source="shards", path=str(folder), vocab_size=1000, seq_len=16, val_fraction=0.1))
    assert data.train_tokens == 1900 and data.val_tokens == 100


def test_negative_token_ids_are_rejected(tmp_path):
    np.save(tmp_path / "neg.npy", np.array([5, 3, -1, 2] * 500, dtype=np.int32))
    b = Batcher(load_data(DataConfig(source="shards", path=str(tmp_path / "neg.npy"), vocab_size=10, seq_len=8)), 8, 4)
    with pytest.raises(DataError, match="-1"):
        b.train_batch(0)


# ---- Batcher ----------------------------------------------------------------------------------

SEQ = 8


def _synthetic(lengths=(100, 5, 77, 40), seq_len=SEQ, val_len=200) -> TokenData:
    """Consecutive integers, so every window is identified by its first token."""
    arrays, start = [], 0
    for n in lengths:
        arrays.append(np.arange(start, start + n, dtype=np.int64))
        start += n
    val = [np.arange(start, start + val_len, dtype=np.int64)]
    return TokenData(arrays, val, start + val_len, None, "synthetic")


def _window_starts(data: TokenData, seq_len=SEQ) -> list[int]:
    return [int(a[0]) + k * seq_len for a in data.train for k in range(max(0, len(a) - 1) // seq_len)]


def _rows(b: Batcher, steps) -> list[int]:
    """First token of each row over these steps, in sample order."""
    return [int(v) for t in steps for v in b.train_batch(t)[0][:, 0]]


def test_batch_shapes_and_shift():
    data = _synthetic()
    b = Batcher(data, SEQ, 4)
    starts = set(_window_starts(data))
    assert len(starts) == 12 + 0 + 9 + 4  # (len-1)//seq_len per array; the 5-token array has none
    for step in range(6):
        x, y = b.train_batch(step)
        assert x.shape == y.shape == (4, SEQ)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert torch.equal(y, x + 1)  # consecutive ids: each row is one window inside one array
        assert {int(v) for v in x[:, 0]} <= starts


def test_batches_are_deterministic_and_seeded():
    data = _synthetic()
    a, b = Batcher(data, SEQ, 4, seed=1), Batcher(data, SEQ, 4, seed=1)
    first = [a.train_batch(t)[0] for t in range(8)]
    for t in (7, 2, 5, 0, 7):  # any order, any instance
        assert torch.equal(b.train_batch(t)[0], first[t])
        assert torch.equal(a.train_batch(t)[0], first[t])
    other = Batcher(data, SEQ, 4, seed=2)
    assert any(not torch.equal(other.train_batch(t)[0], first[t]) for t in range(8))


@pytest.mark.parametrize("limit", [None, 4], ids=["permutation", "affine"])
@pytest.mark.parametrize("workers", [2, 3])
def test_worker_batches_concatenate_to_single_worker_batch(monkeypatch, limit, workers):
    if limit is not None:
        monkeypatch.setattr(Batcher, "FULL_PERMUTATION_LIMIT", limit)
    data, B = _synthetic(), 3
    single = Batcher(data, SEQ, workers * B, seed=5)
    parts = [Batcher(data, SEQ, B, worker_index=w, num_workers=workers, seed=5) for w in range(workers)]
    for step in range(7):  # crosses epoch boundaries (25 windows)
        xs = [p.train_batch(step) for p in parts]
        x1, y1 = single.train_batch(step)
        assert torch.equal(torch.cat([x for x, _ in xs]), x1)
        assert torch.equal(torch.cat([y for _, y in xs]), y1)
        assert [p.samples_before(step) for p in parts] == [(step * workers + w) * B for w in range(workers)]
    # within the first epoch the workers never share a window
    seen = [set(_rows(p, range(2))) for p in parts]
    assert sum(len(s) for s in seen) == len(set().union(*seen)) == 2 * workers * B


def test_grad_accum_micro_batches_concatenate_to_full_batch():
    data = _synthetic()
    for workers, w in ((1, 0), (2, 1)):
        full = Batcher(data, SEQ, 8, worker_index=w, num_workers=workers)
        accum = Batcher(data, SEQ, 8, worker_index=w, num_workers=workers, grad_accum=4)
        for step in range(5):
            micro = [accum.train_batch(step, m) for m in range(4)]
            assert all(x.shape == (2, SEQ) for x, _ in micro)
            x, y = full.train_batch(step)
            assert torch.equal(torch.cat([mx for mx, _ in micro]), x)
            assert torch.equal(torch.cat([my for _, my in micro]), y)


def test_epochs_wrap_and_cover_every_window_once():
    data = _synthetic(lengths=(7 * SEQ + 1,))  # 7 windows, batches of 3: epochs straddle batches
    b = Batcher(data, SEQ, 3, seed=11)
    rows = _rows(b, range(14))  # 42 samples = 6 epochs
    starts = sorted(_window_starts(data))
    epochs = [rows[i:i + 7] for i in range(0, 42, 7)]
    for e in epochs:
        assert sorted(e) == starts
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch


def test_affine_path_is_a_bijection_per_epoch(monkeypatch):
    monkeypatch.setattr(Batcher, "FULL_PERMUTATION_LIMIT", 16)
    data = _synthetic(lengths=(60 * SEQ + 1,))  # 60 windows: not prime, so gcd(a, n) matters
    b = Batcher(data, SEQ, 12, seed=3)
    rows = _rows(b, range(10))  # 2 epochs
    assert b._perm is None  # no O(n) table was built
    starts = sorted(_window_starts(data))
    e0, e1 = rows[:60], rows[60:]
    assert sorted(e0) == starts and sorted(e1) == starts
    assert e0 != starts and e0 != e1  # shuffled, differently per epoch
    # the same data with the full permutation orders it differently, but covers it the same way
    monkeypatch.setattr(Batcher, "FULL_PERMUTATION_LIMIT", 1 << 24)
    full = _rows(Batcher(data, SEQ, 12, seed=3), range(5))
    assert sorted(full) == starts and full != e0


def test_worker_index_out_of_range():
    with pytest.raises(ValueError, match="worker_index"):
        Batcher(_synthetic(), SEQ, 4, worker_index=2, num_workers=2)


def test_a_batch_is_cut_from_one_block_that_goes_to_the_device_whole():
    """Inputs and targets are ``[:, :-1]`` and ``[:, 1:]`` of one contiguous block of windows one token longer:
    on a GPU the trainer pins and moves that block once (a pinned strided view would be staged through pageable
    memory, a copy the host waits for). ``one_block`` finds it for training batches (validation cuts its windows
    the same way), and only for such a pair."""
    from launch.data.batches import one_block

    b = Batcher(_synthetic(), SEQ, 3)
    for x, y in (b.train_batch(2), b.train_batch(3)):
        block = one_block(x, y)
        assert block is not None and block.is_contiguous() and block.shape == (3, SEQ + 1)
        assert torch.equal(block[:, :-1], x) and torch.equal(block[:, 1:], y)
    x, y = b.train_batch(0)
    assert one_block(x.clone(), y) is None and one_block(y, x) is None and one_block(x, x) is None
