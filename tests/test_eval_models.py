"""Models loaded to be scored (``launch.eval.models``): a checkpoint and its fp32 export compute the same logits
through the same tokenizer, for a byte-level run and a BPE; a folder's own eos; bad input as one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from launch.errors import RunError
from launch.eval.models import ScoredModel, load_checkpoint, load_hf

pytest.importorskip("transformers")
from test_export import exported, gqa, trained  # noqa: E402,F401 (fixtures: a byte-level run, a BPE, their exports)

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["trained", "gqa"])
def test_a_checkpoint_and_its_export_score_alike(exported, trained, gqa, name):
    run = {"trained": trained, "gqa": gqa}[name]
    mine, theirs = load_checkpoint(run, CPU), load_hf(exported[name], CPU)
    assert isinstance(mine, ScoredModel) and isinstance(theirs, ScoredModel)
    assert (mine.max_len, mine.vocab_size) == (theirs.max_len, theirs.vocab_size)
    assert not mine.model.training and not theirs.model.training
    assert (mine.tokenizer.token_bytes() == theirs.tokenizer.token_bytes()).all()
    assert mine.tokenizer.eos == theirs.tokenizer.eos
    text = "def add(x, y):\n    return [item for item in items]  # é\n"
    ids = torch.tensor([mine.tokenizer.encode(text).tolist()], dtype=torch.long)[:, :mine.max_len]
    assert ids.tolist() == [theirs.tokenizer.encode(text).tolist()[:mine.max_len]]
    with torch.no_grad():
        want, got = mine.model(ids), theirs.model(ids)
    assert got.shape == want.shape == (1, ids.shape[1], mine.vocab_size)
    assert (got - want).abs().max().item() < 1e-4
    assert theirs.config is None and theirs.step is None and str(exported[name]) in theirs.description
    assert mine.step == (4 if name == "trained" else 3)
    assert f"(step {mine.step})" in mine.description and str(run) in mine.description
    if name == "trained":  # a run's checkpoint holds its settings: the Config comes back
        assert mine.config is not None and (mine.config.data.seq_len, mine.config.run.max_steps) == (32, 4)
        assert mine.tokenizer.name == "bytes" and theirs.tokenizer.name == "tokenizer.json"
    else:  # a checkpoint saved by hand holds no config; the BPE is the very file the export wrote
        assert mine.config is None and mine.tokenizer.sha256 == theirs.tokenizer.sha256


def test_the_python_snippet_of_docs_models_runs(trained, capsys):
    """docs/models.md's ``load_checkpoint`` example, run as written on a checkpoint."""
    import re

    doc = (Path(__file__).parent.parent / "docs" / "models.md").read_text()
    snippet = re.search(r"## From Python.*?```python\n(.*?)```", doc, re.S).group(1)
    exec(snippet.replace('"runs/mine"', repr(str(trained))), {})
    out = capsys.readouterr().out.splitlines()
    assert str(trained) in out[0] and out[-1].endswith("nats per token at step 4")


def test_a_folder_s_eos_is_the_one_its_tokenizer_config_names(exported, tmp_path):
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path / "named"
    shutil.copytree(exported["gqa"], folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<|doc_end|>", special=True, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|doc_end|>", "special": True}  # an added token's fields, as older files have
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_hf(folder, CPU).tokenizer.eos == tok.token_to_id("<|doc_end|>")

    from launch.data.tokens import DataError

    config["eos_token"] = "<|not_there|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match=r"tokenizer.json: the tokenizer has no token '<\|not_there\|>', named as"):
        load_hf(folder, CPU)


def test_bad_input_is_one_line_naming_the_path(tmp_path, exported):
    missing, bare, unweighted, tokenless = (tmp_path / n for n in ("missing", "bare", "unweighted", "tokenless"))
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"")
    unweighted.mkdir()
    (unweighted / "config.json").write_text("{}")
    shutil.copytree(exported["trained"], tokenless, ignore=shutil.ignore_patterns("tokenizer.json"))
    junk = tmp_path / "step_00000001.pt"
    junk.write_bytes(b"PK\x03\x04 not a checkpoint")
    custom = tmp_path / "custom"
    from launch.store.checkpoint import save_checkpoint

    save_checkpoint(custom, 1, {"model": {}, "model_args": None, "tokenizer": "bytes"})
    cases = [(load_hf, missing, "no such folder"), (load_hf, junk, "a file, not a folder"),
             (load_hf, bare, "no config.json there"), (load_hf, unweighted, "no weights there"),
             (load_hf, tokenless, "no tokenizer.json there"), (load_checkpoint, junk, "unreadable"),
             (load_checkpoint, missing, "no such checkpoint file"), (load_checkpoint, bare, "no valid checkpoint"),
             (load_checkpoint, custom, "trained with a custom model")]
    for load, path, words in cases:
        with pytest.raises(RunError) as info:
            load(path, CPU)
        line = str(info.value)
        assert "\n" not in line and str(path) in line and words in line, (load.__name__, path, line)
