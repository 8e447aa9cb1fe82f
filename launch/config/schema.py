"""The run configuration's schema: one dataclass per section, each field with its default, its documentation and
its simple checks (``gt``, ``ge``, ``lt``, ``le``, ``duration``), which the loader applies to every value it sets.

Every key a user can write is declared here, and nowhere else; ``loco train --help-config`` prints them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


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
    size: str = _f("tiny", "Named size: tiny, small, 150m or 1b (see launch/models/transformer.py). Fields below override it when set.")
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
    hf_config: Optional[str] = _f(None, "A transformers config.json (or its folder): the model is that causal LM, built "
                                        "with AutoModelForCausalLM.from_config (pip install 'loco[hf]'); the keys "
                                        "above are then unused.")
    init_from: Optional[str] = _f(None, "A Hugging Face model folder (safetensors) to start from: loco's own Llama "
                                        "model mapped back, or the hf_config model; every worker starts from it.")
    activation_checkpointing: bool = _f(False, "Recompute each block in the backward instead of keeping its "
                                               "activations: a step holds one block's at a time, for about a third "
                                               "more compute (transformers models: their gradient checkpointing).")


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
    vocab_size: Optional[int] = _f(None, "Vocabulary size of shard tokens: empty takes it from the shards' manifest.json "
                                         "(loco data prepare writes one); plain token files need it.", gt=0)
    tokenizer: Optional[str] = _f(None, "bytes (UTF-8 bytes, 256 ids) or a Hugging Face tokenizers JSON file (loco "
                                        "tokenizer train makes one). Empty: bytes for text, the manifest's for shards.")
    streaming: bool = _f(False, "hf only: read the dataset as a stream, tokenized on the fly in a background thread; "
                                "memory stays bounded whatever its size, and a checkpoint keeps the position.")
    val_docs: int = _f(200, "Streamed datasets: the first N documents of the stream are the validation split.", gt=0)
    hf_name: Optional[str] = _f(None, "Configuration name passed to datasets.load_dataset.")
    hf_split: str = _f("train", "Split of the Hugging Face dataset to read.")
    hf_text_field: str = _f("text", "Column that holds the text.")
    hf_data_files: Optional[str] = _f(None, "Local files for a builder dataset, e.g. path: json with hf_data_files: data/*.jsonl.")
    max_docs: Optional[int] = _f(None, "Read at most this many documents/files (quick experiments).", gt=0)
    bad_text: Literal["error", "skip"] = _f(
        "error", "A line that is not UTF-8 in a text file (source text) or in a local .jsonl file (source hf, held or "
                 "streamed): error stops with its file and line; skip leaves the line out (a jsonl record) and says "
                 "on stderr how many of each file. loco data prepare always stops at one.")


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "muon"] = _f(
        "adamw", "Inner optimizer. muon: Muon (torch.optim.Muon's update) on the hidden matrices, AdamW (lr, betas, "
                 "eps, weight_decay) on the embeddings, the head, norms and vectors.")
    lr: float = _f(4e-4, "Peak learning rate of the inner optimizer (with name: muon, of its AdamW part).", gt=0)
    betas: tuple[float, float] = _f((0.9, 0.95), "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.", gt=0)
    weight_decay: float = _f(0.1, "Decoupled weight decay (matrices only; norms and biases get none).", ge=0)
    momentum: float = _f(0.0, "Momentum for name: sgd.", ge=0)
    muon_lr: float = _f(0.02, "name: muon: peak learning rate of the hidden matrices (scaled by sqrt(max(1, rows / "
                              "cols)), or see muon_adjust_lr).", gt=0)
    muon_momentum: float = _f(0.95, "name: muon: Nesterov momentum of the hidden matrices.", ge=0, lt=1)
    muon_weight_decay: float = _f(0.0, "name: muon: decoupled weight decay of the hidden matrices (each step "
                                       "scales them by 1 - lr x this).", ge=0)
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = _f(
        "original", "name: muon: how the lr scales with a matrix's shape: original (sqrt(max(1, rows / cols))) or "
                    "match_rms_adamw (0.2 x sqrt(max(rows, cols)): updates of AdamW's size, for AdamW's lr).")
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
    inner_steps: int = _f(100, "Inner steps per round (H) for diloco, streaming and sparseloco.", gt=0)
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
    chunk: int = _f(4096, "SparseLoCo: values per top-k chunk (a power of two; with chunking tensor a square: "
                          "4096 is 64 x 64 tiles).", gt=1)
    chunking: Literal["tensor", "flat"] = _f(
        "tensor", "SparseLoCo: tensor cuts each parameter on its own into square tiles of algo.chunk values (chunks "
                  "of sqrt(chunk) for a vector), each keeping k scaled to its length, as published; flat cuts the "
                  "flat pseudo-gradient into chunks of algo.chunk consecutive values.")
    ef_decay: float = _f(0.95, "SparseLoCo: error-feedback decay beta (e = beta * e + delta).", ge=0, le=1)
    value_format: Literal["2bit", "stat2", "int4", "fp4", "int8", "bf16", "fp16", "fp32"] = _f(
        "2bit", "SparseLoCo: how each sent value is coded (2bit: four absmax levels per block of 128; stat2: four "
                "bins across 6 standard deviations per block of 1024, each decoded to its values' mean, as published).")
    aggregate: Literal["senders", "all"] = _f(
        "senders", "SparseLoCo: senders averages each position over the workers that sent it, weighted by their "
                   "tokens, as the published code does; all divides by every worker's weight.")


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
    step_time_note: Optional[str] = _f(None, "What sim.step_time stands for, named beside it in the table (e.g. a "
                                             "step measured on a GPU); dropped where sim.step_time is set elsewhere.")
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
class EvalConfig:
    tokens: int = _f(16384, "Validation tokens: windows of data.seq_len spread evenly over the whole validation "
                            "split, the same for every batch size, process count and transport (a smaller split is "
                            "scored whole). The loss comes with its standard error.", gt=0)
    batch_size: Optional[int] = _f(None, "Windows per forward pass while scoring (empty: the run's micro-batch, "
                                         "run.batch_size / run.grad_accum); the score does not depend on it.", gt=0)
    tasks: str = _f("", "lm-eval tasks to run on the model, comma-separated (needs the eval extra), e.g. "
                        "arc_easy,hellaswag; empty: none.")
    tasks_every: int = _f(0, "Run eval.tasks every this many steps (0: only at the end).", ge=0)
    tasks_limit: Optional[int] = _f(None, "Documents per task (empty: all).", gt=0)
    include_path: Optional[str] = _f(None, "A folder of lm-eval task YAMLs (local data: dataset_path: json).")


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
    threads: Optional[Union[int, str]] = _f(
        "auto", "CPU threads for torch. auto: on a CPU this process's share of the cores it may use (divided among "
                "torchrun's processes on the node, at most OMP_NUM_THREADS, fewer where other work keeps cores "
                "busy), and one for a model under 32,768 parameters; the start line says how many and why. A number "
                "fixes it; empty: torch's default.", gt=0, auto=True)
    shard: Literal["none", "fsdp"] = _f(
        "none", "fsdp: under torchrun, the processes of a node shard the worker's model, gradients, optimizer and "
                "algorithm state with FSDP2 (each block one unit), for models larger than one GPU; across nodes "
                "each process exchanges its own shard. none: every process holds the whole model.")
    deterministic: bool = _f(False, "The same result bit for bit from run to run on a GPU (a resumed run and an "
                                    "unbroken one, torchrun and loco simulate): deterministic CUDA kernels and "
                                    "torch.compile without on-device autotuning, at some cost in speed. CPU runs "
                                    "are deterministic without it.")
    eval_every: int = _f(100, "Validation every this many steps (0: only at the end); what is scored: eval.*.",
                         ge=0)
    checkpoint_every: int = _f(500, "Checkpoint every this many steps (0: only at the end).", ge=0)
    keep_checkpoints: int = _f(3, "Keep the newest K checkpoints.", gt=0)
    checkpoint_final: bool = _f(True, "Write a checkpoint when the run ends (false for throwaway runs such as "
                                      "benchmark sweeps: a simulated run's final checkpoint holds every worker).")
    resume: bool = _f(False, "Continue from the newest valid checkpoint in the run folder.")
    resume_from: Optional[str] = _f(None, "With run.resume: continue from this checkpoint file instead of the newest "
                                          "(--resume-from PATH sets both); the run folder's later checkpoints are "
                                          "moved aside into discarded-<time>/.")


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["optim"]["betas"] = list(out["optim"]["betas"])
        return out


#: keys no longer read, and what to write instead (a config that sets one still loads: the key is said and skipped)
RETIRED: dict[str, str] = {
    "run.eval_batches": "validation is eval.tokens tokens spread over the whole split, the same for every batch "
                        "size; write eval.tokens=N instead (default 16384)",
}

SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}


def describe_fields(resolved: Optional[Config] = None) -> str:
    """All keys with defaults and docs, for ``loco train --help-config``; where ``resolved`` (the config the
    command's --config and --set make) holds another value, that value beside the default."""
    lines = []
    defaults = Config()
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        for f in dataclasses.fields(cls):
            value = getattr(getattr(defaults, section), f.name)
            mine = value if resolved is None else getattr(getattr(resolved, section), f.name)
            here = f"   (this config: {mine!r})" if mine != value else ""
            lines.append(f"  {f.name}: {value!r}{here}\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)
