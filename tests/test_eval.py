"""``loco eval``: a run's checkpoint scores what the run reported, whatever the batch layout; its fp32 export scores
the same on the run's text; bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, TINY
from launch.cli import main

RUN = [*FAST, "run.max_steps=4", "data.seq_len=32", "eval.tokens=2048", "run.eval_every=2", "log.every=2"]


def _train(folder: Path, *extra: str) -> dict:
    from launch.config import load_config
    from launch.loop.trainer import train

    cfg, _ = load_config([TINY], [*RUN, f"run.dir={folder}", *extra])
    return train(cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One model trained twice: the batch of 4 whole, and in micro-batches of 2 with its windows scored 3 at a
    time."""
    root = tmp_path_factory.mktemp("eval")
    _train(root / "whole", "run.batch_size=4")
    _train(root / "accum", "run.batch_size=4", "run.grad_accum=2", "eval.batch_size=3")
    return {"whole": root / "whole", "accum": root / "accum", "root": root}


def _eval(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["eval", *args, "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_a_checkpoint_scores_what_its_run_reported_whatever_the_layout(runs, capsys):
    whole, accum = _summary(runs["whole"]), _summary(runs["accum"])
    assert whole["val_tokens"] == accum["val_tokens"] == 2048
    # the same model (gradient accumulation adds the same gradients), the same windows: the same figure
    assert abs(whole["val_loss"] / accum["val_loss"] - 1) < 1e-4
    assert whole["val_loss_se"] > 0 and whole["val_bpb_se"] > 0
    lines = [json.loads(x) for x in (runs["whole"] / "metrics.jsonl").read_text().splitlines()]
    assert all("val_loss_se" in r for r in lines if r.get("val_loss") is not None)
    for rows in ("1", "5", "64"):
        got = _eval(capsys, "--run-dir", str(runs["whole"]), "--batch-size", rows)["validation"]
        assert abs(got["val_loss"] / whole["val_loss"] - 1) < 1e-5, rows
        assert abs(got["val_bpb"] / whole["val_bpb"] - 1) < 1e-5 and got["windows"] == 64
    more = _eval(capsys, "--run-dir", str(runs["whole"]), "--tokens", "4096")["validation"]
    assert more["val_tokens"] == 4096 and more["val_loss_se"] < whole["val_loss_se"] * 0.9


def test_the_fp32_export_scores_the_same_on_the_run_s_text(runs, capsys):
    folder = runs["root"] / "hf"
    assert main(["export", "--run-dir", str(runs["whole"]), "--out", str(folder), "--dtype", "fp32"]) == 0
    run = _summary(runs["whole"])
    got = _eval(capsys, "--hf", str(folder), "--data", "stdlib", "--tokens", "2048", "--set", "data.seq_len=32",
                "--set", "data.max_docs=120")
    assert abs(got["validation"]["val_bpb"] - run["val_bpb"]) < 1e-4
    assert got["step"] is None and "tokenizer.json" in got["data"]


def test_the_table_and_bad_input(runs, capsys, tmp_path):
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(runs["whole"]), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "val loss" in out and " ± " in out and "bits/byte" in out and "64 windows of 32" in out
    (tmp_path / "empty").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    for args, words in [
        (["--run-dir", str(runs["whole"]), "--tokens", "0"], "--tokens 0"),
        (["--run-dir", str(runs["whole"]), "--data", "text", "--path", str(tmp_path / "empty")], "no text files"),
        (["--hf", str(tmp_path / "noweights")], "weights"),
        (["--run-dir", str(tmp_path / "nowhere")], "no such run folder"),
        (["--run-dir", str(runs["whole"]), "--set", "data.seq_len=4096"], "data.seq_len=4096"),
    ]:
        assert main(["eval", *args, "--device", "cpu"]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err, (args, err)
