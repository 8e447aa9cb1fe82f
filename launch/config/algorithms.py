"""Every algorithm the application runs, by ``algo.name``: diloco's registry with DeMo in it.

The application asks an algorithm's class what it is (its declarations on :class:`diloco.Algorithm`), never its
name; the few questions about the whole registry are answered here.
"""

import demo_optim  # noqa: F401  (registers algo.name=demo)
from diloco import ALGORITHMS, Algorithm, algorithm_class


def declared_by(name: str) -> type[Algorithm]:
    """What the algorithm ``name`` declares; for a name no algorithm has (a run folder of another version, or
    edited by hand), what the base class declares."""
    return ALGORITHMS.get(name, Algorithm)


def baseline_name() -> str:
    """The algorithm every other is compared with (DDP)."""
    return next(name for name, cls in ALGORITHMS.items() if cls.baseline)


def swarm_names() -> list[str]:
    """The algorithms that run over internet peers (``loco join``), in order of their names."""
    return sorted(name for name, cls in ALGORITHMS.items() if cls.swarm)


__all__ = ["ALGORITHMS", "algorithm_class", "baseline_name", "declared_by", "swarm_names"]
