"""Transport over torch.distributed process groups (gloo on CPU and between nodes, NCCL on GPUs).

Started by ``torchrun``: rank, world size and the rendezvous come from its
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
Every collective runs under the process group's timeout; a collective that
fails raises :class:`TransportError` naming this rank.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from diloco.comm.base import Transport, TransportError


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


class TorchDistTransport(Transport):
    def __init__(self, backend: str = "auto", timeout: float = 300.0, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.device = device or torch.device("cpu")
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.backend = backend
        self.timeout = timeout
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            try:
                dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
            except Exception as e:
                raise TransportError(
                    f"rank {os.environ.get('RANK', '?')}: could not join the process group at "
                    f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} within {timeout:g}s: {e}"
                ) from None
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def _run(self, what: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with long texts
            raise TransportError(f"rank {self.rank}/{self.world_size}: {what} failed (timeout {self.timeout:g}s): {e}") from None
        finally:
            self.stats.seconds += time.perf_counter() - start

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        self._run("all_reduce", dist.all_reduce, flat, op=dist.ReduceOp.SUM)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._run("broadcast", dist.broadcast, tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run("broadcast_object", dist.broadcast_object_list, box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", dist.all_gather_object, out, obj)
        return out

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self._run("all_gather(sizes)", dist.all_gather, sizes, size)
        longest = int(max(s.item() for s in sizes))
        buf = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else buf[:0]
        bufs = [torch.empty_like(buf) for _ in range(self.world_size)]
        self._run("all_gather(payload)", dist.all_gather, bufs, buf)
        self.stats.bytes_sent += len(payload) * (self.world_size - 1)
        self.stats.bytes_received += sum(int(s.item()) for s in sizes) - len(payload)
        self.stats.collectives += 1
        return [bytes(b[: int(s.item())].cpu().numpy()) for b, s in zip(bufs, sizes)]

    def all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        if len(payloads) != self.world_size:
            raise ValueError(f"all_to_all_bytes needs {self.world_size} payloads, got {len(payloads)}")
        send_sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=self.device)
        recv_sizes = torch.empty_like(send_sizes)
        self._run("all_to_all(sizes)", dist.all_to_all_single, recv_sizes, send_sizes)
        send_n, recv_n = send_sizes.tolist(), recv_sizes.tolist()
        joined = b"".join(payloads)
        send = (torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined
                else torch.zeros(0, dtype=torch.uint8)).to(self.device)
        recv = torch.empty(sum(recv_n), dtype=torch.uint8, device=self.device)
        self._run("all_to_all(payload)", dist.all_to_all_single, recv, send,
                  output_split_sizes=recv_n, input_split_sizes=send_n)
        me = self.rank
        self.stats.bytes_sent += sum(send_n) - send_n[me]
        self.stats.bytes_received += sum(recv_n) - recv_n[me]
        self.stats.collectives += 1
        data = recv.cpu().numpy().tobytes()
        out, pos = [], 0
        for n in recv_n:
            out.append(data[pos:pos + n])
            pos += n
        return out

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
