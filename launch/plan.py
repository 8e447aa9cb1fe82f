"""`loco plan`: choose the algorithm, H, codec and fragments for a model, a number of workers and a link.

For every candidate setting the planner predicts the bytes each worker sends per round, the virtual time a round
takes, and the share of it spent computing (the compute utilization), with the simulator's own accounting
(:mod:`diloco.sim.group`): a step costs the step time; every collective starts when the link is free and lasts
what :class:`diloco.sim.NetworkModel` says its bytes take, collectives on one link one after another; a blocking
exchange holds the workers until it ends, and Streaming DiLoCo's exchange of a fragment is waited for only
``overlap`` steps later. The bytes are the real payload sizes: the transports' 32 MiB buckets, the compressed
all-reduce's shards and messages (weight, wire header, ``Codec.payload_bytes``), the same collectives the
algorithms call (a ring all-reduce for fp32 DDP and DiLoCo; an all-to-all then an all-gather per bucket for a
codec). Every worker is assumed to run at the same speed.

The expected loss penalty against DDP is what loco measured (:data:`MEASURED`, each with the file under
``benchmarks/results/`` it comes from); a setting that was never measured says "unmeasured".

``--check`` simulates the recommended setting on the ``tiny`` model with the same link and a fixed step time,
and prints the utilization predicted for that very run beside the one the simulator reports.
"""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from diloco.sim import NetworkModel
from launch.metrics import count_label, human_bytes

BUCKET_BYTES = 32 << 20  # diloco.comm.base.Transport.bucket_bytes: one all-reduce per bucket
WEIGHT_BYTES = 8  # each compressed message starts with its weight (diloco.compress.collective.WEIGHT)
TARGET_UTILIZATION = 0.95
DEFAULT_STEP_TIME = 1.0  # seconds per step when --step-time is not given (said in the output)
CHECK_WORKERS = 4  # --check simulates at most this many workers, so that it stays short
CHECK_ROUNDS = 1  # the prediction replays the same steps, start and end of training included

# the vocabulary each named size is trained with in its preset (configs/<size>.yaml): byte-level text for the
# small ones, a 32k tokenizer's shards for 150m and 1b
VOCAB = {"tiny": 256, "small": 256, "150m": 32000, "1b": 32000}

# candidate settings
DILOCO_H = (10, 50, 100, 500)
STREAMING_H = (50, 100, 500)
FRAGMENTS = (2, 4)
CODECS = ("fp32", "bf16", "int8", "fp4")
STREAMING_CODECS = ("fp32", "int8", "fp4")
OVERLAP = 5  # Streaming DiLoCo's tau (at most H - 1), with the published merge alpha 0.5
MIX_ALPHA = 0.5


class PlanError(ValueError):
    """A plan's input the user can fix (printed as one line)."""


@dataclass(frozen=True)
class Setting:
    algo: str  # ddp | diloco | streaming
    inner_steps: int = 1  # H (DDP: 1, a round is a step)
    codec: str = "fp32"
    fragments: int = 1
    overlap: int = 0  # streaming's tau

    def label(self) -> str:
        if self.algo == "ddp":
            return "ddp"
        extra = f" P={self.fragments} tau={self.overlap}" if self.algo == "streaming" else ""
        return f"{self.algo} H={self.inner_steps}{extra}"

    def overrides(self) -> list[str]:
        """The config keys that run this setting (``--set`` values)."""
        out = [f"algo.name={self.algo}", f"compress.codec={self.codec}"]
        if self.algo != "ddp":
            out.append(f"algo.inner_steps={self.inner_steps}")
        if self.algo == "streaming":
            out += [f"algo.fragments={self.fragments}", f"algo.overlap_steps={self.overlap}",
                    f"algo.mix_alpha={MIX_ALPHA}"]
        return out


@dataclass(frozen=True)
class Measured:
    penalty: float  # validation loss vs DDP, as a fraction (+0.085: 8.5% above)
    source: str  # the file under benchmarks/results/


