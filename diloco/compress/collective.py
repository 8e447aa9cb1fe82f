"""The compressed collective: a weighted mean of tensors through a codec, over any transport.

``all_reduce_compressed_(transport, tensors, codec, weight, key)`` sets every
worker's tensors to ``sum_i w_i x_i / sum_i w_i`` and returns the total weight.
It is written once, here, on the transports' byte collectives
(``all_to_all_bytes``, ``all_gather_bytes``), so every codec runs on every
transport and the transports know bytes, not codecs. Each message is the
weight (``<d``, 8 bytes) followed by the codec's self-describing payload.

Three aggregators share one decode/accumulate core (:func:`split_weight`, then
``codec.decode_accumulate_``):

* **sharded** (transports with fixed ranks: torch.distributed, the simulator),
  a reduce-scatter by shards:

  1. cut the flat buffer into one shard per worker (at multiples of the codec's
     chunk/block size), encode shard j and send it to worker j (all-to-all);
  2. worker j decodes every worker's copy of its shard into the weighted
     mean (each weighted by its share of the total weight: the first written,
     the others added, one pass each) and re-encodes the mean;
  3. all-gather the encoded means; everyone decodes every shard.

  Each worker sends about ``2 (W - 1) / W`` of the compressed size. Both
  encodes keep their own error-feedback residual (the sender's per destination
  shard, the shard owner's for the mean), so what one round drops is sent in a
  later one, and every worker ends with the same bytes, hence the same result.
  A transport whose worker is several processes (a node of a torchrun mesh)
  runs this on each process's share of the buffer (``transport.on_my_share``).

* **gathered** (``gather=True``, fixed ranks; SparseLoCo): every worker's
  payload reaches every worker (``all_gather_bytes``) and each decodes and sums
  all of them in rank order. The mean is exact (nothing is re-encoded), and a
  sparse payload stays sparse on the wire: the sum of W top-k payloads is
  never densified and sent again. Each worker sends ``W - 1`` times its
  payload.

* **robust** (peers without fixed ranks: hivemind), for members that need not
  trust each other: every member's payload reaches every member
  (``all_gather_bytes``, canonical order); each member decodes all of them,
  leaves out what fails validation (wire format, weight, finiteness), clips
  (or drops, ``transport.clip_action``) a contribution whose norm is more than
  ``transport.norm_clip`` times the median of the *other* members' norms,
  counts a weight above ``transport.weight_clip`` times the median of the
  others' weights as that bound (a member announcing more tokens than it
  trained cannot outweigh the group), and takes the weighted mean in the
  canonical order. Every member decides alike,
  so every member ends with the same result; the transport is told who was
  accepted, left out and clipped (``transport.record_contributions``).
"""

from __future__ import annotations

import math
import statistics
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generator, Hashable, Optional, Sequence

import torch

from diloco.comm.base import (Handle, SharedResult, Transport, TransportError, buckets, end_to_end, shard_bounds,
                              unflatten_into)
from diloco.compress.wire import CorruptPayload

if TYPE_CHECKING:
    from diloco.compress.codec import Codec

WEIGHT = struct.Struct("<d")


def pack_weight(weight: float) -> bytes:
    return WEIGHT.pack(weight)


def _valid_weight(w: float) -> bool:
    return w >= 0 and w < float("inf")


def split_weight(msg: bytes | memoryview) -> tuple[float, memoryview]:
    """(weight, codec payload) of one message; a missing or invalid weight raises :class:`CorruptPayload`."""
    if len(msg) < WEIGHT.size:
        raise CorruptPayload(f"message of {len(msg)} bytes has no weight")
    (w,) = WEIGHT.unpack_from(msg, 0)
    if not _valid_weight(w):
        raise CorruptPayload(f"weight {w} is not finite and >= 0")
    return w, memoryview(msg)[WEIGHT.size:]


def _check_weight(weight: float) -> None:
    if not _valid_weight(weight):
        raise ValueError(f"the weight of a compressed all-reduce must be finite and >= 0, got {weight}")


