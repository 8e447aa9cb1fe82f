"""Transports: local (one worker), torch_dist (torchrun, flat or one worker per node), hivemind (internet peers)
and sim (the simulator's in-process workers); :func:`make_transport` builds any of them."""

import os
from typing import Any

from diloco.comm.agreement import schema_differs
from diloco.comm.base import CommStats, Handle, PayloadBound, Transport, TransportError
from diloco.comm.caps import Capabilities, RobustBounds
from diloco.comm.local import LocalTransport

__all__ = ["Capabilities", "CommStats", "Handle", "LocalTransport", "PayloadBound", "RobustBounds", "Transport",
           "TransportError", "check_run_name", "fingerprint", "make_transport", "merge_ledgers", "read_slices",
           "read_swarm", "schema_differs"]


def make_transport(backend: str = "auto", dist_backend: str = "auto", timeout: float = 300.0, device=None,
                   mesh: str = "auto", shard: str = "none", **options: Any) -> Transport:
    """``auto`` picks torch_dist under torchrun (WORLD_SIZE > 1) and local otherwise.

    ``mesh``: ``flat`` makes every process a worker; ``nodes`` makes every node one worker (its processes
    average gradients every step); ``auto`` is ``nodes`` when torchrun runs several nodes of several processes.
    ``shard``: ``fsdp`` makes every node one worker whose processes shard its model (:mod:`diloco.comm.fsdp`),
    on one node too; it needs torchrun.
    ``settings=`` (torch_dist): what every process must agree on, compared before anything else runs.
    ``hivemind``: a swarm peer, ``HivemindTransport(**options)`` (``run=``, ``initial_peers=``, ...).
    ``sim``: worker ``rank`` of an in-process group, ``make_transport("sim", group=group, rank=r)``.
    """
    from diloco.comm.torch_dist import launched_by_torchrun, torchrun_layout

    if backend == "auto":  # one process started by torchrun shards over itself alone under fsdp (FSDP2's own cost)
        backend = "torch_dist" if launched_by_torchrun() or shard == "fsdp" and "RANK" in os.environ else "local"
    if shard == "fsdp" and not (backend == "torch_dist" and "RANK" in os.environ):
        raise TransportError("run.shard=fsdp shards a worker among the processes of a node started by torchrun "
                             "(torchrun --nproc-per-node G ... loco train); this run is one process: leave "
                             "run.shard at none")
    if backend == "local":
        return LocalTransport()
    if backend == "torch_dist":
        from diloco.comm.node_mesh import NodeMeshTransport
        from diloco.comm.torch_dist import TorchDistTransport

        nodes, per_node = torchrun_layout()
        settings = options.get("settings")  # compared across the processes (TorchDistTransport)
        meshed = mesh == "nodes" or (mesh == "auto" and nodes > 1 and per_node > 1) or shard == "fsdp"
        if settings is not None:  # nodes that cut the processes otherwise would part ways making the mesh's groups
            settings = {**settings, "torchrun layout": (f"{nodes} node(s) x {per_node} process(es), one worker per "
                                                        "node" if meshed else "one worker per process")}
        if shard == "fsdp":
            from diloco.comm.fsdp import ShardedNodeTransport

            return ShardedNodeTransport(dist_backend, timeout, device, per_node, settings=settings)
        if meshed:
            return NodeMeshTransport(dist_backend, timeout, device, per_node, settings=settings)
        return TorchDistTransport(dist_backend, timeout, device, settings=settings)
    if backend == "hivemind":
        from diloco.extras import require

        require("hivemind", "transport.backend=hivemind")
        from diloco.comm.hivemind import HivemindTransport

        return HivemindTransport(**options)
    if backend == "sim":
        if "group" not in options or "rank" not in options:
            raise TypeError("make_transport('sim', group=<InProcessGroup>, rank=<int>): group and rank are required")
        return options["group"].endpoints[options["rank"]]
    raise ValueError(f"transport.backend: unknown backend {backend!r}")


_SWARM_HELPERS = ("check_run_name", "fingerprint", "merge_ledgers", "read_swarm")


def __getattr__(name: str) -> Any:
    """The swarm helpers the application needs (``from diloco.comm import read_swarm``), loaded on first use.

    They live in :mod:`diloco.comm.hivemind`; importing that module does not import the hivemind library.
    """
    if name == "read_slices":  # a sharded run's checkpoint slices, read without a process group
        from diloco.comm.slices import read_slices

        return read_slices
    if name in _SWARM_HELPERS:
        from diloco.comm import hivemind

        return getattr(hivemind, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
