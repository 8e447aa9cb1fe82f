"""The weighted mean of tensors over the workers, for fp32 and every codec, on any transport.

``weighted_mean(transport, tensors, weight, codec, key)`` sets every worker's
tensors to ``sum_i w_i x_i / sum_i w_i`` and returns the total weight
(``weight`` None: every worker counts once). ``weighted_mean_async`` starts it.
How it aggregates is chosen in one place, :func:`aggregation`, from the
transport's capabilities and the codec:

* **dense** (fixed ranks, no codec): the exact ring all-reduce of fp32 sums,
  bucket by bucket (:func:`all_reduce_`); a weighted mean sends the weighted
  tensors and the total weight in the same all-reduce, and divides after.

* **sharded** (fixed ranks: torch.distributed, the simulator), a reduce-scatter
  by shards, written on the transports' byte collectives (``all_to_all_bytes``,
  ``all_gather_bytes``), so every codec runs on every transport:

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

* **robust** (peers without fixed ranks: hivemind, the simulator under churn):
  every member validates, clips and averages every member's payload
  (:mod:`diloco.compress.robust`), through the codec, or raw fp32 without one.

The gathered and robust means can divide each position by the weight of the
workers that sent it instead of the total (``senders``, a
:class:`~diloco.compress.senders.Senders` that counts what they saw): the mean
over senders of published SparseLoCo.

Each message of the coded means is the weight (``<d``, 8 bytes) followed by the
codec's self-describing payload (:mod:`diloco.compress.message`);
:func:`exchange_sizes` gives their sizes without running an exchange.
"""

from __future__ import annotations

from functools import partial
from typing import Generator, Hashable, Optional, Sequence

import torch

from diloco.comm.base import Handle, Transport, TransportError, shard_bounds
from diloco.comm.caps import Capabilities
from diloco.compress.codec import Codec, make_codec
from diloco.compress.flat import Scratch, bucket_groups, buckets, end_to_end, scratch_for, unflatten_into
from diloco.compress.message import check_weight, known_sizes, message_size, pack_weight, split_weight
from diloco.compress.robust import robust_dense_mean_, robust_mean_
from diloco.compress.senders import Senders, divide_by_senders_
from diloco.compress.wire import CorruptPayload


def aggregation(caps: Capabilities, codec: Optional[Codec], gather: bool = False) -> str:
    """How a weighted mean aggregates, decided here alone: ``robust`` where the ranks are not fixed; else
    ``dense`` without a codec, ``gathered`` where the caller asks for it, ``sharded`` otherwise."""
    if not caps.fixed_ranks:
        return "robust"
    if codec is None:
        return "dense"
    return "gathered" if gather else "sharded"


def codec_for(transport: Transport, codec: Optional[Codec]) -> Optional[Codec]:
    """The codec that a caller keeping one (its error feedback, its byte counts) hands :func:`weighted_mean` over
    ``transport``: None where the exact dense mean serves (fixed ranks, and no codec or one that changes
    nothing); peers without fixed ranks always encode, through fp32 where no codec is given (each update
    travels with its weight and is validated)."""
    if transport.caps.fixed_ranks:
        return None if codec is None or codec.is_identity else codec
    return codec or make_codec("fp32")


# ---- the entry points -----------------------------------------------------------------------------
def weighted_mean(transport: Transport, tensors: Sequence[torch.Tensor], weight: Optional[float] = None,
                  codec: Optional[Codec] = None, key: Hashable = "", gather: bool = False,
                  senders: Optional[Senders] = None) -> float:
    """Weighted mean over the workers, in place: ``x <- sum_i w_i x_i / sum_i w_i`` (``weight`` None: every
    worker counts once); the aggregation is :func:`aggregation`'s.

    Returns the total weight (0: every worker sent weight 0, the tensors are then zero). ``codec``: what the
    tensors travel through (None: exact fp32). ``key`` names this list of tensors for the codec's error feedback
    (use one key per list that is reduced repeatedly). With one worker the codec still runs, so compression acts
    alike at any scale. ``gather``: every worker decodes every worker's payload (exact, sparse on the wire)
    instead of the reduce-scatter by shards. ``senders``: each position's mean is over the workers that sent it
    (gathered and robust means only), and ``senders`` counts what they sent.
    """
    how = aggregation(transport.caps, codec, gather)
    if senders is not None and how not in ("gathered", "robust"):
        raise ValueError(f"a mean over senders needs a gathered or robust mean of coded payloads, not {how}")
    if how == "dense":
        return _dense_mean_(transport, tensors, weight)
    if weight is not None:
        check_weight(weight)
    if not tensors:
        return 0.0
    if how == "robust":
        if codec is None:  # an exact mean, of members that validate each other: raw fp32
            return robust_dense_mean_(transport, tensors, weight)
        return robust_mean_(transport, tensors, codec, weight, key, senders)
    mean_ = _sharded_mean_ if how == "sharded" else partial(_gathered_mean_, senders=senders)
    return _coded_mean_(transport, tensors, codec, 1.0 if weight is None else float(weight), key, mean_)