def _split_all(received: Sequence[bytes], me: int, what: str) -> list[tuple[float, memoryview]]:
    """Every worker's (weight, payload), in rank order; a bad one is a TransportError naming its sender."""
    out = []
    for src, msg in enumerate(received):
        try:
            out.append(split_weight(msg))
        except CorruptPayload as e:
            raise TransportError(f"rank {me}: worker {src} sent a corrupt {what.format(src=src)}: {e}") from None
    return out


def _decode_into(codec: "Codec", body: memoryview, out: torch.Tensor, scale: float, fresh: bool, me: int, src: int,
                 what: str) -> None:
    """``out += scale * decode(body)`` (``fresh``: ``out <- scale * decode(body)``, in the same one pass); a bad
    payload is a TransportError naming its sender."""
    try:
        if fresh:
            codec.decode_into_(body, out, scale)
        else:
            codec.decode_accumulate_(body, out, scale)
    except CorruptPayload as e:
        raise TransportError(f"rank {me}: worker {src} sent a corrupt {what.format(src=src)}: {e}") from None


# ---- the entry points -----------------------------------------------------------------------------
def all_reduce_compressed_(transport: Transport, tensors: Sequence[torch.Tensor], codec: "Codec",
                           weight: float = 1.0, key: Hashable = "", gather: bool = False) -> float:
    """Weighted mean over the workers through ``codec``, in place: ``x <- sum_i w_i x_i / sum_i w_i``.

    Returns the total weight (0: every worker sent weight 0, the tensors are then zero). ``key``
    names this list of tensors for the codec's error feedback (use one key per list that is
    reduced repeatedly). With one worker the codec still runs, so compression acts alike at any scale.
    ``gather``: every worker decodes every worker's payload (exact, sparse on the wire) instead of the
    reduce-scatter by shards.
    """
    _check_weight(weight)
    if not tensors:
        return 0.0
    if not transport.fixed_ranks:
        return _robust_all_reduce_(transport, tensors, codec, weight, key)
    mean_ = _gathered_mean_ if gather else _sharded_mean_
    groups = buckets(tensors, transport.bucket_bytes)
    alone = [_alone(bucket) for bucket in groups]
    largest = max((sum(t.numel() for t in g) for g, a in zip(groups, alone) if not a), default=0)
    with transport.exchange_scope():
        if transport.overlaps_exchange and len(groups) > 1:
            return _pipelined(transport, groups, alone, largest, mean_, codec, float(weight), key)
        totals = []
        scratch = None  # one buffer for every bucket that is concatenated (its pages faulted in once)
        for b, bucket in enumerate(groups):
            flat, scratch = _flat_of(transport, bucket, alone[b], scratch, largest)
            totals.append(transport.on_my_share(
                flat, codec.align, (key, b),
                lambda share, k: _complete(mean_(transport, share, codec, float(weight), k))))
            if not alone[b]:
                unflatten_into(bucket, flat)
        transport.give_scratch(scratch)
    return max(totals)


def _complete(steps: Generator[Handle, object, float]) -> float:
    """Run one bucket's exchange (a generator of the collectives it starts, see :func:`_sharded_mean_`) to its end."""
    try:
        handle = next(steps)
        while True:
            handle = steps.send(handle.wait())
    except StopIteration as done:
        return done.value


