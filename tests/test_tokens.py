"""Real tokens: a BPE trained here, prepared shards with a manifest, streamed datasets with an exact resume,
sampling through the run's tokenizer, bits per byte, and every bad input as one line."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY
from launch.cli import main
from launch.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

WORDS = ("def return class import self value index token stream shard worker round merge tensor model "
         "loss batch step eval the of and to in for with über naïve 東京").split()
SMALL = ["data.seq_len=32", "run.batch_size=4", "model.size=tiny", "eval.tokens=512", "optim.warmup_steps=0"]


def _write_corpus(folder: Path, docs: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(docs):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) for _ in range(rng.randint(3, 12)))
        (folder / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text folder, a BPE of 384 ids trained on it, its shards, and the same texts as a jsonl file."""
    root = tmp_path_factory.mktemp("tokens")
    texts = _write_corpus(root / "text", 120)
    tok = train_bpe(texts, 384, root / "tok.json", say=lambda m: None)
    with open(root / "docs.jsonl", "w", encoding="utf-8") as fh:
        for i, t in enumerate(texts * 3):
            fh.write(json.dumps({"text": t, "n": i}) + "\n")
    assert main(["data", "prepare", "--source", "text", "--path", str(root / "text"), "--tokenizer",
                 str(root / "tok.json"), "--out", str(root / "shards"), "--shard-mb", "0.002", "--workers", "2",
                 "--val-fraction", "0.1"]) == 0
    return {"root": root, "texts": texts, "tok": tok}


def test_a_bpe_trained_here_round_trips_text_and_counts_its_bytes(corpus):
    tok = load_tokenizer(str(corpus["root"] / "tok.json"))
    # a corpus this small runs out of pairs seen twice a little before 384 ids
    assert isinstance(tok, BPETokenizer) and 300 < tok.vocab_size <= 384 and tok.eos == 0
    assert tok.sha256 == corpus["tok"].sha256  # named by its content, file or memory
    text = "def naïve über 東京 return"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8")) and tok.decode(ids) == text
    assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))
    assert tok.token_bytes()[tok.eos] == 0 and ByteTokenizer().token_bytes().sum() == 255


