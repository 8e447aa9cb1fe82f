"""loco's ``Transformer`` <-> Hugging Face ``LlamaForCausalLM``: the config and the weights, both ways.

The two compute the same function; what differs is naming and one convention. loco's ``apply_rope`` rotates
interleaved pairs (even, odd) of each head, ``transformers``' Llama rotates the first half of a head against the
second. Reordering the rows of the query and key projections within each head, loco's rows
``[0, 2, 4, ..., D-2, 1, 3, ..., D-1]`` becoming HF's ``[0, 1, ..., D-1]``, turns one into the other: the scores
``q . k`` do not change when q and k are reordered alike, and values and the output projection keep their order.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch

from launch.errors import RunError
from launch.models.transformer import ModelArgs

ARCHITECTURE = "LlamaForCausalLM"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # --dtype
TORCH_DTYPE = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
# loco's name in a block -> HF's, and whether its rows are heads to reorder ("q": query heads, "kv": key heads)
_BLOCK = (
    ("attn_norm.weight", "input_layernorm.weight", None),
    ("attn.wq.weight", "self_attn.q_proj.weight", "q"),
    ("attn.wk.weight", "self_attn.k_proj.weight", "kv"),
    ("attn.wv.weight", "self_attn.v_proj.weight", None),
    ("attn.wo.weight", "self_attn.o_proj.weight", None),
    ("ffn_norm.weight", "post_attention_layernorm.weight", None),
    ("ffn.w1.weight", "mlp.gate_proj.weight", None),
    ("ffn.w3.weight", "mlp.up_proj.weight", None),
    ("ffn.w2.weight", "mlp.down_proj.weight", None),
)
# HF's Llama computes these from the config; older checkpoints saved them
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def llama_config(args: ModelArgs, dtype: torch.dtype = torch.bfloat16, eos_id: Optional[int] = None) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` computing what ``Transformer(args)`` computes.

    ``eos_id`` is the id that ends a document; it also begins one (loco's data puts it between documents), so it
    is the bos id too, as in GPT-2.
    """
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.dim // args.n_heads,
        "intermediate_size": args.hidden,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": None,
        "rms_norm_eps": float(args.norm_eps),
        "tie_word_embeddings": bool(args.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": float(args.init_std),
        "use_cache": True,
        "torch_dtype": TORCH_DTYPE[dtype],
    }
    if eos_id is not None:
        config["bos_token_id"] = config["eos_token_id"] = int(eos_id)
    return config


