"""One worker alone: every collective is the identity and moves no bytes."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from diloco.comm.base import Transport


class LocalTransport(Transport):
    rank = 0
    world_size = 1

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        pass

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return [payload]

    def _all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        return [payloads[0]]

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]
