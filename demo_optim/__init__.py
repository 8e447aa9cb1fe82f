"""DeMo: decoupled momentum optimization, exchanging only the fast DCT components of the momentum.

``demo_optim.DeMo(params, lr, compression_decay=0.999, compression_topk=32, compression_chunk=64,
weight_decay=0.0, transport=None, ...)`` takes the published implementation's argument names, so
switching is a change of import. ``transport=None`` runs it as a single worker; any loco transport
(the simulator's, torch.distributed, ...) makes it a multi-worker optimizer with one collective per step.
"""

from demo_optim.optimizer import DeMo
from demo_optim.algorithm import DeMoAlgorithm  # registers algo.name=demo

__all__ = ["DeMo", "DeMoAlgorithm"]