# loco's own measurements (benchmarks/convergence.py): validation loss against DDP in the same table
_CONV = "convergence_cpu.md"
_CODECS = "codecs_convergence_cpu.md"
SOURCES = {
    _CONV: "tiny, 4 workers, 1,200 steps, 1 Gbit/s and 80 ms, median of 3 seeds (Streaming: tau=5, alpha=0.5)",
    _CODECS: "tiny, 4 workers, 600 steps, 1 Gbit/s and 80 ms, one seed (DiLoCo H=50 fp32 there: +21.1%)",
}
MEASURED: dict[Setting, Measured] = {
    Setting("ddp"): Measured(0.0, _CONV),
    Setting("diloco", 10): Measured(0.054, _CONV),
    Setting("diloco", 50): Measured(0.085, _CONV),
    Setting("diloco", 100): Measured(0.120, _CONV),
    Setting("streaming", 50, "fp32", 4, 5): Measured(0.111, _CONV),
    Setting("diloco", 50, "int8"): Measured(0.215, _CODECS),
    Setting("diloco", 50, "fp4"): Measured(0.211, _CODECS),
}


@dataclass
class Model:
    """What crosses the network for one model: its trainable tensors' sizes and, per fragment count, the
    pieces of each Streaming DiLoCo fragment (``diloco.streaming.layer_fragments``)."""

    name: str
    tensors: list[int]
    n_layers: int
    fragments: dict[int, list[list[int]]] = field(default_factory=dict)

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
    """A named size of ``launch.models.SIZES`` (its exact tensors, built on the meta device) or a parameter
    count such as ``150m`` or ``1.1e9`` (tensors of a typical size, fragments of equal size)."""
    import torch

    from launch.models import SIZES, Transformer

    spec = str(spec).strip()
    if spec.lower() in SIZES:
        name = spec.lower()
        args = replace(SIZES[name], vocab_size=VOCAB.get(name, 256))
        with torch.device("meta"):
            model = Transformer(args)
        from diloco.streaming import layer_fragments

        params = [p for p in model.parameters() if p.requires_grad]
        frags = {}
        for p in fragment_counts:
            if p <= args.n_layers:
                frags[p] = [[_piece_numel(params, e) for e in frag] for frag in layer_fragments(model, p)]
        return Model(name, [p.numel() for p in params], args.n_layers, frags)
    count = _parse_count(spec)
    if count is None or not math.isfinite(count) or count < 1:
        raise PlanError(f"--model {spec!r}: expected a size ({', '.join(SIZES)}) or a parameter count such as "
                        f"150m or 1.1e9")
    n = int(count)
    per = max(1, min(n, 4 << 20))  # a large matrix: 4M elements, as in a model of this scale
    tensors = [per] * (n // per) + ([n % per] if n % per else [])
    layers = max(1, min(64, round(math.log2(max(n, 2) / 1e6) * 3)))  # only bounds how many fragments make sense
    frags = {p: _split(n, p) for p in fragment_counts if p <= layers}
    return Model(f"{count_label(n)} parameters", tensors, layers, frags)


def _split(n: int, p: int) -> list[list[int]]:
    """``n`` elements in ``p`` fragments of equal size, each in tensors of at most 4M elements."""
    out = []
    for j in range(p):
        size = n // p + (1 if j < n % p else 0)
        per = max(1, min(size, 4 << 20))
        out.append([per] * (size // per) + ([size % per] if size % per else []))
    return out


def _piece_numel(params: list, entry: Any) -> int:
    if isinstance(entry, int):
        return params[entry].numel()
    i, start, stop = entry
    row = params[i].numel() // params[i].shape[0]
    return (stop - start) * row


# ---- the collectives, as the transports and the simulator count them ---------------------------------------
def _buckets(sizes: Sequence[int], limit_bytes: int = BUCKET_BYTES, itemsize: int = 4) -> list[int]:
    """Element counts of the flat buckets ``diloco.compress.flat.buckets`` makes of fp32 tensors of ``sizes``."""
    from diloco.compress.flat import bucket_groups

    return [sum(sizes[i] for i in g) for g in bucket_groups([n * itemsize for n in sizes], limit_bytes)]


@dataclass(frozen=True)
class Exchange:
    """One exchange on one worker's link: the collectives it runs (seconds each) and the bytes it sends."""

    seconds: tuple[float, ...]
    bytes_sent: int

    @property
    def total_s(self) -> float:
        return sum(self.seconds)


def _message_sizes(codec, numel: int, world: int) -> list[int]:
    """Bytes of each shard's message in the compressed all-reduce: weight, wire header and payload."""
    from diloco.comm.base import shard_bounds
    from diloco.compress import wire

    header = wire.header_size(1, codec.chain)
    return [WEIGHT_BYTES + header + codec.payload_bytes(b - a) for a, b in shard_bounds(numel, world, codec.align)]


def exchange(tensors: Sequence[int], codec_chain: str, world: int, net: NetworkModel, dense_total: bool) -> Exchange:
    """The exchange of fp32 tensors of ``tensors`` elements over ``world`` workers.

    fp32: the exact ring all-reduce of each bucket (``dense_total``: DiLoCo adds its one-element weight);
    another codec: per bucket, an all-to-all of the shards then an all-gather of their means."""
    from diloco.compress.codec import make_codec

    if world <= 1:
        return Exchange((), 0)
    seconds: list[float] = []
    sent = 0
    if codec_chain == "fp32":
        for numel in _buckets([*tensors, 1] if dense_total else list(tensors)):
            nbytes = 4 * numel
            seconds.append(net.all_reduce_s(nbytes, world))
            sent += 2 * (world - 1) * nbytes // world
        return Exchange(tuple(seconds), sent)
    codec = make_codec(codec_chain)
    for numel in _buckets(tensors):
        msgs = _message_sizes(codec, numel, world)
        total = sum(msgs)
        # all-to-all: worker r sends every shard but its own, receives W-1 copies of its own
        seconds.append(max(net.all_to_all_s(total - m, (world - 1) * m, world) for m in msgs))
        # all-gather of the means: worker r receives every other shard's mean
        seconds.append(max(net.all_gather_s(total - m, world) for m in msgs))
        sent += (total - msgs[0]) + (world - 1) * msgs[0]  # worker 0, as its summary counts
    return Exchange(tuple(seconds), sent)


# ---- virtual time, step by step as the simulator charges it -------------------------------------------------
@dataclass
class Timeline:
    """A run of equal-speed workers on the virtual clock: ``wall_s`` when it ends, ``compute_s`` of it computing,
    ``bytes_sent`` per worker, and the clock after each step (``clock_at``)."""

    wall_s: float
    compute_s: float
    bytes_sent: int
    clock_at: list[float]

    @property
    def utilization(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s > 0 else 1.0


def timeline(setting: Setting, model: Model, world: int, net: NetworkModel, step_time: float, steps: int) -> Timeline:
    """Replay ``steps`` training steps of ``setting`` with the simulator's accounting, the end of training included
    (a partial DiLoCo round is synced; Streaming DiLoCo waits for what is in flight and sends what is left)."""
    clock, link_free, sent = 0.0, 0.0, 0
    clock_at = []

    def run(x: Exchange) -> float:
        """Start ``x`` now (when the link is free); its end."""
        nonlocal link_free, sent
        if not x.seconds:
            return clock
        start = max(clock, link_free)
        end = start + x.total_s
        link_free = end
        sent += x.bytes_sent
        return end

    if setting.algo == "ddp":
        x = exchange(model.tensors, setting.codec, world, net, dense_total=False)
        for _ in range(steps):
            clock += step_time
            clock = max(clock, run(x))
            clock_at.append(clock)
        return Timeline(clock, steps * step_time, sent, clock_at)

    H = setting.inner_steps
    if setting.algo == "diloco":
        x = exchange(model.tensors, setting.codec, world, net, dense_total=True)
        since = 0
        for _ in range(steps):
            clock += step_time
            since += 1
            if since == H:
                clock, since = max(clock, run(x)), 0
            clock_at.append(clock)
        if since:
            clock = max(clock, run(x))
        return Timeline(clock, steps * step_time, sent, clock_at)

    # streaming: fragment p is sent at steps off_p + k H, and waited for tau steps later
    P, tau = setting.fragments, setting.overlap
    xs = [exchange(piece, setting.codec, world, net, dense_total=True) for piece in model.fragment_pieces(P)]
    offsets = [p * H // P for p in range(P)]
    since = [0] * P
    pending: list[tuple[int, float]] = []  # (apply at step, end of the exchange)
    for step in range(1, steps + 1):
        clock += step_time
        since = [s + 1 for s in since]
        for p, off in enumerate(offsets):
            if step >= max(off, 1) and (step - off) % H == 0:
                pending.append((step + tau, run(xs[p])))
                since[p] = 0
        due = [end for at, end in pending if at <= step]
        pending = [(at, end) for at, end in pending if at > step]
        for end in due:
            clock = max(clock, end)
        clock_at.append(clock)
    for _, end in pending:  # the end of training: what is in flight, then every fragment's unsent steps
        clock = max(clock, end)
    ends = [run(xs[p]) for p in range(P) if since[p] > 0]
    for end in ends:
        clock = max(clock, end)
    return Timeline(clock, steps * step_time, sent, clock_at)


@dataclass
class Row:
    setting: Setting
    bytes_per_round: int  # sent by one worker per round of H steps (DDP: per step)
    round_s: float  # virtual seconds per round, in the steady state
    compute_s: float  # of which computing: H x step time
    measured: Optional[Measured]

    @property
    def utilization(self) -> float:
        return self.compute_s / self.round_s if self.round_s > 0 else 1.0

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_round / self.setting.inner_steps


def predict(setting: Setting, model: Model, world: int, net: NetworkModel, step_time: float) -> Row:
    """Steady-state bytes and time per round: rounds 4 to 12 of a long run (Streaming's first exchanges and the
    end of training left out)."""
    H = setting.inner_steps
    first, last = 4, 12
    t = timeline(setting, model, world, net, step_time, (last + 1) * H)
    round_s = (t.clock_at[last * H - 1] - t.clock_at[first * H - 1]) / (last - first)
    per_round = exchange_bytes(setting, model, world, net)
    return Row(setting, per_round, round_s, H * step_time, MEASURED.get(setting))


def exchange_bytes(setting: Setting, model: Model, world: int, net: NetworkModel) -> int:
    """Bytes one worker sends per round: every fragment once."""
    if setting.algo == "ddp":
        return exchange(model.tensors, setting.codec, world, net, dense_total=False).bytes_sent
    return sum(exchange(piece, setting.codec, world, net, dense_total=True).bytes_sent
               for piece in model.fragment_pieces(setting.fragments if setting.algo == "streaming" else 1))


def candidates(model: Model) -> list[Setting]:
    out = [Setting("ddp")]
    out += [Setting("diloco", h, c) for h in DILOCO_H for c in CODECS]
    out += [Setting("streaming", h, c, p, min(OVERLAP, h - 1)) for h in STREAMING_H for p in FRAGMENTS
            if p <= model.n_layers and p in model.fragments for c in STREAMING_CODECS]
    return out


def recommend(rows: Sequence[Row]) -> tuple[Optional[Row], Optional[Row]]:
    """(the fewest bytes per step among rows at >= 95% utilization, the most: the setting nearest DDP that
    still reaches it); (None, None) when none does."""
    ok = [r for r in rows if r.utilization >= TARGET_UTILIZATION - 1e-12]
    if not ok:
        return None, None
    cheapest = min(ok, key=lambda r: (r.bytes_per_step, -r.utilization, r.setting.inner_steps))
    nearest = max(ok, key=lambda r: (r.bytes_per_step, r.utilization))
    return cheapest, nearest


# ---- input ---------------------------------------------------------------------------------------------------
@dataclass
class Link:
    bandwidth: Optional[float]  # bytes/s
    latency: float
    note: str = ""  # where the figures come from (a trace, as the plan's workers see it)


def parse_link(bandwidth: Optional[str], latency: Optional[str], links: Optional[str], workers: int = 1) -> Link:
    from diloco.sim import parse_bandwidth
    from launch.config import parse_duration

    note = ""
    bw = lat = None
    if links:
        from diloco.sim.links import LinkTrace, LinkTraceError

        try:
            trace = LinkTrace.load(links)
        except (OSError, LinkTraceError) as e:
            raise PlanError(f"--links {links}: {e}") from None
        try:
            trace.check_workers(workers)
        except LinkTraceError as e:
            raise PlanError(f"--links {links}: {e}") from None
        bw, lat = trace.effective(workers)
        note = (f"{links} as {workers} workers' exchanges see it: the slowest member's link at each moment, "
                f"{bw * 8 / 1e6:.4g} Mbit/s and {lat * 1e3:.4g} ms averaged over "
                f"{trace.span_s() / 3600:g} h of the trace")
    if bandwidth is not None:
        try:
            bw = parse_bandwidth(bandwidth)
        except ValueError as e:
            raise PlanError(f"--bandwidth: {e}") from None
    if latency is not None:
        try:
            lat = parse_duration(latency)
        except ValueError as e:
            raise PlanError(f"--latency {latency!r}: {e}") from None
        if not (lat >= 0 and math.isfinite(lat)):
            raise PlanError(f"--latency {latency!r}: must be a duration >= 0, e.g. 80ms")
    if bw is None or lat is None:
        raise PlanError("give the link: --bandwidth RATE and --latency DURATION (e.g. --bandwidth 100Mbit "
                        "--latency 40ms), or --links FILE")
    return Link(bw, lat, note)


def parse_step_time(text: Optional[str]) -> tuple[float, bool]:
    """(seconds per step, whether the user gave it)."""
    from launch.config import parse_duration

    if text is None:
        return DEFAULT_STEP_TIME, False
    try:
        s = parse_duration(text)
    except ValueError as e:
        raise PlanError(f"--step-time {text!r}: {e}") from None
    if not (s > 0 and math.isfinite(s)):
        raise PlanError(f"--step-time {text!r}: must be a duration > 0, e.g. 0.5s")
    return s, True


# ---- the plan ------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: Model
    workers: int
    link: Link
    step_time: float
    step_time_given: bool
    rows: list[Row]
    cheapest: Optional[Row]
    nearest: Optional[Row]

    @property
    def network(self) -> NetworkModel:
        return NetworkModel(self.link.bandwidth, self.link.latency)


def make_plan(model: str, workers: int, bandwidth: Optional[str], latency: Optional[str],
              step_time: Optional[str] = None, links: Optional[str] = None) -> Plan:
    if not isinstance(workers, int) or workers < 1:
        raise PlanError(f"--workers {workers}: must be a whole number >= 1")
    link = parse_link(bandwidth, latency, links, workers)
    step, given = parse_step_time(step_time)
    m = resolve_model(model)
    net = NetworkModel(link.bandwidth, link.latency)
    rows = [predict(s, m, workers, net, step) for s in candidates(m)]
    rows.sort(key=lambda r: (r.bytes_per_step, -r.utilization))
    cheapest, nearest = recommend(rows)
    return Plan(m, workers, link, step, given, rows, cheapest, nearest)


def penalty_text(row: Row, sources: list[str]) -> str:
    m = row.measured
    if m is None:
        return "unmeasured"
    if row.setting.algo == "ddp":
        return "baseline"
    if m.source not in sources:
        sources.append(m.source)
    return f"{100 * m.penalty:+.1f}% [{sources.index(m.source) + 1}]"


def format_plan(plan: Plan) -> str:
    net = plan.network
    step = f"{plan.step_time:g} s per step" + ("" if plan.step_time_given else " (assumed: pass --step-time)")
    lines = [f"model: {plan.model.name} ({plan.model.params / 1e6:.1f}M parameters, fp32 exchanges); "
             f"{plan.workers} workers at equal speed; {step}",
             f"link: {net.describe()} per worker" + (f" ({plan.link.note})" if plan.link.note else ""),
             ""]
    sources: list[str] = []
    head = (f"{'algorithm':<30} {'codec':<6} {'sent/round':>11} {'sent/step':>11} {'round time':>11} "
            f"{'compute':>9} {'utilization':>12}  loss vs DDP")
    lines += [head, "-" * (len(head) + 6)]
    for r in plan.rows:
        mark = " <-" if r is plan.cheapest else ""
        lines.append(f"{r.setting.label():<30} {r.setting.codec:<6} {human_bytes(r.bytes_per_round):>11} "
                     f"{human_bytes(r.bytes_per_step):>11} {r.round_s:>10.4g}s {r.compute_s:>8.4g}s "
                     f"{100 * r.utilization:>11.1f}%  {penalty_text(r, sources)}{mark}")
    lines.append("")
    lines.append("round: H steps (DDP: one step); utilization: compute time / round time, as `loco simulate` "
                 "counts it (Streaming's exchanges hide behind tau steps where the link keeps up).")
    for i, src in enumerate(sources, 1):
        lines.append(f"[{i}] benchmarks/results/{src}: val loss vs DDP; {SOURCES[src]}")
    lines.append("loss penalties: loco's measurements on the tiny model with 4 workers (at this model's scale they "
                 "may differ); a setting never measured says so.")
    if plan.cheapest is None:
        best = max(plan.rows, key=lambda r: r.utilization)
        lines.append(f"no setting reaches {100 * TARGET_UTILIZATION:.0f}% utilization; the highest is "
                     f"{best.setting.label()} {best.setting.codec} at {100 * best.utilization:.1f}%.")
    else:
        c, n = plan.cheapest, plan.nearest
        lines.append(f"recommended (fewest bytes at >= {100 * TARGET_UTILIZATION:.0f}% utilization): "
                     f"{c.setting.label()} {c.setting.codec}: {human_bytes(c.bytes_per_round)} per round, "
                     f"{100 * c.utilization:.1f}% utilization, loss vs DDP {penalty_text(c, sources)}")
        lines.append(f"  run it: loco simulate --workers {plan.workers} "
                     + " ".join(f"--set {o}" for o in c.setting.overrides()))
        if n is not None and n is not c:
            lines.append(f"nearest DDP at >= {100 * TARGET_UTILIZATION:.0f}%: {n.setting.label()} {n.setting.codec}: "
                         f"{human_bytes(n.bytes_per_round)} per round, {100 * n.utilization:.1f}% utilization, "
                         f"loss vs DDP {penalty_text(n, sources)}")
    return "\n".join(lines)


# ---- --check ----------------------------------------------------------------------------------------------------
@dataclass
class Check:
    setting: Setting
    workers: int
    steps: int
    predicted: float
    simulated: float
    run_dir: str

    @property
    def agrees(self) -> bool:
        return abs(self.predicted - self.simulated) <= 0.05


def check(plan: Plan, setting: Optional[Setting] = None, run_dir: Optional[str] = None) -> Check:
    """Simulate ``setting`` (the recommendation) on the tiny model with the plan's link and step time, and
    predict the same run."""
    import torch

    from launch.config import load_config
    from launch.data import load_data
    from launch.models import Transformer, model_args_from_config
    from launch.simulate import simulate_once

    setting = setting or (plan.cheapest or max(plan.rows, key=lambda r: r.utilization)).setting
    workers = min(plan.workers, CHECK_WORKERS)
    steps = CHECK_ROUNDS * setting.inner_steps
    folder = run_dir or tempfile.mkdtemp(prefix="loco-plan-check-")
    bw = f"{plan.link.bandwidth}B/s" if plan.link.bandwidth else "null"
    overrides = [*setting.overrides(), f"sim.workers={workers}", f"sim.bandwidth={bw}",
                 f"sim.latency={plan.link.latency}", f"sim.step_time={plan.step_time}", "sim.baseline=none",
                 f"run.max_steps={steps}", "run.batch_size=1", "data.seq_len=16", "data.max_docs=40",
                 "run.eval_every=0", "run.eval_batches=1", "run.checkpoint_every=0", "run.checkpoint_final=false",
                 "log.plot=false", "log.progress=off", "log.every=1000000", "run.threads=1", f"run.dir={folder}"]
    cfg, _ = load_config(["tiny"], overrides)
    data = load_data(cfg.data)
    args = model_args_from_config(cfg.model, data.vocab_size, cfg.data.seq_len)
    with torch.device("meta"):
        tiny = Transformer(args)
    from diloco.streaming import layer_fragments

    params = [p for p in tiny.parameters() if p.requires_grad]
    frags = {}
    if setting.algo == "streaming":
        frags[setting.fragments] = [[_piece_numel(params, e) for e in f]
                                    for f in layer_fragments(tiny, setting.fragments)]
    model = Model("tiny", [p.numel() for p in params], args.n_layers, frags)
    predicted = timeline(setting, model, workers, plan.network, plan.step_time, steps).utilization
    summary = simulate_once(cfg, data)
    return Check(setting, workers, steps, predicted, summary["compute_utilization"], summary["run_dir"])


def format_check(c: Check) -> str:
    verdict = "agree" if c.agrees else "DISAGREE"
    return (f"check: {c.setting.label()} {c.setting.codec} simulated on tiny, {c.workers} workers, {c.steps} steps, "
            f"the same link and step time\n"
            f"  {'predicted utilization':<24} {100 * c.predicted:6.1f}%\n"
            f"  {'simulated utilization':<24} {100 * c.simulated:6.1f}%\n"
            f"  they {verdict} within 5 points ({100 * abs(c.predicted - c.simulated):.2f} points apart); "
            f"run folder {c.run_dir}")


__all__ = ["MEASURED", "Check", "Plan", "PlanError", "Row", "Setting", "check", "exchange", "format_check",
           "format_plan", "make_plan", "predict", "recommend", "resolve_model", "timeline"]
