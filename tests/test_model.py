"""launch.models.transformer: shapes, causality, parameter counts of the named sizes, generation, and training a custom module."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from launch.config import load_config
from launch.config.schema import ModelConfig
from launch.models.transformer import SIZES, ModelArgs, Transformer, count_params, flops_per_token, model_args_from_config

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def small_args(**kw) -> ModelArgs:
    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)
    base.update(kw)
    return ModelArgs(**base)


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


def analytic_params(a: ModelArgs) -> int:
    """Parameters of the Llama-style decoder, counted by hand."""
    head = a.dim // a.n_heads
    attn = a.dim * a.n_heads * head * 2 + a.dim * a.kv_heads * head * 2  # wq, wo; wk, wv
    ffn = 3 * a.dim * a.hidden
    norms = 2 * a.dim
    embed = a.vocab_size * a.dim
    output = 0 if a.tie_embeddings else a.vocab_size * a.dim
    return a.n_layers * (attn + ffn + norms) + a.dim + embed + output


def meta_model(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


# ---------------------------------------------------------------------------------------------
# shapes and structure
# ---------------------------------------------------------------------------------------------

def test_tiny_logits_shape():
    args = replace(SIZES["tiny"], vocab_size=256, max_seq_len=32)
    model = build(args)
    idx = torch.randint(0, 256, (3, 20))
    logits = model(idx)
    assert logits.shape == (3, 20, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_causal_changing_a_token_leaves_earlier_logits_alone():
    model = build(small_args()).eval()
    idx = torch.randint(0, 64, (2, 12))
    t = 7
    changed = idx.clone()
    changed[:, t] = (idx[:, t] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=1e-4)  # and it does change the rest


def test_prefix_gives_same_logits_as_full_sequence():
    model = build(small_args()).eval()
    idx = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        assert torch.allclose(model(idx[:, :6]), model(idx)[:, :6], atol=1e-5)


def test_tied_vs_untied_embeddings():
    tied, untied = build(small_args(tie_embeddings=True)), build(small_args(tie_embeddings=False))
    assert tied.output is None and isinstance(untied.output, nn.Linear)
    assert count_params(untied) - count_params(tied) == 64 * 32
    assert count_params(tied) == analytic_params(tied.args)
    assert count_params(untied) == analytic_params(untied.args)
    # tied: the output projection is the embedding matrix
    h = torch.randn(1, 3, 32)
    assert torch.allclose(F.linear(h, tied.embed.weight), h @ tied.embed.weight.T, atol=1e-6)
    assert untied(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 64)
    # optim.name=muon steps the blocks' matrices, tied or not: never the embedding, the head or a norm
    from launch.loop.build import hidden_matrices

    for model in (tied, untied):
        names = {id(p): n for n, p in model.named_parameters()}
        hidden = [names[id(p)] for p in hidden_matrices(model)]
        assert len(hidden) == 7 * model.args.n_layers and all(n.startswith("layers.") for n in hidden), hidden


def test_count_params_non_embedding():
    model = build(small_args())
    assert count_params(model) - count_params(model, non_embedding=True) == 64 * 32


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_grouped_query_attention(kv):
    args = small_args(n_heads=4, n_kv_heads=kv)
    model = build(args)
    head = 32 // 4
    attn = model.layers[0].attn
    assert attn.wq.weight.shape == (4 * head, 32)
    assert attn.wk.weight.shape == (kv * head, 32)
    assert attn.wv.weight.shape == (kv * head, 32)
    assert attn.wo.weight.shape == (32, 4 * head)
    logits = model(torch.randint(0, 64, (2, 9)))
    assert logits.shape == (2, 9, 64)
    assert torch.isfinite(logits).all()
    mha = build(small_args(n_heads=4))
    assert count_params(mha) - count_params(model) == 2 * 2 * (4 - kv) * head * 32  # 2 layers x (wk + wv)


def test_gqa_is_causal_too():
    model = build(small_args(n_kv_heads=2)).eval()
    idx = torch.randint(0, 64, (1, 10))
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 3) % 64
    with torch.no_grad():
        assert torch.allclose(model(idx)[:, :5], model(changed)[:, :5], atol=1e-6)


def test_sequence_longer_than_max_seq_len_raises():
    model = build(small_args(max_seq_len=16))
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly max_seq_len is fine
    with pytest.raises(ValueError, match="longer than max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_hidden_size_rounding():
    assert ModelArgs(dim=128, n_layers=1, n_heads=4).hidden == 384  # int(8*128/3)=341 -> 384
    assert ModelArgs(dim=128, n_layers=1, n_heads=4, ffn_dim=100).hidden == 100
    assert ModelArgs(dim=128, n_layers=1, n_heads=4).kv_heads == 4
    assert ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2).kv_heads == 2


def test_residual_projections_have_smaller_init():
    model = build(ModelArgs(dim=256, n_layers=8, n_heads=4, vocab_size=64))
    wq, wo = model.layers[0].attn.wq.weight, model.layers[0].attn.wo.weight
    assert wq.std().item() == pytest.approx(0.02, rel=0.1)
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert torch.all(model.norm.weight == 1)


# ---------------------------------------------------------------------------------------------
# named sizes, without allocating their weights
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", list(SIZES))
def test_every_named_size_builds_on_meta(size):
    args = replace(SIZES[size], vocab_size=32000, max_seq_len=256)
    model = meta_model(args)
    assert model.embed.weight.is_meta
    assert count_params(model) == analytic_params(args) == args.n_params
    assert len(model.layers) == args.n_layers
    assert args.dim % args.n_heads == 0 and args.n_heads % args.kv_heads == 0
    assert (args.dim // args.n_heads) % 2 == 0


def test_150m_parameter_count():
    args = replace(SIZES["150m"], vocab_size=32000)
    n = count_params(meta_model(args))
    assert 140e6 <= n <= 160e6, n
    assert (args.dim, args.n_layers, args.n_heads) == (896, 12, 16)


def test_1b_parameter_count():
    args = replace(SIZES["1b"], vocab_size=32000)
    n = count_params(meta_model(args))
    assert 1.0e9 <= n <= 1.2e9, n
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (2048, 22, 32, 4)
    assert not args.tie_embeddings


def test_named_sizes_grow():
    counts = [count_params(meta_model(replace(SIZES[s], vocab_size=32000))) for s in ("tiny", "small", "150m", "1b")]
    assert counts == sorted(counts) and len(set(counts)) == 4


# ---------------------------------------------------------------------------------------------
# model_args_from_config
# ---------------------------------------------------------------------------------------------

def test_model_args_from_config_defaults_to_named_size():
    args = model_args_from_config(ModelConfig(size="small"), vocab_size=256, seq_len=128)
    assert (args.dim, args.n_layers, args.n_heads) == (SIZES["small"].dim, SIZES["small"].n_layers, SIZES["small"].n_heads)
    assert args.vocab_size == 256 and args.max_seq_len == 128


def test_model_args_from_config_overrides():
    mcfg = ModelConfig(size="tiny", dim=64, n_layers=3, n_heads=8, n_kv_heads=2, ffn_dim=96, vocab_size=500,
                       tie_embeddings=False, rope_theta=500.0, norm_eps=1e-6, init_std=0.01)
    args = model_args_from_config(mcfg, vocab_size=256, seq_len=64)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.hidden) == (64, 3, 8, 2, 96)
    assert args.vocab_size == 500  # the config's vocab wins over the data's
    assert args.tie_embeddings is False
    assert (args.rope_theta, args.norm_eps, args.init_std, args.max_seq_len) == (500.0, 1e-6, 0.01, 64)
    model = build(args)
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 500)


def test_model_args_from_loaded_config():
    cfg, _ = load_config([TINY], ["model.dim=64", "model.n_layers=2"])
    args = model_args_from_config(cfg.model, vocab_size=256, seq_len=cfg.data.seq_len)
    assert (args.dim, args.n_layers, args.n_heads, args.max_seq_len) == (64, 2, 4, 128)


@pytest.mark.parametrize("overrides, match", [
    (dict(dim=130), "does not divide model.dim=130"),
    (dict(dim=64, n_heads=5), "does not divide model.dim=64"),
    (dict(n_kv_heads=3), "model.n_kv_heads=3 does not divide model.n_heads=4"),
    (dict(dim=100), "must be even for rotary"),  # 100 / 4 heads = 25
])
def test_model_args_from_config_rejects(overrides, match):
    with pytest.raises(ValueError, match=match):
        model_args_from_config(ModelConfig(size="tiny", **overrides), vocab_size=256, seq_len=64)


# ---------------------------------------------------------------------------------------------
# generation, FLOPs, gradients
# ---------------------------------------------------------------------------------------------

def test_generate_length_and_prompt_kept():
    model = build(small_args()).eval()
    prompt = torch.randint(0, 64, (2, 5))
    out = model.generate(prompt, 7, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :5], prompt)
    assert out.dtype == torch.long and int(out.min()) >= 0 and int(out.max()) < 64


def test_generate_beyond_max_seq_len_crops_context():
    model = build(small_args(max_seq_len=16)).eval()
    out = model.generate(torch.zeros(1, 10, dtype=torch.long), 20, temperature=0)
    assert out.shape == (1, 30)


def test_greedy_generation_is_deterministic_and_argmax():
    model = build(small_args()).eval()
    prompt = torch.randint(0, 64, (1, 4))
    a = model.generate(prompt, 6, temperature=0)
    b = model.generate(prompt, 6, temperature=0, generator=torch.Generator().manual_seed(123))
    assert torch.equal(a, b)
    with torch.no_grad():
        assert int(a[0, 4]) == int(model(prompt)[0, -1].argmax())


def test_sampling_follows_the_generator_seed():
    model = build(small_args()).eval()
    prompt = torch.zeros(1, 3, dtype=torch.long)
    a = model.generate(prompt, 10, temperature=1.5, generator=torch.Generator().manual_seed(7))
    b = model.generate(prompt, 10, temperature=1.5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_top_k_one_is_greedy():
    model = build(small_args()).eval()
    prompt = torch.randint(0, 64, (1, 4))
    sampled = model.generate(prompt, 5, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sampled, model.generate(prompt, 5, temperature=0))


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_exceeds_6n(tie):
    model = build(small_args(tie_embeddings=tie))
    fpt = flops_per_token(model, seq_len=16)
    assert fpt > 6 * count_params(model)
    a = model.args
    assert fpt == 6.0 * (count_params(model, non_embedding=True) + a.vocab_size * a.dim) + 12.0 * a.n_layers * a.dim * 16


def test_flops_per_token_of_a_big_meta_model():
    model = meta_model(replace(SIZES["150m"], vocab_size=32000))
    assert flops_per_token(model, 1024) > 6 * count_params(model)


def test_flops_per_token_of_a_custom_module():
    custom = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    assert flops_per_token(custom, 8) == 6.0 * count_params(custom)


@pytest.mark.parametrize("tie, kv", [(True, None), (False, 2)])
def test_backward_gives_finite_grads_everywhere(tie, kv):
    model = build(small_args(tie_embeddings=tie, n_kv_heads=kv))
    idx = torch.randint(0, 64, (2, 16))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1))
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(math.log(64), rel=0.1)  # near uniform at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_state_dict_has_no_rope_buffers():
    model = build(small_args())
    keys = model.state_dict().keys()
    assert not any("rope" in k for k in keys)
    clone = build(small_args(), seed=1)
    clone.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert torch.equal(clone(idx), model(idx))


# ---------------------------------------------------------------------------------------------
# a custom module through the Python API
# ---------------------------------------------------------------------------------------------

class Bigram(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))


def test_custom_module_trains_through_python_api(tmp_path):
    from launch.loop.trainer import train

    # 'off' is quoted: unquoted, YAML 1.1 reads it as false (see the xfail in test_config.py)
    cfg, _ = load_config([TINY], ["run.max_steps=3", "run.eval_every=0", "eval.tokens=256", "log.plot=false",
                                  "data.max_docs=50", "log.progress='off'", f"run.dir={tmp_path}"])
    custom = Bigram()
    before = custom.head.weight.detach().clone()
    summary = train(cfg, model=custom)
    assert summary["steps"] == 3
    assert summary["algorithm"] == "ddp" and summary["num_workers"] == 1
    assert summary["tokens"] == 3 * cfg.run.batch_size * cfg.data.seq_len
    assert math.isfinite(summary["val_loss"])
    # the weights moved (on whichever device run.device=auto chose: compared on the CPU)
    assert not torch.equal(before, custom.head.weight.detach().cpu())
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"] == 3
    assert (tmp_path / "config.yaml").is_file()
    assert list((tmp_path / "checkpoints").glob("step_*.pt"))
    assert not (tmp_path / "loss.png").exists()  # log.plot=false


def test_recomputed_blocks_give_the_same_gradients_and_run_twice_also_compiled():
    """model.activation_checkpointing: each block runs again in the backward (its forward counted twice a step),
    the loss and every gradient as without; under torch.compile too (aot_eager: dynamo and autograd's partition
    of the recomputation, without generating kernels)."""
    args = small_args(n_layers=3)
    x = torch.randint(0, args.vocab_size, (2, args.max_seq_len))

    def grads(model: Transformer) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        calls = []
        # pre-hooks: a recomputation stops once it has what the backward needs, before a block's forward returns
        hooks = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in model.layers]
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        for h in hooks:
            h.remove()
        return loss.detach(), [p.grad for p in model.parameters()], len(calls)

    loss, want, calls = grads(build(args))
    assert calls == 3
    recomputed = build(args)
    recomputed.recompute_blocks(True)
    loss2, got, calls2 = grads(recomputed)
    assert calls2 == 6 and torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(want, got))
    with torch.no_grad():  # nothing to recompute for: evaluation keeps running each block once
        assert torch.equal(recomputed(x), build(args)(x))

    torch._dynamo.reset()
    compiled = build(args)
    compiled.recompute_blocks(True)
    compiled.compile(backend="aot_eager")
    loss3 = F.cross_entropy(compiled(x).flatten(0, 1), x.flatten())
    loss3.backward()
    assert torch.allclose(loss3.detach(), loss, rtol=1e-6)
    assert all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7) for p, g in zip(compiled.parameters(), want))
