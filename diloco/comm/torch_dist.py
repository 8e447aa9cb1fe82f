"""The flat transport over torch.distributed process groups (gloo on CPU and between nodes, NCCL on GPUs): every
process is one worker (:mod:`diloco.comm.node_mesh` makes every node one).

Started by ``torchrun``: rank, world size and the rendezvous come from its
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ...).
Every collective runs under the process group's timeout; a collective that
fails raises :class:`TransportError` naming this rank. On gloo every exchange
starts with a monitored barrier, so a worker that does not arrive within the
timeout is named by rank 0 ("Ranks 2 failed to pass monitoredBarrier") instead
of a silent hang. Given ``settings`` (what every process must agree on), the
transport compares them across the processes as its first collective and
raises on every process where any differs, naming the keys, values, ranks and
hosts (:mod:`diloco.comm.agreement`): processes started with different settings
would otherwise hang at the first collective where they part ways.

Overlapped exchanges (``all_reduce_async_``, Streaming DiLoCo's tau steps) on
gloo run in one background thread (a lane) over a second set of process groups,
made by every rank at the first such exchange: the collectives the training loop
issues meanwhile (control plane, gradients inside a node) keep their own
groups, so the two streams never interleave on one group. ``wait()`` returns
the result or raises the thread's :class:`TransportError`. On NCCL an exchange
started "async" still completes before returning.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import queue
import socket
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from diloco.comm.agreement import settings_differ
from diloco.comm.base import Handle, PayloadBound, Transport, TransportError
from diloco.comm.caps import Capabilities
from diloco.comm.pool import BufferPool


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def torchrun_layout() -> tuple[int, int]:
    """(nodes, processes per node) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        return 1, world
    return world // local, local


class _LaneGroups(threading.local):
    """The process groups of the calling thread: a lane's own in its background thread (set there), None in every
    other thread (the training thread's groups are the transport's attributes)."""

    groups: Optional[dict[str, Any]] = None


