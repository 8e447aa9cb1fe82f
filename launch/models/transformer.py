"""A Llama-style decoder in plain torch: RMSNorm, rotary positions, SwiGLU, optional GQA.

Named sizes follow the papers loco is compared against: ``150m`` is the
150M-parameter model of DiLoCo (12 layers, width 896, 16 heads; the count
assumes a 32k vocabulary), ``1b`` the 1.1B Llama of OpenDiLoCo (22 layers,
width 2048, 32 heads, 4 key/value heads). ``tiny`` trains visibly on two CPU
cores in a minute; ``small`` is a step up for one GPU.

Any ``nn.Module`` that maps token ids ``[B, T]`` to logits ``[B, T, V]`` can be
trained instead (``launch.loop.trainer.Trainer(cfg, model=...)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from launch.models.base import RunModel


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    vocab_size: int = 256
    max_seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        h = int(8 * self.dim / 3)  # SwiGLU keeps the parameter count of a 4x MLP
        return (h + 63) // 64 * 64

    @property
    def n_params(self) -> int:
        """The parameter count of :class:`Transformer` with these arguments, without building it."""
        head = self.dim // self.n_heads
        attn = self.dim * head * (2 * self.n_heads + 2 * self.kv_heads)
        block = attn + 3 * self.dim * self.hidden + 2 * self.dim
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embed + self.n_layers * block + self.dim


SIZES: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=128, n_layers=4, n_heads=4, tie_embeddings=True),
    "small": ModelArgs(dim=512, n_layers=8, n_heads=8, tie_embeddings=True),
    "150m": ModelArgs(dim=896, n_layers=12, n_heads=16, ffn_dim=2432, tie_embeddings=True),
    "1b": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, tie_embeddings=False),
}


def model_args_from_config(mcfg, vocab_size: int, seq_len: int) -> ModelArgs:
    """Named size, then any field the config sets explicitly."""
    args = replace(SIZES[mcfg.size], vocab_size=mcfg.vocab_size or vocab_size, max_seq_len=seq_len,
                   rope_theta=mcfg.rope_theta, norm_eps=mcfg.norm_eps, init_std=mcfg.init_std)
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings"):
        value = getattr(mcfg, key)
        if value is not None:
            args = replace(args, **{key: value})
    if args.dim % args.n_heads:
        raise ValueError(f"model.n_heads={args.n_heads} does not divide model.dim={args.dim}")
    if args.n_heads % args.kv_heads:
        raise ValueError(f"model.n_kv_heads={args.kv_heads} does not divide model.n_heads={args.n_heads}")
    if (args.dim // args.n_heads) % 2:
        raise ValueError(f"head size model.dim/model.n_heads={args.dim // args.n_heads} must be even for rotary embeddings")
    return args


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; rotates pairs (even, odd) of the last dim."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.n_heads, a.kv_heads, a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, self.n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, self.n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.hidden, bias=False)
        self.w3 = nn.Linear(a.dim, a.hidden, bias=False)
        self.w2 = nn.Linear(a.hidden, a.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.ffn = FeedForward(a)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


def _embedding(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(idx, weight)


#: The embedding lookup, kept out of ``torch.compile``'s graph: compiled, its backward becomes an atomic
#: scatter-add on CUDA, whose summation order changes from run to run, so two identical runs (a resumed one
#: and an unbroken one, the simulator and torchrun) would drift apart in the last bits. Eager, the backward
#: is deterministic, and the graph break it costs is one, at the very start of the forward.
#: ``Transformer.compile`` wraps it in ``torch.compiler.disable`` (which imports torch._dynamo: over a second,
#: for every process that never compiles, were it done at import).
_lookup = _embedding


class Transformer(RunModel):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.recompute = False  # model.activation_checkpointing: see recompute_blocks
        self.reset_parameters()

    def recompute_blocks(self, on: bool = True) -> None:
        """``model.activation_checkpointing``: each block keeps only its input through the forward and runs
        again in the backward, so a step holds one block's activations at a time instead of every block's, for
        about a third more compute."""
        self.recompute = on

    def output_head(self) -> Optional[nn.Module]:
        """The layer that makes the logits, where it is not the embedding (tied)."""
        return self.output

    def compile(self, *args, **kwargs) -> None:
        """``nn.Module.compile``, with the embedding lookup kept out of the graph (see ``_lookup``)."""
        global _lookup
        if _lookup is _embedding:
            _lookup = torch.compiler.disable(_embedding)
        super().compile(*args, **kwargs)

    def reset_parameters(self) -> None:
        std = self.args.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight")):  # residual projections, scaled by depth
                nn.init.normal_(p, std=std / math.sqrt(2 * self.args.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than max_seq_len={self.args.max_seq_len}")
        h = _lookup(idx, self.embed.weight)
        recompute = self.recompute and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:  # the blocks draw no random numbers: the second forward needs no saved RNG state
                h = checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=False, preserve_rng_state=False)
            else:
                h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h)
        return F.linear(h, self.embed.weight) if self.output is None else self.output(h)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        return sample_tokens(self, idx, max_new_tokens, self.args.max_seq_len, temperature, top_k, generator)


@torch.no_grad()
def sample_tokens(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, context: int, temperature: float = 1.0,
                  top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``idx`` and ``max_new_tokens`` more ids, each drawn from the logits of the last ``context`` ids (greedy
    at temperature 0)."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -context:])[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def count_params(model: nn.Module, non_embedding: bool = False) -> int:
    total = sum(p.numel() for p in model.parameters())
    if non_embedding and isinstance(model, Transformer):
        total -= model.embed.weight.numel()
    return total


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (forward + backward) plus attention scores (PaLM appendix B)."""
    if isinstance(model, Transformer):
        a = model.args
        n = count_params(model, non_embedding=True) + (a.vocab_size * a.dim)  # output projection does matmul work
        return 6.0 * n + 12.0 * a.n_layers * a.dim * seq_len
    return 6.0 * count_params(model)
