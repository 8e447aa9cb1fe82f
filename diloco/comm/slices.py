"""A sharded run's checkpoint slices: every process's own state, kept by torch's distributed checkpoint in one
folder (:meth:`diloco.comm.fsdp.ShardedNodeTransport.save_slices` writes it), and read back one process's part at
a time, without a process group: a run of another layout reads the parts of the processes that stood for its
worker (:mod:`diloco.reshard` joins them)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch


def read_slices(folder: Path, process: int) -> dict[str, Any]:
    """Process ``process``'s part of a folder ``save_slices`` wrote; KeyError where it holds none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # what torch's _load_state_dict_from_keys does, without its collectives where a process group is up: the state
    # is built from the folder's metadata, and each process reads its own part alone
    key = f"p{process}"
    out: dict[str, Any] = {}
    _load_state_dict(out, storage_reader=dcp.FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(keys={key}),
                     no_dist=True)
    return _unpacked(out[key])


_SLOT = "__tensor__"  # a dict holding only this key stands for the tensor of that number


def packed(state: Any) -> dict[str, Any]:
    """``state`` as the distributed checkpoint keeps it whole: its tensors by number, and the rest of it (dicts,
    lists, numbers, strings, with each tensor's number in its place) as one serialized tree. The checkpoint
    flattens nested containers into keys, which would lose an empty one (an optimizer's empty ``state``)."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors[f"t{len(tensors)}"] = obj
            return {_SLOT: len(tensors) - 1}
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    tree = strip(state)
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    return {"tree": buffer.getvalue(), "tensors": tensors}


def _unpacked(kept: dict[str, Any]) -> Any:
    """The state :func:`packed` made ``kept`` of."""
    tensors = kept.get("tensors", {})
    tree = torch.load(io.BytesIO(kept["tree"]), weights_only=True)

    def fill(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_SLOT}:
                return tensors[f"t{obj[_SLOT]}"]
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(fill(v) for v in obj)
        return obj

    return fill(tree)

