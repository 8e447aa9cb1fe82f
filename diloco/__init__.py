"""loco's algorithm library: loop-agnostic algorithms over a transport."""

from diloco.algorithm import ALGORITHMS, DDP, Algorithm

__all__ = ["ALGORITHMS", "DDP", "Algorithm"]
