"""``loco train --dry-run``: the resolved settings, the data, the model and what a process would hold, then exit.

Nothing trains and nothing is written: the data is loaded (and encoded) as the run would, the model is built on
the meta device (no memory, no initialisation, ``model.init_from``'s weights not read), and the memory is what
the run's start line would say a process holds.
"""

from __future__ import annotations

import torch

from diloco.comm.agreement import flat_settings
from launch.config import Config
from launch.config.algorithms import algorithm_class
from launch.data.batches import load_data
from launch.data.tokens import Windows
from launch.eval.validation import ValidationSet
from launch.loop.memory import process_bytes
from launch.models.hf.causal_lm import build_hf_model
from launch.models.hf.from_llama import loco_args_of
from launch.models.transformer import Transformer, count_params, model_args_from_config


def _meta_model(cfg: Config, vocab_size: int) -> tuple[torch.nn.Module, str]:
    """The run's architecture on the meta device, and where it comes from."""
    m, seq_len = cfg.model, cfg.data.seq_len
    with torch.device("meta"):
        if m.init_from and not m.hf_config:
            own = loco_args_of(m.init_from, seq_len)
            if own is not None:
                return Transformer(own), f"loco's Transformer from model.init_from {m.init_from} (weights read at start)"
        if m.hf_config or m.init_from:
            source = m.hf_config or m.init_from
            return build_hf_model(source, vocab_size, seq_len), f"a transformers model from {source}"
        return Transformer(model_args_from_config(m, vocab_size, seq_len)), f"loco's Transformer ({m.size})"


def dry_run(cfg: Config) -> str:
    """What ``loco train`` would run with ``cfg`` in one process (under torchrun, each process holds its share of
    a sharded worker: ``loco plan --shard`` tells it)."""
    changed = changed_lines(cfg)
    data = load_data(cfg.data)
    model, where = _meta_model(cfg, data.vocab_size)
    params = count_params(model)
    run = cfg.run
    train = "streamed" if data.stream is not None else f"{data.train_tokens:,}"
    vset = ValidationSet.spread(Windows(data.val, cfg.data.seq_len), cfg.eval.tokens)
    per_step = run.batch_size * cfg.data.seq_len
    algo = algorithm_class(cfg.algo.name)
    held = process_bytes(cfg, params)
    steps = f"{run.max_steps:,} steps" if run.max_steps else "no step limit"
    lines = [
        "dry run: nothing is trained or written",
        f"settings: {len(changed)} differ from the defaults" + ("".join(f"\n  {c}" for c in changed)),
        f"data: {data.description}: {train} train / {data.val_tokens:,} val tokens",
        f"validation: {vset.describe()}" + (f"; {vset.note()}" if vset.note() else ""),
        f"model: {params / 1e6:.2f}M parameters, {where}",
        f"algorithm: {cfg.algo.name}" + (f" (H={cfg.algo.inner_steps})" if algo.round_based else "")
        + f", codec {cfg.compress.codec}, optimizer {cfg.optim.name}",
        f"would run: {steps}" + (f" or {run.max_time:g} s" if run.max_time else "")
        + f", {per_step:,} tokens a step a worker ({run.batch_size} x {cfg.data.seq_len}), on {run.device}",
        f"a process holds: {held.describe()} (activations and the device's own use come on top)",
    ]
    return "\n".join(lines)


def changed_lines(cfg: Config) -> list[str]:
    """``key = value`` for every setting that differs from the defaults."""
    defaults, now = flat_settings(Config().to_dict()), flat_settings(cfg.to_dict())
    return [f"{k} = {v!r}" for k, v in now.items() if defaults.get(k) != v]
