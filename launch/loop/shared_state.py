"""The state a worker shares, as bytes: what a joining worker downloads (``loco join``, and a simulated worker
that comes back), and the host copies a checkpoint is gathered from.

One owner for the shared state's bytes: :func:`shared_blob` / :func:`shared_later` make them from an
algorithm's :meth:`~diloco.Algorithm.shared_state`, :func:`load_shared_blob` takes them whole or not at all.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterator, Optional, Union

import torch

from diloco import Algorithm
from launch.errors import RunError


def host_copy(obj: Any, later: bool = False) -> Any:
    """A copy of the tensors in a state, in host memory (another worker keeps training while rank 0 writes it;
    a simulator's workers would otherwise all hold a second copy of their state on the GPU at once).

    ``later``: a GPU tensor's copy goes into pinned memory without waiting for it (the device copies it in the
    stream's order, before any later change to the tensor); the caller waits for the stream before reading."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if later and t.device.type == "cuda":
            try:
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError:  # page-locked memory refused (a container's limit): a plain copy, waited for
                return t.to("cpu", copy=True)
            return out.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v, later) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v, later) for v in obj)
    return obj


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a state (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def saved_bytes(state: dict[str, Any]) -> bytes:
    """``state`` as the bytes of ``torch.save``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()  # the buffer itself, not a copy


class BufferReader(io.RawIOBase):
    """A read-only file over a ``bytes``/``bytearray``/memoryview, without copying it: ``torch.load`` reads each
    tensor straight into its storage. ``io.BytesIO`` would copy a ``bytearray`` (a downloaded state is one)
    whole first: one more copy of the state in host memory at a join."""

    def __init__(self, data: Union[bytes, bytearray, memoryview]) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError(f"seek to {base + offset}, before the start")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        try:
            self._view.release()  # the caller's buffer may be resized again
        except BufferError:  # a slice still held somewhere: it goes with its last reference
            pass
        super().close()


def shared_blob(algo: Algorithm, **extra: Any) -> bytes:
    """What every worker shares (:meth:`Algorithm.shared_state`) and ``extra``, as the bytes a joining worker
    downloads."""
    return saved_bytes({**extra, **algo.shared_state()})


def shared_later(algo: Algorithm, **extra: Any) -> Callable[[], bytes]:
    """:func:`shared_blob` as a function that makes those bytes when called: the state is copied to host memory
    now (training goes on without touching the copy), and serialized only if someone asks. A ``loco join`` peer
    publishes its state after every round, and in most rounds no peer downloads it, so serializing and hashing
    it each time would cost the training thread for nothing. On a GPU the copy goes into pinned memory without
    the training thread waiting for it; the function waits for it first."""
    live = {**extra, **algo.shared_state()}
    device = next((t.device for t in tensors_in(live) if t.device.type == "cuda"), None)
    state = host_copy(live, later=device is not None)
    if device is None:
        return lambda: saved_bytes(state)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))

    def made() -> bytes:
        copied.synchronize()  # on the thread that serializes, when a peer first asks
        return saved_bytes(state)
    return made


def load_shared_blob(algo: Algorithm, blob: Union[bytes, bytearray, memoryview], source: str = "a peer",
                     check: Optional[Callable[[dict[str, Any]], None]] = None) -> dict[str, Any]:
    """Take a :func:`shared_blob` into ``algo``; ``check(state)`` may refuse it with a RunError first. Returns it.
    A state that does not load, does not fit this model, or holds NaN or infinite values is refused whole
    (RunError naming ``source`` and what is wrong), and the algorithm's state stays as it was."""
    try:
        with BufferReader(blob) as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RunError(f"the state from {source} does not load: {e}") from None
    if not isinstance(state, dict):
        raise RunError(f"the state from {source} is a {type(state).__name__}, not a run's state")
    if check is not None:
        check(state)
    try:  # checked whole first: a refused state leaves this one as it was
        algo.load_shared_state(state)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise RunError(f"the state from {source} does not fit this model: {e}") from None
    return state
