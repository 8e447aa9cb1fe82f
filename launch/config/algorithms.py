"""Every algorithm the application runs, by ``algo.name``: diloco's registry with DeMo in it.

The application asks an algorithm's class what it is (its declarations on :class:`diloco.Algorithm`), never its
name; the few questions about the whole registry are answered here.
"""

from typing import Optional

from demo_optim import DeMoAlgorithm  # registers algo.name=demo
from diloco import ALGORITHMS, DDP, Algorithm, DiLoCo, SparseLoCo, StreamingDiLoCo, algorithm_class

# the algo.* keys each algorithm reads (its from_config, check_config and outer_lr_of), algo.name aside: a key the
# user sets for an algorithm that does not read it is said at load, since the run goes on without it
_OUTER = frozenset({"inner_steps", "outer_lr", "outer_momentum", "nesterov", "offload_outer"})
READS: dict[type[Algorithm], frozenset[str]] = {
    DDP: frozenset(),
    DiLoCo: _OUTER,
    StreamingDiLoCo: _OUTER | {"fragments", "overlap_steps", "mix_alpha", "overlap_merge"},
    SparseLoCo: (_OUTER - {"outer_momentum", "nesterov"})  # its error feedback is the momentum
                | {"topk_density", "chunk", "chunking", "ef_decay", "value_format", "aggregate"},
    DeMoAlgorithm: frozenset({"compression_decay", "compression_topk", "compression_chunk", "chunk_rule",
                              "sign_values", "nonfinite"}),
}


def declared_by(name: str) -> type[Algorithm]:
    """What the algorithm ``name`` declares; for a name no algorithm has (a run folder of another version, or
    edited by hand), what the base class declares."""
    return ALGORITHMS.get(name, Algorithm)


def reads(name: str) -> Optional[frozenset[str]]:
    """The algo.* keys the algorithm ``name`` reads; None for one whose keys are not known here (say nothing)."""
    return READS.get(ALGORITHMS.get(name))


def baseline_name() -> str:
    """The algorithm every other is compared with (DDP)."""
    return next(name for name, cls in ALGORITHMS.items() if cls.baseline)


def swarm_names() -> list[str]:
    """The algorithms that run over internet peers (``loco join``), in order of their names."""
    return sorted(name for name, cls in ALGORITHMS.items() if cls.swarm)


__all__ = ["ALGORITHMS", "algorithm_class", "baseline_name", "declared_by", "reads", "swarm_names"]
