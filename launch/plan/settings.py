"""What ``loco plan`` weighs: a setting to run (algorithm, H, codec, fragments, overlap), what loco measured of
it, and the model whose tensors cross the network."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from diloco.streaming import layer_fragments
from launch.config.algorithms import algorithm_class
from launch.metrics.log import count_label

# the vocabulary each named size is trained with in its preset (configs/<size>.yaml): byte-level text for the
# small ones, a 32k tokenizer's shards for 150m and 1b
VOCAB = {"tiny": 256, "small": 256, "150m": 32000, "1b": 32000}
FRAGMENTS = (2, 4)  # Streaming DiLoCo's fragment counts a model is cut into
MIX_ALPHA = 0.5  # Streaming DiLoCo's published merge alpha, for a setting with overlap


class PlanError(ValueError):
    """A plan's input the user can fix (printed as one line)."""


@dataclass(frozen=True)
class Setting:
    algo: str  # algo.name: ddp | diloco | streaming | sparseloco; what it declares shapes its exchanges
    inner_steps: int = 1  # H (DDP: 1, a round is a step)
    codec: str = "fp32"  # compress.codec; for an algorithm that makes its own payload, its value format
    fragments: int = 1
    overlap: int = 0  # streaming's tau
    density: Optional[float] = None  # algo.topk_density of an algorithm that makes its own top-k payload
    topk: Optional[int] = None  # algo.compression_topk of an algorithm that sends a payload of its own every step

    def algo_settings(self) -> dict[str, Any]:
        """The ``algo`` keys this setting fixes, as an algorithm's declarations read them."""
        out: dict[str, Any] = {}
        if self.density is not None:
            out.update(topk_density=self.density, value_format=self.codec)
        if self.topk is not None:
            out.update(compression_topk=self.topk)
        return out

    def step_payload(self, model: "Model") -> Optional[int]:
        """The bytes of the payload its algorithm sends every step itself (DeMo), for ``model``; else None."""
        return algorithm_class(self.algo).step_payload_bytes(model.shapes, self.algo_settings())

    def label(self) -> str:
        algo = algorithm_class(self.algo)
        if not algo.round_based:
            return self.algo + (f" k={self.topk}" if self.topk is not None else "")
        extra = f" P={self.fragments} tau={self.overlap}" if algo.fragmented else ""
        top = f" top {100 * self.density:.3g}%" if self.density is not None else ""
        return f"{self.algo} H={self.inner_steps}{extra}{top}"

    def chain(self) -> str:
        """The codec chain its exchanges are priced with: its algorithm's own payload, else ``codec``."""
        return algorithm_class(self.algo).payload_chain(self.algo_settings()) or self.codec

    def overrides(self) -> list[str]:
        """The config keys that run this setting (``--set`` values)."""
        algo = algorithm_class(self.algo)
        out = [f"algo.name={self.algo}"]
        own = self.algo_settings()
        out += [f"algo.{k}={v}" for k, v in own.items()] if own else [f"compress.codec={self.codec}"]
        if algo.round_based:
            out.append(f"algo.inner_steps={self.inner_steps}")
        if algo.fragmented:
            out += [f"algo.fragments={self.fragments}", f"algo.overlap_steps={self.overlap}",
                    f"algo.mix_alpha={MIX_ALPHA}"]
        return out

    def schedule(self) -> "Schedule":
        """Its exchanges, as its algorithm declares them."""
        algo = algorithm_class(self.algo)
        staggered = algo.fragmented
        return Schedule(self.inner_steps if algo.round_based else 1, self.fragments if staggered else 1,
                        self.overlap if staggered else 0, algo.token_weighted, algo.gather)


@dataclass(frozen=True)
class Schedule:
    """When a setting's exchanges run: every ``period`` steps, the model in ``fragments`` parts sent at evenly
    staggered steps (part p at p x period / fragments), each waited for ``overlap`` steps after it is sent;
    ``weighted``: an exchange carries its total weight beside the values; ``gathered``: every worker's payload
    reaches every worker (SparseLoCo) instead of the reduce-scatter by shards. DDP exchanges every step
    (period 1), DiLoCo every H steps, Streaming DiLoCo its P fragments with tau steps of overlap."""

    period: int
    fragments: int
    overlap: int
    weighted: bool
    gathered: bool = False


@dataclass(frozen=True)
class Measured:
    penalty: float  # validation loss vs DDP, as a fraction (+0.085: 8.5% above)
    source: str  # the file under benchmarks/results/
    se: Optional[float] = None  # its standard error (the paired gap's, as a fraction of DDP's loss); None: the
    # figure predates validation over the whole split and carries none


