"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706): top-k + 2-bit pseudo-gradients.

Every round, after H inner steps on local data, worker r::

    delta_r = theta_global - theta_local_r                  fp32
    e_r     = beta * e_r + delta_r                           its error-feedback buffer (algo.ef_decay)
    s_r     = Q(TopK_chunk(e_r))                             the k largest |e| of each chunk (a 64 x 64 tile of
                                                             a matrix: algo.chunk = 4096), quantized
                                                             (algo.value_format, 2bit)
    e_r     = e_r - s_r                                      what was not sent (or lost to Q) waits
    theta_global <- theta_global - alpha * mean(s)           algo.outer_lr; no other momentum state
    theta_local_r <- theta_global

where ``mean(s)`` takes each position over the workers that sent it, weighted by
their tokens (``algo.aggregate: senders``, as the authors' code aggregates:
their ``scatter_reduce`` mean leaves out the workers that did not send a
position); ``algo.aggregate: all`` divides by every worker's weight instead.
Workers' top-k sets barely overlap, so the published mean is 1.4 to 2.5 times
the mean over all workers.

The error-feedback buffer takes the place of DiLoCo's outer momentum. Steps
two to four are the codec chain ``topk:chunk=C,k=K,ef=beta+2bit`` (its
residual is ``e``), so the kernels and the wire format are the codecs'. The
mean is the *gathered* aggregation of :mod:`diloco.compress.collective`: every
worker decodes every worker's sparse payload, so the mean is exact and the
sum of W sparse payloads is never densified on the wire. Weights are the
tokens each worker trained in the round, as in DiLoCo.

Two figures follow each round into the metrics lines: ``senders_per_position``
(the mean number of senders of a position that was sent) and ``sent_share``
(the share of positions whose mean has moved at least once so far).

The chunks are the published ones (``algo.chunking: tensor``, the chain's
``tile`` option, :mod:`diloco.compress.tiles`): each parameter is cut on its
own into tiles of at most sqrt(``algo.chunk``) a side (64 x 64, chunks of 64
for a vector), and a tile keeps k scaled to its length. ``algo.chunking:
flat`` cuts the flat pseudo-gradient (parameters in model order) into
``algo.chunk`` consecutive values instead. Under ``run.shard: fsdp`` a
process's tiles are cut in its own rows of each parameter, the same tiles
where its rows start at a multiple of the tile; on a node mesh each process's
share of a bucket is one vector (chunks of sqrt(``algo.chunk``) values).
Over hivemind peers the same payloads go through the robust
mean (validation and norm clipping); a worker with a non-finite pseudo-gradient
sends weight 0 and takes the new global model; over hivemind each payload is clipped
before the mean over senders.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from diloco.algorithm import ConfigConflict, register
from diloco.comm.base import Transport
from diloco.compress.chain import VALUE_FORMATS, CodecSpecError, exact_number
from diloco.compress.codec import Codec, make_codec
from diloco.compress.senders import Senders
from diloco.outer import DiLoCo

AGGREGATES = ("senders", "all")
CHUNKINGS = ("tensor", "flat")


def sparse_chain(density: float, chunk: int, ef_decay: float, value_format: str, chunking: str = "tensor") -> str:
    """The codec chain of one SparseLoCo payload."""
    k = max(1, round(density * chunk))
    tile = f",tile={math.isqrt(chunk)}" if chunking == "tensor" else ""
    return f"topk:chunk={chunk},k={k},ef={exact_number(ef_decay)}{tile}+{value_format}"


