"""loco's algorithm library: loop-agnostic algorithms over a transport.

``ALGORITHMS`` is the one registry of ``algo.name`` -> class: ddp, diloco, streaming and sparseloco register here;
DeMo registers itself when ``demo_optim`` is imported (it builds on this package, not the reverse).
"""

from diloco.algorithm import ALGORITHMS, Algorithm, ConfigConflict, algorithm_class, register
from diloco.ddp import DDP
from diloco.outer import DiLoCo
from diloco.sparseloco import SparseLoCo
from diloco.streaming import StreamingDiLoCo
from diloco.sync import SyncPolicy

__all__ = ["ALGORITHMS", "DDP", "Algorithm", "ConfigConflict", "DiLoCo", "SparseLoCo", "StreamingDiLoCo", "SyncPolicy",
           "algorithm_class", "register"]
