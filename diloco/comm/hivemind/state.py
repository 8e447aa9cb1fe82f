"""A peer's state for new and out-of-step peers: served on request, downloaded, compared by sketches.

A download is striped over the peers that hold the newest state: the first stripe, from the first peer that
answers, fixes the epoch, the size and the SHA-256 of the state; then every such peer takes the next missing
stripe as soon as it has sent its last one (a fast peer sends more of them), and a peer that fails or serves
another state is dropped, its stripe fetched again from the others: nothing received is fetched twice. The
assembled state must match the SHA-256 that the serving peers signed (with the run key's MAC). A serving peer
keeps the snapshot a download began from (:data:`PINNED_S` after its last request) even after it publishes a
newer one, so a download that spans several rounds still finishes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Any, Optional, Sequence

import torch

from diloco.comm.hivemind.auth import mac
from diloco.comm.hivemind.framing import STATE_CEILING_S, _read_framed, _write_framed, log, state_timeout


# how long a peer asked for a state of a newer epoch than it holds waits for that epoch before refusing (a peer
# that resyncs right after a round asks before the others have published it); the asker waits as long, and more
STATE_WAIT_S = 30.0
STRIPE_BYTES = 16 << 20  # a download asks each peer for this much at a time
PINNED_S = 120.0  # a replaced snapshot stays served this long after the last request for it


class StateMixin:
    """State serving and download of :class:`~diloco.comm.hivemind.HivemindTransport`."""

    def state_timeout(self, nbytes: int) -> float:
        """How long a download of a ``nbytes`` state may take: from this peer's measured exchange rate, or an
        assumed slow link before it has one (:func:`~diloco.comm.hivemind.framing.state_timeout`). The size is
        read from the reply's header, before its body: a 4 GB state is given the time 4 GB needs."""
        return state_timeout(nbytes, self.rate.median())

    def publish_state(self, blob: bytes) -> None:
        """Serve ``blob`` (this peer's state after its latest epoch) to peers that ask for it."""
        old = self._snapshot
        self._snapshot = (self.epoch, blob, hashlib.sha256(blob).digest())
        pinned = self._pinned
        now = time.monotonic()
        if old is not None and old[2] in pinned:  # a download of the old one is under way: keep serving it
            pinned[old[2]] = (*old, pinned[old[2]][3])
        for sha, entry in list(pinned.items()):  # a copy: the event loop's thread adds to it meanwhile
            if now - entry[3] > PINNED_S or sha == self._snapshot[2]:
                pinned.pop(sha, None)

    def _served(self, want: int, sha: Optional[bytes]) -> Optional[tuple[int, bytes, bytes]]:
        """The snapshot a request asks for: the one whose SHA-256 it names (pinned while it is asked for), or the
        current one when it names none and is of epoch ``want`` or newer."""
        snap = self._snapshot
        pinned = self._pinned
        if sha is not None:
            if snap is not None and snap[2] == sha:
                pinned[sha] = (*snap, time.monotonic())
                return snap
            entry = pinned.get(sha)  # one lookup: publish_state may drop it from the training thread
            if entry is not None:
                pinned[sha] = (*entry[:3], time.monotonic())
                return entry[:3]
            return None
        if snap is not None and snap[0] >= want:
            pinned[snap[2]] = (*snap, time.monotonic())
            return snap
        return None

    async def _on_state_request(self, info, reader, writer) -> None:
        from hivemind.utils.serializer import MSGPackSerializer

        sender = info.peer_id
        try:
            header, body = await _read_framed(reader, 1 << 10, 10)
            if not hmac.compare_digest(header.get("m", b""), mac(self.key, b"state", sender.to_bytes(),
                                                                  self.peer_id.to_bytes(), body)):
                raise PermissionError("bad MAC (no or another run key)")
            request = MSGPackSerializer.loads(body)
            want, asked = int(request["min_epoch"]), request.get("sha")
            end = time.perf_counter() + STATE_WAIT_S
            while (served := self._served(want, asked)) is None and asked is None and time.perf_counter() < end:
                await asyncio.sleep(0.1)
            if served is None:
                raise TimeoutError(f"no state of epoch >= {want} here" if asked is None else
                                   "the state asked for is no longer here")
            epoch, blob, sha = served
            start = int(request.get("off", 0))
            stop = len(blob) if request.get("len") is None else min(len(blob), start + int(request["len"]))
            if not 0 <= start <= stop:
                raise ValueError(f"a stripe at {start} of a {len(blob)}-byte state")
            piece = memoryview(blob)[start:stop]
            await _write_framed(writer, {"e": epoch, "n": len(piece), "total": len(blob), "off": start, "sha": sha,
                                         "m": mac(self.key, b"state-reply", self.peer_id.to_bytes(), sender.to_bytes(),
                                                  str(epoch).encode(), sha)}, piece)
            # the reader closes when it has it all: over a slow link, long after the last byte left this peer
            await asyncio.wait_for(reader.read(1), self.state_timeout(len(piece)))
        except Exception as e:
            log.info("peer %s: state request from %s failed: %s: %s", self.me[-8:], sender.to_base58()[-8:],
                     type(e).__name__, e)
        finally:
            writer.close()

    async def _fetch_state(self, peer, min_epoch: int, off: int = 0, length: Optional[int] = None,
                           sha: Optional[bytes] = None) -> tuple[int, bytes, int, bytes]:
        """One stripe of ``peer``'s state: (epoch, SHA-256 of the whole state, its size, the stripe's bytes).
        ``sha``: the state wanted (a stripe of another one is refused by the peer); else its newest, if of epoch
        ``min_epoch`` or later. The reply's MAC (run key) covers the epoch and the hash."""
        from hivemind.utils.serializer import MSGPackSerializer

        body = MSGPackSerializer.dumps({"min_epoch": min_epoch, "off": off, "len": length, "sha": sha})
        head = {"n": len(body), "m": mac(self.key, b"state", self.peer_id.to_bytes(), peer.to_bytes(), body)}
        _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(peer, f"{self.run}.state"), 10)
        try:
            await _write_framed(writer, head, body)
            # the reply's header may come only once the peer has the epoch asked for: up to STATE_WAIT_S
            header, piece = await _read_framed(reader, self.max_payload_bytes, self.state_timeout,
                                               header_timeout=STATE_WAIT_S + 10)
            epoch, total, digest = int(header["e"]), int(header.get("total", len(piece))), header["sha"]
            if not hmac.compare_digest(header["m"], mac(self.key, b"state-reply", peer.to_bytes(),
                                                        self.peer_id.to_bytes(), str(epoch).encode(), digest)):
                raise PermissionError("the state's MAC does not check (no or another run key)")
            want = min(total - off, length if length is not None else total)
            if int(header.get("off", 0)) != off or len(piece) != want or total > self.max_payload_bytes:
                raise ValueError(f"a stripe of {len(piece)} bytes at {header.get('off', 0)} of {total}, asked for "
                                 f"{want} at {off}")
            return epoch, digest, total, piece
        finally:
            writer.close()

    async def _striped(self, peers: Sequence[Any], min_epoch: int) -> Optional[tuple[int, bytearray]]:
        """The state, in stripes from every peer of ``peers`` that holds it (see the module's docstring)."""
        first = None
        for i, peer in enumerate(peers):
            try:
                first = await self._fetch_state(peer, min_epoch, 0, STRIPE_BYTES)
                break
            except Exception as e:
                self._failed_download(peer, e)
        if first is None:
            return None
        epoch, sha, total, head = first
        blob = bytearray(total)  # the stripes land in place: one copy of the state in memory
        blob[:len(head)] = head
        todo = list(range(len(head), total, STRIPE_BYTES))[::-1]  # offsets, the next one last
        busy = [0]
        served = {peers[i].to_base58(): len(head)}

        async def pull(peer) -> None:
            name = peer.to_base58()
            while todo or busy[0]:
                if not todo:  # the rest is in flight: take a stripe over if its peer fails
                    await asyncio.sleep(0.05)
                    continue
                off = todo.pop()
                busy[0] += 1
                try:
                    got = await self._fetch_state(peer, epoch, off, STRIPE_BYTES, sha)
                    if got[:3] != (epoch, sha, total):
                        raise ValueError(f"serves another state (epoch {got[0]}, {got[2]} bytes)")
                    blob[off:off + len(got[3])] = got[3]
                    served[name] = served.get(name, 0) + len(got[3])
                except Exception as e:
                    todo.append(off)  # another peer fetches it
                    self._failed_download(peer, e)
                    return
                finally:
                    busy[0] -= 1

        await asyncio.gather(*(pull(p) for p in peers[i:]))
        if todo:
            log.warning("peer %s: every peer that held the state failed before the download finished",
                        self.me[-8:])
            return None
        if hashlib.sha256(blob).digest() != sha:
            log.warning("peer %s: the state assembled from %d peers fails its hash; nothing is loaded",
                        self.me[-8:], len(served))
            return None
        self.state_sources = served
        if len(served) > 1:
            log.info("peer %s: downloaded the state (%d bytes) from %d peers: %s", self.me[-8:], total, len(served),
                     ", ".join(f"{k[-8:]} {v} bytes" for k, v in served.items()))
        return epoch, blob

    def _failed_download(self, peer, e: Exception) -> None:
        log.warning("peer %s: could not download the state from %s: %s: %s", self.me[-8:], peer.to_base58()[-8:],
                    type(e).__name__, e)

    def download_state(self, peers: Sequence[Any] = (),
                       min_epoch: Optional[int] = None) -> Optional[tuple[int, bytearray]]:
        """The newest state other peers serve: (epoch, blob), or None when no peer has one; striped over every
        peer that holds it.

        ``peers``: PeerIDs to ask (default: the registry's peers, highest epoch first).
        """
        from hivemind.p2p import PeerID

        if not peers:
            live = {pid: v for pid, v in self.peers().items() if pid != self.me}
            if not live:
                return None
            order = sorted(live, key=lambda pid: -int(live[pid].get("epoch", 0)))
            peers = [PeerID.from_base58(pid) for pid in order]
            min_epoch = int(live[order[0]].get("epoch", 0)) if min_epoch is None else min_epoch
        # each stripe's own timeout (state_timeout of its size) bounds the download; this only catches a hang
        # elsewhere (opening a stream: 10 s; a header: STATE_WAIT_S + 10 s)
        try:
            return self._call(self._striped(list(peers), min_epoch or 0), STATE_CEILING_S + 60)
        except Exception as e:
            log.warning("peer %s: the state download failed: %s: %s", self.me[-8:], type(e).__name__, e)
            return None


def fingerprint(tensors: Sequence[torch.Tensor], per_tensor: int = 8) -> bytes:
    """A sketch of a list of tensors: ``per_tensor`` evenly spaced values of each, as float32 bytes."""
    parts = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        idx = torch.linspace(0, max(flat.numel() - 1, 0), min(per_tensor, flat.numel())).round().long()
        parts.append(flat[idx.to(flat.device)].float().cpu())
    return torch.cat(parts).numpy().tobytes() if parts else b""


def same_state(a: bytes, b: bytes, rtol: float = 1e-4) -> bool:
    """Whether two sketches describe the same state up to float rounding (relative ``rtol``)."""
    if len(a) != len(b) or len(a) % 4:
        return False
    if a == b:
        return True
    x = torch.frombuffer(bytearray(a), dtype=torch.float32)
    y = torch.frombuffer(bytearray(b), dtype=torch.float32)
    return bool(((x - y).abs() <= rtol * torch.maximum(x.abs(), y.abs()) + 1e-12).all())
