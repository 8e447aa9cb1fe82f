"""Checks across a config's fields, once every layer is applied and before anything is trained: what no single
field's type or bounds can say (a data source without its path, a model shape that does not divide, settings an
algorithm cannot run with, a simulator trace that does not parse)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from diloco.compress.chain import CodecSpecError, parse_chain
from launch.config.schema import Config, ConfigError


def validate(cfg: Config, where: Any = lambda key: "default") -> None:
    """Checks across fields. ``where(key)`` names the source of a key for the message."""

    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{where(key)}: {key}: {msg}")

    from launch.models.transformer import SIZES  # local import: models imports torch

    if cfg.model.size not in SIZES:
        fail("model.size", f"unknown size {cfg.model.size!r}, allowed: {', '.join(SIZES)}")
    if cfg.run.resume_from and not cfg.run.resume:
        fail("run.resume_from", "a checkpoint to continue from, read only with run.resume=true (--resume-from PATH "
                                "sets both)")
    if cfg.run.batch_size % cfg.run.grad_accum:
        fail("run.grad_accum", f"{cfg.run.grad_accum} does not divide run.batch_size={cfg.run.batch_size}")
    if cfg.run.max_steps is None and cfg.run.max_time is None:
        fail("run.max_steps", "empty, and run.max_time is empty too: the run would never stop; set one of them")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", cfg.run.device):
        fail("run.device", f"got {cfg.run.device!r}, allowed: auto, cpu, cuda, cuda:N, mps")
    for b in cfg.optim.betas:
        if not 0 <= b < 1:
            fail("optim.betas", f"got {list(cfg.optim.betas)}, each beta must be in [0, 1)")
    if cfg.optim.lr <= 0:
        fail("optim.lr", f"got {cfg.optim.lr}, must be > 0")
    try:
        parse_chain(cfg.compress.codec)
    except CodecSpecError as e:
        fail("compress.codec", str(e))
    d = cfg.data
    if d.source in ("text", "shards", "hf") and not d.path:
        raise ConfigError(f"{where('data.source')}: data.path: data.source is {d.source!r}, which needs data.path")
    if d.source in ("stdlib", "python"):
        for key in ("path", "val_path"):
            if getattr(d, key):
                fail(f"data.{key}", f"{getattr(d, key)!r} would not be read: data.source is {d.source!r}, the built-in "
                                    f"corpus; set data.source to text (a text file or folder), shards (token files) or "
                                    f"hf to train on it, or data.{key}= (empty) for the built-in corpus")
    if d.source in ("text", "shards"):
        for key in ("path", "val_path"):
            value = getattr(d, key)
            if value and not Path(value).exists():
                fail(f"data.{key}", f"{value!r} does not exist")
    if d.source == "shards" and not d.vocab_size and d.path and not (Path(d.path) / "manifest.json").is_file():
        raise ConfigError(f"{where('data.source')}: data.vocab_size: source 'shards' needs the vocabulary size "
                          f"of its tokens (data.vocab_size), or a manifest.json beside them (loco data prepare "
                          f"writes one)")
    if d.streaming and d.source != "hf":
        fail("data.streaming", f"streams Hugging Face datasets (data.source: hf); data.source is {d.source!r}")
    if cfg.run.shard == "fsdp":
        if cfg.optim.name == "muon":
            fail("optim.name", "muon orthogonalizes whole matrices, and run.shard=fsdp leaves each process a slice of "
                               "them; use adamw (or run.shard=none)")
        if cfg.transport.mesh == "flat":
            fail("transport.mesh", "flat makes every process a worker of its own, with nothing to shard across; "
                                   "run.shard=fsdp needs the node mesh (auto or nodes)")
    n_layers = _model_layers(cfg, fail, where)
    from diloco import ConfigConflict
    from launch.config.algorithms import algorithm_class

    try:  # each algorithm states its own constraints across keys
        algorithm_class(cfg.algo.name).check_config(cfg, n_layers)
    except ConfigConflict as e:
        fail(e.key, e.message)
    if cfg.sync.mode == "time" and not cfg.sync.time_budget_s:
        raise ConfigError(f"{where('sync.mode')}: sync.time_budget_s: sync.mode=time needs a round length, "
                          f"e.g. sync.time_budget_s=30s")
    from diloco.sim import parse_bandwidth, resolve_speeds

    sim = cfg.sim
    if sim.bandwidth:
        try:
            parse_bandwidth(sim.bandwidth)
        except ValueError as e:
            fail("sim.bandwidth", str(e))
    try:
        resolve_speeds(sim.workers, sim.speeds, sim.speed_dist, cfg.run.seed)
    except ValueError as e:
        fail("sim.speeds" if sim.speeds else "sim.speed_dist", str(e))
    if sim.links:
        from diloco.sim.links import LinkTrace, LinkTraceError

        try:
            LinkTrace.load(sim.links).check_workers(sim.workers)
        except (OSError, LinkTraceError) as e:
            fail("sim.links", str(e))
    if sim.churn:
        from diloco.sim.churn import ChurnError, ChurnSchedule

        try:
            ChurnSchedule.parse(sim.churn, sim.workers, cfg.run.seed)
        except (OSError, ChurnError) as e:
            fail("sim.churn", str(e))


def _model_layers(cfg: Any, fail: Any, where: Any) -> int:
    """The model's number of layers (what algorithms check their settings against); a model that cannot be
    built as configured fails on the key to blame."""
    m = cfg.model
    for key in ("hf_config", "init_from"):
        value = getattr(m, key)
        if value and not Path(value).exists():
            fail(f"model.{key}", f"{value!r} does not exist")
    if m.hf_config or m.init_from:
        from launch.errors import RunError
        from launch.models.hf.causal_lm import LAYER_KEYS, n_layers_of, read_config_json, read_hf_config

        key = "model.hf_config" if m.hf_config else "model.init_from"
        try:
            if m.hf_config:
                return n_layers_of(read_hf_config(m.hf_config))
            raw = read_config_json(m.init_from)  # no transformers import for a folder loco's model may hold
            return next((raw[k] for k in LAYER_KEYS if isinstance(raw.get(k), int)), 1)
        except RunError as e:
            fail(key, str(e))
    from launch.models.transformer import model_args_from_config

    try:  # the named size with its overrides must make a valid shape
        return model_args_from_config(m, m.vocab_size or 256, cfg.data.seq_len).n_layers
    except ValueError as e:
        named = re.findall(r"model\.\w+", str(e))  # blame the first key in the message the user set
        fail(next((k for k in named if where(k) != "default"), named[0] if named else "model.size"), str(e))
