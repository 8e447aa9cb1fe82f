"""``loco export``: a checkpoint as a Hugging Face Llama folder that ``transformers`` loads and that computes what
loco's model computes; the weight map both ways; the tokenizer; shards; bad input as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST, TINY, loco
from launch.store.checkpoint import latest_checkpoint, save_checkpoint
from launch.errors import RunError
from launch.models.hf.weights import args_from_llama_config, hf_shapes, hf_to_loco, llama_config, loco_to_hf
from launch.models.transformer import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LOGITS_ATOL = "1e-4"  # fp32 logits of an export against loco's; docs/run-folder.md states the same bound
TEXTS = ["def add(x, y):\n    return x + y\n", "for item in items:\n    print(item)\n",
         "class Point:\n    def __init__(self, x):\n        self.x = x\n"] * 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run trained a few steps: tied embeddings, byte-level."""
    from launch.config import load_config
    from launch.loop.trainer import train

    run = tmp_path_factory.mktemp("trained") / "run"
    cfg, _ = load_config([TINY], [*FAST, f"run.dir={run}", "run.max_steps=4", "data.seq_len=32",
                                  "run.batch_size=4"])
    train(cfg)
    return run


@pytest.fixture(scope="module")
def gqa(tmp_path_factory) -> Path:
    """A checkpoint of a model with 2 key/value heads for 4 query heads, its own output projection, and a BPE."""
    from launch.data.tokenizer import BPETokenizer, train_bpe

    folder = tmp_path_factory.mktemp("gqa")
    train_bpe(TEXTS, 300, folder / "tok.json", say=lambda m: None)
    tok = BPETokenizer.from_file(folder / "tok.json")
    torch.manual_seed(1)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size, max_seq_len=48,
                     tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6)
    model = Transformer(args)
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight would show
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_checkpoint(folder / "run" / "checkpoints", 3, {"model": model.state_dict(), "model_args": vars(args),
                                                        "tokenizer": tok.state()})
    return folder / "run"


