"""One worker per node, its model sharded among the node's processes with FSDP2 (``run.shard: fsdp``).

The node mesh (:mod:`diloco.comm.node_mesh`) makes each node of a torchrun mesh one worker whose G processes
hold the whole model and average gradients every step. Here they hold a 1/G slice of it instead: torch's
``fully_shard`` cuts every parameter along its first dimension among the node's processes (each block one
unit, the output head one, the rest with the root: :func:`shard_units`), reduce-scatters the gradients in
the backward, and the inner optimizer and the algorithm keep state only for the local slice. Between workers
each process exchanges its own slice with the processes of the same local rank on the other nodes: what the
node mesh does with its 1/G share of a replicated buffer, without the gather inside the node that follows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from diloco.comm.base import Transport, TransportError
from diloco.comm.node_mesh import NodeMeshTransport
from diloco.comm.slices import packed, read_slices
from diloco.layers import layer_stack, output_head


class ShardedNodeTransport(NodeMeshTransport):
    """:class:`NodeMeshTransport` whose processes each hold a slice of the worker (see the module's docstring):
    a buffer handed to an exchange is already this process's share. ``inner`` is the node's, as there; an
    algorithm on a sharded model uses it only to sum what the slices make together (a gradient norm)."""

    shards_model = True

    def _on_my_share(self, flat: torch.Tensor, align: int, reduce: Callable[[torch.Tensor], Any]) -> Any:
        work = self._reachable(flat)
        result = reduce(work)
        if work is not flat:  # a host buffer under NCCL went through the device
            flat.copy_(work)
        return result

    def count_all_reduce(self, nbytes: int) -> None:
        Transport.count_all_reduce(self, nbytes)  # the whole buffer is this process's share

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "mesh": f"{self.nodes} nodes x {self.per_node} processes, sharded (fsdp)"}

    # ---- checkpoints: every process's own slices, written together --------------------------------
    def save_slices(self, folder: Path, state: dict[str, Any]) -> None:
        """Every process's ``state`` (its slices: :func:`diloco.state.local_tree`) into ``folder`` with torch's
        distributed checkpoint, each process writing its own file at once (a collective of every process)."""
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(folder, sync_files=True)
        self._run("distributed checkpoint save", dcp.save, {f"p{self.global_rank}": packed(state)},
                  storage_writer=writer, process_group=self._g("world"))

    def load_slices(self, folder: Path) -> dict[str, Any]:
        """This process's part of a :meth:`save_slices` folder, read alone (no collective)."""
        return read_slices(folder, self.global_rank)

    def whole_model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The sharded ``model``'s weights whole, in host memory, at the leader (empty elsewhere): each node's
        processes gather one tensor at a time (a collective of every process)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def shard(self, model: nn.Module, bf16: bool) -> nn.Module:
        """``model`` sharded among this node's processes, in place (see :func:`shard_model`)."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(self.node_group, self.device.type)
        return shard_model(model, mesh, self.per_node, bf16)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units: every block (the children of :func:`diloco.layers.layer_stack`, the
    layers Streaming DiLoCo's fragments are cut by) and the output head unless it is tied to the embedding. The
    embeddings stay with the root, which gathers its own parameters first in every forward: loco's model reads the
    embedding's weight itself instead of calling its module, which a unit of its own would leave sharded there."""
    stack = layer_stack(model)
    units = list(stack) if stack is not None else []
    head = output_head(model)
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    if head is not None and not {id(p) for p in head.parameters()} & embedded:
        units.append(head)
    return [m for m in units if any(True for _ in m.parameters())]


def shard_model(model: nn.Module, mesh: Any, processes: int, bf16: bool) -> nn.Module:
    """``fully_shard`` each of :func:`shard_units` and then the root over ``mesh``: the forward gathers one unit
    at a time and frees it after. ``bf16``: compute in bf16 with fp32 master weights and fp32 reductions."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = shard_units(model)
    if len(units) < processes:
        raise TransportError(f"run.shard=fsdp: the model has {len(units)} unit(s) to shard (its blocks and its "
                             f"head) and the node {processes} processes; run fewer processes per node, or "
                             f"run.shard=none")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    for k, unit in enumerate(units):
        # the last unit of the forward is the first of the backward: freeing its weights between the two would only
        # gather them again at once
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=k < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