class _Lane:
    """One daemon thread that runs the overlapped exchanges in order, on process groups of its own.

    A daemon, so a process whose training thread fails never waits at exit for an exchange that other
    ranks will not finish (a thread pool's workers are joined at exit). On a GPU the thread takes the process's
    device as its current one: a new thread starts on cuda:0, and Triton launches its kernels on the current
    device's stream, whatever device their tensors are on.
    """

    def __init__(self, groups: dict[str, Any], lanes: _LaneGroups, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # "cuda": the device current here, named
            device = torch.device("cuda", torch.cuda.current_device())
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(groups, lanes, device), name="loco-exchange",
                                       daemon=True)
        self.thread.start()

    def _loop(self, groups: dict[str, Any], lanes: _LaneGroups, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        lanes.groups = groups
        while (job := self.jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # surfaces at the handle's wait()
                    future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((fn, future))
        return future

    def stop(self, wait: bool) -> None:
        self.jobs.put(None)
        if wait:
            self.thread.join()


class _Future(Handle):
    """An exchange running in the background thread."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        super().__init__()
        self.future = future

    def wait(self) -> Any:
        return self.future.result()


def _elastic_store(timeout: float) -> dict[str, Any]:
    """After torchrun restarted the workers, rendezvous under a key prefix of this attempt.

    torchrun's agent keeps one store across restarts; without a prefix a restarted worker can read
    the previous attempt's addresses (of processes that are gone) and fail to connect.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return {"store": dist.PrefixStore(f"/loco/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


class TorchDistTransport(Transport):
    # torchrun signals every rank, and broadcast_object spans the whole process group; one worker per process; the
    # device gather (NCCL) and the overlapped exchanges (gloo) where the backend allows them (see __init__)
    caps = Capabilities(shared_stop=True, keep_scratch=True, device_gather=True, overlaps_exchange=True)

    def __init__(self, backend: str = "auto", timeout: float = 300.0, device: Optional[torch.device] = None,
                 group: Any = None, settings: Optional[Mapping[str, Any]] = None) -> None:
        """``settings``: what every process of the run must agree on (name -> value, values comparable with
        ``==``); compared across every process before any other collective (see :func:`settings_differ`)."""
        super().__init__()
        self.device = device or torch.device("cpu")
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl" and self.device.type != "cuda":
            raise TransportError(f"transport.dist_backend=nccl moves CUDA tensors, but this process trains on "
                                 f"{self.device}: use run.device=cuda (or auto), or transport.dist_backend=gloo")
        self.backend = backend
        self.timeout = timeout
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            # NCCL's groups get gloo beside them for what lies in host memory: the object collectives (a checkpoint
            # gathers every worker's state through them) pickle into CPU tensors and go over gloo, where NCCL would
            # stage each object on the GPU, and rank 0's gather would take world x the largest state there
            both = "cpu:gloo,cuda:nccl" if backend == "nccl" else backend
            try:
                dist.init_process_group(backend=both, timeout=datetime.timedelta(seconds=timeout),
                                        **_elastic_store(timeout))
            except Exception as e:
                raise TransportError(
                    f"rank {os.environ.get('RANK', '?')}: could not join the process group at "
                    f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} within {timeout:g}s: {e}"
                ) from None
        if settings is not None and dist.get_world_size() > 1:
            views: list[Any] = [None] * dist.get_world_size()
            self._run("all_gather_object (settings)", dist.all_gather_object, views,
                      (socket.gethostname(), dict(settings)))
            problem = settings_differ(views)
            if problem is not None:
                raise TransportError(f"rank {dist.get_rank()}: {problem}")
        self.group = group  # None: the whole world
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # gloo gathers host memory (through bytes) and runs a started collective on threads of its own; NCCL's
        # streams would need the tensors' lifetimes tied to them, which only the synchronous path does here
        self.caps = replace(self.caps, settings_agreed=settings is not None,
                            device_gather=self.caps.device_gather and backend == "nccl",
                            overlaps_exchange=self.caps.overlaps_exchange and backend == "gloo" and self.world_size > 1)
        self.global_rank = dist.get_rank()
        self._lanes = _LaneGroups()
        self._background: Optional[_Lane] = None
        self._gather_sizes: set[int] = set()  # tensor sizes all ranks agreed on (all_gather_tensor)
        self._pool = BufferPool(1 << 20, 8)  # host send / receive buffers of the byte collectives
        # the size exchanges of overlapped collectives run on a group of their own: on the main group they would
        # queue behind the transfers in flight (gloo runs a group's collectives on two threads)
        self.sizes_group = self._new_group() if self.caps.overlaps_exchange and self.group is None else None

    # ---- lanes: the training thread's process groups, or the background thread's -----------------
    def _g(self, name: str = "group") -> Any:
        """The process group ``name`` (group, world, node_group, cross_group) of the calling thread."""
        side = self._lanes.groups
        if side is not None:
            return side[name]
        return None if name == "world" else getattr(self, name)

    def _side_groups(self) -> dict[str, Any]:
        """A copy of every group this transport uses; every rank runs this at the same exchange."""
        world = self._new_group()
        return {"group": world if self.group is None else self._new_group(dist.get_process_group_ranks(self.group)),
                "world": world, "sizes_group": self._new_group() if self.sizes_group is not None else None}

    def _new_group(self, ranks: Optional[list[int]] = None) -> Any:
        """A process group of ``ranks`` (None: all) whose collectives time out after this transport's ``timeout``
        (``new_group`` alone gives 30 minutes); every rank makes every group, in the same order."""
        return dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout))

    def _start(self, fn: Callable[[], Any]) -> Handle:
        if self.backend != "gloo" or self.world_size == 1:
            return super()._start(fn)
        if self._background is None:
            self._background = _Lane(self._side_groups(), self._lanes, self.device)
        return _Future(self._background.submit(fn))

    def _drain(self, wait: bool = True) -> None:
        """Let the exchange in flight finish (its errors surface at its ``wait()``), then stop the thread;
        ``wait=False`` leaves the thread to end with the process."""
        if self._background is not None:
            self._background.stop(wait)
            self._background = None

    def _src(self, src: int) -> int:
        """The global rank of group rank ``src`` (collectives take global ranks)."""
        return src if self.group is None else dist.get_global_rank(self.group, src)

    def _run(self, what: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with long texts
            raise TransportError(f"rank {self.global_rank} (worker {self.rank}/{self.world_size}): {what} failed "
                                 f"(timeout {self.timeout:g}s): {e}") from None
        finally:
            self.stats.seconds += time.perf_counter() - start

    def before_exchange(self) -> None:
        """gloo: a monitored barrier, so rank 0 names a worker that does not arrive within the timeout."""
        if self.backend == "gloo" and self.world_size > 1:
            self._run("waiting for every worker (monitored barrier)", dist.monitored_barrier, group=self._g(),
                      timeout=datetime.timedelta(seconds=self.timeout), wait_all_ranks=True)

    def _reachable(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or a copy of it on this process's GPU where the backend cannot take it: NCCL moves device
        memory only, and an outer step kept on the host (``algo.offload_outer``) hands it host tensors."""
        return t.to(self.device) if self.backend == "nccl" and t.device.type != "cuda" else t

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        work = self._reachable(flat)
        self._run("all_reduce", dist.all_reduce, work, op=dist.ReduceOp.SUM, group=self._g())
        if work is not flat:
            flat.copy_(work)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        work = self._reachable(tensor)
        self._run("broadcast", dist.broadcast, work, src=self._src(src), group=self._g())
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run("broadcast_object", dist.broadcast_object_list, box, src=self._src(src), group=self._g())
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", dist.all_gather_object, out, obj, group=self._g())
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list[Any]]:
        out: Optional[list[Any]] = [None] * self.world_size if self.rank == dst else None
        self._run("gather_object", dist.gather_object, obj, out, dst=self._src(dst), group=self._g())
        return out

    @staticmethod
    def _bytes_tensor(payload: bytes | bytearray | memoryview) -> torch.Tensor:
        """``payload`` as a uint8 tensor over the same memory (only ever read: sent)."""
        with warnings.catch_warnings():  # immutable bytes: the tensor is never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(payload, dtype=torch.uint8)

    def _buffer(self, n: int, host: bool = False) -> tuple[torch.Tensor, Optional[memoryview]]:
        """``n`` bytes to send or receive into: in host memory (on a host device, or ``host``) a buffer of the
        pool (a uint8 tensor over it, and the buffer itself, whose views are handed out), else a new tensor on
        the device."""
        if self.device.type != "cpu" and not host:
            return torch.empty(n, dtype=torch.uint8, device=self.device), None
        buf = memoryview(self._pool.take(n))
        return (self._bytes_tensor(buf) if n else torch.zeros(0, dtype=torch.uint8)), buf

    def _host_views(self, recv: torch.Tensor, spans: Sequence[tuple[int, int]],
                    buf: Optional[memoryview] = None) -> list[memoryview]:
        """Views of ``recv`` (moved to host memory once, if it is not there) at ``spans``: nothing is copied out.
        ``buf``: the host buffer under ``recv``, viewed directly."""
        data = buf if buf is not None else memoryview(recv.cpu().numpy()) if recv.numel() else memoryview(b"")
        return [data[a:a + n] for a, n in spans]

    def _all_gather_bytes(self, payload: bytes | bytearray | memoryview) -> list[memoryview]:
        return self._gather_start(payload, False)()

    def _gather_start(self, payload: bytes | bytearray | memoryview, async_op: bool,
                      known: Optional[Sequence[int]] = None) -> Callable[[], list[memoryview]]:
        """Exchange the sizes (unless ``known``), start the all-gather of the payloads (left in flight with
        ``async_op``); the callable returned waits for it and returns the views of every worker's payload."""
        if known is not None:
            lengths = list(known)
        else:
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
            self._run("all_gather(sizes)", dist.all_gather, sizes, size,
                      group=self._g("sizes_group" if async_op else "group"))
            lengths = [int(n) for n in torch.cat(sizes).tolist()]
        width = max(lengths)
        if len(payload) == width and self.device.type == "cpu":
            mine = self._bytes_tensor(payload) if width else torch.zeros(0, dtype=torch.uint8)
        else:  # padded to the longest payload (and moved to the device)
            mine, _ = self._buffer(width)
            if len(payload):
                mine[:len(payload)] = self._bytes_tensor(payload)
            mine[len(payload):] = 0
        recv, buf = self._buffer(self.world_size * width)
        work = self._run("all_gather(payload)", dist.all_gather, list(recv.view(self.world_size, width)), mine,
                         group=self._g(), async_op=async_op)
        spans = [(i * width, n) for i, n in enumerate(lengths)]
        return self._finisher("all_gather(payload)", work, recv, spans, buf, mine)

    def _finisher(self, what: str, work: Any, recv: torch.Tensor, spans: list[tuple[int, int]],
                  buf: Optional[memoryview], sent: torch.Tensor) -> Callable[[], list[memoryview]]:
        """The callable that waits for ``work`` (None: done already) and returns the views of ``recv`` at
        ``spans``; it holds the tensor sent until then (its buffer must not be reused while it is on the wire)."""
        held = [sent]

        def finish() -> list[memoryview]:
            if work is not None:
                self._run(what, work.wait)
            held.clear()
            return self._host_views(recv, spans, buf)
        return finish

    def _start_all_gather_bytes(self, payload: bytes | bytearray | memoryview, sizes: Optional[Sequence[int]] = None,
                                bound: Optional[PayloadBound] = None) -> Callable[[], list[memoryview]]:
        return self._gather_start(payload, self.caps.overlaps_exchange, sizes if self.caps.settings_agreed else None)

    def _start_all_to_all_bytes(self, payloads: Sequence[bytes | bytearray | memoryview],
                                sizes: Optional[Sequence[int]] = None) -> Callable[[], list[memoryview]]:
        return self._all_to_all_start(payloads, self.caps.overlaps_exchange,
                                      sizes if self.caps.settings_agreed else None)

    def _all_gather_tensor(self, t: torch.Tensor) -> list[torch.Tensor]:
        if t.numel() not in self._gather_sizes:  # once per size: every rank must bring one of the same size
            sizes = self.all_gather_object(t.numel())
            if len(set(sizes)) > 1:
                raise TransportError(f"rank {self.global_rank}: the workers' payloads differ in size "
                                     f"({', '.join(map(str, sizes))} bytes by rank): do they train the same model "
                                     "with the same settings?")
            self._gather_sizes.add(t.numel())
        work = self._reachable(t.contiguous())
        out = list(torch.empty((self.world_size, t.numel()), dtype=t.dtype, device=work.device).unbind(0))
        self._run("all_gather(tensor)", dist.all_gather, out, work, group=self._g())
        return out if work.device == t.device else [x.to(t.device) for x in out]

    def _all_to_all_bytes(self, payloads: Sequence[bytes | bytearray | memoryview]) -> list[memoryview]:
        return self._all_to_all_start(payloads, False)()

    def _all_to_all_start(self, payloads: Sequence[bytes | bytearray | memoryview], async_op: bool,
                          known: Optional[Sequence[int]] = None) -> Callable[[], list[memoryview]]:
        """Exchange the sizes (unless ``known``: what each worker sends this one), start the all-to-all of the
        payloads (left in flight with ``async_op``); the callable returned waits for it and returns the views of
        what each worker sent this one."""
        send_n = [len(p) for p in payloads]
        if known is not None:
            recv_n = list(known)
        else:
            send_sizes = torch.tensor(send_n, dtype=torch.int64, device=self.device)
            recv_sizes = torch.empty_like(send_sizes)
            self._run("all_to_all(sizes)", dist.all_to_all_single, recv_sizes, send_sizes,
                      group=self._g("sizes_group" if async_op else "group"))
            recv_n = recv_sizes.tolist()
        send, _ = self._buffer(sum(send_n), host=True)
        pos = 0
        for p, n in zip(payloads, send_n):  # each payload copied once, into its place
            if n:
                send[pos:pos + n] = self._bytes_tensor(p)
            pos += n
        send = send.to(self.device)
        recv, buf = self._buffer(sum(recv_n))
        work = self._run("all_to_all(payload)", dist.all_to_all_single, recv, send,
                         output_split_sizes=recv_n, input_split_sizes=send_n, group=self._g(), async_op=async_op)
        starts = [sum(recv_n[:i]) for i in range(len(recv_n))]
        return self._finisher("all_to_all(payload)", work, recv, list(zip(starts, recv_n)), buf, send)

    def barrier(self) -> None:
        self._run("barrier", dist.barrier, group=self._g())

    def abort(self) -> None:
        """After a failure: no wait for the exchange in flight, no barrier, no teardown of groups another
        thread may still be blocked in; the process ends with its own error, and torchrun stops the rest."""
        self._drain(wait=False)
        self._owns_group = False

    def close(self) -> None:
        self._drain()
        if self._owns_group and dist.is_initialized():
            if self.backend == "gloo":
                try:  # nobody tears the group down while another rank still has traffic in flight
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
                except Exception:
                    pass  # a rank gone or stuck: destroy what is left here all the same
            dist.destroy_process_group()
            self._owns_group = False