@pytest.fixture(scope="module")
def exported(trained, gqa, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, run in (("trained", trained), ("gqa", gqa)):
        folder = tmp_path_factory.mktemp("exports") / name
        done = loco(["export", "--run-dir", str(run), "--out", str(folder), "--dtype", "fp32"])
        assert done.returncode == 0
        out[name] = folder
    return out


def _loco_model(run: Path) -> Transformer:
    _, state = latest_checkpoint(run / "checkpoints")
    model = Transformer(ModelArgs(**state["model_args"]))
    model.load_state_dict(state["model"])
    return model.eval()


@pytest.mark.parametrize("name", ["trained", "gqa"])
def test_transformers_loads_the_folder_and_computes_loco_s_logits(exported, trained, gqa, name):
    folder, run = exported[name], {"trained": trained, "gqa": gqa}[name]
    mine = _loco_model(run)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.dtype == torch.float32
    ids = torch.randint(0, mine.args.vocab_size, (2, min(32, mine.args.max_seq_len)),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = mine(ids), theirs(ids).logits
    assert (got - want).abs().max().item() < float(LOGITS_ATOL)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] == mine.args.tie_embeddings
    assert config["num_key_value_heads"] == mine.args.kv_heads and config["torch_dtype"] == "float32"
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= files
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder beside it
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files  # bytes or BPE alike
    if name == "trained":  # a byte-level run: the README says its ids are bytes and its tokenizer makes them
        assert config["eos_token_id"] == 0
        assert "`<|endoftext|>`, ends a document" in (folder / "README.md").read_text()


def test_the_weight_map_round_trips_bit_for_bit(exported, trained, gqa):
    from safetensors.torch import load_file

    for name, run in (("trained", trained), ("gqa", gqa)):
        _, state = latest_checkpoint(run / "checkpoints")
        args = ModelArgs(**state["model_args"])
        back = hf_to_loco(dict(loco_to_hf(state["model"], args)), args)
        assert back.keys() == state["model"].keys()
        assert all(torch.equal(back[k], state["model"][k]) for k in back)
        # the exported file reads back into the checkpoint's weights (an fp32 export changes no value)
        again = args_from_llama_config(json.loads((exported[name] / "config.json").read_text()))
        assert hf_shapes(again) == hf_shapes(args)
        assert (again.rope_theta, again.norm_eps, again.max_seq_len, again.tie_embeddings) == \
               (args.rope_theta, args.norm_eps, args.max_seq_len, args.tie_embeddings)
        loaded = hf_to_loco(load_file(exported[name] / "model.safetensors"), again)
        assert all(torch.equal(loaded[k], state["model"][k]) for k in loaded)


def test_the_run_s_bpe_becomes_a_tokenizer_transformers_loads(exported, gqa):
    from launch.data.tokenizer import tokenizer_from_state

    _, state = latest_checkpoint(gqa / "checkpoints")
    mine = tokenizer_from_state(state["tokenizer"], "test")
    theirs = transformers.AutoTokenizer.from_pretrained(exported["gqa"])
    assert isinstance(theirs, transformers.PreTrainedTokenizerFast)
    text = "def add(x, y):\n    return [item for item in items]\n"
    ids = theirs(text)["input_ids"]
    assert ids == mine.encode(text).tolist()
    assert theirs.decode(ids) == text
    assert theirs.eos_token_id == mine.eos == json.loads((exported["gqa"] / "config.json").read_text())["eos_token_id"]


def test_a_byte_level_run_s_tokenizer_encodes_text_to_its_bytes(exported, trained, tmp_path, capsys):
    """The tokenizer a byte-level export carries: AutoTokenizer, loco's own reader and lm-eval all take a text to
    its UTF-8 bytes, so the model scores the same bits per byte through it as through loco's ``bytes``."""
    from launch.data.tokenizer import BPETokenizer, ByteTokenizer

    folder, text = exported["trained"], "déf añadir(x):\n\treturn x + 1  # 🙂 <b>\x7f\x01"
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert theirs(text)["input_ids"] == list(text.encode("utf-8")) and theirs.decode(list(text.encode())) == text
    assert theirs.eos_token_id == 0 and theirs.eos_token == "<|endoftext|>" and len(theirs) == 256
    mine, plain = BPETokenizer.from_file(folder / "tokenizer.json"), ByteTokenizer()
    assert (mine.vocab_size, mine.eos) == (256, 0) and (mine.token_bytes() == plain.token_bytes()).all()
    every = "".join(map(chr, range(1, 0x800)))  # every byte but 0 (the separator), as 1- and 2-byte characters
    assert all(mine.encode(t).tolist() == plain.encode(t).tolist() for t in (text, every, ""))
    assert mine.encode("a\x00b").tolist() == [97, 98]  # byte 0 is no text: a NUL has no id of its own
    assert mine.decode([0, *text.encode()]) == text
    done = loco(["export", "--run-dir", str(trained), "--out", str(tmp_path / "again")], capsys)
    assert done.stdout.rstrip().endswith("tokenizer: bytes (tokenizer.json)")

    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(folder), device="cpu", dtype="float32")
    assert lm.tok_encode(text) == list(text.encode("utf-8")) and lm.eot_token_id == 0


def test_the_readme_generates_within_the_context_and_the_docs_state_the_tested_bound(exported):
    import re

    readme = (exported["trained"] / "README.md").read_text()
    context = json.loads((exported["trained"] / "config.json").read_text())["max_position_embeddings"]
    prompt = transformers.AutoTokenizer.from_pretrained(exported["trained"])(
        re.search(r"tokenizer\('(.*?)'", readme).group(1))["input_ids"]
    new = int(re.search(r"max_new_tokens=(\d+)", readme).group(1))
    assert context == 32 and len(prompt) + new <= context
    doc = (Path(__file__).parent.parent / "docs" / "run-folder.md").read_text()
    assert f"within {LOGITS_ATOL} in fp32" in doc and f"checks {LOGITS_ATOL}" in doc


def test_shards_hold_every_tensor_under_the_limit_and_load(gqa, tmp_path):
    from launch.models.hf.export import INDEX_FILE, write_safetensors

    _, state = latest_checkpoint(gqa / "checkpoints")
    args = ModelArgs(**state["model_args"])
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama_config(args, torch.bfloat16)))
    files = write_safetensors(folder, loco_to_hf(state["model"], args), hf_shapes(args), torch.bfloat16,
                              max_shard_bytes=40_000)
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((folder / INDEX_FILE).read_text())
    assert index["weight_map"].keys() == hf_shapes(args).keys() and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in state["model"].values())
    for file in files:
        tensors = safetensors_torch.load_file(folder / file)
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert sum(t.numel() * 2 for t in tensors.values()) <= 40_000 or len(tensors) == 1
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weights = dict(loco_to_hf(state["model"], args))
    for name, t in model.state_dict().items():
        if name in weights:
            assert torch.equal(t, weights[name].to(torch.bfloat16).float()), name


