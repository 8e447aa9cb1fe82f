"""A sharded worker's state in another layout: the parts its processes kept, joined into the state an unsharded
worker keeps, and a whole worker's state cut into one process's part.

``fully_shard`` cuts each parameter along its first dimension as ``torch.chunk`` does: process r of G holds rows
``r*c : (r+1)*c`` (c = ceil(rows / G), fewer or none at the end). So does every per-parameter tensor of the state
(the weights, the inner optimizer's moments, DiLoCo's global copy), and joining is concatenating the parts in
process order. A *piece* (:mod:`diloco.outer`: a parameter, or rows of one, that one fragment's outer optimizer
steps) holds the rows of its whole piece that fall in the process's slice; each process's state records, for
each of its pieces, the whole piece it comes from and where in it its rows start (``whole_pieces``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

Span = Optional[tuple[int, int]]  # (first row, rows) of a parameter that this process holds; None: all of it


def span_of(param: Any) -> Span:
    """The rows of the sharded ``param`` (a DTensor cut along its first dimension) that this process holds; None
    for a parameter held whole."""
    if not hasattr(param, "device_mesh"):
        return None
    rows, g, r = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = -(-rows // g)
    first = min(r * chunk, rows)
    return first, min(chunk, rows - first)


def sharded_keys(state: dict[str, Any]) -> list[str]:
    """The entries of a model's ``state_dict()`` that it holds sharded (DTensors)."""
    return [k for k, v in state.items() if hasattr(v, "device_mesh")]


def cut_rows(whole: torch.Tensor, span: Span) -> torch.Tensor:
    """The rows ``span`` of ``whole`` (all of it for None), a copy of its own (a checkpoint keeps no view)."""
    return whole if span is None else whole[span[0]:span[0] + span[1]].clone()


def _is_rows(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def join_model(parts: Sequence[dict[str, Any]], cut: Sequence[str]) -> dict[str, Any]:
    """A whole model's state from its processes' ``parts``: the entries named in ``cut`` (its sharded ones)
    joined, every other entry the first part's."""
    return {k: torch.cat([p[k] for p in parts]) if k in cut else v for k, v in parts[0].items()}


def cut_model(template: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """This process's rows of each entry of ``whole`` that the sharded model's ``template`` (its ``state_dict()``)
    holds sharded."""
    return {k: cut_rows(v, span_of(template.get(k))) if _is_rows(v) else v for k, v in whole.items()}


def join_optimizer(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An optimizer's whole state from its processes' ``state_dict()`` parts: its moments (tensors of a dimension
    or more) joined, its step counts and settings the first part's."""
    first = parts[0]
    state = {i: {k: torch.cat([p["state"][i][k] for p in parts]) if _is_rows(v) else v for k, v in entry.items()}
             for i, entry in first["state"].items()}
    return {**first, "state": state}


def cut_optimizer(optimizer: torch.optim.Optimizer, whole: dict[str, Any]) -> dict[str, Any]:
    """This process's part of an optimizer's whole state, for ``optimizer`` (over the sharded parameters)."""
    spans: dict[Any, Span] = {}
    for saved, group in zip(whole.get("param_groups", []), optimizer.param_groups):
        spans.update((i, span_of(p)) for i, p in zip(saved["params"], group["params"]))
    state = {i: {k: cut_rows(v, spans.get(i)) if _is_rows(v) else v for k, v in entry.items()}
             for i, entry in whole.get("state", {}).items()}
    return {**whole, "state": state}


def join_pieces(parts: Sequence[Sequence[Optional[torch.Tensor]]], origins: Sequence[Sequence[Sequence[int]]],
                count: int) -> list[Optional[torch.Tensor]]:
    """Each of ``count`` whole pieces from its rows in every part, in the parts' order: ``parts[p][k]`` is part
    p's piece k (None: nothing kept for it), and ``origins[p][k][0]`` the whole piece it is rows of."""
    rows: list[list[torch.Tensor]] = [[] for _ in range(count)]
    for tensors, whence in zip(parts, origins):
        for t, origin in zip(tensors, whence):
            if t is not None:
                rows[origin[0]].append(t)
    return [torch.cat(r) if r else None for r in rows]


def cut_pieces(whole: Sequence[Optional[torch.Tensor]], origins: Sequence[Sequence[int]]) -> list[Optional[torch.Tensor]]:
    """This process's pieces from the ``whole`` pieces: piece k is rows ``start : start + rows`` of whole piece
    ``w``, for ``origins[k] = (w, start, rows)``."""
    return [None if whole[w] is None else whole[w][start:start + rows].clone() for w, start, rows in origins]


def by_fragment(pieces: Sequence[Any], sizes: Sequence[int]) -> list[list[Any]]:
    """``pieces`` in fragment order, cut into fragments of ``sizes`` pieces."""
    out, first = [], 0
    for n in sizes:
        out.append(list(pieces[first:first + n]))
        first += n
    return out


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
    return {"state": {q: {"momentum_buffer": t} for q, t in enumerate(pieces) if t is not None}, "param_groups": [group]}


__all__ = ["by_fragment", "cut_model", "cut_optimizer", "cut_pieces", "cut_rows", "join_model", "join_optimizer",
           "join_pieces", "momenta", "sharded_keys", "span_of", "with_momenta"]
