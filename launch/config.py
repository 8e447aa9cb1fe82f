"""Typed run configuration: dataclasses, YAML files, ``--set`` overrides, validation.

A config is built in layers: code defaults, then each ``--config FILE`` in order
(files hold only differences from the defaults), then each ``--set a.b=value``.
Every value remembers where it came from, so an error names the file (or the
``--set`` flag), the key, and what is allowed. Nothing is trained before the
whole config has been checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from diloco.comm.base import flat_settings
from diloco.compress.chain import CodecSpecError, parse_chain
from diloco.sim.network import parse_duration  # noqa: F401  (also part of this module's API)


class ConfigError(ValueError):
    """A user mistake in a config file or an override. The message says where and what."""


def _f(default: Any, doc: str, **checks: Any) -> Any:
    """A config field with its documentation and simple checks (gt, ge, le, duration)."""
    meta = {"doc": doc, **checks}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    size: str = _f("tiny", "Named size: tiny, small, 150m or 1b (see launch/models.py). Fields below override it when set.")
    dim: Optional[int] = _f(None, "Width of the residual stream.", gt=0)
    n_layers: Optional[int] = _f(None, "Number of transformer blocks.", gt=0)
    n_heads: Optional[int] = _f(None, "Attention heads (dim must be divisible by it).", gt=0)
    n_kv_heads: Optional[int] = _f(None, "Key/value heads for grouped-query attention (divides n_heads).", gt=0)
    ffn_dim: Optional[int] = _f(None, "Hidden width of the SwiGLU feed-forward block.", gt=0)
    vocab_size: Optional[int] = _f(None, "Vocabulary size; empty means take it from the data (256 for byte-level text).", gt=0)
    tie_embeddings: Optional[bool] = _f(None, "Share the input embedding and output projection weights.")
    rope_theta: float = _f(10000.0, "Base of the rotary position embedding frequencies.", gt=0)
    norm_eps: float = _f(1e-5, "Epsilon of RMSNorm.", gt=0)
    init_std: float = _f(0.02, "Standard deviation of the weight initialisation.", gt=0)


@dataclass
class DataConfig:
    source: Literal["stdlib", "text", "shards", "hf", "python"] = _f(
        "stdlib",
        "stdlib: the Python standard library's source on this interpreter (no download, ~30 MB); "
        "text: a text file or folder; shards: pre-tokenized uint16/uint32 files; hf: a Hugging Face dataset; "
        "python: the standard library plus the .py files of every installed package (site-packages; "
        "no download, ~200 MB with torch, for GPU runs).",
    )
    path: Optional[str] = _f(None, "File or folder for text/shards; dataset name or saved folder for hf.")
    val_path: Optional[str] = _f(None, "Optional separate validation file or folder (text, shards).")
    pattern: str = _f("**/*", "Glob of files to read inside a text folder (hidden and binary files are skipped).")
    val_fraction: float = _f(0.02, "Share of files (or, for one file, of tokens) held out for validation.", gt=0, le=0.5)
    seq_len: int = _f(256, "Tokens per training sequence.", gt=1)
    dtype: Literal["auto", "uint16", "uint32"] = _f("auto", "Token dtype of shard files; auto reads .npy headers and assumes uint16 for .bin.")
    vocab_size: Optional[int] = _f(None, "Vocabulary size of shard tokens (required for shards).", gt=0)
    hf_name: Optional[str] = _f(None, "Configuration name passed to datasets.load_dataset.")
    hf_split: str = _f("train", "Split of the Hugging Face dataset to read.")
    hf_text_field: str = _f("text", "Column that holds the text.")
    hf_data_files: Optional[str] = _f(None, "Local files for a builder dataset, e.g. path: json with hf_data_files: data/*.jsonl.")
    max_docs: Optional[int] = _f(None, "Read at most this many documents/files (quick experiments).", gt=0)


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = _f("adamw", "Inner optimizer.")
    lr: float = _f(4e-4, "Peak learning rate of the inner optimizer.", gt=0)
    betas: tuple[float, float] = _f((0.9, 0.95), "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.", gt=0)
    weight_decay: float = _f(0.1, "Decoupled weight decay (matrices only; norms and biases get none).", ge=0)
    momentum: float = _f(0.0, "Momentum for name: sgd.", ge=0)
    warmup_steps: int = _f(100, "Linear warmup steps from 0 to lr.", ge=0)
    schedule: Literal["cosine", "linear", "constant"] = _f("cosine", "Decay after warmup, over run.max_steps (or run.max_time).")
    min_lr_ratio: float = _f(0.1, "Final lr as a fraction of lr for cosine/linear.", ge=0, le=1)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 turns clipping off).", ge=0)


@dataclass
class AlgoConfig:
    name: Literal["ddp", "diloco", "streaming", "demo", "sparseloco"] = _f(
        "ddp", "Training algorithm. ddp: average gradients every step (the baseline); diloco: H local steps, "
               "then an outer step on the averaged pseudo-gradient; streaming: Streaming DiLoCo (fragments, overlap); "
               "demo: DeMo, the optimizer exchanges DCT top-k momentum components every step; sparseloco: "
               "DiLoCo rounds exchanging the top-k of an error-feedback buffer at 2 bits a value (no outer momentum).")
    inner_steps: int = _f(100, "Inner steps per round (H) for diloco and streaming.", gt=0)
    outer_lr: Optional[float] = _f(None, "Outer optimizer (SGD) learning rate; SparseLoCo: its alpha. Empty: the algorithm's own (0.7 for DiLoCo and Streaming, 1.0 for SparseLoCo; configs/sparseloco.yaml sets 4).", gt=0)
    outer_momentum: float = _f(0.9, "Outer optimizer momentum (0: plain SGD; sparseloco has none: its error feedback is the momentum).", ge=0, lt=1)
    nesterov: bool = _f(True, "Nesterov momentum in the outer optimizer.")
    offload_outer: bool = _f(False, "Keep the global parameters and outer momentum on the CPU.")
    fragments: int = _f(1, "Streaming DiLoCo: fragments P, strided by layer, each synced on its own schedule.", gt=0)
    overlap_steps: int = _f(0, "Streaming DiLoCo: inner steps tau that hide a fragment's communication.", ge=0)
    mix_alpha: float = _f(0.0, "Streaming DiLoCo: local = alpha * local + (1 - alpha) * global after an exchange.", ge=0, le=1)
    overlap_merge: Literal["mix", "keep"] = _f(
        "mix", "Streaming DiLoCo with overlap_steps > 0: mix (merge with mix_alpha, as published) or keep "
               "(new global + the local steps made while the exchange was in flight; mix_alpha unused).")
    compression_decay: float = _f(0.999, "DeMo: momentum decay of delta.", ge=0, lt=1)
    compression_topk: int = _f(32, "DeMo: coefficients kept per DCT chunk (clamped to the chunk size).", gt=0)
    compression_chunk: int = _f(64, "DeMo: DCT chunk side (64: 64x64 blocks for matrices).", gt=0)
    chunk_rule: Literal["auto", "divisor", "pad"] = _f(
        "auto", "DeMo: divisor (published: largest divisor <= chunk), pad (zero-pad to chunk multiples), "
                "auto (the divisor unless it is below half the chunk, then pad).")
    sign_values: bool = _f(False, "DeMo: send 1 bit (the sign) per kept coefficient instead of fp32.")
    nonfinite: Literal["skip", "raise"] = _f("skip", "DeMo: on non-finite gradients sit the step out (skip) or stop (raise).")
    topk_density: float = _f(0.02, "SparseLoCo: fraction of each chunk sent per round (k = density x chunk).", gt=0, le=1)
    chunk: int = _f(4096, "SparseLoCo: values per top-k chunk of the flat pseudo-gradient (a power of two).", gt=1)
    ef_decay: float = _f(0.95, "SparseLoCo: error-feedback decay beta (e = beta * e + delta).", ge=0, le=1)
    value_format: Literal["2bit", "int4", "fp4", "int8", "bf16", "fp16", "fp32"] = _f(
        "2bit", "SparseLoCo: how each sent value is coded (2bit: four levels per block of 128).")


@dataclass
class SyncConfig:
    mode: Literal["steps", "time"] = _f(
        "steps", "steps: every worker does algo.inner_steps per round; time: every worker trains until "
                 "sync.time_budget_s has passed on its clock, so fast workers do more steps (averages weighted by tokens).")
    time_budget_s: Optional[float] = _f(None, "Round length for sync.mode=time, e.g. 30s or 5m.", gt=0, duration=True)


@dataclass
class SimConfig:
    workers: int = _f(4, "Simulated workers N (loco simulate --workers).", gt=0)
    speeds: Optional[str] = _f(None, "Relative worker speeds, one per worker, e.g. 1,1,0.5,0.25 (--speeds).")
    speed_dist: Optional[str] = _f(None, "Draw speeds instead: lognormal:SIGMA or uniform:LOW (--speed-dist).")
    bandwidth: Optional[str] = _f("1Gbit", "Per-worker link bandwidth for virtual time, e.g. 1Gbit, 100Mbit/s, 50MB/s; empty: unlimited.")
    latency: float = _f(0.08, "One-way latency per message, e.g. 80ms.", ge=0, duration=True)
    step_time: Optional[float] = _f(None, "Virtual compute seconds per step at speed 1 (empty: the median of the measured step times), e.g. 0.35s.", gt=0, duration=True)
    links: Optional[str] = _f(None, "A link trace (CSV or YAML: time, worker or *, bandwidth, latency) replayed over "
                                    "virtual time instead of sim.bandwidth and sim.latency, e.g. "
                                    "configs/links-home-uplink.csv (--links).")
    churn: Optional[str] = _f(None, "Workers leaving and coming back: a trace (CSV or YAML: time or round, worker, "
                                    "leave|join) or poisson:mtbf=DURATION,rejoin=DURATION, e.g. poisson:mtbf=30m,"
                                    "rejoin=5m (--churn); worker 0 stays.")
    offload: bool = _f(False, "Keep idle workers' model and optimizer state off the accelerator.")
    baseline: Literal["ddp", "none"] = _f("ddp", "Also simulate DDP on the same tokens and compare (ignored when algo.name is ddp).")


@dataclass
class CompressConfig:
    codec: str = _f("fp32", "Codec chain for what crosses the network, stages joined by '+': [dct+][topk[:density]+]"
                           "fp32|bf16|fp16|int8|int4|fp4|2bit[+zstd], e.g. int8, fp4+zstd, topk:0.02+2bit+zstd. "
                           "fp32 is the exact dense all-reduce.")


@dataclass
class TransportConfig:
    backend: Literal["auto", "local", "torch_dist"] = _f(
        "auto", "auto: torch_dist when started by torchrun (WORLD_SIZE > 1), else local (one worker)."
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = _f("auto", "torch.distributed backend; auto: nccl on CUDA, gloo on CPU.")
    timeout: float = _f(300.0, "Seconds (or a duration like 5m) before a collective is declared stuck.", gt=0, duration=True)
    mesh: Literal["auto", "flat", "nodes"] = _f(
        "auto", "torchrun layout. flat: every process is a worker; nodes: every node is one worker whose processes "
                "average gradients each step (run.batch_size is per process); auto: nodes when torchrun runs several "
                "nodes with several processes each.")


@dataclass
class LogConfig:
    every: int = _f(10, "Write a metrics line every this many steps.", gt=0)
    progress: Literal["auto", "bar", "plain", "off"] = _f("auto", "auto: a progress bar on a terminal, plain lines otherwise.")
    wandb: bool = _f(False, "Also log to Weights & Biases (offline when no API key is configured).")
    wandb_project: str = _f("loco", "wandb project name.")
    wandb_entity: Optional[str] = _f(None, "wandb entity (team or user).")
    wandb_mode: Literal["auto", "online", "offline"] = _f("auto", "auto: online with an API key, offline without.")
    plot: bool = _f(True, "Write loss.png into the run folder at the end.")


@dataclass
class RunConfig:
    name: str = _f("loco", "Run name; the default run folder is runs/<name>-<time>.")
    dir: Optional[str] = _f(None, "Run folder (config.yaml, metrics.jsonl, summary.json, checkpoints/).")
    seed: int = _f(0, "Seed for initialisation and data order.", ge=0)
    max_steps: Optional[int] = _f(1000, "Stop after this many optimizer steps (empty: only max_time stops).", gt=0)
    max_time: Optional[float] = _f(None, "Stop after this much training time, e.g. 90s, 30m, 24h; then evaluate and save (several processes: on rank 0's clock, checked at each sync, or every log.every steps for DDP and DeMo; in loco simulate, the simulated workers' virtual time).", gt=0, duration=True)
    batch_size: int = _f(16, "Sequences per worker per optimizer step.", gt=0)
    grad_accum: int = _f(1, "Micro-batches per step (batch_size must be divisible by it).", gt=0)
    device: str = _f("auto", "auto, cpu, cuda or cuda:N.")
    precision: Literal["auto", "fp32", "bf16"] = _f("auto", "auto: bf16 autocast on CUDA, fp32 on CPU.")
    compile: Optional[bool] = _f(None, "torch.compile the model (empty: on CUDA yes, on CPU no); if compiling "
                                       "fails the run goes on uncompiled with a one-line warning.")
    threads: Optional[int] = _f(None, "CPU threads for torch (empty: torch's default).", gt=0)
    eval_every: int = _f(100, "Validation every this many steps (0: only at the end).", ge=0)
    eval_batches: int = _f(10, "Validation batches per evaluation.", gt=0)
    checkpoint_every: int = _f(500, "Checkpoint every this many steps (0: only at the end).", ge=0)
    keep_checkpoints: int = _f(3, "Keep the newest K checkpoints.", gt=0)
    checkpoint_final: bool = _f(True, "Write a checkpoint when the run ends (false for throwaway runs such as "
                                      "benchmark sweeps: a simulated run's final checkpoint holds every worker).")
    resume: bool = _f(False, "Continue from the newest valid checkpoint in the run folder.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["optim"]["betas"] = list(out["optim"]["betas"])
        return out


SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}

def format_duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(args[0]) + " or empty (null)"
    if origin is tuple:
        return "a list of " + str(len(typing.get_args(tp))) + " numbers"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, meta: dict[str, Any]) -> Any:
    """Convert ``value`` to ``tp`` or raise ValueError with what is allowed."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none", "~")):
            return None
        return _coerce(value, args[0], meta)
    if meta.get("duration"):
        try:
            return parse_duration(value)
        except ValueError as e:
            raise ValueError(str(e)) from None
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool):  # YAML reads off/on/yes/no as booleans
            value = next((w for w in (("on", "yes", "true") if value else ("off", "no", "false")) if w in allowed), value)
        if value not in allowed:
            raise ValueError(f"got {value!r}, allowed: {', '.join(str(a) for a in allowed)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in re.split(r"[,\s]+", value.strip("[]() ")) if v]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"got {value!r}, expected {_type_name(tp)}")
        return tuple(_coerce(v, a, {}) for v, a in zip(value, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ValueError(f"got {value!r}, expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}, expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:  # 1e3
                    as_float = float(value)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ValueError(f"got {value!r}, expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}, expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 as a string
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"got {value!r}, expected a number")
    if tp is str:
        if value is None:
            raise ValueError("empty, expected a string")
        if isinstance(value, (dict, list, bool)):
            raise ValueError(f"got {value!r}, expected a string (quote it in YAML)")
        return str(value)
    raise ValueError(f"unsupported config type {tp}")


def _check_bounds(value: Any, meta: dict[str, Any]) -> None:
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"got {value}, expected a finite number")
    for key, ok, word in (
        ("gt", lambda v, b: v > b, ">"),
        ("ge", lambda v, b: v >= b, ">="),
        ("lt", lambda v, b: v < b, "<"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if key in meta and not ok(value, meta[key]):
            raise ValueError(f"got {value}, must be {word} {meta[key]}")


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class ConfigBuilder:
    """Applies layers of values to a Config, remembering the source of each key."""

    def __init__(self) -> None:
        self.config = Config()
        self.sources: dict[str, str] = {}

    def _field(self, section: str, key: str, source: str) -> dataclasses.Field:
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section '{section}'{_suggest(section, list(SECTIONS))}; "
                f"sections are: {', '.join(SECTIONS)}"
            )
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{section}.{key}'{_suggest(key, list(fields))}; "
                f"keys in '{section}' are: {', '.join(fields)}"
            )
        return fields[key]

    def set(self, dotted: str, value: Any, source: str) -> None:
        parts = dotted.split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"{source}: key '{dotted}' must look like section.key (for example optim.lr)")
        section, key = parts
        f = self._field(section, key, source)
        hints = typing.get_type_hints(SECTIONS[section])
        try:
            coerced = _coerce(value, hints[key], dict(f.metadata))
            _check_bounds(coerced, dict(f.metadata))
        except ValueError as e:
            raise ConfigError(f"{source}: {dotted}: {e} ({f.metadata.get('doc', '')})") from None
        setattr(getattr(self.config, section), key, coerced)
        self.sources[dotted] = source

    def apply_mapping(self, data: Any, source: str) -> None:
        if data is None:
            return
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections (model:, data:, ...), got {type(data).__name__}")
        for section, values in data.items():
            if section not in SECTIONS:
                raise ConfigError(
                    f"{source}: unknown section '{section}'{_suggest(str(section), list(SECTIONS))}; "
                    f"sections are: {', '.join(SECTIONS)}"
                )
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got {values!r}")
            for key, value in values.items():
                self.set(f"{section}.{key}", value, source)

    def apply_file(self, path: str | Path, _chain: tuple[Path, ...] = ()) -> None:
        """Apply a YAML file; ``extends: other.yaml`` (relative to this file) applies that file first."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a YAML text file (not UTF-8): name a .yaml config") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot be read: {e.strerror or e}") from None
        if isinstance(data, dict) and "extends" in data:
            parent = (p.parent / str(data.pop("extends"))).resolve()
            if parent in _chain or parent == p.resolve():
                raise ConfigError(f"{p}: extends {parent}, which extends it back (a cycle)")
            if not parent.is_file():
                raise ConfigError(f"{p}: extends: {parent} not found")
            self.apply_file(parent, _chain + (p.resolve(),))
        self.apply_mapping(data, str(p))

    def apply_override(self, text: str, source: str = "--set") -> None:
        if "=" not in text:
            raise ConfigError(f"{source} {text!r}: expected section.key=value (for example --set optim.lr=3e-4)")
        key, raw = text.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        self.set(key.strip(), value, f"{source} {text}")

    def where(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")


def validate(cfg: Config, where: Any = lambda key: "default") -> None:
    """Checks across fields. ``where(key)`` names the source of a key for the message."""

    def fail(key: str, msg: str) -> None:
        raise ConfigError(f"{where(key)}: {key}: {msg}")

    from launch.models import SIZES, model_args_from_config  # local import: models imports torch

    if cfg.model.size not in SIZES:
        fail("model.size", f"unknown size {cfg.model.size!r}, allowed: {', '.join(SIZES)}")
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
    if d.source == "shards" and not d.vocab_size:
        raise ConfigError(f"{where('data.source')}: data.vocab_size: source 'shards' needs the vocabulary size "
                          f"of its tokens (data.vocab_size)")
    try:  # the named size with its overrides must make a valid shape
        args = model_args_from_config(cfg.model, cfg.model.vocab_size or 256, d.seq_len)
    except ValueError as e:
        named = re.findall(r"model\.\w+", str(e))  # blame the first key in the message the user set
        fail(next((k for k in named if where(k) != "default"), named[0] if named else "model.size"), str(e))
    from diloco import ConfigConflict
    from launch.algorithms import algorithm_class

    try:  # each algorithm states its own constraints across keys
        algorithm_class(cfg.algo.name).check_config(cfg, args.n_layers)
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
        if cfg.algo.name == "streaming" and cfg.algo.overlap_steps > 0:
            fail("sim.churn", "Streaming DiLoCo with algo.overlap_steps > 0 has exchanges in flight that a joining "
                              "worker cannot take over; use algo.overlap_steps=0 with churn")


def resolve_config_path(name: str) -> str:
    """A file path as given, or a preset name: 'tiny' -> <checkout>/configs/tiny.yaml."""
    if Path(name).exists() or "/" in name or name.endswith((".yaml", ".yml")):
        return name
    preset = PRESETS_DIR / f"{name}.yaml"
    return str(preset) if preset.is_file() else name


PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"


def load_config(files: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = (),
                extra: dict[str, Any] | None = None) -> tuple[Config, ConfigBuilder]:
    """Defaults <- each file <- each ``--set`` <- ``extra`` ({'run.seed': (3, '--seed')} from flags); then validate."""
    builder = ConfigBuilder()
    for f in map(resolve_config_path, files):
        builder.apply_file(f)
    for o in overrides:
        builder.apply_override(o)
    for key, (value, source) in (extra or {}).items():
        builder.set(key, value, source)
    validate(builder.config, builder.where)
    return builder.config, builder


def config_from_dict(data: dict[str, Any], source: str = "checkpoint") -> Config:
    builder = ConfigBuilder()
    builder.apply_mapping(data, source)
    return builder.config


def changed_settings(saved: Any, cfg: Config, shown: int = 8) -> Optional[str]:
    """What a resumed run changed against the settings its checkpoint was written with (``saved``: the
    checkpoint's ``config``), as ``key old -> new; ...``; None where nothing changed (``run.resume`` aside).
    The run goes on with its own settings: the optimizers keep them over the checkpoint's."""
    before = flat_settings(saved)
    lines = [f"{key} {before[key]!r} -> {value!r}" for key, value in flat_settings(cfg.to_dict()).items()
             if key != "run.resume" and key in before and before[key] != value]
    if not lines:
        return None
    more = f"; and {len(lines) - shown} more" if len(lines) > shown else ""
    return "; ".join(lines[:shown]) + more


#: keys that may differ between the processes of one run: where files lie, how a process shows its progress,
#: and the machine it runs on; the simulator's section is not read by a real run
PER_PROCESS = frozenset({"data.path", "data.val_path", "data.hf_data_files", "run.dir", "run.name", "run.device",
                         "run.threads", "run.compile", "run.precision", "log.progress", "log.wandb",
                         "log.wandb_project", "log.wandb_entity", "log.wandb_mode", "log.plot"})


def shared_settings(cfg: Config) -> dict[str, Any]:
    """What every process of a torchrun job must agree on: every key but :data:`PER_PROCESS` (``section.key`` ->
    value), and loco's version."""
    from importlib.metadata import PackageNotFoundError, version

    out = {key: value for key, value in flat_settings(cfg.to_dict()).items()
           if not key.startswith("sim.") and key not in PER_PROCESS}
    try:
        out["loco version"] = version("loco")
    except PackageNotFoundError:  # run from a source tree that was never installed
        out["loco version"] = "unknown"
    return out


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def describe_fields() -> str:
    """All keys with defaults and docs, for ``loco train --help-config``."""
    lines = []
    defaults = Config()
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section), f.name)
            lines.append(f"  {f.name}: {value!r}\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)
