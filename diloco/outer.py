"""DiLoCo: many inner steps on local data, then one outer step on the averaged pseudo-gradient.

Every round (Douillard et al. 2023, arXiv 2311.08105)::

    delta_i = theta_global - theta_local_i                 per worker, fp32
    delta   = sum_i w_i delta_i / sum_i w_i                 w_i: tokens worker i trained this round
    theta_global <- OuterSGD(theta_global, grad=delta)     lr 0.7, momentum 0.9, Nesterov
    theta_local_i <- theta_global

The parameters may be split into *fragments*, each with its own outer
optimizer and its own exchange; plain DiLoCo has one fragment, Streaming
DiLoCo (``streaming.py``) several on staggered schedules. A fragment holds
whole parameters or row ranges of one (views of the global copy and of the
model), so fragments can be even when one matrix is large. The global copy and
the outer momentum can live on the CPU (``offload_outer``) to save
accelerator memory. With a lossy ``codec`` (``compress.codec``) the average
runs through the codec: each worker's
pseudo-gradient is encoded (with the codec's error feedback), the weights
travel exactly beside the payloads, and every worker decodes the same bytes.
Whatever the codec, the average is one call, ``collective.weighted_mean``,
which picks its aggregation from the transport and the codec.
A worker whose weight is 0 (it did no step, or its
pseudo-gradient is not finite) adds nothing to the average and still takes the
new global parameters, so no NaN is ever averaged into the model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from diloco.algorithm import Algorithm, move_optimizer_state, move_tensor, register
from diloco.comm.base import Handle, Transport
from diloco.compress import collective
from diloco.compress.codec import Codec
from diloco.compress.senders import Senders
from diloco.reshard import (KEPT_BY_SHARES, Span, bucketed, cut_pieces, cut_rows, exchange_name, exchanges, firsts,
                            join_pieces, momenta, origins_in, piece_shapes, span_of, unbucketed, with_momenta)
from diloco.state import (check_finite, check_fits, check_optimizer_state, copy_into, counts_of, list_at,
                           load_optimizer_state)
from diloco.sync import SyncPolicy
from diloco.tensors import all_finite, flatten_parameters_


@register
class DiLoCo(Algorithm):
    name = "diloco"
    round_based = True
    replicated_state = False
    senders: Optional[Senders] = None  # a mean over the workers that sent each position (SparseLoCo), counted here
    swarm = True
    token_weighted = True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Optional[Transport] = None,
                 grad_clip: float = 0.0, *, inner_steps: int = 100, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, offload_outer: bool = False, sync_mode: str = "steps",
                 time_budget_s: Optional[float] = None, tokens_per_step: int = 1,
                 fragments: Optional[Sequence[Sequence[Any]]] = None, codec: Optional[Codec] = None,
                 inner: Optional[Transport] = None) -> None:
        super().__init__(model, optimizer, transport, grad_clip, inner=inner)
        self.codec = collective.codec_for(self.transport, codec)  # None: the exact dense all-reduce
        self.policy = SyncPolicy(sync_mode, inner_steps, time_budget_s)
        self.tokens_per_step = tokens_per_step
        self.offload_outer = offload_outer
        self.outer_device = torch.device("cpu") if offload_outer else self.params[0].device
        with torch.no_grad():
            self.global_params = [p.detach().to(self.outer_device, torch.float32, copy=True) for p in self.params]
        # a codec's exchange writes the pseudo-gradients over the local parameters (see start_exchange): laid end to
        # end in one buffer, they are encoded and decoded where they lie, with no bucket copied in and out
        self.flat_params = (self.codec is not None and self.params[0].device == self.outer_device
                            and flatten_parameters_(self.params)) if self.params else False
        fragments = [list(range(len(self.params)))] if fragments is None else fragments
        # sharded: the whole worker's fragments, and where each piece here comes from in them (diloco.reshard)
        self.whole_layout: Optional[list[list[list[int]]]] = None
        self.whole_pieces: list[tuple[int, int, int]] = []
        if self._sharded:
            self.whole_layout = _layout_of(*_pieces(fragments, [p for p, _ in self._slice_of]))
            self.param_spans = [span_of(p) for p, _ in self._slice_of]
            fragments, origins = _local_rows(fragments, self._slice_of)
        self.pieces, self.fragments = _pieces(fragments, self.params)
        if self.whole_layout is not None:
            first = firsts(self.whole_layout)
            self.whole_pieces = [(first[f] + j, start, _num_rows(self._local(k)))
                                 for f, frag in enumerate(self.fragments) for k, (j, start) in zip(frag, origins[f])]
        # one view of the global copy per piece: what the outer optimizers step and the exchanges send
        self.global_views = [_rows_of(self.global_params[i], rows) for i, rows in self.pieces]
        nesterov = nesterov and outer_momentum > 0
        self.outer_optimizers = [
            torch.optim.SGD([self.global_views[k] for k in frag], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
            for frag in self.fragments
        ]
        self.round = 0
        self.rejected_updates = 0  # rounds this worker sat out with a non-finite pseudo-gradient
        self.left_out = False  # the latest exchange started with a non-finite pseudo-gradient (weight 0)
        self.round_steps = 0  # inner steps since this worker's last full sync
        self.global_tokens = 0.0  # tokens trained by all workers, as agreed through the averages
        self.policy.start_round(self.transport.mark)

    @classmethod
    def from_config(cls, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    *, tokens_per_step: int = 1, inner: Optional[Transport] = None) -> "DiLoCo":
        return cls(model, optimizer, transport, cfg.optim.grad_clip, tokens_per_step=tokens_per_step,
                   codec=cls._codec(cfg), inner=inner, **cls._settings(cfg))

    @classmethod
    def state_copies(cls, cfg: Any) -> float:
        """The global copy and the outer momentum, besides a codec's residual."""
        return super().state_copies(cfg) + 1.0 + (1.0 if cfg.algo.outer_momentum > 0 else 0.0)

    @classmethod
    def steps_per_round(cls, cfg: Any) -> float:
        return float(cfg.algo.inner_steps)

    @classmethod
    def _settings(cls, cfg: Any) -> dict[str, Any]:
        a = cfg.algo
        return dict(inner_steps=a.inner_steps, outer_lr=cls.outer_lr_of(cfg), outer_momentum=a.outer_momentum,
                    nesterov=a.nesterov, offload_outer=a.offload_outer, sync_mode=cfg.sync.mode,
                    time_budget_s=cfg.sync.time_budget_s)

    # ---- the round --------------------------------------------------------------------------
    def _after_step(self) -> dict[str, Any]:
        self.round_steps += 1
        if self.policy.round_done(self.round_steps, self.transport.seconds_since):
            return self.sync()
        return {}

    def sync(self) -> dict[str, Any]:
        """End the round for every fragment at once."""
        weight = SyncPolicy.round_weight(self.round_steps, self.tokens_per_step)
        total = self.exchange(0 if len(self.fragments) == 1 else None, weight)
        self.round += 1
        self.round_steps = 0
        self.global_tokens += total
        self.policy.start_round(self.transport.mark)
        return {"synced": True, "round": self.round, "round_tokens": total}

    def exchange(self, fragment: Optional[int], weight: float) -> float:
        """Average the pseudo-gradients of one fragment (None: all) and apply the outer step now."""
        indices = list(range(len(self.pieces))) if fragment is None else self.fragments[fragment]
        # the local parameters are replaced by the global ones right after, so they can hold the pseudo-gradient:
        # no second copy of the model per worker while the exchange runs (N simulated workers wait at once)
        # (with one worker nothing waits, and a Ctrl-C that saves must find the local model whole)
        deltas, total, handle = self.start_exchange(indices, weight, key=fragment,
                                                    in_place=self.transport.world_size > 1)
        handle.wait()
        total_weight = self._total(total)  # read back once
        self.apply_exchange(indices, deltas, total_weight, mix_alpha=0.0)
        return total_weight

    def start_exchange(self, indices: Sequence[int], weight: float, key: Optional[int] = None,
                       in_place: bool = False) -> tuple[list[torch.Tensor], torch.Tensor, Handle]:
        """Start averaging the pseudo-gradients of the pieces ``indices``, weighted by ``weight`` over the workers.

        Once the handle's ``wait()`` returns, ``deltas`` hold the weighted mean and ``total`` (a
        one-element tensor) the total weight. ``key`` names the fragment for the codec's error feedback.
        ``in_place``: the pseudo-gradient overwrites the local parameters where they are fp32 on the outer
        device (the caller then sets them from the global copy, as :meth:`apply_exchange` does); the same
        bits as a new tensor, since ``-local + global`` rounds as ``global - local``.
        """
        with torch.no_grad():
            locals_ = [self._local(k) for k in indices]
            over = [in_place and t.dtype == torch.float32 and t.device == self.outer_device for t in locals_]
            # the others in one new buffer, end to end as the exchange reads them best (see flatten_parameters_)
            room = torch.empty(sum(t.numel() for t, o in zip(locals_, over) if not o), dtype=torch.float32,
                               device=self.outer_device)
            deltas, offset = [], 0
            for k, local, o in zip(indices, locals_, over):
                if o:
                    deltas.append(local.neg_().add_(self.global_views[k]))
                else:
                    out = room[offset:offset + local.numel()].view_as(local)
                    deltas.append(torch.sub(self.global_views[k], local.to(self.outer_device, torch.float32), out=out))
                    offset += local.numel()
            # a diverged worker is left out of this average (weight 0) and re-syncs to the new global model: its
            # local values are replaced, not mixed or kept (the caller reads ``left_out``)
            self.left_out = not all_finite(deltas)  # one host sync per exchange, not one per parameter
            if self.left_out:
                self.rejected_updates += 1
                weight = 0.0
                for d in deltas:
                    d.zero_()
        total = torch.zeros(1, dtype=torch.float32)
        return deltas, total, _Filled(collective.weighted_mean_async(
            self.transport, deltas, weight, self.codec, key=exchange_name(key),
            gather=self.gather, senders=self.senders), total)

    @staticmethod
    def _total(total: torch.Tensor) -> float:
        return float(total.item())

    def apply_exchange(self, indices: Sequence[int], deltas: list[torch.Tensor], total: float, mix_alpha: float) -> None:
        """Outer step on the global copy; local := alpha * local + (1 - alpha) * global."""
        with torch.no_grad():
            if total > 0:
                for k, d in zip(indices, deltas):
                    self.global_views[k].grad = d
                for opt in self._optimizers_of(indices):
                    opt.step()
                for k in indices:
                    self.global_views[k].grad = None
            for k in indices:
                local = self._local(k)
                target = self.global_views[k].to(local.device, local.dtype)
                if mix_alpha > 0:
                    local.mul_(mix_alpha).add_(target, alpha=1 - mix_alpha)
                else:
                    local.copy_(target)

    def _local(self, k: int) -> torch.Tensor:
        """This worker's parameters of piece ``k`` (a view: writing it writes the model)."""
        i, rows = self.pieces[k]
        return _rows_of(self.params[i].detach(), rows)

    def _optimizers_of(self, indices: Sequence[int]) -> list[torch.optim.Optimizer]:
        wanted = set(indices)
        return [opt for opt, frag in zip(self.outer_optimizers, self.fragments) if wanted & set(frag)]

    def finalize(self) -> None:
        """At the end of training: a last sync of a partial round, so every worker holds the global model."""
        if self.round_steps > 0:
            self.sync()

    @contextlib.contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Evaluate the global model: swap it into the local parameters, then restore them."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, g in zip(self.params, self.global_params):
                p.copy_(g.to(p.device, p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    # ---- state ------------------------------------------------------------------------------
    def _move(self, device: torch.device) -> None:
        """The model and inner state; the global copy and outer state too unless ``offload_outer`` keeps them
        on the CPU. Row pieces stay views of the moved global copy (the outer optimizers hold them)."""
        super()._move(device)
        if not self.offload_outer:
            with torch.no_grad():
                for g in self.global_params:
                    g.data = move_tensor(g.data, device)
                for view, (i, rows) in zip(self.global_views, self.pieces):
                    if rows is not None:
                        view.data = _rows_of(self.global_params[i].data, rows)
            for opt in self.outer_optimizers:
                move_optimizer_state(opt, device)
            self.outer_device = torch.device(device)
        if self.flat_params and torch.device(device).type != "cpu":
            # the move gave every parameter its own storage; laid end to end again where the exchanges run (on the
            # device's stream, behind the copies; a worker parked on the host waits unflattened, in pinned memory)
            self.flat_params = self.params[0].device == self.outer_device and flatten_parameters_(self.params)

    def _exchange_device(self, device: torch.device) -> torch.device:
        return self.outer_device  # the host with offload_outer, else where _move put the global copy

    def global_parameters(self) -> list[torch.Tensor]:
        return self.global_params

    def shared_state(self) -> dict[str, Any]:
        return {"global_params": [g.detach() for g in self.global_params],  # live tensors, as the base class says
                "outer_optimizers": [o.state_dict() for o in self.outer_optimizers],
                "round": self.round, "global_tokens": self.global_tokens}

    def check_shared_state(self, state: dict[str, Any]) -> None:
        check_fits(self.global_params, list_at(state, "global_params"), "global_params")
        saved = list_at(state, "outer_optimizers")
        if len(saved) != len(self.outer_optimizers):
            raise ValueError(f"{len(saved)} outer optimizers, this run has {len(self.outer_optimizers)}")
        for k, (opt, s) in enumerate(zip(self.outer_optimizers, saved)):
            check_optimizer_state(opt, s, f"outer_optimizers[{k}]")
        counts_of(state)
        check_finite(state, "the state")

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """The global model, outer state, round and tokens of another worker; this worker starts a new round
        from that global model. All of it or (ValueError, :meth:`check_shared_state`) none of it."""
        self.check_shared_state(state)
        copy_into(self.global_params, state["global_params"])
        copy_into(self.params, state["global_params"])
        for opt, saved in zip(self.outer_optimizers, state["outer_optimizers"]):
            load_optimizer_state(opt, saved)
        self.round, self.global_tokens = counts_of(state)
        self.round_steps = 0
        self.policy.start_round(self.transport.mark)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(fragments=self._layout(), round_steps=self.round_steps, **self.shared_state())
        if self.codec is not None:
            state["codec"] = self._codec_state()
        if self.whole_layout is not None:
            state.update(whole_layout=self.whole_layout, whole_pieces=self.whole_pieces, param_spans=self.param_spans)
        return state

    def _layout(self) -> list[list[list[int]]]:
        return _layout_of(self.pieces, self.fragments)

    # ---- the state of a sharded worker in another layout (diloco.reshard) ----------------------------
    @classmethod
    def whole_state(cls, slices: list[dict[str, Any]]) -> dict[str, Any]:
        state = super().whole_state(slices)
        first = slices[0]
        if "whole_layout" not in first:
            return state
        state["global_params"] = [torch.cat(ts) if span is not None else ts[0]
                                  for ts, span in zip(zip(*(p["global_params"] for p in slices)), first["param_spans"])]
        state["outer_optimizers"] = [with_momenta(o, cls._joined(slices, f, [momenta([p["outer_optimizers"][f]])
                                                                            for p in slices]))
                                     for f, o in enumerate(first["outer_optimizers"])]
        state["fragments"] = first["whole_layout"]
        if any((p.get("codec") or {}).get("residuals") for p in slices):
            state["codec"] = {"chain": first["codec"]["chain"], "residuals": cls._joined_residuals(slices, state)}
        for key in ("whole_layout", "whole_pieces", "param_spans"):
            del state[key]
        return state

    @classmethod
    def _joined_residuals(cls, slices: list[dict[str, Any]], whole: dict[str, Any]) -> dict[Any, torch.Tensor]:
        """The codec's error-feedback residuals of the whole worker: each slice's, piece by piece, joined and laid
        into the whole worker's buckets."""
        layout, size = whole["fragments"], Transport.bucket_bytes
        pieces = [unbucketed(p["codec"]["residuals"], exchanges(piece_shapes(p["fragments"], p["global_params"])), size)
                  for p in slices]
        shapes = exchanges(piece_shapes(layout, whole["global_params"]))
        joined = {f: join_pieces([x[f] for x in pieces], [origins_in(p["fragments"], p["whole_pieces"], layout, f)
                                                          for p in slices], len(shapes[f])) for f in shapes}
        return bucketed(joined, shapes, size)

    def cut_state(self, whole: dict[str, Any]) -> dict[str, Any]:
        state = super().cut_state(whole)
        if self.whole_layout is None:
            return state
        if whole.get("fragments") != self.whole_layout:
            raise ValueError(f"its outer state is cut into {len(whole.get('fragments') or [])} fragment(s), this "
                             f"run's into {len(self.whole_layout)}: resume with the same algo.fragments and model")
        state["global_params"] = [cut_rows(g, span) for g, span in zip(whole["global_params"], self.param_spans)]
        state["outer_optimizers"] = [with_momenta(o, self._cut(f, momenta([o])))
                                     for f, o in enumerate(whole["outer_optimizers"])]
        state["fragments"] = self._layout()
        codec = whole.get("codec") or {}
        if codec.get("residuals_by_process"):
            raise ValueError(KEPT_BY_SHARES)
        if codec.get("residuals"):
            size, layout = self.transport.bucket_bytes, self._layout()
            pieces = unbucketed(codec["residuals"], exchanges(piece_shapes(self.whole_layout, whole["global_params"])),
                                size)
            mine = {f: cut_pieces(tensors, origins_in(layout, self.whole_pieces, self.whole_layout, f))
                    for f, tensors in pieces.items()}
            state["codec"] = {"chain": codec["chain"], "residuals": bucketed(
                mine, exchanges(piece_shapes(layout, self.global_params)), size, self.transport.local_rank)}
        return state

    @staticmethod
    def _joined(parts: list[dict[str, Any]], f: int, lists: list[list[Any]]) -> list[Any]:
        """Fragment ``f``'s whole pieces from ``lists``, each part's tensors for its pieces of ``f``."""
        layout = parts[0]["whole_layout"]
        origins = [origins_in(p["fragments"], p["whole_pieces"], layout, f) for p in parts]
        return join_pieces(lists, origins, len(layout[f]))

    def _cut(self, f: int, whole: list[Any]) -> list[Any]:
        """This process's pieces of fragment ``f`` from the fragment's ``whole`` pieces."""
        return cut_pieces(whole, origins_in(self._layout(), self.whole_pieces, self.whole_layout, f))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # checks the algorithm's name first
        sizes = [len(o["param_groups"][0]["params"]) for o in state["outer_optimizers"]]
        if state.get("fragments") != self._layout() or \
                sizes != [len(o.param_groups[0]["params"]) for o in self.outer_optimizers]:
            raise ValueError(f"its outer state is cut into {len(sizes)} fragment(s) of {sizes} pieces, this run's into "
                             f"{len(self.fragments)} of {[len(f) for f in self.fragments]}: resume with the same "
                             f"algo.fragments and model")
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"]):
                g.copy_(saved)
        for opt, saved in zip(self.outer_optimizers, state["outer_optimizers"]):
            load_optimizer_state(opt, saved)
        self.round, self.round_steps = state["round"], state["round_steps"]
        self.global_tokens = state["global_tokens"]
        if self.codec is not None and "codec" in state:
            self._load_codec_state(state["codec"])
        self.policy.start_round(self.transport.mark)


def _layout_of(pieces: Sequence[tuple[int, Optional[tuple[int, int]]]], fragments: Sequence[Sequence[int]]
               ) -> list[list[list[int]]]:
    """Each fragment's pieces as [parameter, start, stop] (start = stop = -1: the whole parameter)."""
    return [[[i, *(rows if rows is not None else (-1, -1))] for i, rows in (pieces[k] for k in frag)]
            for frag in fragments]


def _rows_of(t: torch.Tensor, rows: Optional[tuple[int, int]]) -> torch.Tensor:
    """A view of rows ``start:stop`` of ``t`` (all of it for None)."""
    return t if rows is None else t[rows[0]:rows[1]]


def _num_rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() > 0 else 1


def _local_rows(fragments: Sequence[Sequence[Any]], slices: Sequence[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[list[list[Any]], list[list[tuple[int, int]]]]:
    """Fragments given in rows of whole parameters (:func:`_pieces`), in rows of this process's slices: a model
    sharded among a node's processes (DTensors cut along their first dimension as ``torch.chunk`` cuts them) holds
    rows ``off:off+n`` of each parameter here. ``slices``: (parameter, this process's slice of it) pairs. A slice
    with no rows here still belongs to a fragment: the first that holds rows of its parameter. Also, for each item
    of each fragment here, where it comes from: its position in the whole fragment, and the row of that whole item
    where its rows start."""
    spans: list[Span] = []
    for whole, local in slices:
        span = None if whole is local else span_of(whole)
        if span is not None and local.shape[0] != span[1]:
            raise ValueError(f"a sharded parameter of {whole.shape[0]} rows holds {local.shape[0]} here, not the "
                             f"{span[1]} rows torch.chunk gives it")
        spans.append(span)
    out: list[list[Any]] = []
    origins: list[list[tuple[int, int]]] = []
    placed: set[int] = set()
    for frag in fragments:
        mine: list[Any] = []
        whence: list[tuple[int, int]] = []
        for j, item in enumerate(frag):
            i = item if isinstance(item, int) else item[0]
            if spans[i] is None:
                mine.append(item)
                whence.append((j, 0))
                continue
            off, n = spans[i]
            start = 0 if isinstance(item, int) else item[1]
            stop = _num_rows(slices[i][0]) if isinstance(item, int) else item[2]
            lo, hi = max(start, off) - off, min(stop, off + n) - off
            if lo < hi or (n == 0 and i not in placed):
                mine.append(i if (lo, hi) == (0, n) or n == 0 else (i, lo, hi))
                whence.append((j, max(off + lo - start, 0)))
                placed.add(i)
        out.append(mine)
        origins.append(whence)
    return out, origins


def _pieces(fragments: Sequence[Sequence[Any]], params: Sequence[torch.Tensor]
            ) -> tuple[list[tuple[int, Optional[tuple[int, int]]]], list[list[int]]]:
    """Pieces (parameter index, rows or None for all of it) and each fragment's piece indices.

    A fragment lists parameter indices, or ``(index, start, stop)`` for rows ``start:stop`` of a
    parameter's first dimension; together the fragments must cover every element exactly once.
    """
    pieces: list[tuple[int, Optional[tuple[int, int]]]] = []
    frags: list[list[int]] = []
    covered: list[list[tuple[int, int]]] = [[] for _ in params]
    for frag in fragments:
        frags.append([])
        for item in frag:
            i, rows = (item, None) if isinstance(item, int) else (item[0], (int(item[1]), int(item[2])))
            if not 0 <= i < len(params):
                raise ValueError(f"fragment piece names parameter {i}; the model has {len(params)}")
            n = _num_rows(params[i])
            start, stop = rows if rows is not None else (0, n)
            if rows is not None and (params[i].dim() == 0 or not 0 <= start < stop <= n):
                raise ValueError(f"fragment piece rows {start}:{stop} do not fit parameter {i} of shape "
                                 f"{tuple(params[i].shape)}")
            covered[i].append((start, stop))
            frags[-1].append(len(pieces))
            pieces.append((i, None if rows is None or (start, stop) == (0, n) else rows))
    for p, spans in zip(params, covered):  # sorted spans must tile 0:n, each starting where the last stopped
        spans.sort()
        if not spans or [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]] or spans[-1][1] != _num_rows(p):
            raise ValueError("fragments must cover every parameter exactly once")
    return pieces, frags


class _Filled(Handle):
    """An exchange whose deltas hold the mean once it is done: write the total weight into ``total``."""

    def __init__(self, inner: Handle, total: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.total = inner, total

    def wait(self) -> Any:
        value = self.inner.wait()
        self.total.fill_(value)
        return value
