"""Any transformers causal LM as loco's model (model.hf_config) and weights from a Hugging Face folder
(model.init_from): trained with DiLoCo alike in the simulator and under torchrun, resumed exactly, and every bad
input refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TINY, loco, simulate_and_torchrun
from launch.cli import main

CONFIGS = {
    "llama": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
              "tie_word_embeddings": False},
    # no dropout: its draws come from each process's generator, which the simulator's workers share
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
COMMON = ["--set", "data.seq_len=32", "--set", "run.batch_size=4", "--set", "data.max_docs=60",
          "--set", "eval.tokens=256", "--set", "log.plot=false", "--set", "run.device=cpu",
          "--set", "run.threads=1"]


def _config(folder: Path, kind: str, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}.json"
    path.write_text(json.dumps({**CONFIGS[kind], **changes}))
    return path


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# one model under torchrun: the wrapper and the exchange are the same for every transformers model (gpt2 trains in
# the resume test below), and each torchrun costs two fresh processes
@pytest.mark.parametrize("kind", ["llama"])
def test_an_hf_config_model_trains_alike_simulated_and_under_torchrun(tmp_path, kind, capfd):
    config = _config(tmp_path, kind)
    args = ["--config", TINY, "--max-steps", "4", "--seed", "3", *COMMON, "--set", f"model.hf_config={config}",
            "--set", "algo.name=diloco", "--set", "algo.inner_steps=2", "--set", "run.checkpoint_every=4"]
    a, b, sa, sb = simulate_and_torchrun(tmp_path, args, 2, capfd)
    assert a["hf_config"]["model_type"] == kind and a["model_args"] is None
    assert next(iter(a["model"])).startswith("hf.")
    assert _max_diff(a["model"], b["model"]) < 1e-5
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0 and sa["val_bpb"] is not None


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_an_hf_config_run_resumes_exactly_and_samples(tmp_path, tiny_cfg, capsys, kind):
    from launch.loop.trainer import Hooks, train

    config = _config(tmp_path, kind)
    # gpt2 with Muon on its hidden matrices (Conv1D weights), AdamW on the rest: its state resumes as AdamW's
    extra = ["data.seq_len=32", "run.batch_size=4", "run.max_steps=6", "run.eval_every=3", "log.every=1",
             f"model.hf_config={config}", "run.checkpoint_every=0", "algo.name=diloco", "algo.inner_steps=2",
             f"optim.name={'muon' if kind == 'gpt2' else 'adamw'}"]
    whole = train(tiny_cfg(*extra, run_dir=tmp_path / "whole"))

    def interrupt(step, record):
        if step == 4:
            raise KeyboardInterrupt

    # the broken run recomputes its layers in the backward (transformers' gradient checkpointing): the same bits
    recompute = "model.activation_checkpointing=true"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(*extra, recompute, run_dir=tmp_path / "broken"), hooks=Hooks(on_step=interrupt))
    resumed = train(tiny_cfg(*extra, recompute, "run.resume=true", run_dir=tmp_path / "broken"))
    assert resumed["val_loss"] == whole["val_loss"]
    from launch.loop.build import hidden_matrices
    from launch.models.hf.causal_lm import build_hf_model

    model = build_hf_model(str(config), 256, 32)
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = sorted(names[id(p)] for p in hidden_matrices(model))
    in_blocks = sorted(n for n, p in model.named_parameters() if p.dim() == 2 and (".h." in n or ".layers." in n))
    assert hidden == in_blocks, hidden  # neither an embedding nor the head
    model.recompute_blocks(True)
    assert getattr(model.hf, "is_activation_checkpointing", None) or model.hf.is_gradient_checkpointing
    capsys.readouterr()
    assert main(["sample", "--run-dir", str(tmp_path / "whole"), "--prompt", "def ", "--max-new-tokens", "5",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_init_from_a_saved_hf_model_starts_every_worker_from_its_weights(tmp_path, capfd):
    from launch.models.hf.causal_lm import HFCausalLM, read_hf_config

    config = _config(tmp_path, "gpt2")
    torch.manual_seed(123)
    saved = HFCausalLM(read_hf_config(config))
    saved.hf.save_pretrained(tmp_path / "start")
    run = loco(["simulate", "--config", TINY, "--workers", "2", "--max-steps", "1", *COMMON,
                "--set", f"model.hf_config={config}", "--set", f"model.init_from={tmp_path / 'start'}",
                "--set", "optim.lr=1e-12", "--set", "optim.warmup_steps=0", "--set", "algo.name=diloco",
                "--set", "algo.inner_steps=1", "--set", "run.checkpoint_every=1", "--baseline", "none",
                "--run-dir", str(tmp_path / "run")], capfd)
    assert run.returncode == 0, run.stderr[-2000:]
    from launch.store.checkpoint import latest_checkpoint

    state = latest_checkpoint(tmp_path / "run" / "checkpoints")[1]
    for w in state["workers"]:
        assert _max_diff({k: v for k, v in saved.state_dict().items()}, w["model"]) < 1e-6
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["init_from"]["path"] == str(tmp_path / "start") and len(summary["init_from"]["sha256"]) == 64


def _one_error(capsys, *sets: str) -> str:
    capsys.readouterr()
    argv = ["train", "--config", TINY, "--max-steps", "1", *COMMON]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_bad_models_and_weights_are_one_line(tmp_path, capsys):
    from launch.models.hf.causal_lm import HFCausalLM, read_hf_config

    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "no-such-model", "hidden_size": 8}))
    assert "transformers does not know model_type 'no-such-model'" in _one_error(capsys, f"model.hf_config={unknown}")
    small = _config(tmp_path / "small", "gpt2", vocab_size=200)
    assert "vocab_size 200 is smaller than the tokenizer's 256 ids" in _one_error(capsys, f"model.hf_config={small}")
    gpt2 = _config(tmp_path, "gpt2")
    folder = tmp_path / "sharded"
    HFCausalLM(read_hf_config(gpt2)).hf.save_pretrained(folder, max_shard_size="20KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (folder / victim).rename(tmp_path / victim)
    assert f"names {victim}, which is not in" in _one_error(capsys, f"model.hf_config={gpt2}",
                                                             f"model.init_from={folder}")
    wide = tmp_path / "wide"
    HFCausalLM(read_hf_config(_config(tmp_path / "w", "gpt2", n_embd=48))).hf.save_pretrained(wide)
    assert "has shape" in _one_error(capsys, f"model.hf_config={gpt2}", f"model.init_from={wide}")
    llama = tmp_path / "llama"
    HFCausalLM(read_hf_config(_config(tmp_path / "l", "llama"))).hf.save_pretrained(llama)
    assert "another architecture" in _one_error(capsys, f"model.hf_config={gpt2}", f"model.init_from={llama}")


def test_an_hf_config_run_exports_with_save_pretrained_and_its_tokenizer(tmp_path, tiny_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launch.store.checkpoint import latest_checkpoint
    from launch.models.hf.export import export
    from launch.models.hf.causal_lm import HFCausalLM, config_from_dict
    from launch.data.tokenizer import train_bpe
    from launch.loop.trainer import train

    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    tok = train_bpe(texts, 300, tmp_path / "tok.json", say=lambda m: None)
    cfg = tiny_cfg("data.seq_len=32", "run.batch_size=4", "run.max_steps=2", "run.eval_every=0",
                   f"model.hf_config={_config(tmp_path, 'llama', vocab_size=320)}", f"data.tokenizer={tmp_path / 'tok.json'}")
    train(cfg)
    state = latest_checkpoint(tmp_path / "run" / "checkpoints")[1]
    export(tmp_path / "run", tmp_path / "out", dtype="fp32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = HFCausalLM(config_from_dict(state["hf_config"], "checkpoint"))
    ours.load_state_dict(state["model"])
    ids = torch.randint(0, tok.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, ours.eval()(ids), atol=1e-5)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert hf_tok.decode(hf_tok("def f3(x):")["input_ids"]) == "def f3(x):"


def test_init_from_an_export_then_export_gives_the_same_weights_back(tmp_path, tiny_cfg):
    from safetensors.torch import load_file

    from launch.loop.build import build_model
    from launch.store.checkpoint import latest_checkpoint, save_checkpoint
    from launch.data.batches import load_data
    from launch.models.hf.export import export
    from launch.loop.trainer import train

    base = ["data.seq_len=32", "run.batch_size=4", "run.eval_every=0", "model.n_kv_heads=2",
            "model.tie_embeddings=false"]
    cfg = tiny_cfg(*base, "run.max_steps=2")
    train(cfg)
    first = latest_checkpoint(tmp_path / "run" / "checkpoints")[1]
    export(tmp_path / "run", tmp_path / "a", dtype="fp32")
    again = tiny_cfg(*base, "run.max_steps=1", f"model.init_from={tmp_path / 'a'}", run_dir=tmp_path / "again")
    model, args = build_model(again, load_data(again.data), torch.device("cpu"))
    assert args.n_kv_heads == 2 and not args.tie_embeddings
    assert all(torch.equal(model.state_dict()[k], v) for k, v in first["model"].items())
    save_checkpoint(tmp_path / "b", 1, {"model": model.state_dict(), "model_args": vars(args), "tokenizer": "bytes"})
    export(tmp_path / "b", tmp_path / "b-out", dtype="fp32")
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b-out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_an_export_names_it_and_refuses_another_tokenizer_or_a_smaller_vocabulary(tmp_path, capsys):
    """An export starts a run of its own tokenizer, and the start lines say so with its step; a BPE of the same
    size but other merges, or a vocabulary smaller than the data's, is one line naming model.init_from."""
    from launch.data.tokenizer import train_bpe
    from launch.models.hf.export import export
    from launch.models.transformer import ModelArgs, Transformer
    from launch.store.checkpoint import save_checkpoint

    mine = train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(200)], 280, tmp_path / "a.json",
                     say=lambda m: None)
    other = train_bpe([f"while n > {i}:\n    n -= {i % 5}\n" for i in range(200)], 280, tmp_path / "b.json",
                      say=lambda m: None)
    assert mine.vocab_size == other.vocab_size and mine.sha256 != other.sha256

    def exported(name: str, vocab: int, tokenizer) -> Path:
        args = ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=vocab, max_seq_len=32)
        save_checkpoint(tmp_path / name, 7, {"model": Transformer(args).state_dict(), "model_args": vars(args),
                                             **({"tokenizer": tokenizer.state()} if tokenizer else {})})
        export(tmp_path / name, tmp_path / f"{name}-out", dtype="fp32")
        return tmp_path / f"{name}-out"

    folder = exported("a", mine.vocab_size, mine)
    err = _one_error(capsys, f"data.tokenizer={tmp_path / 'b.json'}", f"model.init_from={folder}")
    assert f"model.init_from {folder}" in err and "b.json" in err and "data.tokenizer" in err, err
    err = _one_error(capsys, f"data.tokenizer={tmp_path / 'a.json'}", f"model.init_from={exported('v', 256, None)}")
    assert "model.init_from" in err and "vocabulary of 256 ids" in err and "model.vocab_size" not in err, err
    assert main(["train", "--config", TINY, "--max-steps", "1", *COMMON, "--set", "run.eval_every=0",
                 "--set", f"run.dir={tmp_path / 'run'}", "--set", f"data.tokenizer={tmp_path / 'a.json'}",
                 "--set", f"model.init_from={folder}"]) == 0
    assert f"weights from model.init_from {folder} (step 7 of" in capsys.readouterr().err
