"""The objects a run is built of, from its config: the model, the inner optimizer, and the algorithm around it
(through the registry: nothing here asks which algorithm runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from diloco import Algorithm
from diloco.comm import Transport
from diloco.layers import output_head
from diloco.muon import MuonAdamW
from launch.config.algorithms import algorithm_class
from launch.config import Config
from launch.errors import RunError
from launch.models.hf.causal_lm import build_hf_model, check_init_tokenizer, load_hf_weights
from launch.models.hf.from_llama import load_loco_weights, loco_args_of
from launch.models.transformer import Transformer, model_args_from_config
from launch.loop.runtime import check_model_fits
from launch.data.tokens import TokenData

FUSED_DEVICES = ("cuda", "cpu")  # where torch has fused AdamW and SGD kernels


def build_model(cfg: Config, data: TokenData, device: torch.device) -> tuple[nn.Module, Any]:
    """The run's model for ``data``'s vocabulary, initialised from ``run.seed`` where it trains (a 1B model takes
    seconds to initialise on a CPU), or loaded from ``model.init_from``, its blocks recomputed in the backward
    where ``model.activation_checkpointing`` says so; and loco's model arguments (None for a ``transformers``
    model)."""
    model, args = _built_model(cfg, data, device)
    if cfg.model.activation_checkpointing:
        model.recompute_blocks(True)
    return model, args


def _built_model(cfg: Config, data: TokenData, device: torch.device) -> tuple[nn.Module, Any]:
    m = cfg.model
    if m.init_from:
        check_init_tokenizer(m.init_from, data.tokenizer)
    own = loco_args_of(m.init_from, cfg.data.seq_len) if m.init_from and not m.hf_config else None
    if m.hf_config or m.init_from and own is None:
        torch.manual_seed(cfg.run.seed)
        with torch.device(device):
            model = build_hf_model(m.hf_config or m.init_from, data.vocab_size, cfg.data.seq_len,
                                   "model.hf_config" if m.hf_config else "model.init_from")
        if m.init_from:
            load_hf_weights(model, Path(m.init_from))
        return model, None
    if own is not None:
        if own.vocab_size < data.vocab_size:
            raise RunError(f"model.init_from {m.init_from}: its vocabulary of {own.vocab_size} ids is smaller than "
                           f"the data's {data.vocab_size}, so it was trained on another tokenizer; start from a "
                           f"folder trained on the data's tokenizer")
        model, _ = _loco_model(cfg, own, data, device)
        load_loco_weights(model, Path(m.init_from))
        return model, own
    return _loco_model(cfg, model_args_from_config(m, data.vocab_size, cfg.data.seq_len), data, device)


def _loco_model(cfg: Config, args: Any, data: TokenData, device: torch.device) -> tuple[nn.Module, Any]:
    if args.vocab_size < data.vocab_size:  # a token past the embedding: a device assert
        raise RunError(f"model.vocab_size={args.vocab_size} is smaller than the data's vocabulary of "
                       f"{data.vocab_size} tokens: raise it, or leave it unset to take the data's")
    check_model_fits(args, device)
    torch.manual_seed(cfg.run.seed)
    with torch.device(device):
        return Transformer(args), args


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon steps: every 2-D parameter outside the embeddings and the output head (a model names
    its head by ``output_head()``; a tied head is the embedding)."""
    outside = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = output_head(model)
    if head is not None:
        outside |= {id(p) for p in head.parameters()}
    return [p for p in model.parameters() if p.requires_grad and p.dim() == 2 and id(p) not in outside]


def build_optimizer(model: nn.Module, ocfg, device: torch.device, transport: Optional[Transport] = None,
                    cfg: Optional[Config] = None) -> torch.optim.Optimizer:
    """AdamW (or SGD) with weight decay on matrices only, or Muon on the hidden matrices and that AdamW on the
    rest (``optim.name: muon``), unless the algorithm of ``cfg.algo.name`` brings its own (DeMo)."""
    groups = _decay_groups(list(model.parameters()), ocfg)
    if cfg is not None:
        own = algorithm_class(cfg.algo.name).make_optimizer(cfg, groups, device, transport)
        if own is not None:
            return own
    # the fused kernels on CUDA and CPU alike: one pass per step, and the step checks finiteness and clips on the
    # device, so a step reads nothing back (Algorithm._checks_on_device)
    fused = device.type in FUSED_DEVICES
    if ocfg.name == "sgd":
        return torch.optim.SGD(groups, lr=ocfg.lr, momentum=ocfg.momentum, fused=fused)
    adamw = dict(lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps, fused=fused)
    if ocfg.name == "muon":
        muon = hidden_matrices(model)
        stepped = {id(p) for p in muon}
        rest = _decay_groups([p for p in model.parameters() if id(p) not in stepped], ocfg)
        return MuonAdamW(muon, rest, lr=ocfg.muon_lr, weight_decay=ocfg.muon_weight_decay,
                         momentum=ocfg.muon_momentum, adjust_lr_fn=ocfg.muon_adjust_lr, adamw=adamw)
    return torch.optim.AdamW(groups, **adamw)


def _decay_groups(params: list[nn.Parameter], ocfg) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms and biases get none."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": ocfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_algorithm(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    tokens_per_step: int, inner: Optional[Transport] = None) -> Algorithm:
    """The configured algorithm around the inner optimizer."""
    return algorithm_class(cfg.algo.name).from_config(cfg, model, optimizer, transport,
                                                      tokens_per_step=tokens_per_step, inner=inner)