def _bad_checkpoints(folder: Path) -> dict[str, tuple[Path, str]]:
    """A checkpoint of each kind export refuses, with the words its one line says."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=2)
    state = Transformer(args).state_dict()
    custom = save_checkpoint(folder / "custom", 1, {"model": state, "model_args": None, "tokenizer": "bytes"})
    broken = folder / "broken" / "step_00000001.pt"
    broken.parent.mkdir()
    broken.write_bytes(b"PK\x03\x04 not a checkpoint")
    state["layers.0.attn.wk.weight"] = torch.zeros(30, 32)
    shape = save_checkpoint(folder / "shape", 1, {"model": state, "model_args": vars(args), "tokenizer": "bytes"})
    return {"custom": (custom, "trained with a custom model"), "unreadable": (broken, "unreadable"),
            "shape": (shape, "tensor layers.0.attn.wk.weight has shape [30, 32], the config expects [32, 32]")}


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, trained, capsys):
    exports = tmp_path / "exports"
    exports.mkdir()
    for name, (checkpoint, words) in _bad_checkpoints(tmp_path).items():
        done = loco(["export", "--checkpoint", str(checkpoint), "--out", str(exports / name)], capsys)
        lines = [line for line in done.stderr.splitlines() if "error:" in line]
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], (name, done.stderr)
        assert "Traceback" not in done.stderr
    assert list(exports.iterdir()) == []  # neither the folder nor a temporary one beside it

    full = exports / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    done = loco(["export", "--run-dir", str(trained), "--out", str(full)], capsys)
    assert done.returncode == 2 and "--out" in done.stderr and "--force" in done.stderr
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and len(list(exports.iterdir())) == 1
    done = loco(["export", "--run-dir", str(trained), "--out", str(full), "--force"], capsys)
    assert done.returncode == 0 and "wrote" in done.stdout
    assert not (full / "keep.txt").exists() and (full / "model.safetensors").is_file()
    assert [p.name for p in exports.iterdir()] == ["full"]
    with safetensors_torch.safe_open(full / "model.safetensors", "pt") as f:  # bf16 unless asked
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


def test_a_full_disk_names_both_sizes_in_units_that_differ(tmp_path, monkeypatch):
    import os

    import launch.models.hf.export as hf_export

    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 9, 9, 1, 9, 9, 9, 0, 255)))
    with pytest.raises(RunError, match=r"needs about 1\.5 MiB and 4\.0 KiB is free there"):
        hf_export._check_space(tmp_path, 3 << 19)


def test_a_failure_while_writing_leaves_neither_the_folder_nor_the_folders_made_for_it(tmp_path, trained,
                                                                                      monkeypatch):
    import launch.models.hf.export as hf_export

    def full_disk(folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export, "write_safetensors", full_disk)
    with pytest.raises(RunError, match="no space left on device for the export's [0-9.]+ [KMG]iB of weights; nothing"):
        hf_export.export(trained, tmp_path / "new" / "deeper" / "out")
    assert list(tmp_path.iterdir()) == []


def test_the_weight_map_names_a_mismatch_in_one_line():
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, tie_embeddings=False)
    tensors = {name: torch.zeros(shape) for name, shape in hf_shapes(args).items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 32)
    with pytest.raises(RunError, match=r"^x.safetensors: tensor model.layers.0.mlp.up_proj.weight has shape "
                                       r"\[7, 32\], the config expects \[128, 32\]$"):
        hf_to_loco(tensors, args, "x.safetensors")
    del tensors["lm_head.weight"]
    with pytest.raises(RunError, match="no tensor lm_head.weight"):
        hf_to_loco(tensors, args)
    with pytest.raises(RunError, match=r"hidden_act='gelu' \(loco's model has 'silu'\)"):
        args_from_llama_config({**llama_config(args), "hidden_act": "gelu"})


def test_export_help_documents_every_flag_with_examples(capsys):
    from test_cli import help_of, undocumented_options

    out = help_of(capsys, "export")
    assert out.startswith("usage: loco export") and undocumented_options(out) == []
    assert "\nexamples:\n  loco export --run-dir" in out
