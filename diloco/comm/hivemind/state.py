"""A peer's state for new and out-of-step peers: served on request, downloaded, compared by sketches."""

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


class StateMixin:
    """State serving and download of :class:`~diloco.comm.hivemind.HivemindTransport`."""

    def state_timeout(self, nbytes: int) -> float:
        """How long a download of a ``nbytes`` state may take: from this peer's measured exchange rate, or an
        assumed slow link before it has one (:func:`~diloco.comm.hivemind.framing.state_timeout`). The size is
        read from the reply's header, before its body: a 4 GB state is given the time 4 GB needs."""
        return state_timeout(nbytes, self.rate.median())

    def publish_state(self, blob: bytes) -> None:
        """Serve ``blob`` (this peer's state after its latest epoch) to peers that ask for it."""
        self._snapshot = (self.epoch, blob, hashlib.sha256(blob).digest())

    async def _on_state_request(self, info, reader, writer) -> None:
        from hivemind.utils.serializer import MSGPackSerializer

        sender = info.peer_id
        try:
            header, body = await _read_framed(reader, 1 << 10, 10)
            if not hmac.compare_digest(header.get("m", b""), mac(self.key, b"state", sender.to_bytes(),
                                                                  self.peer_id.to_bytes(), body)):
                raise PermissionError("bad MAC (no or another run key)")
            want = int(MSGPackSerializer.loads(body)["min_epoch"])
            end = time.perf_counter() + STATE_WAIT_S
            while (self._snapshot is None or self._snapshot[0] < want) and time.perf_counter() < end:
                await asyncio.sleep(0.1)
            if self._snapshot is None or self._snapshot[0] < want:
                raise TimeoutError(f"no state of epoch >= {want} here")
            epoch, blob, sha = self._snapshot
            await _write_framed(writer, {"e": epoch, "n": len(blob), "sha": sha, "m": mac(
                self.key, b"state-reply", self.peer_id.to_bytes(), sender.to_bytes(), str(epoch).encode(), sha)}, blob)
            # the reader closes when it has it all: over a slow link, long after the last byte left this peer
            await asyncio.wait_for(reader.read(1), self.state_timeout(len(blob)))
        except Exception as e:
            log.info("peer %s: state request from %s failed: %s: %s", self.me[-8:], sender.to_base58()[-8:],
                     type(e).__name__, e)
        finally:
            writer.close()

    async def _fetch_state(self, peer, min_epoch: int) -> tuple[int, bytes]:
        from hivemind.utils.serializer import MSGPackSerializer

        body = MSGPackSerializer.dumps({"min_epoch": min_epoch})
        head = {"n": len(body), "m": mac(self.key, b"state", self.peer_id.to_bytes(), peer.to_bytes(), body)}
        _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(peer, f"{self.run}.state"), 10)
        try:
            await _write_framed(writer, head, body)
            # the reply's header may come only once the peer has the epoch asked for: up to STATE_WAIT_S
            header, blob = await _read_framed(reader, self.max_payload_bytes, self.state_timeout,
                                              header_timeout=STATE_WAIT_S + 10)
            sha = hashlib.sha256(blob).digest()
            if sha != header["sha"] or not hmac.compare_digest(header["m"], mac(
                    self.key, b"state-reply", peer.to_bytes(), self.peer_id.to_bytes(), str(header["e"]).encode(), sha)):
                raise PermissionError("state failed its hash or MAC check")
            return int(header["e"]), blob
        finally:
            writer.close()

    def download_state(self, peers: Sequence[Any] = (), min_epoch: Optional[int] = None) -> Optional[tuple[int, bytes]]:
        """The newest state another peer serves: (epoch, blob), or None when no peer has one.

        ``peers``: PeerIDs to ask first (default: the registry's peers with the highest epoch).
        """
        from hivemind.p2p import PeerID

        if not peers:
            live = {pid: v for pid, v in self.peers().items() if pid != self.me}
            if not live:
                return None
            order = sorted(live, key=lambda pid: -int(live[pid].get("epoch", 0)))
            peers = [PeerID.from_base58(pid) for pid in order]
            min_epoch = int(live[order[0]].get("epoch", 0)) if min_epoch is None else min_epoch
        for peer in peers:
            try:
                # the body's own timeout (state_timeout, at most STATE_CEILING_S) bounds the download; this only
                # catches a stream that hangs elsewhere (opening it: 10 s; the header: 10 s a read)
                return self._call(self._fetch_state(peer, min_epoch or 0), STATE_CEILING_S + 60)
            except Exception as e:
                log.warning("peer %s: could not download the state from %s: %s: %s", self.me[-8:],
                            peer.to_base58()[-8:], type(e).__name__, e)
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