def _pipelined(transport: Transport, groups: list[list[torch.Tensor]], alone: list[bool], largest: int, mean_,
               codec: "Codec", weight: float, key: Hashable) -> float:
    """The buckets' exchanges overlapped: while one bucket's payloads are on the wire, this worker encodes the
    next and decodes an earlier one.

    Each bucket's exchange is a generator that starts a collective and yields its handle, and takes up the
    result when resumed. Every tick starts the next bucket, then resumes each bucket in flight once, newest
    first: with the sharded mean, tick t encodes bucket t and starts its all-to-all, decodes bucket t-1's
    shard and starts its all-gather, and decodes bucket t-2's means. Every worker starts the same collectives
    in the same order, and each bucket's arithmetic is that of the one-at-a-time loop, so the result is the
    same to the bit.
    """
    totals: list[float] = []
    active: list[list] = []  # [steps, handle, bucket index, flat, scratch slot], oldest first
    free_slots: list[str] = []  # a concatenation buffer per bucket in flight, kept by slot
    scratch: dict[str, torch.Tensor] = {}

    def resume(item: list) -> bool:
        steps, handle, b, flat, slot = item
        try:
            item[1] = steps.send(handle.wait())
            return False
        except StopIteration as done:
            totals.append(done.value)
            if not alone[b]:
                unflatten_into(groups[b], flat)
                free_slots.append(slot)
            return True

    b = 0
    while b < len(groups) or active:
        older = list(active)  # resumed this tick; a bucket started now waits for the next
        if b < len(groups):
            slot = None if alone[b] else free_slots.pop() if free_slots else f"concat{len(scratch) or ''}"
            flat, kept = _flat_of(transport, groups[b], alone[b], scratch.get(slot), largest, slot or "concat")
            if slot is not None:
                scratch[slot] = kept
            steps = mean_(transport, flat, codec, weight, (key, b))
            active.append([steps, next(steps), b, flat, slot])
            b += 1
        done = {id(item) for item in reversed(older) if resume(item)}
        active = [item for item in active if id(item) not in done]
    for slot, buf in scratch.items():
        transport.give_scratch(buf, slot)
    return max(totals)


def _alone(bucket: Sequence[torch.Tensor]) -> bool:
    """A bucket reduced where it lies, not concatenated: fp32 tensors that lie end to end in one storage (one
    contiguous tensor; or consecutive pieces of one flat buffer, as DiLoCo's pseudo-gradients are)."""
    return bucket[0].dtype == torch.float32 and end_to_end(bucket) is not None


def _flat_of(transport: Transport, bucket: Sequence[torch.Tensor], alone: bool, scratch: Optional[torch.Tensor],
             largest: int, slot: str = "concat") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the bucket as one flat fp32 buffer, the scratch kept for the next bucket): the tensors themselves where
    they are ``alone`` (reduced in place: every payload is encoded before the result is written back), else the
    bucket concatenated into scratch of ``slot`` (:meth:`Transport.concat_bucket`); its result is written back
    with ``unflatten_into`` then."""
    if alone:
        return end_to_end(bucket), scratch
    return transport.concat_bucket(bucket, scratch, largest, slot)


def all_reduce_compressed_async_(transport: Transport, tensors: Sequence[torch.Tensor], codec: "Codec",
                                 weight: float = 1.0, key: Hashable = "", gather: bool = False) -> Handle:
    """Start :func:`all_reduce_compressed_`; the handle's ``wait()`` returns the total weight."""
    return transport.start(lambda: all_reduce_compressed_(transport, tensors, codec, weight, key, gather))


