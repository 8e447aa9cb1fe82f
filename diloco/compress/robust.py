"""The robust mean, for members without fixed ranks that need not trust each other (hivemind peers, the simulator
under churn).

Every member's payload reaches every member (``all_gather_bytes``, canonical order); each member decodes all of
them, leaves out what fails validation (wire format, weight, finiteness), clips (or drops,
``transport.bounds.clip_action``) a contribution whose norm is more than ``bounds.norm_clip`` times the median of
the *other* members' norms, counts a weight above ``bounds.weight_clip`` times the median of the others' weights as
that bound (a member announcing more tokens than it trained cannot outweigh the group), and takes the weighted
mean in the canonical order. Every member decides alike, so every member ends with the same result; the transport
is told who was accepted, left out and clipped (``transport.record_contributions``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import torch

from diloco.comm.base import Transport
from diloco.compress.codec import Codec, make_codec
from diloco.compress.flat import buckets, end_to_end, unflatten_into
from diloco.compress.message import message_bound, pack_weight, split_weight
from diloco.compress.senders import Senders, divide_by_senders_
from diloco.compress.shared import SharedResult
from diloco.compress.wire import CorruptPayload


@dataclass
class RobustResult:
    mean: torch.Tensor
    total: float
    accepted: dict = field(default_factory=dict)  # member -> weight
    rejected: dict = field(default_factory=dict)  # member -> why
    clipped: dict = field(default_factory=dict)  # member -> its norm over the bound
    weights_clipped: dict = field(default_factory=dict)  # member -> its announced weight over the bound
    senders: Optional[Senders] = None  # a mean over senders: what it saw


def robust_mean_(transport: Transport, tensors: Sequence[torch.Tensor], codec: "Codec", weight: Optional[float],
                 key: Hashable, senders: Optional[Senders] = None) -> float:
    """The tensors (one dtype and device) become the robust mean through ``codec``; returns the total weight.
    ``senders``: each position is averaged over the members that sent it, and ``senders`` counts them."""
    if len(buckets(tensors, 1 << 62)) > 1:
        raise ValueError("tensors of one compressed all-reduce must share dtype and device")
    # no copy where they lie end to end: read (encoded) before the result is written
    flat = end_to_end(tensors) if tensors[0].dtype == torch.float32 else None
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    result = robust_mean(transport, flat, codec, weight, key, over_senders=senders is not None,
                         shapes=[t.shape for t in tensors])
    unflatten_into(list(tensors), result.mean.to(tensors[0].device))
    if senders is not None and result.senders is not None:
        senders.pairs += result.senders.pairs
        senders.covered = senders.covered + result.senders.covered
    return result.total


def robust_dense_mean_(transport: Transport, tensors: Sequence[torch.Tensor], weight: Optional[float]) -> float:
    """The exact mean a caller asked for (tensors of any dtypes and devices), as the robust mean of raw fp32
    payloads gathered on the host; returns the total weight."""
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    result = robust_mean(transport, flat, make_codec("fp32"), weight, key=None)
    unflatten_into(list(tensors), result.mean)  # piece by piece from host memory: no second model-sized copy on a GPU
    return result.total


def robust_mean(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float | None,
                key: Hashable, over_senders: bool = False,
                shapes: Optional[Sequence[torch.Size]] = None) -> RobustResult:
    """Exchange ``flat`` with every member and average what passes validation and the norm bound.

    ``weight`` None sends no weight (every member counts 1). ``flat`` (fp32) is the caller's to give: once
    encoded it may become the mean's buffer; ``shapes``: the tensors it is (a chain with tiles cuts each). Members
    that received the very same payload list share one result (:class:`~diloco.compress.shared.SharedResult`): it
    is read only.
    """
    with transport.exchange_scope():
        prefix = b"" if weight is None else pack_weight(weight)
        bound = message_bound(codec, flat.numel(), weight is not None, shapes)  # what the others' messages weigh
        payloads = transport.all_gather_bytes(codec.encode(flat, key=key, prefix=prefix, shapes=shapes,
                                                           feedback=weight is None or weight > 0), bound=bound)
    names = transport.member_names()
    b = transport.bounds
    tiles = codec.tiling(shapes, flat.numel()) if shapes is not None else None
    shared_key = (codec.chain, flat.numel(), flat.device, weight is None, b.norm_clip, b.clip_action, b.weight_clip,
                  over_senders, None if tiles is None else tiles.shapes)
    result, _ = _SHARED_ROBUST.once(transport, payloads, shared_key, lambda shared: _mean(
        transport, flat, codec, weight, payloads, names, shared, over_senders, shapes))
    transport.record_contributions(result.accepted, result.rejected, result.clipped, result.weights_clipped)
    return result


def _mean(transport: Transport, flat: torch.Tensor, codec: "Codec", weight: float | None, payloads: list,
          names: list[str], shared: bool, over_senders: bool = False,
          shapes: Optional[Sequence[torch.Size]] = None) -> RobustResult:
    """The robust mean of ``payloads`` (sent by ``names``); ``shared``: other members read it too;
    ``over_senders``: each position divided by the weight of the members that sent it (after the clipping)."""
    # the mean's own tensor is pass 1's buffer too: one vector for the whole mean; a member alone with this list
    # writes it over ``flat``, encoded already; a shared result gets a buffer of its own
    own = shared or flat.dtype != torch.float32 or not flat.is_contiguous()
    result = RobustResult(torch.empty(flat.numel(), dtype=torch.float32, device=flat.device) if own
                          else flat.view(-1), 0.0)
    # pass 1: validate every member's update and measure its norm, each decoded into that buffer in turn
    rows: list[tuple[str, memoryview, float, float]] = []  # (member, body, weight, norm)
    x = result.mean
    for name, msg in zip(names, payloads):
        try:
            w, body = split_weight(msg) if weight is not None else (1.0, memoryview(msg))
            codec.decode_into_(body, x, shapes=shapes)
            # in float64, whose sum of float32 squares cannot overflow (in float32 a norm near 1.8e19 is finite or
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
    bound_factor, action = transport.bounds.norm_clip, transport.bounds.clip_action
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
    weight_clip = transport.bounds.weight_clip
    if weight is not None and weight_clip > 0 and len(rows) > 1:
        announced = [r[2] for r in rows]
        for i, (name, body, w, n) in enumerate(rows):
            others = [a for j, a in enumerate(announced) if j != i and a > 0]
            if not others:
                continue
            bound = weight_clip * statistics.median(others)
            if w > bound:
                rows[i] = (name, body, bound, n)
                result.weights_clipped[name] = w / bound
    result.total = sum(r[2] for r in rows)
    # pass 2: the weighted mean, accumulated in the canonical member order
    if result.total > 0 and not over_senders:
        for name, body, w, _ in rows:
            codec.decode_accumulate_(body, result.mean, w / result.total * scale.get(name, 1.0), shapes=shapes)
    elif result.total > 0:
        counts = torch.zeros_like(result.mean)
        for name, body, w, _ in rows:
            codec.decode_accumulate_(body, result.mean, w * scale.get(name, 1.0), counts if w > 0 else None, w,
                                     shapes)
        result.senders = Senders()
        divide_by_senders_(codec, result.mean, counts, result.senders, sum(r[2] > 0 for r in rows), shapes)
    result.accepted = {r[0]: r[2] for r in rows}
    return result


# one robust mean, for the other simulated workers that received the same payload list (read only: callers copy it)
_SHARED_ROBUST = SharedResult()
