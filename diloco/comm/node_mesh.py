"""One worker per node of a torchrun mesh: ``--nnodes M --nproc-per-node G`` as a 2-D mesh of processes.

A worker is a node: its G processes train as one DDP worker (gradients averaged
inside the node every step, through ``inner``), and the workers' exchange runs
across nodes, each local rank moving its 1/G share of the buffer over its
cross-node group (the ranks with the same local rank), then sharing the
result inside the node. Everything else (timeouts, errors that name the rank,
the settings compared before anything runs, overlapped exchanges on a lane of
their own) is the flat transport's (:mod:`diloco.comm.torch_dist`).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Hashable, Mapping, Optional

import torch
import torch.distributed as dist

from diloco.comm.base import Transport, TransportError, shard_bounds
from diloco.comm.caps import Capabilities
from diloco.comm.torch_dist import TorchDistTransport, torchrun_layout


class NodeMeshTransport(TorchDistTransport):
    """One worker per node of a torchrun mesh (``nodes`` x ``per_node`` processes, ranks node-major).

    ``rank`` / ``world_size`` are the node and the number of nodes; ``inner`` averages gradients
    inside the node. Control-plane calls (objects, barrier) run over every process with global
    rank 0 as the source, so the processes of a node always agree. Byte counters hold what this
    process put on the inter-node links (its 1/G share); intra-node traffic is not counted.
    """

    # gloo between the nodes: payloads go through bytes; a bucket's exchange runs through on_my_share (inside the
    # node, then across), one at a time
    caps = Capabilities(shared_stop=True, keep_scratch=True)

    def __init__(self, backend: str = "auto", timeout: float = 300.0, device: Optional[torch.device] = None,
                 per_node: Optional[int] = None, settings: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(backend, timeout, device, settings=settings)
        world = dist.get_world_size()
        g = per_node or torchrun_layout()[1]
        if g < 1 or world % g:
            raise TransportError(f"{world} processes cannot form nodes of {g}")
        m = world // g
        self.per_node, self.nodes = g, m
        self.node, self.local_rank = self.global_rank // g, self.global_rank % g
        self.node_group, self.cross_group = self._mesh_groups()
        self.group = self.cross_group  # byte collectives: my share, across nodes
        self.rank, self.world_size = self.node, m
        self.inner = _NodeInner(self)

    def _mesh_groups(self) -> tuple[Any, Any]:
        """My node's group and my cross-node group (every rank makes every group, in the same order)."""
        g, m = self.per_node, self.nodes
        node_groups = [self._new_group([n * g + i for i in range(g)]) for n in range(m)]
        cross_groups = [self._new_group([n * g + i for n in range(m)]) for i in range(g)]
        return node_groups[self.node], cross_groups[self.local_rank]

    def _side_groups(self) -> dict[str, Any]:
        node_group, cross_group = self._mesh_groups()
        return {"world": self._new_group(), "node_group": node_group, "cross_group": cross_group, "group": cross_group}

    @property
    def is_leader(self) -> bool:
        return self.global_rank == 0

    # ---- dense all-reduce: my 1/G share across nodes, then shared inside the node ---------------
    def _on_my_share(self, flat: torch.Tensor, align: int, reduce: Callable[[torch.Tensor], Any]) -> Any:
        """Cut ``flat`` into one share per local rank (at multiples of ``align``), ``reduce`` mine in place
        (across nodes), then all-gather the shares inside the node back into ``flat``."""
        work = self._reachable(flat)
        if work is not flat:  # a host buffer under NCCL: the whole of it goes through the device
            result = self._on_my_share(work, align, reduce)
            flat.copy_(work)
            return result
        bounds = shard_bounds(flat.numel(), self.per_node, align)
        lo, hi = bounds[self.local_rank]
        share = flat[lo:hi].clone()
        result = reduce(share)
        sizes = [h - l for l, h in bounds]
        mine = torch.zeros(max(sizes), dtype=flat.dtype, device=flat.device)
        mine[:share.numel()] = share
        parts = [torch.empty_like(mine) for _ in range(self.per_node)]
        self._run("all_gather (inside the node)", dist.all_gather, parts, mine, group=self._g("node_group"))
        flat.copy_(torch.cat([p[:s] for p, s in zip(parts, sizes)]))
        return result

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        self._on_my_share(flat, 1, lambda share: self._run("all_reduce (across nodes)", dist.all_reduce, share,
                                                           op=dist.ReduceOp.SUM, group=self._g("cross_group")))

    def count_all_reduce(self, nbytes: int) -> None:
        super().count_all_reduce(-(-nbytes // self.per_node))

    def on_my_share(self, flat: torch.Tensor, align: int, key: Hashable,
                    reduce: Callable[[torch.Tensor, Hashable], Any]) -> Any:
        """My 1/G share of the buffer through the exchange across nodes, then shared inside the node."""
        return self._on_my_share(flat, align, lambda share: reduce(share, (key, self.local_rank)))

    # ---- control plane over every process, from global rank 0 -----------------------------------
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run("broadcast_object", dist.broadcast_object_list, box, src=src * self.per_node, group=self._g("world"))
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        self._run("all_gather_object", dist.all_gather_object, out, obj, group=self._g("world"))
        return out[::self.per_node]  # one per node: its local rank 0

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        out: Optional[list[Any]] = [None] * dist.get_world_size() if self.global_rank == dst * self.per_node else None
        self._run("gather_object", dist.gather_object, obj, out, dst=dst * self.per_node, group=self._g("world"))
        return out[::self.per_node] if out is not None else None

    def gather_in_worker(self, obj: Any) -> Optional[list[Any]]:
        """Every process of this node's ``obj`` at its local rank 0 (each holds state of its own share: the
        error-feedback residuals of the pieces it encodes). Its tensors travel as host copies: a GPU tensor
        pickled to another process would come back on that process's device."""
        out: Optional[list[Any]] = [None] * self.per_node if self.local_rank == 0 else None
        self._run("gather_object (inside the node)", dist.gather_object, _on_host(obj), out,
                  dst=self.node * self.per_node, group=self._g("node_group"))
        return out

    def barrier(self) -> None:
        self._run("barrier", dist.barrier, group=self._g("world"))

    def before_exchange(self) -> None:
        if self.backend == "gloo":
            self._run("waiting for every process (monitored barrier)", dist.monitored_barrier, group=self._g("world"),
                      timeout=datetime.timedelta(seconds=self.timeout), wait_all_ranks=True)

    def now(self) -> float:
        """The node's clock (its local rank 0's), so a node's processes end time-budgeted rounds together."""
        t = torch.tensor([time.monotonic()], dtype=torch.float64, device=self.device)
        self._run("broadcast (node clock)", dist.broadcast, t, src=self.node * self.per_node, group=self._g("node_group"))
        return float(t.item())

    def summary(self) -> dict[str, Any]:
        return {"mesh": f"{self.nodes} nodes x {self.per_node} processes", "intra_node_bytes": self.inner.stats.bytes_sent}


def _on_host(obj: Any) -> Any:
    """``obj`` with every tensor in it (dicts, lists, tuples) copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


class _NodeInner(Transport):
    """The processes of one node: averages gradients every step (DDP inside the node)."""

    def __init__(self, mesh: NodeMeshTransport) -> None:
        super().__init__()
        self.mesh = mesh
        self.rank, self.world_size = mesh.local_rank, mesh.per_node

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        self.mesh._run("all_reduce (inside the node)", dist.all_reduce, flat, op=dist.ReduceOp.SUM,
                       group=self.mesh.node_group)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.mesh._run("broadcast (inside the node)", dist.broadcast, tensor,
                       src=self.mesh.node * self.mesh.per_node + src, group=self.mesh.node_group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        raise NotImplementedError("the node transport only averages gradients")

    all_gather_object = _all_gather_bytes = _all_to_all_bytes = broadcast_object
