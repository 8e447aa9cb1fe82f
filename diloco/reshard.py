"""A sharded worker's state in another layout: the slices its processes kept, joined into the state an unsharded
worker keeps, and a whole worker's state cut into one process's slice.

``fully_shard`` cuts each parameter along its first dimension as ``torch.chunk`` does: process r of G holds rows
``r*c : (r+1)*c`` (c = ceil(rows / G), fewer or none at the end). So does every per-parameter tensor of the state
(the weights, the inner optimizer's moments, DiLoCo's global copy), and joining is concatenating the slices in
process order. A *piece* (:mod:`diloco.outer`: a parameter, or rows of one, that one fragment's outer optimizer
steps) holds the rows of its whole piece that fall in the process's slice; each process's state records, for
each of its pieces, the whole piece it comes from and where in it its rows start (``whole_pieces``). A gathered
codec's error-feedback residuals (one per bucket of an exchange's pieces laid end to end) go through the
bucketing rule into pieces (:func:`unbucketed`) and back into the other layout's buckets (:func:`bucketed`).
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Optional, Sequence

import torch

from diloco.comm.dtensor import is_sharded, mesh_place
from diloco.compress.flat import bucket_groups

Span = Optional[tuple[int, int]]  # (first row, rows) of a parameter that this process holds; None: all of it


def span_of(param: Any) -> Span:
    """The rows of the sharded ``param`` (a DTensor cut along its first dimension) that this process holds; None
    for a parameter held whole."""
    if not is_sharded(param):
        return None
    rows, (g, r) = param.shape[0], mesh_place(param)
    chunk = -(-rows // g)
    first = min(r * chunk, rows)
    return first, min(chunk, rows - first)


def sharded_keys(state: dict[str, Any]) -> list[str]:
    """The entries of a model's ``state_dict()`` that it holds sharded (DTensors)."""
    return [k for k, v in state.items() if is_sharded(v)]


def cut_rows(whole: torch.Tensor, span: Span) -> torch.Tensor:
    """The rows ``span`` of ``whole`` (all of it for None), a copy of its own (a checkpoint keeps no view)."""
    return whole if span is None else whole[span[0]:span[0] + span[1]].clone()