def test_prepare_writes_a_manifest_and_resumes_without_redoing_shards(corpus, capsys):
    out = corpus["root"] / "shards"
    m = json.loads((out / "manifest.json").read_text())
    assert m["vocab_size"] == corpus["tok"].vocab_size and m["dtype"] == "uint16" and m["tokenizer"]["sha256"] == corpus["tok"].sha256
    assert m["documents"]["train"] + m["documents"]["val"] == 120 and m["documents"]["val"] > 0
    assert len(m["shards"]["train"]) > 2 and all(
        (out / s["file"]).stat().st_size == 2 * s["tokens"] for s in m["shards"]["train"] + m["shards"]["val"])
    tok = corpus["tok"]
    ids = np.fromfile(out / m["shards"]["train"][0]["file"], dtype=np.uint16)
    assert ids[-1] == tok.eos and tok.decode(ids[:np.flatnonzero(ids == tok.eos)[0]]) in corpus["texts"]
    # an interrupted prepare: the manifest and one unit's record gone; only that unit is done again
    copy = corpus["root"] / "resumed"
    shutil.copytree(out, copy)
    (copy / "manifest.json").unlink()
    (copy / "units" / "00001.json").unlink()
    kept = copy / m["shards"]["train"][0]["file"]
    before = kept.stat().st_mtime_ns
    argv = ["data", "prepare", "--source", "text", "--path", str(corpus["root"] / "text"), "--tokenizer",
            str(corpus["root"] / "tok.json"), "--out", str(copy), "--shard-mb", "0.002", "--workers", "1",
            "--val-fraction", "0.1"]
    capsys.readouterr()
    assert main(argv) == 0
    assert "continuing:" in capsys.readouterr().out
    assert kept.stat().st_mtime_ns == before
    assert json.loads((copy / "manifest.json").read_text())["shards"] == m["shards"]
    # the same folder with other settings: one line, nothing touched
    assert main(argv[:-1] + ["0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "begun with other settings (val_fraction: 0.1, now 0.2)" in err[0]


def test_train_on_prepared_shards_then_sample_text_from_a_moved_checkpoint(corpus, tiny_cfg, tmp_path, capsys):
    from launch.loop.trainer import train

    cfg = tiny_cfg(*SMALL, "data.source=shards", f"data.path={corpus['root'] / 'shards'}", "run.max_steps=6",
                   "run.eval_every=3", "run.checkpoint_every=0", "data.max_docs=")
    summary = train(cfg)
    run = Path(cfg.run.dir)
    assert summary["val_bpb"] is not None and math.isfinite(summary["val_bpb"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("val_bpb" in r for r in rows if r.get("val_loss") is not None)
    assert (run / "tokenizer.json").read_text() == corpus["tok"].json
    # moved: only the checkpoint file, on a machine without the tokenizer
    moved = tmp_path / "elsewhere" / "step.pt"
    moved.parent.mkdir()
    shutil.copy(sorted((run / "checkpoints").glob("*.pt"))[-1], moved)
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(moved), "--prompt", "def naïve", "--max-new-tokens", "12",
                 "--device", "cpu", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def naïve") and len(out) > len("def naïve\n")


def test_bits_per_byte_is_the_loss_over_ln2_and_the_bytes_per_token(corpus, tmp_path):
    from launch.data.tokens import TokenData, Windows
    from launch.eval.validation import Score, ValidationSet

    tok = corpus["tok"]
    text = "def token stream return value"  # ASCII: each id's bytes decode alone
    ids = np.tile(np.append(tok.encode(text), tok.eos), 40).astype(np.uint16)
    vset = ValidationSet.spread(Windows(TokenData([ids], [ids], tok.vocab_size, tok, "known text").val, 16), 48)
    window_bytes = vset.target_bytes(tok.token_bytes())
    targets = np.concatenate([vset.rows(np.arange(vset.count))[:, 1:].ravel()])
    by_decoding = sum(len(tok.decode([int(t)]).encode()) for t in targets)
    assert window_bytes.sum() == by_decoding and 1.5 < by_decoding / len(targets) < len(text) + 1
    nll = np.array([20.0, 30.0, 25.0])
    score = Score.of(nll, 16, window_bytes)
    assert score.loss == pytest.approx(nll.sum() / 48)
    assert score.bpb == pytest.approx(nll.sum() / math.log(2) / by_decoding)
    assert vset.target_bytes(None) is None and Score.of(nll, 16, None).bpb is None


def _stream_run(tiny_cfg, corpus, run_dir, *extra, **kwargs):
    from launch.loop.trainer import train

    cfg = tiny_cfg(*SMALL, "data.source=hf", f"data.path={corpus['root'] / 'docs.jsonl'}", "data.streaming=true",
                   f"data.tokenizer={corpus['root'] / 'tok.json'}", "data.val_docs=20", "run.max_steps=9",
                   "run.eval_every=3", "run.checkpoint_every=0", "log.every=1", "data.max_docs=", *extra,
                   run_dir=run_dir)
    return train(cfg, **kwargs)


def _curve(run_dir):
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, open(run_dir / "metrics.jsonl"))]


def test_a_streamed_dataset_resumes_on_the_very_tokens(corpus, tiny_cfg, tmp_path):
    import torch

    from launch.loop.trainer import Hooks

    whole = _stream_run(tiny_cfg, corpus, tmp_path / "whole")

    def interrupt(step, record):
        if step == 5:  # mid-stream: the position is inside a document
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _stream_run(tiny_cfg, corpus, tmp_path / "broken", hooks=Hooks(on_step=interrupt))
    position = torch.load(tmp_path / "broken" / "checkpoints" / "step_00000005.pt", weights_only=False)["streams"][0][1]
    assert position["epoch"] == 0 and position["doc"] >= 0 and position["offset"] > 0
    resumed = _stream_run(tiny_cfg, corpus, tmp_path / "broken", "run.resume=true")
    assert resumed["val_loss"] == whole["val_loss"] and resumed["val_bpb"] == whole["val_bpb"]
    assert _curve(tmp_path / "broken") == _curve(tmp_path / "whole")


def test_each_worker_takes_its_own_interleaved_share(corpus):
    from launch.data.documents import HFOptions
    from launch.data.stream import load_stream, share_docs

    data = load_stream(str(corpus["root"] / "docs.jsonl"), HFOptions(), corpus["tok"], 20)
    seen = [set(d[1] for d in itertools.takewhile(lambda d: d[0] == 0, share_docs(data.stream, share, 3, None)))
            for share in range(3)]
    assert all(seen) and not (seen[0] & seen[1]) and not (seen[1] & seen[2])
    assert seen[0] | seen[1] | seen[2] == set(range(360 - 20))
    capped = dataclasses.replace(data.stream, max_docs=50)  # data.max_docs: 50 read, 20 of them validate
    assert {d[1] for d in itertools.takewhile(lambda d: d[0] == 0, share_docs(capped, 0, 1, None))} == set(range(30))


def _one_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_bad_inputs_are_one_line_and_write_nothing(corpus, tmp_path, capsys):
    root = corpus["root"]
    fake = tmp_path / "fake.json"
    fake.write_text('{"hello": 1}')
    run = tmp_path / "run"
    train = ["train", "--config", TINY, "--run-dir", str(run), "--set", "run.device=cpu",
             "--max-steps", "1"]
    assert "not a Hugging Face tokenizers JSON file" in _one_error(
        capsys, train + ["--set", f"data.tokenizer={fake}", "--set", "data.max_docs=20"])
    assert f"model.vocab_size=300 is smaller than the data's vocabulary of {corpus['tok'].vocab_size}" in _one_error(
        capsys, train + ["--set", "data.source=shards", "--set", f"data.path={root / 'shards'}",
                         "--set", "model.vocab_size=300"])
    bare = tmp_path / "bare"
    bare.mkdir()
    np.arange(100, dtype=np.uint16).tofile(bare / "a.bin")
    assert "needs the vocabulary size" in _one_error(
        capsys, train + ["--set", "data.source=shards", "--set", f"data.path={bare}"])
    other = train_bpe(corpus["texts"], 300, tmp_path / "other.json", say=lambda m: None)
    assert "made with tokenizer" in _one_error(
        capsys, train + ["--set", "data.source=shards", "--set", f"data.path={root / 'shards'}",
                         "--set", f"data.tokenizer={tmp_path / 'other.json'}"]) and other.sha256
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n' * 5)
    assert "no column 'text'" in _one_error(
        capsys, train + ["--set", "data.source=hf", "--set", f"data.path={nofield}", "--set", "data.streaming=true"])
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert "data.streaming" in _one_error(capsys, train + ["--set", "data.streaming=true"])
    assert "not a Hugging Face tokenizers JSON file" in _one_error(
        capsys, ["data", "prepare", "--source", "stdlib", "--tokenizer", str(fake), "--out", str(tmp_path / "p")])
    assert not (tmp_path / "p").exists()


def test_the_cli_trains_a_tokenizer_and_prepares_a_jsonl_dataset(corpus, tmp_path, capsys):
    root = corpus["root"]
    out = tmp_path / "cli-tok.json"
    assert main(["tokenizer", "train", "--data", str(root / "text"), "--vocab-size", "300", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and load_tokenizer(str(out)).vocab_size <= 300
    assert "no such file or folder" in _one_error(
        capsys, ["tokenizer", "train", "--data", str(tmp_path / "nope"), "--vocab-size", "300", "--out", str(out)])
    assert main(["data", "prepare", "--source", "hf", "--path", str(root / "docs.jsonl"), "--tokenizer", str(out),
                 "--out", str(tmp_path / "hf")]) == 0
    m = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    assert m["documents"]["train"] + m["documents"]["val"] == 360 and m["source"]["hf"]["text_field"] == "text"


def _copied_shards(corpus, tmp_path) -> tuple[Path, dict]:
    folder = tmp_path / "shards"
    shutil.copytree(corpus["root"] / "shards", folder)
    return folder, json.loads((folder / "manifest.json").read_text())


def test_a_cut_or_miscounted_shard_is_refused_at_load_naming_it_and_both_counts(corpus, tmp_path, capsys):
    from launch.data.shards import load_shards
    from launch.data.tokens import DataError

    folder, m = _copied_shards(corpus, tmp_path)
    manifest = folder / "manifest.json"
    entry = m["shards"]["val"][0]
    entry["tokens"] += 5000
    manifest.write_text(json.dumps(m))
    with pytest.raises(DataError, match=f"{entry['file']}: {entry['tokens'] - 5000:,} tokens on disk, "
                                        f"the manifest says {entry['tokens']:,}; copy it again"):
        load_shards(str(folder), None, "auto", None, 0.1)
    entry["tokens"] -= 5000
    manifest.write_text(json.dumps(m))
    # half copied: a whole number of tokens, so only the manifest tells
    entry = m["shards"]["train"][1]
    shard = folder / entry["file"]
    shard.write_bytes(shard.read_bytes()[:entry["tokens"] // 2 * 2])
    train = ["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), "--set", "run.device=cpu",
             "--max-steps", "1", "--set", "data.source=shards", "--set", f"data.path={folder}"]
    assert _one_error(capsys, train) == (
        f"loco train: error: {shard}: {entry['tokens'] // 2:,} tokens on disk, the manifest says {entry['tokens']:,}; "
        f"copy it again or run loco data prepare again")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_loco_data_verify_reads_every_shard_against_its_checksum(corpus, tmp_path, capsys):
    folder, m = _copied_shards(corpus, tmp_path)
    entries = m["shards"]["train"] + m["shards"]["val"]
    assert all(len(s["xxh3_64"]) == 16 for s in entries)
    verify = ["data", "verify", "--path", str(folder)]
    capsys.readouterr()
    assert main(verify) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{folder}: {len(entries)} shard(s), {sum(s['tokens'] for s in entries):,} tokens, match the manifest "
        f"(sizes and checksums)"]
    flipped, cut = (folder / m["shards"][side][0]["file"] for side in ("val", "train"))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the size still matches
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-2])
    assert main(verify) == 2
    *bad, summary = capsys.readouterr().out.splitlines()
    assert bad == [f"{cut}: {m['shards']['train'][0]['tokens'] - 1:,} tokens on disk, "
                   f"the manifest says {m['shards']['train'][0]['tokens']:,}", bad[1]]
    assert bad[1].startswith(f"{flipped}: checksum ") and bad[1].endswith(
        f" on disk, the manifest says {m['shards']['val'][0]['xxh3_64']}")
    assert summary == (f"{folder}: 2 of {len(entries)} shard(s) differ from the manifest; copy them again or run "
                       f"loco data prepare again")


def test_a_manifest_without_checksums_loads_and_verify_checks_sizes_only(corpus, tmp_path, capsys):
    from launch.data.shards import load_shards

    folder, m = _copied_shards(corpus, tmp_path)
    for s in m["shards"]["train"] + m["shards"]["val"]:
        s.pop("xxh3_64", None)
    (folder / "manifest.json").write_text(json.dumps(m))
    assert load_shards(str(folder), None, "auto", None, 0.1).val_tokens == m["tokens"]["val"]
    capsys.readouterr()
    assert main(["data", "verify", "--path", str(folder)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "match the manifest; all by size only, their checksums unknown (the manifest records none)")
