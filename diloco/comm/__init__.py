"""Transports: local (one worker), torch_dist (torchrun); hivemind and the simulator's in-process one follow."""

from diloco.comm.base import CommStats, Handle, Transport, TransportError
from diloco.comm.local import LocalTransport

__all__ = ["CommStats", "Handle", "LocalTransport", "Transport", "TransportError", "make_transport"]


def make_transport(backend: str = "auto", dist_backend: str = "auto", timeout: float = 300.0, device=None,
                   mesh: str = "auto") -> Transport:
    """``auto`` picks torch_dist under torchrun (WORLD_SIZE > 1) and local otherwise.

    ``mesh``: ``flat`` makes every process a worker; ``nodes`` makes every node one worker (its processes
    average gradients every step); ``auto`` is ``nodes`` when torchrun runs several nodes of several processes.
    """
    from diloco.comm.torch_dist import launched_by_torchrun, torchrun_layout

    if backend == "auto":
        backend = "torch_dist" if launched_by_torchrun() else "local"
    if backend == "local":
        return LocalTransport()
    if backend == "torch_dist":
        from diloco.comm.torch_dist import NodeMeshTransport, TorchDistTransport

        nodes, per_node = torchrun_layout()
        if mesh == "nodes" or (mesh == "auto" and nodes > 1 and per_node > 1):
            return NodeMeshTransport(dist_backend, timeout, device, per_node)
        return TorchDistTransport(dist_backend, timeout, device)
    raise ValueError(f"transport.backend: unknown backend {backend!r}")
