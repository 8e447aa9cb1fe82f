"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706): top-k + 2-bit pseudo-gradients.

Every round, after H inner steps on local data, worker r::

    delta_r = theta_global - theta_local_r                  fp32
    e_r     = beta * e_r + delta_r                           its error-feedback buffer (algo.ef_decay)
    s_r     = Q(TopK_chunk(e_r))                             the k largest |e| of each chunk of algo.chunk
                                                             values, quantized (algo.value_format, 2bit)
    e_r     = e_r - s_r                                      what was not sent (or lost to Q) waits
    theta_global <- theta_global - alpha * mean_r(s_r)       algo.outer_lr; no other momentum state
    theta_local_r <- theta_global

The error-feedback buffer takes the place of DiLoCo's outer momentum. Steps
two to four are the codec chain ``topk:chunk=C,k=K,ef=beta+2bit`` (its
residual is ``e``), so the kernels and the wire format are the codecs'. The
mean is the *gathered* aggregation of :mod:`diloco.compress.collective`: every
worker decodes every worker's sparse payload, so the mean is exact and the
sum of W sparse payloads is never densified on the wire. Weights are the
tokens each worker trained in the round, as in DiLoCo (equal workers: the
plain mean of the paper).

The chunks are ``algo.chunk`` consecutive values of the flat pseudo-gradient
(parameters in model order); the published code cuts matrices into 2-D blocks
of the same size. Over hivemind peers the same payloads go through the robust
mean (validation and norm clipping); a worker with a non-finite pseudo-gradient
sends weight 0 and takes the new global model.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from diloco.algorithm import ConfigConflict, register
from diloco.comm.base import Transport
from diloco.compress.chain import VALUE_FORMATS, CodecSpecError, exact_number
from diloco.compress.codec import Codec, make_codec
from diloco.outer import DiLoCo


def sparse_chain(density: float, chunk: int, ef_decay: float, value_format: str) -> str:
    """The codec chain of one SparseLoCo payload."""
    k = max(1, round(density * chunk))
    return f"topk:chunk={chunk},k={k},ef={exact_number(ef_decay)}+{value_format}"


@register
class SparseLoCo(DiLoCo):
    name = "sparseloco"
    gather = True
    default_outer_lr = 1.0  # alpha, as published (not DiLoCo's 0.7)
    # no outer momentum to agree on: the error feedback is the momentum; the top-k payload's settings instead
    peer_settings = ("inner_steps", "topk_density", "chunk", "ef_decay", "value_format")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Optional[Transport] = None,
                 grad_clip: float = 0.0, *, topk_density: float = 0.02, chunk: int = 4096, ef_decay: float = 0.95,
                 outer_lr: float = 1.0, value_format: str = "2bit", **kwargs: Any) -> None:
        codec = self.check(topk_density, chunk, ef_decay, value_format)
        kwargs.pop("codec", None)
        kwargs.update(outer_momentum=0.0, nesterov=False)  # e_r is the momentum: theta -= alpha * mean
        super().__init__(model, optimizer, transport, grad_clip, outer_lr=outer_lr, codec=codec, **kwargs)
        self.topk_density, self.chunk, self.ef_decay, self.value_format = topk_density, chunk, ef_decay, value_format

    @staticmethod
    def check(topk_density: float, chunk: int, ef_decay: float, value_format: str) -> Codec:
        """SparseLoCo's constraints, stated once (the config check and the constructor both run it); returns
        the codec of these settings."""
        if not 0.0 < topk_density <= 1.0:
            raise ConfigConflict("algo.topk_density", f"must be in (0, 1], got {topk_density}")
        if value_format not in VALUE_FORMATS:
            raise ConfigConflict("algo.value_format", f"must be one of {', '.join(VALUE_FORMATS)}, got {value_format!r}")
        if not 0.0 <= ef_decay <= 1.0:
            raise ConfigConflict("algo.ef_decay", f"must be in [0, 1], got {ef_decay}")
        try:
            return make_codec(sparse_chain(topk_density, chunk, ef_decay, value_format))
        except CodecSpecError as e:
            raise ConfigConflict("algo.chunk", str(e).replace("codec stage 'topk': ", "")) from None

    @classmethod
    def check_config(cls, cfg: Any, n_layers: int) -> None:
        super().check_config(cfg, n_layers)
        a = cfg.algo
        cls.check(a.topk_density, a.chunk, a.ef_decay, a.value_format)
        if cfg.compress.codec != "fp32":
            raise ConfigConflict("compress.codec", "SparseLoCo sends its own top-k payload (tune algo.topk_density, "
                                                   "algo.chunk and algo.value_format); leave compress.codec at fp32")

    @classmethod
    def payload_label(cls, algo: dict[str, Any], codec: Optional[str]) -> list[str]:
        """Its own payload (``compress.codec`` stays fp32): the top-k density and the value format."""
        density, fmt = algo.get("topk_density"), algo.get("value_format")
        parts = [f"top {100 * density:g}%"] if isinstance(density, (int, float)) else []
        return parts + ([str(fmt)] if fmt else [])

    @classmethod
    def from_config(cls, cfg: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport,
                    *, tokens_per_step: int = 1, inner: Optional[Transport] = None) -> "SparseLoCo":
        a = cfg.algo
        settings = cls._settings(cfg)
        settings.pop("outer_momentum")
        settings.pop("nesterov")
        return cls(model, optimizer, transport, cfg.optim.grad_clip, tokens_per_step=tokens_per_step, inner=inner,
                   topk_density=a.topk_density, chunk=a.chunk, ef_decay=a.ef_decay, value_format=a.value_format,
                   **settings)
