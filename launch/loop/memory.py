"""The bytes one process holds for its worker's training state: parameters, gradients, the inner optimizer's state
and the algorithm's. Read from the parameter count and the settings, the way ``loco plan`` reads a model it never
builds; under ``run.shard: fsdp`` each part is 1/G of the worker's (G processes a node). Activations and the
exchange's buffers are not counted: they depend on the batch and the bucket size, not on the model alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launch.config.algorithms import algorithm_class
from launch.store.disk import human_bytes

FP32 = 4


@dataclass(frozen=True)
class ProcessBytes:
    params: float
    grads: float
    optimizer: float
    algorithm: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.algorithm

    def describe(self) -> str:
        return (f"parameters {human_bytes(self.params)}, gradients {human_bytes(self.grads)}, optimizer {human_bytes(self.optimizer)}, "
                f"algorithm {human_bytes(self.algorithm)}: {human_bytes(self.total)}")


def optimizer_copies(cfg: Any, matrix_share: float) -> float:
    """fp32 copies of the parameters the inner optimizer keeps: AdamW's two moments, SGD's momentum, Muon's momentum
    on the hidden matrices (``matrix_share`` of the parameters) and AdamW's moments on the rest; or what the
    algorithm's own optimizer keeps."""
    own = algorithm_class(cfg.algo.name).optimizer_copies(cfg)
    if own is not None:
        return own
    o = cfg.optim
    if o.name == "sgd":
        return 1.0 if o.momentum > 0 else 0.0
    if o.name == "muon":
        return matrix_share + 2 * (1 - matrix_share)
    return 2.0


def process_bytes(cfg: Any, params: int, processes: int = 1, matrix_share: float = 0.9) -> ProcessBytes:
    """What one of ``processes`` sharding a worker of ``params`` parameters holds (``processes=1``: unsharded)."""
    share = params * FP32 / processes
    return ProcessBytes(share, share, share * optimizer_copies(cfg, matrix_share),
                        share * algorithm_class(cfg.algo.name).state_copies(cfg))