# loco's own measurements (benchmarks/convergence.py): validation loss against DDP in the same table
_CONV = "convergence_cpu.md"
_CODECS = "codecs_convergence_cpu.md"
_DEMO = "demo_cpu.md"
SOURCES = {
    _DEMO: "tiny, 4 workers, 300 steps, 3 seeds (DeMo with its own lr, warmup and decay); k=32 scored on "
           "eval.tokens over the whole split, its gap paired; k=8 on the earlier validation",
    _CONV: "tiny, 4 workers, 1,200 steps, 1 Gbit/s and 80 ms, median of 3 seeds (Streaming: tau=5, alpha=0.5); "
           "DiLoCo H=50 scored on eval.tokens over the whole split, its gap paired; the others on the earlier "
           "validation",
    _CODECS: "tiny, 4 workers, 600 steps, 1 Gbit/s and 80 ms, one seed (DiLoCo H=50 fp32 there: +21.1%)",
}
MEASURED: dict[Setting, Measured] = {
    Setting("ddp"): Measured(0.0, _CONV),
    Setting("diloco", 10): Measured(0.054, _CONV),
    Setting("diloco", 50): Measured(0.084, _CONV, 0.006),  # +0.106 ± 0.007 nats of DDP's 1.250
    Setting("diloco", 100): Measured(0.120, _CONV),
    Setting("streaming", 50, "fp32", 4, 5): Measured(0.111, _CONV),
    Setting("diloco", 50, "int8"): Measured(0.215, _CODECS),
    Setting("diloco", 50, "fp4"): Measured(0.211, _CODECS),
    Setting("demo", codec="dct", topk=32): Measured(0.040, _DEMO, 0.005),  # +0.057 ± 0.008 nats of DDP's 1.527
    Setting("demo", codec="dct", topk=8): Measured(0.167, _DEMO),
}


@dataclass
class Model:
    """What crosses the network for one model: its trainable tensors' sizes and, per fragment count, the
    pieces of each Streaming DiLoCo fragment (``diloco.streaming.layer_fragments``)."""

    name: str
    tensors: list[int]
    n_layers: int
    fragments: dict[int, list[list[int]]] = field(default_factory=dict)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # the tensors' shapes (a count's: typical ones)

    @property
    def params(self) -> int:
        return sum(self.tensors)

    def fragment_pieces(self, p: int) -> list[list[int]]:
        if p == 1:
            return [self.tensors]
        if p not in self.fragments:
            raise PlanError(f"{p} fragments but the model has {self.n_layers} layers")
        return self.fragments[p]


def _parse_count(text: str) -> Optional[float]:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        return None
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1)) * scale


def resolve_model(spec: str, fragment_counts: Sequence[int] = FRAGMENTS) -> Model:
    """A named size of ``launch.models.transformer.SIZES`` (its exact tensors, built on the meta device) or a parameter
    count such as ``150m`` or ``1.1e9`` (tensors of a typical size, fragments of equal size)."""
    import torch

    from launch.models.transformer import SIZES, Transformer

    spec = str(spec).strip()
    if spec.lower() in SIZES:
        name = spec.lower()
        args = replace(SIZES[name], vocab_size=VOCAB.get(name, 256))
        with torch.device("meta"):
            model = Transformer(args)
        return model_of(name, model, args.n_layers, [p for p in fragment_counts if p <= args.n_layers])
    count = _parse_count(spec)
    if count is None or not math.isfinite(count) or count < 1:
        raise PlanError(f"--model {spec!r}: expected a size ({', '.join(SIZES)}) or a parameter count such as "
                        f"150m or 1.1e9")
    n = int(count)
    per = _tensor_size(n)
    tensors = [per] * (n // per) + ([n % per] if n % per else [])
    layers = max(1, min(64, round(math.log2(max(n, 2) / 1e6) * 3)))  # only bounds how many fragments make sense
    frags = {p: _split(n, p) for p in fragment_counts if p <= layers}
    return Model(f"{count_label(n)} parameters", tensors, layers, frags, [_typical_shape(t) for t in tensors])


MAX_TENSORS = 4096  # a parameter count is cut in at most this many tensors, whatever its size


def _tensor_size(n: int) -> int:
    """Elements of a typical large matrix of an ``n``-parameter model: 4M (a width of 2048 times its MLP's), and
    from 17B parameters on, a 4096th of the model (GPT-3's 175B has matrices of 600M): the plan's cost then
    stays that of at most :data:`MAX_TENSORS` tensors."""
    return max(1, min(n, 4 << 20), -(-n // MAX_TENSORS))


def _typical_shape(n: int, width: int = 2048) -> tuple[int, ...]:
    """A matrix ``width`` wide where ``n`` divides into its rows (a large model's matrices), else a vector."""
    return (n // width, width) if n >= width and n % width == 0 else (n,)


def _split(n: int, p: int) -> list[list[int]]:
    """``n`` elements in ``p`` fragments of equal size, each in tensors of a typical size (:func:`_tensor_size`)."""
    out = []
    for j in range(p):
        size = n // p + (1 if j < n % p else 0)
        per = max(1, min(size, _tensor_size(n)))
        out.append([per] * (size // per) + ([size % per] if size % per else []))
    return out


def model_of(name: str, module: Any, n_layers: int, fragment_counts: Sequence[int]) -> Model:
    """The :class:`Model` of a built ``module`` (on the meta device will do): its trainable tensors, and the
    pieces of each Streaming DiLoCo fragment for each of ``fragment_counts``."""
    params = [p for p in module.parameters() if p.requires_grad]
    frags = {p: [[_piece_numel(params, e) for e in frag] for frag in layer_fragments(module, p)]
             for p in fragment_counts}
    return Model(name, [p.numel() for p in params], n_layers, frags, [tuple(p.shape) for p in params])


def _piece_numel(params: list, entry: Any) -> int:
    if isinstance(entry, int):
        return params[entry].numel()
    i, start, stop = entry
    row = params[i].numel() // params[i].shape[0]
    return (stop - start) * row