@register
class SparseLoCo(DiLoCo):
    name = "sparseloco"
    gather = True
    default_outer_lr = 1.0  # alpha, as published (not DiLoCo's 0.7)
    # no outer momentum to agree on: the error feedback is the momentum; the top-k payload's settings instead
    peer_settings = ("inner_steps", "topk_density", "chunk", "ef_decay", "value_format", "aggregate", "chunking")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Optional[Transport] = None,
                 grad_clip: float = 0.0, *, topk_density: float = 0.02, chunk: int = 4096, ef_decay: float = 0.95,
                 outer_lr: float = 1.0, value_format: str = "2bit", aggregate: str = "senders",
                 chunking: str = "tensor", **kwargs: Any) -> None:
        codec = self.check(topk_density, chunk, ef_decay, value_format, aggregate, chunking)
        kwargs.pop("codec", None)
        kwargs.update(outer_momentum=0.0, nesterov=False)  # e_r is the momentum: theta -= alpha * mean
        super().__init__(model, optimizer, transport, grad_clip, outer_lr=outer_lr, codec=codec, **kwargs)
        self.topk_density, self.chunk, self.ef_decay, self.value_format = topk_density, chunk, ef_decay, value_format
        self.aggregate, self.chunking = aggregate, chunking
        self.senders = Senders() if aggregate == "senders" else None
        # per position of each piece: its mean has moved at least once (the same on every worker: it is the mean's;
        # a peer that joins a run in progress counts from its first round)
        self.moved = [torch.zeros(v.shape, dtype=torch.bool, device=v.device) for v in self.global_views]

    @staticmethod
    def check(topk_density: float, chunk: int, ef_decay: float, value_format: str, aggregate: str = "senders",
              chunking: str = "tensor") -> Codec:
        """SparseLoCo's constraints, stated once (the config check and the constructor both run it); returns
        the codec of these settings."""
        if chunking not in CHUNKINGS:
            raise ConfigConflict("algo.chunking", f"must be one of {', '.join(CHUNKINGS)}, got {chunking!r}")
        if aggregate not in AGGREGATES:
            raise ConfigConflict("algo.aggregate", f"must be one of {', '.join(AGGREGATES)}, got {aggregate!r}")
        if not 0.0 < topk_density <= 1.0:
            raise ConfigConflict("algo.topk_density", f"must be in (0, 1], got {topk_density}")
        if value_format not in VALUE_FORMATS:
            raise ConfigConflict("algo.value_format", f"must be one of {', '.join(VALUE_FORMATS)}, got {value_format!r}")
        if not 0.0 <= ef_decay <= 1.0:
            raise ConfigConflict("algo.ef_decay", f"must be in [0, 1], got {ef_decay}")
        try:
            codec = make_codec(sparse_chain(topk_density, chunk, ef_decay, value_format, "flat"))
        except CodecSpecError as e:
            raise ConfigConflict("algo.chunk", str(e).replace("codec stage 'topk': ", "")) from None
        if chunking == "flat":
            return codec
        if math.isqrt(chunk) ** 2 != chunk:
            raise ConfigConflict("algo.chunk", f"the chunks of algo.chunking: tensor are square tiles, so algo.chunk "
                                               f"must be a square (4096 = 64 x 64), got {chunk}; or set "
                                               f"algo.chunking: flat")
        return make_codec(sparse_chain(topk_density, chunk, ef_decay, value_format, chunking))

    @classmethod
    def check_config(cls, cfg: Any, n_layers: int) -> None:
        super().check_config(cfg, n_layers)
        a = cfg.algo
        cls.check(a.topk_density, a.chunk, a.ef_decay, a.value_format, a.aggregate, a.chunking)
        if cfg.compress.codec != "fp32":
            raise ConfigConflict("compress.codec", "SparseLoCo sends its own top-k payload (tune algo.topk_density, "
                                                   "algo.chunk and algo.value_format); leave compress.codec at fp32")

    @classmethod
    def payload_chain(cls, algo: dict[str, Any]) -> Optional[str]:
        return sparse_chain(algo.get("topk_density", 0.02), algo.get("chunk", 4096), algo.get("ef_decay", 0.95),
                            algo.get("value_format", "2bit"), algo.get("chunking", "tensor"))

    @classmethod
    def payload_label(cls, algo: dict[str, Any], codec: Optional[str]) -> list[str]:
        """Its own payload (``compress.codec`` stays fp32): the top-k density and the value format."""
        density, fmt = algo.get("topk_density"), algo.get("value_format")
        parts = [f"top {100 * density:g}%"] if isinstance(density, (int, float)) else []
        return parts + ([str(fmt)] if fmt else [])

    @classmethod
    def state_copies(cls, cfg: Any) -> float:
        """The global copy and the error feedback (its codec's residual); no outer momentum."""
        return 2.0

    @classmethod
    def from_config(cls, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    *, tokens_per_step: int = 1, inner: Optional[Transport] = None) -> "SparseLoCo":
        a = cfg.algo
        settings = cls._settings(cfg)
        settings.pop("outer_momentum")
        settings.pop("nesterov")
        return cls(model, optimizer, transport, cfg.optim.grad_clip, tokens_per_step=tokens_per_step, inner=inner,
                   topk_density=a.topk_density, chunk=a.chunk, ef_decay=a.ef_decay, value_format=a.value_format,
                   aggregate=a.aggregate, chunking=a.chunking, **settings)

    # ---- the round's figures ------------------------------------------------------------------
    def sync(self) -> dict[str, Any]:
        if self.senders is not None:
            self.senders.restart()  # the figure is the latest round's
        return super().sync()

    def apply_exchange(self, indices: Sequence[int], deltas: list[torch.Tensor], total: float,
                       mix_alpha: float) -> None:
        if total > 0:
            for k, d in zip(indices, deltas):
                self.moved[k] |= d != 0
        super().apply_exchange(indices, deltas, total, mix_alpha)

    def figures(self) -> dict[str, Any]:
        moved = int(sum(m.sum() for m in self.moved))  # one read back, at log steps only
        out: dict[str, Any] = {"sent_share": moved / max(1, sum(m.numel() for m in self.moved))}
        if self.senders is not None:
            out["senders_per_position"] = self.senders.per_position()
        return out

    def _move(self, device: torch.device) -> None:
        super()._move(device)
        self.moved = [m.to(v.device) for m, v in zip(self.moved, self.global_views)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "moved": [m.detach().cpu() for m in self.moved]}

    @classmethod
    def whole_state(cls, slices: list[dict[str, Any]]) -> dict[str, Any]:
        state = super().whole_state(slices)
        if "whole_layout" in slices[0] and "moved" in slices[0]:  # one fragment: its pieces are every piece
            state["moved"] = cls._joined(slices, 0, [p["moved"] for p in slices])
        return state

    def cut_state(self, whole: dict[str, Any]) -> dict[str, Any]:
        state = super().cut_state(whole)
        if self.whole_layout is not None and "moved" in whole:
            state["moved"] = self._cut(0, whole["moved"])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("moved")  # a checkpoint from before the figure starts it over
        if isinstance(saved, list) and len(saved) == len(self.moved) and \
                all(isinstance(s, torch.Tensor) and s.shape == m.shape for s, m in zip(saved, self.moved)):
            for m, s in zip(self.moved, saved):
                m.copy_(s.to(m.device, torch.bool))