def _is_rows(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def join_model(slices: Sequence[dict[str, Any]], cut: Sequence[str]) -> dict[str, Any]:
    """A whole model's state from its processes' ``slices``: the entries named in ``cut`` (its sharded ones)
    joined, every other entry the first slice's."""
    return {k: torch.cat([p[k] for p in slices]) if k in cut else v for k, v in slices[0].items()}


def cut_model(template: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """This process's rows of each entry of ``whole`` that the sharded model's ``template`` (its ``state_dict()``)
    holds sharded."""
    return {k: cut_rows(v, span_of(template.get(k))) if _is_rows(v) else v for k, v in whole.items()}


def join_optimizer(slices: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An optimizer's whole state from its processes' ``state_dict()`` slices: its moments (tensors of a dimension
    or more) joined, its step counts and settings the first slice's."""
    first = slices[0]
    state = {i: {k: torch.cat([p["state"][i][k] for p in slices]) if _is_rows(v) else v for k, v in entry.items()}
             for i, entry in first["state"].items()}
    return {**first, "state": state}


def cut_optimizer(optimizer: torch.optim.Optimizer, whole: dict[str, Any]) -> dict[str, Any]:
    """This process's slice of an optimizer's whole state, for ``optimizer`` (over the sharded parameters)."""
    spans: dict[Any, Span] = {}
    for saved, group in zip(whole.get("param_groups", []), optimizer.param_groups):
        spans.update((i, span_of(p)) for i, p in zip(saved["params"], group["params"]))
    state = {i: {k: cut_rows(v, spans.get(i)) if _is_rows(v) else v for k, v in entry.items()}
             for i, entry in whole.get("state", {}).items()}
    return {**whole, "state": state}


def join_pieces(slices: Sequence[Sequence[Optional[torch.Tensor]]], origins: Sequence[Sequence[Sequence[int]]],
                count: int) -> list[Optional[torch.Tensor]]:
    """Each of ``count`` whole pieces from its rows in every slice, in the slices' order: ``slices[p][k]`` is slice
    p's piece k (None: nothing kept for it), and ``origins[p][k][0]`` the whole piece it is rows of."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(count)]
    for tensors, whence in zip(slices, origins):
        for t, origin in zip(tensors, whence):
            if t is not None:
                rows[origin[0]].append(t)
    return [torch.cat(r) if r else None for r in rows]


def cut_pieces(whole: Sequence[Optional[torch.Tensor]], origins: Sequence[Sequence[int]]
               ) -> list[Optional[torch.Tensor]]:
    """This process's pieces from the ``whole`` pieces: piece k is rows ``start : start + rows`` of whole piece
    ``w``, for ``origins[k] = (w, start, rows)``."""
    return [None if whole[w] is None else whole[w][start:start + rows].clone() for w, start, rows in origins]


def momenta(outer_optimizers: Sequence[dict[str, Any]]) -> list[Optional[torch.Tensor]]:
    """Every piece's outer momentum (None before its first outer step), in fragment order, from the fragments'
    outer optimizers' ``state_dict()``s (one group each, a position per piece)."""
    out: list[Optional[torch.Tensor]] = []
    for saved in outer_optimizers:
        state = saved["state"]
        out += [state.get(q, {}).get("momentum_buffer") for q in range(len(saved["param_groups"][0]["params"]))]
    return out


def with_momenta(saved: dict[str, Any], pieces: Sequence[Optional[torch.Tensor]]) -> dict[str, Any]:
    """An outer optimizer's ``state_dict()`` like ``saved`` (its settings) over ``pieces``' momenta."""
    group = {**saved["param_groups"][0], "params": list(range(len(pieces)))}
    state = {q: {"momentum_buffer": t} for q, t in enumerate(pieces) if t is not None}
    return {"state": state, "param_groups": [group]}


def firsts(layout: Sequence[Sequence[Any]]) -> list[int]:
    """The index of each fragment's first piece."""
    return [sum(len(f) for f in layout[:k]) for k in range(len(layout))]


def origins_in(layout: Sequence[Sequence[Any]], whole_pieces: Sequence[Sequence[int]],
               whole_layout: Sequence[Sequence[Any]], f: Optional[int]) -> list[tuple[int, int, int]]:
    """Where each piece of fragment ``f`` (None: of every fragment) of a process laid out as ``layout`` comes
    from: (its whole piece's position in the whole fragment, or among all pieces; its first row there; its rows)."""
    if f is None:
        return [tuple(w) for w in whole_pieces]  # type: ignore[misc]
    first, whole_first = firsts(layout)[f], firsts(whole_layout)[f]
    return [(w - whole_first, start, rows) for w, start, rows in whole_pieces[first:first + len(layout[f])]]


def piece_shapes(layout: Sequence[Sequence[Sequence[int]]], params: Sequence[torch.Tensor]) -> list[list[torch.Size]]:
    """Each fragment's pieces' shapes, for a layout of [parameter, start, stop] pieces over ``params``."""
    return [[params[i].shape if start < 0 else params[i][start:stop].shape for i, start, stop in frag]
            for frag in layout]


KEPT_BY_SHARES = ("a codec's error-feedback residuals kept by shares of the exchanged buffers (the node mesh's "
                  "processes, a sharded mean's workers) cannot be carried to another layout: resume laid out as it "
                  "was written (run.shard, processes a node)")


def exchange_name(fragment: Optional[int]) -> str:
    """The name DiLoCo's exchange of ``fragment`` (None: of every fragment at once) gives its codec's residuals."""
    return "all" if fragment is None else f"fragment{fragment}"


def exchanges(shapes: Sequence[Sequence[torch.Size]]) -> dict[Optional[int], list[torch.Size]]:
    """The exchanges a run of pieces of these ``shapes`` (by fragment) keeps residuals for, by fragment, and their
    pieces' shapes: one per fragment, and one of every piece (None: a sync of all fragments at once)."""
    out: dict[Optional[int], list[torch.Size]] = {f: list(frag) for f, frag in enumerate(shapes)}
    out[None] = [s for frag in shapes for s in frag]
    return out


def _bucket_of(key: Hashable) -> Optional[tuple[str, int]]:
    """The (exchange, bucket) a residual's key names where it holds one whole bucket of a gathered exchange:
    ``(name, b)`` from a worker of one process, ``((name, b), local rank)`` from a sharded process; None for
    anything else (a share of a node mesh's bucket, a shard of a sharded mean)."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], tuple) and isinstance(key[1], int):
        key = key[0]
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int):
        return key[0], key[1]
    return None


def unbucketed(residuals: dict[Hashable, torch.Tensor], shapes: dict[Optional[int], list[torch.Size]],
               bucket_bytes: int) -> dict[Optional[int], list[Optional[torch.Tensor]]]:
    """A codec's residuals as one tensor per piece of each exchange (:func:`exchanges`; None: nothing kept): each
    residual is one bucket of an exchange's pieces, laid end to end (:func:`diloco.compress.flat.bucket_groups`);
    ValueError where one is not."""
    by_name = {exchange_name(f): f for f in shapes}
    out: dict[Optional[int], list[Optional[torch.Tensor]]] = {f: [None] * len(s) for f, s in shapes.items()}
    for key, residual in residuals.items():
        found = _bucket_of(key)
        if found is None or found[0] not in by_name:
            raise ValueError(KEPT_BY_SHARES)
        f, b = by_name[found[0]], found[1]
        sizes = [math.prod(s) for s in shapes[f]]
        groups = bucket_groups([4 * n for n in sizes], bucket_bytes)
        if b >= len(groups) or residual.numel() != sum(sizes[i] for i in groups[b]):
            raise ValueError(KEPT_BY_SHARES)
        flat, first = residual.reshape(-1), 0
        for i in groups[b]:
            out[f][i] = flat[first:first + sizes[i]].reshape(shapes[f][i])
            first += sizes[i]
    return out


def bucketed(pieces: dict[Optional[int], list[Optional[torch.Tensor]]], shapes: dict[Optional[int], list[torch.Size]],
             bucket_bytes: int, process: Optional[int] = None) -> dict[Hashable, torch.Tensor]:
    """:func:`unbucketed`'s inverse: each bucket that holds a residual of any of its pieces (zeros for the others),
    keyed as a worker of one process keys it, or as sharded process ``process`` does."""
    out: dict[Hashable, torch.Tensor] = {}
    for f, tensors in pieces.items():
        sizes = [math.prod(s) for s in shapes[f]]
        for b, group in enumerate(bucket_groups([4 * n for n in sizes], bucket_bytes)):
            held = [tensors[i] for i in group if tensors[i] is not None]
            if held:
                key = (exchange_name(f), b)
                out[key if process is None else (key, process)] = torch.cat(
                    [tensors[i].reshape(-1) if tensors[i] is not None else held[0].new_zeros(sizes[i]) for i in group])
    return out


__all__ = ["KEPT_BY_SHARES", "bucketed", "cut_model", "cut_optimizer", "cut_pieces", "cut_rows",
           "exchange_name", "exchanges", "firsts", "join_model", "join_optimizer", "join_pieces", "momenta",
           "origins_in", "piece_shapes", "sharded_keys", "span_of", "unbucketed", "with_momenta"]