def args_from_llama_config(config: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """The ``ModelArgs`` of a Llama config; a config loco's model cannot compute is one line naming what differs."""

    def refuse(what: str) -> RunError:
        return RunError(f"{source}: {what}; loco's model is a Llama with SiLU, no biases and plain rotary positions")

    archs = config.get("architectures") or [ARCHITECTURE]
    if config.get("model_type", "llama") != "llama" or ARCHITECTURE not in archs:
        raise refuse(f"model_type={config.get('model_type')!r}, architectures={archs} is not a {ARCHITECTURE}")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("pretraining_tp", 1)):
        if config.get(key, want) != want:
            raise refuse(f"{key}={config[key]!r} (loco's model has {want!r})")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise refuse(f"rotary scaling {kind!r} (loco's model has plain rotary positions)")
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        args = ModelArgs(dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
                         n_kv_heads=int(config.get("num_key_value_heads") or heads),
                         ffn_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                         max_seq_len=int(config.get("max_position_embeddings", 2048)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                         rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
                         norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         init_std=float(config.get("initializer_range", 0.02)))
    except KeyError as e:
        raise refuse(f"no {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise refuse(f"a value that is not a number ({e})") from None
    head_dim = config.get("head_dim") or dim // heads
    if dim % heads or head_dim != dim // heads:
        raise refuse(f"head_dim={head_dim} with hidden_size={dim} and {heads} heads (loco's heads split hidden_size)")
    if head_dim % 2 or heads % args.kv_heads:
        raise refuse(f"{heads} heads of {head_dim} over {args.kv_heads} key/value heads "
                     "(rotary needs an even head size, and key/value heads must divide the heads)")
    return args


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every weight of the HF model with its shape, in the order the model uses them."""
    head = args.dim // args.n_heads
    q, kv = args.n_heads * head, args.kv_heads * head
    block = {"input_layernorm.weight": (args.dim,), "self_attn.q_proj.weight": (q, args.dim),
             "self_attn.k_proj.weight": (kv, args.dim), "self_attn.v_proj.weight": (kv, args.dim),
             "self_attn.o_proj.weight": (args.dim, q), "post_attention_layernorm.weight": (args.dim,),
             "mlp.gate_proj.weight": (args.hidden, args.dim), "mlp.up_proj.weight": (args.hidden, args.dim),
             "mlp.down_proj.weight": (args.dim, args.hidden)}
    out = {"model.embed_tokens.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        out.update({f"model.layers.{i}.{name}": shape for name, shape in block.items()})
    out["model.norm.weight"] = (args.dim,)
    if not args.tie_embeddings:
        out["lm_head.weight"] = (args.vocab_size, args.dim)
    return out


def _names(args: ModelArgs) -> list[tuple[str, str, Optional[str]]]:
    """(loco name, HF name, heads to reorder) for every weight, in HF's order."""
    out = [("embed.weight", "model.embed_tokens.weight", None)]
    for i in range(args.n_layers):
        out += [(f"layers.{i}.{mine}", f"model.layers.{i}.{theirs}", heads) for mine, theirs, heads in _BLOCK]
    out.append(("norm.weight", "model.norm.weight", None))
    if not args.tie_embeddings:
        out.append(("output.weight", "lm_head.weight", None))
    return out


def _rope_order(head_dim: int) -> torch.Tensor:
    """The loco row of each HF row within a head: the even rows (each pair's first), then the odd."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _reorder(w: torch.Tensor, n_heads: int, order: torch.Tensor) -> torch.Tensor:
    rows = w.shape[0] // n_heads
    return w.reshape(n_heads, rows, -1)[:, order].reshape(w.shape)


def _check(tensors: Mapping[str, Any], expected: dict[str, tuple[int, ...]], source: str, ignore=()) -> None:
    """Every expected tensor is there with its shape, and nothing else is: one line for the first that differs."""
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RunError(f"{source}: no tensor {missing[0]}{more}, which the model's config needs")
    extra = [n for n in tensors if n not in expected and not n.endswith(ignore)]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise RunError(f"{source}: tensor {extra[0]}{more} is not a weight of loco's Llama with this config")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise RunError(f"{source}: tensor {name} has shape {list(got)}, the config expects {list(shape)}")


def loco_to_hf(state: Mapping[str, torch.Tensor], args: ModelArgs,
               source: str = "the checkpoint") -> Iterator[tuple[str, torch.Tensor]]:
    """HF's (name, tensor) for each weight of a loco state dict, in HF's order, one at a time.

    The state is checked whole before the first tensor comes (a wrong shape is one line naming it); only the
    query and key projections are copied (reordered), the rest are the state's own tensors.
    """
    names = _names(args)
    _check(state, {mine: hf_shapes(args)[theirs] for mine, theirs, _ in names}, source)
    return _converted(state, names, args, _rope_order(args.dim // args.n_heads))


def _converted(state, names, args, order) -> Iterator[tuple[str, torch.Tensor]]:
    for mine, theirs, heads in names:
        t = state[mine]
        if heads is not None:
            t = _reorder(t, args.n_heads if heads == "q" else args.kv_heads, order)
        yield theirs, t


def hf_to_loco(tensors: Mapping[str, torch.Tensor], args: ModelArgs, source: str = "the weights") -> dict:
    """A loco state dict from HF's Llama weights (the inverse of :func:`loco_to_hf`, bit for bit).

    With tied embeddings a stored ``lm_head.weight`` is left out: the model's output is its embedding.
    """
    names = _names(args)
    shapes = hf_shapes(args)
    ignore = _DERIVED_SUFFIXES + (("lm_head.weight",) if args.tie_embeddings else ())
    _check(tensors, shapes, source, ignore)
    inverse = torch.argsort(_rope_order(args.dim // args.n_heads))
    out = {}
    for mine, theirs, heads in names:
        t = tensors[theirs]
        if heads is not None:
            t = _reorder(t, args.n_heads if heads == "q" else args.kv_heads, inverse)
        out[mine] = t
    return out

