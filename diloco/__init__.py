"""loco's algorithm library: loop-agnostic algorithms over a transport."""

from diloco.algorithm import DDP, Algorithm
from diloco.outer import DiLoCo
from diloco.streaming import StreamingDiLoCo
from diloco.sync import SyncPolicy

ALGORITHMS: dict[str, type[Algorithm]] = {"ddp": DDP, "diloco": DiLoCo, "streaming": StreamingDiLoCo}

__all__ = ["ALGORITHMS", "DDP", "Algorithm", "DiLoCo", "StreamingDiLoCo", "SyncPolicy"]
