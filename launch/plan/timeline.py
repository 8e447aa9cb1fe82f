"""``loco plan``'s prediction: the bytes each exchange sends and the virtual time a run takes, step by step as the
simulator charges them (:mod:`diloco.sim.group`), for equal-speed workers."""

from __future__ import annotations

import math

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

from diloco.comm import Transport
from diloco.compress import make_codec
from diloco.compress.collective import exchange_sizes
from diloco.compress.flat import bucket_groups
from diloco.sim import NetworkModel
from launch.plan.settings import MEASURED, Measured, Model, Setting

TARGET_UTILIZATION = 0.95


# ---- the collectives, as the transports and the simulator count them ---------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One exchange on one worker's link: the seconds its collectives take one after another, and the bytes it
    sends."""

    total_s: float
    bytes_sent: int


def exchange(tensors: Sequence[int], codec_chain: str, world: int, net: NetworkModel, dense_total: bool,
             gathered: bool = False, shapes: Optional[Sequence[tuple[int, ...]]] = None) -> Exchange:
    """The exchange of fp32 tensors of ``tensors`` elements over ``world`` workers, with the messages the
    collective itself makes (:func:`diloco.compress.collective.exchange_sizes`).

    fp32: the exact ring all-reduce of each bucket (``dense_total``: DiLoCo adds its one-element weight);
    another codec: per bucket, an all-to-all of the shards then an all-gather of their means; ``gathered``: per
    bucket, an all-gather of every worker's payload. ``shapes``: the tensors' shapes (a chain with tiles cuts
    each on its own); else each is one vector.

    Buckets alike cost alike: each kind is priced once and counted, so a model of many equal tensors costs no
    more to plan than one of a few (the weight joins the last bucket only, which is priced on its own)."""
    if world <= 1 or not tensors:
        return Exchange(0.0, 0)
    units = [tuple(s) for s in shapes] if shapes is not None else [(n,) for n in tensors]
    groups = bucket_groups([4 * n for n in tensors], Transport.bucket_bytes)
    kinds = Counter(tuple(units[i] for i in g) for g in groups[:-1])
    total_s, sent = 0.0, 0
    for kind, count, weighted in [*((k, c, False) for k, c in kinds.items()),
                                  (tuple(units[i] for i in groups[-1]), 1, dense_total)]:
        seconds, nbytes = _buckets(kind, codec_chain, world, net.bandwidth, net.latency, weighted, gathered)
        total_s += count * seconds
        sent += count * nbytes
    return Exchange(total_s, sent)


@lru_cache(maxsize=4096)
def _buckets(shapes: tuple[tuple[int, ...], ...], codec_chain: str, world: int, bandwidth: Optional[float],
             latency: float, weighted: bool, gathered: bool = False) -> tuple[float, int]:
    """(seconds, bytes sent) of the exchange of one bucket's tensors (a weight may make it two buckets)."""
    net = NetworkModel(bandwidth, latency)
    codec = None if codec_chain == "fp32" else make_codec(codec_chain)
    seconds, sent = 0.0, 0
    numels = [math.prod(s) for s in shapes]
    for msgs in exchange_sizes(numels, world, codec, weighted=weighted, gather=gathered, shapes=shapes):
        if codec is None:
            nbytes = msgs[0]
            seconds += net.all_reduce_s(nbytes, world)
            sent += 2 * (world - 1) * nbytes // world
            continue
        if gathered:
            s, b = _gather(net, msgs[0], world)
            seconds, sent = seconds + s, sent + b
            continue
        total, sizes = sum(msgs), set(msgs)  # shards differ by an alignment at most: a few sizes, however many
        # all-to-all: worker r sends every shard but its own, receives W-1 copies of its own
        seconds += max(net.all_to_all_s(total - m, (world - 1) * m, world) for m in sizes)
        # all-gather of the means: worker r receives every other shard's mean
        seconds += max(net.all_gather_s(total - m, world) for m in sizes)
        sent += (total - msgs[0]) + (world - 1) * msgs[0]  # worker 0, as its summary counts
    return seconds, sent


def _gather(net: NetworkModel, payload: int, world: int) -> tuple[float, int]:
    """(seconds, bytes sent) of an all-gather of one ``payload``-byte message per worker: each worker's to every
    other (none with one worker)."""
    return net.all_gather_s((world - 1) * payload, world), (world - 1) * payload


# ---- virtual time, step by step as the simulator charges it -------------------------------------------------
@dataclass
class Timeline:
    """A run of equal-speed workers on the virtual clock: ``wall_s`` when it ends, ``compute_s`` of it computing,
    ``bytes_sent`` per worker, the clock after each step (``clock_at``), and the bytes one worker sends per round
    (``round_bytes``: every fragment once)."""

    wall_s: float
    compute_s: float
    bytes_sent: int
    clock_at: list[float]
    round_bytes: int

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
        if not x.total_s and not x.bytes_sent:
            return clock
        start = max(clock, link_free)
        end = start + x.total_s
        link_free = end
        sent += x.bytes_sent
        return end

    # fragment p is sent at steps off_p + k H, and waited for tau steps later (one fragment, no overlap: every
    # H steps, waited for at once; DDP's H is 1)
    sched = setting.schedule()
    H, P, tau = sched.period, sched.fragments, sched.overlap
    xs = _exchanges(setting, model, world, net)
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
    return Timeline(clock, steps * step_time, sent, clock_at, sum(x.bytes_sent for x in xs))


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
    return Row(setting, t.round_bytes, round_s, H * step_time, MEASURED.get(setting))


def _exchanges(setting: Setting, model: Model, world: int, net: NetworkModel) -> list[Exchange]:
    """Each fragment's exchange: a weighted mean of its tensors, or the all-gather of a payload the algorithm
    makes itself every step (DeMo: each worker's to every other)."""
    own = setting.step_payload(model)
    if own is not None:
        return [Exchange(*_gather(net, own, world))]
    sched = setting.schedule()
    shapes = model.shapes if sched.fragments == 1 and len(model.shapes) == len(model.tensors) else None
    return [exchange(piece, setting.chain(), world, net, dense_total=sched.weighted, gathered=sched.gathered,
                     shapes=shapes) for piece in model.fragment_pieces(sched.fragments)]


def recommend(rows: Sequence[Row]) -> tuple[Optional[Row], Optional[Row]]:
    """(the fewest bytes per step among rows at >= 95% utilization, the most: the setting nearest DDP that
    still reaches it); (None, None) when none does."""
    ok = [r for r in rows if r.utilization >= TARGET_UTILIZATION - 1e-12]
    if not ok:
        return None, None
    cheapest = min(ok, key=lambda r: (r.bytes_per_step, -r.utilization, r.setting.inner_steps))
    nearest = max(ok, key=lambda r: (r.bytes_per_step, r.utilization))
    return cheapest, nearest