def weighted_mean_async(transport: Transport, tensors: Sequence[torch.Tensor], weight: Optional[float] = None,
                        codec: Optional[Codec] = None, key: Hashable = "", gather: bool = False,
                        senders: Optional[Senders] = None) -> Handle:
    """Start :func:`weighted_mean`; the handle's ``wait()`` returns the total weight."""
    return transport.start(lambda: weighted_mean(transport, tensors, weight, codec, key, gather, senders))


def all_reduce_(transport: Transport, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
    """Sum or average a list of tensors over workers with fixed ranks, in place, in flat buckets: the exact ring
    all-reduce (:meth:`Transport.all_reduce_sum_`) of each."""
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if not transport.caps.fixed_ranks:
        raise TransportError("a transport without fixed ranks averages with weighted_mean (its robust mean)")
    if transport.world_size == 1 or not tensors:
        return
    groups = buckets(tensors, transport.bucket_bytes)
    largest = max((sum(t.numel() for t in g) for g in groups if g[0].dtype == torch.float32), default=0)
    pool = scratch_for(transport)
    scratch = None  # fp32 buckets are concatenated into one buffer (kept between exchanges where that pays)
    with transport.exchange_scope():
        for bucket in groups:
            if bucket[0].dtype == torch.float32:
                # a bucket of one tensor is copied too: a failed exchange leaves the tensor as it was
                flat, scratch = pool.concat(bucket, scratch, largest)
            else:
                flat = (torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1
                        else bucket[0].reshape(-1).clone())
            transport.all_reduce_sum_(flat)
            if op == "mean":
                flat.div_(transport.world_size)
            unflatten_into(bucket, flat)
    pool.give(scratch)


def all_reduce_async_(transport: Transport, tensors: Sequence[torch.Tensor], op: str = "mean") -> Handle:
    """Start :func:`all_reduce_`; the tensors hold the result once the handle's ``wait()`` returns."""
    return transport.start(lambda: all_reduce_(transport, tensors, op))


def _dense_mean_(transport: Transport, tensors: Sequence[torch.Tensor], weight: Optional[float]) -> float:
    if weight is None:
        all_reduce_(transport, tensors, "mean")
        return float(transport.world_size)
    # the weighted sums and the total weight in one all-reduce: the weight is one more element of the last bucket
    total = torch.tensor([weight], dtype=torch.float32, device=tensors[-1].device if tensors else None)
    with torch.no_grad():
        for t in tensors:
            t.mul_(weight)
        all_reduce_(transport, [*tensors, total], "sum")
        value = float(total.item())
        if value > 0:
            for t in tensors:
                t.div_(value)
    return value


def _coded_mean_(transport: Transport, tensors: Sequence[torch.Tensor], codec: Codec, weight: float, key: Hashable,
                 mean_) -> float:
    """The sharded or gathered mean (``mean_``), bucket by bucket: buckets that lie end to end are reduced where
    they lie, others through a concatenation buffer."""
    groups = buckets(tensors, transport.bucket_bytes)
    alone = [_alone(bucket) for bucket in groups]
    largest = max((sum(t.numel() for t in g) for g, a in zip(groups, alone) if not a), default=0)
    pool = scratch_for(transport)
    with transport.exchange_scope():
        if transport.caps.overlaps_exchange and len(groups) > 1:
            return _pipelined(transport, pool, groups, alone, largest, mean_, codec, weight, key)
        totals = []
        scratch = None  # one buffer for every bucket that is concatenated (its pages faulted in once)
        for b, bucket in enumerate(groups):
            flat, scratch = _flat_of(pool, bucket, alone[b], scratch, largest)
            # a chain with tiles cuts the bucket's tensors; a share of the bucket (a node's process) is one vector
            shapes = [t.shape for t in bucket]
            totals.append(transport.on_my_share(flat, codec.align, (key, b), lambda share, k: _complete(mean_(
                transport, share, codec, weight, k, shapes=shapes if share.numel() == flat.numel() else None))))
            if not alone[b]:
                unflatten_into(bucket, flat)
        pool.give(scratch)
    return max(totals)


def _complete(steps: Generator[Handle, object, float]) -> float:
    """Run one bucket's exchange (a generator of the collectives it starts, see :func:`_sharded_mean_`) to its end."""
    try:
        handle = next(steps)
        while True:
            handle = steps.send(handle.wait())
    except StopIteration as done:
        return done.value


def _pipelined(transport: Transport, pool: Scratch, groups: list[list[torch.Tensor]], alone: list[bool], largest: int,
               mean_, codec: "Codec", weight: float, key: Hashable) -> float:
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
            flat, kept = _flat_of(pool, groups[b], alone[b], scratch.get(slot), largest, slot or "concat")
            if slot is not None:
                scratch[slot] = kept
            steps = mean_(transport, flat, codec, weight, (key, b), shapes=[t.shape for t in groups[b]])
            active.append([steps, next(steps), b, flat, slot])
            b += 1
        done = {id(item) for item in reversed(older) if resume(item)}
        active = [item for item in active if id(item) not in done]
    for slot, buf in scratch.items():
        pool.give(buf, slot)
    return max(totals)


def _alone(bucket: Sequence[torch.Tensor]) -> bool:
    """A bucket reduced where it lies, not concatenated: fp32 tensors that lie end to end in one storage (one
    contiguous tensor; or consecutive pieces of one flat buffer, as DiLoCo's pseudo-gradients are)."""
    return bucket[0].dtype == torch.float32 and end_to_end(bucket) is not None


def _flat_of(pool: Scratch, bucket: Sequence[torch.Tensor], alone: bool, scratch: Optional[torch.Tensor],
             largest: int, slot: str = "concat") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the bucket as one flat fp32 buffer, the scratch kept for the next bucket): the tensors themselves where
    they are ``alone`` (reduced in place: every payload is encoded before the result is written back), else the
    bucket concatenated into scratch of ``slot`` (:meth:`Scratch.concat`); its result is written back with
    ``unflatten_into`` then."""
    if alone:
        return end_to_end(bucket), scratch
    return pool.concat(bucket, scratch, largest, slot)


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
                 what: str, support: Optional[torch.Tensor] = None,
                 shapes: Optional[Sequence[torch.Size]] = None) -> None:
    """``out += scale * decode(body)`` (``fresh``: ``out <- scale * decode(body)``, in the same one pass), and
    ``support += scale`` where the payload holds a value; a bad payload is a TransportError naming its sender."""
    try:
        if fresh:
            codec.decode_into_(body, out, scale, support, scale, shapes)
        else:
            codec.decode_accumulate_(body, out, scale, support, scale, shapes)
    except CorruptPayload as e:
        raise TransportError(f"rank {me}: worker {src} sent a corrupt {what.format(src=src)}: {e}") from None


# ---- sharded: reduce-scatter by shards ------------------------------------------------------------
def _sharded_mean_(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float,
                   key: Hashable, shapes: Optional[Sequence[torch.Size]] = None) -> Generator[Handle, object, float]:
    """``flat`` (this worker's, fp32) becomes the weighted mean over the workers; returns the total weight.
    Its shards cut tensors: each is encoded as one vector (``shapes`` is not used).

    A generator: it yields the handle of each collective it starts and is resumed with that collective's result
    (:func:`_complete` runs it through)."""
    w, me = transport.world_size, transport.rank
    bounds = shard_bounds(flat.numel(), w, codec.align)
    prefix = pack_weight(weight)
    sizes = known_sizes(codec, [b - a for a, b in bounds])  # shard j's payloads, and its mean's
    sends = [codec.encode(flat[a:b], key=(key, "shard", j), prefix=prefix, feedback=weight > 0)
             for j, (a, b) in enumerate(bounds)]
    started = transport.all_to_all_bytes_start(sends, None if sizes is None else [sizes[me]] * w)
    del sends  # the transport holds what it still sends; the buffers are free for the next encode
    received = _split_all((yield started), me, f"payload for shard {me}")
    a, b = bounds[me]
    pool = scratch_for(transport)
    room = pool.take(b - a, flat.device, "mean")
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
    pool.give(room, "mean")
    started = transport.all_gather_bytes_start(mine, sizes)
    del mine
    means = _split_all((yield started), me, "mean of shard {src}")
    for src, (_, body) in enumerate(means):
        a, b = bounds[src]
        _decode_into(codec, body, flat[a:b], 1.0, True, me, src, "mean of shard {src}")
    return max(wi for wi, _ in means)


# ---- gathered: every worker's payload, decoded by every worker -------------------------------------
def _gathered_mean_(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float,
                    key: Hashable, senders: Optional[Senders] = None,
                    shapes: Optional[Sequence[torch.Size]] = None) -> Generator[Handle, object, float]:
    """``flat`` becomes ``sum_i w_i decode(payload_i) / sum_i w_i``, summed in rank order on every worker (a
    generator, as :func:`_sharded_mean_`); with ``senders`` each position is divided by the weight of the workers
    that sent it instead. ``shapes``: the tensors ``flat`` is (a chain with tiles cuts each on its own)."""
    me = transport.rank
    prefix = pack_weight(weight)
    sizes = known_sizes(codec, [flat.numel()] * transport.world_size, shapes)
    mine = codec.encode(flat, key=key, prefix=prefix, feedback=weight > 0, shapes=shapes)
    started = transport.all_gather_bytes_start(mine, sizes)
    del mine
    received = _split_all((yield started), me, "payload")
    total = sum(wi for wi, _ in received)
    if total <= 0:
        flat.zero_()
    elif senders is None:
        for src, (wi, body) in enumerate(received):
            _decode_into(codec, body, flat, wi / total, src == 0, me, src, "payload", shapes=shapes)
    else:
        counts = torch.zeros_like(flat)
        for src, (wi, body) in enumerate(received):
            _decode_into(codec, body, flat, wi, src == 0, me, src, "payload", counts if wi > 0 else None, shapes)
        divide_by_senders_(codec, flat, counts, senders, sum(wi > 0 for wi, _ in received), shapes)
    return total

# ---- sizes, without an exchange ------------------------------------------------------------------------
def exchange_sizes(numels: Sequence[int], world: int, codec: Optional[Codec] = None, *, weighted: bool = True,
                   gather: bool = False, bucket_bytes: int = Transport.bucket_bytes,
                   shapes: Optional[Sequence[Sequence[int]]] = None) -> list[list[int]]:
    """The messages of one :func:`weighted_mean` of fp32 tensors of ``numels`` values over ``world`` workers with
    fixed ranks, bucket by bucket, as the exchange makes them:

    * dense (no codec): per bucket ``[bytes of the bucket]``, of which the ring all-reduce puts ``2 (W - 1) / W``
      on the wire each way; ``weighted``: the one-element total weight joins the last bucket;
    * sharded: per bucket, the message of each shard j: worker j receives every worker's copy of it in the
      all-to-all, and every worker receives the mean of shard j, of the same size, in the all-gather;
    * gathered (``gather``): per bucket, every worker's message of the whole bucket (of tensors of ``shapes``,
      for a chain with tiles).

    With a zstd stage the sizes are those before zstd (:func:`~diloco.compress.message.message_size`).
    """
    how = aggregation(Capabilities(), codec, gather)
    sizes = [*numels, 1] if how == "dense" and weighted else list(numels)
    sized: dict[int, int] = {}  # shards differ by an alignment at most: each size is priced once, whatever W is

    def size_of(n: int) -> int:
        if n not in sized:
            sized[n] = message_size(codec, n)
        return sized[n]

    out = []
    for group in bucket_groups([4 * n for n in sizes], bucket_bytes):
        n = sum(sizes[i] for i in group)
        if how == "dense":
            out.append([4 * n])
        elif how == "gathered":
            out.append([message_size(codec, n, None if shapes is None else [shapes[i] for i in group])] * world)
        else:
            out.append([size_of(b - a) for a, b in shard_bounds(n, world, codec.align)])
    return out


__all__ = ["Senders", "aggregation", "all_reduce_", "all_reduce_async_", "codec_for", "exchange_sizes",
           "weighted_mean", "weighted_mean_async"]