def robust_all_reduce_(transport: Transport, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
    """The dense all-reduce of a transport without fixed ranks: raw fp32 payloads, validated and clipped."""
    from diloco.compress.codec import make_codec

    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    result = robust_mean(transport, flat, make_codec("fp32"), None, key=None)
    mean = result.mean * result.total if op == "sum" else result.mean  # not in place: the result may be shared
    unflatten_into(list(tensors), mean)  # piece by piece from host memory: no second model-sized copy on a GPU


# ---- sharded: reduce-scatter by shards ------------------------------------------------------------
def _sharded_mean_(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float,
                   key: Hashable) -> Generator[Handle, object, float]:
    """``flat`` (this worker's, fp32) becomes the weighted mean over the workers; returns the total weight.

    A generator: it yields the handle of each collective it starts and is resumed with that collective's result
    (:func:`_complete` runs it through)."""
    w, me = transport.world_size, transport.rank
    bounds = shard_bounds(flat.numel(), w, codec.align)
    prefix = pack_weight(weight)
    sizes = _known_sizes(codec, [b - a for a, b in bounds], len(prefix))  # shard j's payloads, and its mean's
    sends = [codec.encode(flat[a:b], key=(key, "shard", j), prefix=prefix, feedback=weight > 0)
             for j, (a, b) in enumerate(bounds)]
    started = transport.all_to_all_bytes_start(sends, None if sizes is None else [sizes[me]] * w)
    del sends  # the transport holds what it still sends; the buffers are free for the next encode
    received = _split_all((yield started), me, f"payload for shard {me}")
    a, b = bounds[me]
    room = transport.take_scratch(b - a, flat.device, "mean")
    acc = room[:b - a]
    total = sum(wi for wi, _ in received)
    # the mean as sum_i (w_i / total) x_i: the first payload written, the others added, each in one pass
    for src, (wi, body) in enumerate(received):
        _decode_into(codec, body, acc, wi / total if total > 0 else 0.0, src == 0, me, src, f"payload for shard {me}")
    if total <= 0:  # every payload is still checked; the mean of nothing is zero
        acc.zero_()
    del received  # its buffer is free for the next receive
    mine = codec.encode(acc, key=(key, "mean"), prefix=pack_weight(total), feedback=total > 0)
    del acc
    transport.give_scratch(room, "mean")
    started = transport.all_gather_bytes_start(mine, sizes)
    del mine
    means = _split_all((yield started), me, "mean of shard {src}")
    for src, (_, body) in enumerate(means):
        a, b = bounds[src]
        _decode_into(codec, body, flat[a:b], 1.0, True, me, src, "mean of shard {src}")
    return max(wi for wi, _ in means)


def _known_sizes(codec: "Codec", numels: Sequence[int], prefix: int) -> Optional[list[int]]:
    """The message lengths of 1-D pieces of ``numels`` elements, where the codec's sizes do not depend on the
    values (no zstd): every worker then knows what it will receive, and the transport needs no size exchange."""
    sizes = [codec.wire_size(n) for n in numels]
    return None if None in sizes else [prefix + n for n in sizes]


# ---- gathered: every worker's payload, decoded by every worker -------------------------------------
def _gathered_mean_(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float,
                    key: Hashable) -> Generator[Handle, object, float]:
    """``flat`` becomes ``sum_i w_i decode(payload_i) / sum_i w_i``, summed in rank order on every worker (a
    generator, as :func:`_sharded_mean_`)."""
    me = transport.rank
    prefix = pack_weight(weight)
    sizes = _known_sizes(codec, [flat.numel()] * transport.world_size, len(prefix))
    mine = codec.encode(flat, key=key, prefix=prefix, feedback=weight > 0)
    started = transport.all_gather_bytes_start(mine, sizes)
    del mine
    received = _split_all((yield started), me, "payload")
    total = sum(wi for wi, _ in received)
    if total > 0:
        for src, (wi, body) in enumerate(received):
            _decode_into(codec, body, flat, wi / total, src == 0, me, src, "payload")
    else:
        flat.zero_()
    return total


# ---- robust: every member's payload, validated, clipped, averaged -----------------------------------
@dataclass
class RobustResult:
    mean: torch.Tensor
    total: float
    accepted: dict = field(default_factory=dict)  # member -> weight
    rejected: dict = field(default_factory=dict)  # member -> why
    clipped: dict = field(default_factory=dict)  # member -> its norm over the bound
    weights_clipped: dict = field(default_factory=dict)  # member -> its announced weight over the bound


def _robust_all_reduce_(transport: Transport, tensors: Sequence[torch.Tensor], codec: "Codec", weight: float,
                        key: Hashable) -> float:
    if len(buckets(tensors, 1 << 62)) > 1:
        raise ValueError("tensors of one compressed all-reduce must share dtype and device")
    # no copy where they lie end to end: read (encoded) before the result is written
    flat = end_to_end(tensors) if tensors[0].dtype == torch.float32 else None
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    result = robust_mean(transport, flat, codec, weight, key)
    unflatten_into(list(tensors), result.mean.to(tensors[0].device))
    return result.total


def robust_mean(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float | None,
                key: Hashable) -> RobustResult:
    """Exchange ``flat`` with every member and average what passes validation and the norm bound.

    ``weight`` None sends no weight (every member counts 1). ``flat`` (fp32) is the caller's to give: once
    encoded it may become the mean's buffer.
    """
    with transport.exchange_scope():
        prefix = b"" if weight is None else pack_weight(weight)
        payloads = transport.all_gather_bytes(codec.encode(flat, key=key, prefix=prefix,
                                                           feedback=weight is None or weight > 0))
    names = transport.member_names()
    shared_key = (codec.chain, flat.numel(), flat.device, weight is None, transport.norm_clip, transport.clip_action,
                  transport.weight_clip)
    shared = _SHARED_ROBUST.take(payloads, shared_key) if transport.shared_results else None
    if shared is not None:  # simulated members of one collective: the mean was computed once, from the same bytes
        transport.record_contributions(shared.accepted, shared.rejected, shared.clipped, shared.weights_clipped)
        return shared
    # the mean's own tensor is pass 1's buffer too: one vector for the whole mean (on a GPU, 4 GB less for 1B); a
    # member alone with this list writes it over ``flat``, encoded already (4 GB less again); simulated members
    # share the result, so it gets its own
    own = transport.shared_results or flat.dtype != torch.float32 or not flat.is_contiguous()
    result = RobustResult(torch.empty(flat.numel(), dtype=torch.float32, device=flat.device) if own
                          else flat.view(-1), 0.0)
    # pass 1: validate every member's update and measure its norm, each decoded into that buffer in turn
    rows: list[tuple[str, memoryview, float, float]] = []  # (member, body, weight, norm)
    x = result.mean
    for name, msg in zip(names, payloads):
        try:
            w, body = split_weight(msg) if weight is not None else (1.0, memoryview(msg))
            codec.decode_into_(body, x)
            # in float64, whose sum of float32 squares cannot overflow (a float32 norm near 1.8e19 was finite or
            # not by the order of the reduction, so members on other hardware could accept other payloads), and
            # rounded to 9 digits, so the clip decisions below come out alike on every member
            norm = float(f"{float(torch.linalg.vector_norm(x, dtype=torch.float64)):.9g}")
            if not math.isfinite(norm):
                raise CorruptPayload("non-finite values")
        except (CorruptPayload, ValueError) as e:
            result.rejected[name] = f"invalid payload: {e}"
            continue
        rows.append((name, body, float(w), norm))
    result.mean.zero_()
    # clip (or drop) an update far above the others' median norm; every member decides alike
    scale: dict[str, float] = {}
    bound_factor, action = transport.norm_clip, transport.clip_action
    if bound_factor > 0 and len(rows) > 1:
        for i, (name, _, _, n) in enumerate(rows):
            others = [r[3] for j, r in enumerate(rows) if j != i and r[3] > 0]  # zeros: members that sat out
            if not others:
                continue
            bound = bound_factor * statistics.median(others)
            if n > bound:
                if action == "drop":
                    result.rejected[name] = (f"norm {n:.4g} > {bound_factor:g} x the others' median "
                                             f"{bound / bound_factor:.4g}: dropped")
                else:
                    scale[name] = bound / n
                    result.clipped[name] = n / bound
    rows = [r for r in rows if r[0] not in result.rejected]
    # a weight far above the others' median counts as that bound: honest members differ by their batch sizes and
    # speeds, while a member announcing a billion tokens would otherwise make the mean its own update
    if weight is not None and transport.weight_clip > 0 and len(rows) > 1:
        announced = [r[2] for r in rows]
        for i, (name, body, w, n) in enumerate(rows):
            others = [a for j, a in enumerate(announced) if j != i and a > 0]
            if not others:
                continue
            bound = transport.weight_clip * statistics.median(others)
            if w > bound:
                rows[i] = (name, body, bound, n)
                result.weights_clipped[name] = w / bound
    result.total = sum(r[2] for r in rows)
    # pass 2: the weighted mean, accumulated in the canonical member order
    if result.total > 0:
        for name, body, w, _ in rows:
            codec.decode_accumulate_(body, result.mean, w / result.total * scale.get(name, 1.0))
    result.accepted = {r[0]: r[2] for r in rows}
    if transport.shared_results:
        _SHARED_ROBUST.fill(payloads, shared_key, result, len(payloads) - 1)
    transport.record_contributions(result.accepted, result.rejected, result.clipped, result.weights_clipped)
    return result


# one robust mean, for the other simulated workers that received the same payload list (read only: callers copy it)
_SHARED_ROBUST = SharedResult()


__all__ = ["RobustResult", "WEIGHT", "all_reduce_compressed_", "all_reduce_compressed_async_", "pack_weight",
           "robust_all_reduce_", "robust_mean", "split_weight"]
