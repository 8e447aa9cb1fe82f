"""Sharded tensors told apart from plain ones: a parameter that ``fully_shard`` cut among a node's processes is a
torch DTensor, and this process works on its local part. The one place that asks, so that the algorithms, their
state and its layouts need not know torch.distributed's types."""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch


def _dtensor_type() -> Optional[type]:
    """torch's DTensor class, or None where its module was never loaded (a torch build without distributed, or a
    run that shards nothing): no tensor can be a DTensor then. Looked up rather than imported, because importing
    it costs about half a second at every start of a run that never shards. A torch before 2.5 keeps DTensor
    elsewhere; ``run.shard: fsdp`` needs a later one."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a tensor cut among processes (a DTensor)."""
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


def local_part(t: Any) -> Any:
    """This process's part of ``t``: its local tensor where ``t`` is sharded (on the same storage), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def mesh_place(t: torch.Tensor) -> tuple[int, int]:
    """(processes, this process's place among them) of the mesh the sharded ``t`` is cut over."""
    return t.device_mesh.size(), t.device_mesh.get_local_rank()


def sharded_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local``, this process's part of the sharded ``param``, as a DTensor of ``param``'s layout again."""
    return type(param).from_local(local.to(param.device), param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
