"""A peer's state for new and out-of-step peers: served on request, downloaded, compared by sketches.

A serving peer cuts its state into stripes and publishes a manifest with it: the stripe size and the SHA-256 of
every stripe. The state's SHA-256 is the manifest's, and it is what the run key's MAC signs.

A download is striped over the peers that hold the newest state: the first stripe, from the first peer that
answers (asked of one holder at a time, and of the next as well after :data:`HEDGE_S` without an answer), fixes
the epoch, the size and the manifest of the state; then every such peer takes the next missing
stripe as soon as it has sent its last one (a fast peer sends more of them), and a peer that fails or serves
another state or a stripe that does not match the manifest is dropped, its stripe fetched again from the
others. A stripe is asked of a second peer only when its first one is far slower than the rest (:data:`HEDGE_S`;
a holder that hangs or a link that stalls), and the first answer counts: a stopped or cut-off holder delays a
download by seconds, not by its timeout. When every holder fails part-way, the stripes received are kept: the
next download of the same state (the holders' newest still) fetches only the rest. A serving peer keeps the
snapshot a download began from (:data:`PINNED_S` after its last request) even after it publishes a newer one,
so a download that spans several rounds still finishes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from diloco.comm.hivemind.auth import mac
from diloco.comm.hivemind.framing import (STATE_CEILING_S, _now, _read_framed, _write_framed, log, pack,
                                          state_timeout, unpack)


# how long a peer asked for a state of a newer epoch than it holds waits for that epoch before refusing (a peer
# that resyncs right after a round asks before the others have published it); the asker waits as long, and more
STATE_WAIT_S = 30.0
STRIPE_BYTES = 16 << 20  # a download asks each peer for this much at a time (larger for a state of 1024+ stripes)
MAX_STRIPES = 1024  # the manifest (32 bytes a stripe) fits a reply's header
PINNED_S = 120.0  # a replaced snapshot stays served this long after the last request for it
HEDGE_S = 2.0  # a stripe out this long (and 4x the typical stripe's time) is asked of an idle peer as well


class StateMixin:
    """State serving and download of :class:`~diloco.comm.hivemind.HivemindTransport`."""

    def state_timeout(self, nbytes: int) -> float:
        """How long a download of a ``nbytes`` state may take: from this peer's measured exchange rate, or an
        assumed slow link before it has one (:func:`~diloco.comm.hivemind.framing.state_timeout`). The size is
        read from the reply's header, before its body: a 4 GB state is given the time 4 GB needs."""
        return state_timeout(nbytes, self.rate.median())

    def publish_state(self, blob: Union[bytes, Callable[[], bytes]]) -> None:
        """Serve ``blob`` (this peer's state after its latest epoch) to peers that ask for it: its bytes, or a
        function that makes them, called (on a thread of its own) only when a peer first asks for this state."""
        old = self._snapshot
        if callable(blob):
            self._snapshot = _Later(self.epoch, blob)
        else:
            man = manifest(blob)
            self._snapshot = (self.epoch, blob, hashlib.sha256(man).digest(), man)
        old = old.made if isinstance(old, _Later) else old  # one that was never asked for is dropped
        current = self._snapshot[2] if isinstance(self._snapshot, tuple) else None
        pinned = self._pinned
        now = time.monotonic()
        if old is not None and old[2] in pinned:  # a download of the old one is under way: keep serving it
            pinned[old[2]] = (*old, pinned[old[2]][4])
        for sha, entry in list(pinned.items()):  # a copy: the event loop's thread adds to it meanwhile
            if now - entry[4] > PINNED_S or sha == current:
                pinned.pop(sha, None)

    def _served(self, want: int, sha: Optional[bytes]) -> Optional[tuple[int, bytes, bytes, bytes]]:
        """The snapshot a request asks for: the one whose SHA-256 it names (pinned while it is asked for), or the
        current one when it names none and is of epoch ``want`` or newer. A current one published as a function
        is made on the first such request; until it is, this says None (the request waits, as for an epoch)."""
        snap = self._snapshot
        if isinstance(snap, _Later):
            if snap.made is None and sha is None and snap.epoch >= want:
                snap.start()
            snap = snap.made
        pinned = self._pinned
        if sha is not None:
            if snap is not None and snap[2] == sha:
                pinned[sha] = (*snap, time.monotonic())
                return snap
            entry = pinned.get(sha)  # one lookup: publish_state may drop it from the training thread
            if entry is not None:
                pinned[sha] = (*entry[:4], time.monotonic())
                return entry[:4]
            return None
        if snap is not None and snap[0] >= want:
            pinned[snap[2]] = (*snap, time.monotonic())
            return snap
        return None

    async def _on_state_request(self, info, reader, writer) -> None:
        sender = info.peer_id
        try:
            header, body = await _read_framed(reader, 1 << 10, 10)
            if not hmac.compare_digest(header.get("m", b""), mac(self.key, b"state", sender.to_bytes(),
                                                                  self.peer_id.to_bytes(), body)):
                raise PermissionError("bad MAC (no or another run key)")
            request = unpack(body)
            want, asked = int(request["min_epoch"]), request.get("sha")
            end = time.perf_counter() + STATE_WAIT_S
            while (served := self._served(want, asked)) is None and asked is None and time.perf_counter() < end:
                await asyncio.sleep(0.1)
            if served is None:
                raise TimeoutError(f"no state of epoch >= {want} here" if asked is None else
                                   "the state asked for is no longer here")
            epoch, blob, sha, man = served
            stripe, start = int.from_bytes(man[:8], "big"), int(request.get("off", 0))
            if not (0 <= start < max(len(blob), 1) and start % stripe == 0):
                raise ValueError(f"a stripe at {start} of a {len(blob)}-byte state in stripes of {stripe}")
            piece = await self._phase("state", memoryview(blob)[start:start + stripe])
            reply = {"e": epoch, "n": len(piece), "total": len(blob), "off": start, "sha": sha,
                     "m": mac(self.key, b"state-reply", self.peer_id.to_bytes(), sender.to_bytes(),
                              str(epoch).encode(), sha)}
            if start == 0:  # the first stripe brings the manifest (its SHA-256 is the signed one)
                reply["man"] = man
            await _write_framed(writer, reply, piece)
            # the reader closes when it has it all: over a slow link, long after the last byte left this peer
            await asyncio.wait_for(reader.read(1), self.state_timeout(len(piece)))
        except Exception as e:
            log.info("peer %s: state request from %s failed: %s: %s", self.me[-8:], sender.to_base58()[-8:],
                     type(e).__name__, e)
        finally:
            writer.close()

    async def _fetch_state(self, peer, min_epoch: int, off: int = 0,
                           sha: Optional[bytes] = None) -> tuple[int, bytes, int, bytes, Optional[bytes]]:
        """The stripe at ``off`` of ``peer``'s state: (epoch, SHA-256 of the state, its size, the stripe's bytes,
        the manifest (with the first stripe; else None)). ``sha``: the state wanted (a stripe of another one is
        refused by the peer); else its newest, if of epoch ``min_epoch`` or later. The reply's MAC (run key)
        covers the epoch and the hash, and the hash covers the manifest."""
        body = pack({"min_epoch": min_epoch, "off": off, "sha": sha})
        head = {"n": len(body), "m": mac(self.key, b"state", self.peer_id.to_bytes(), peer.to_bytes(), body)}
        _, reader, writer = await asyncio.wait_for(self.p2p.call_binary_stream_handler(peer, f"{self.run}.state"), 10)
        try:
            await _write_framed(writer, head, body)
            # the reply's header may come only once the peer has the epoch asked for: up to STATE_WAIT_S
            largest = self.max_state_bytes or self.max_payload_bytes
            header, piece = await _read_framed(reader, largest, self.state_timeout,
                                               header_timeout=STATE_WAIT_S + 10)
            epoch, total, digest = int(header["e"]), int(header.get("total", len(piece))), header["sha"]
            if not hmac.compare_digest(header["m"], mac(self.key, b"state-reply", peer.to_bytes(),
                                                        self.peer_id.to_bytes(), str(epoch).encode(), digest)):
                raise PermissionError("the state's MAC does not check (no or another run key)")
            if int(header.get("off", 0)) != off or total > largest:
                raise ValueError(f"a stripe at {header.get('off', 0)} of a state of {total} bytes (at most {largest} "
                                 f"taken), asked for one at {off}")
            man = header.get("man")
            if off == 0 and not (isinstance(man, bytes) and hashlib.sha256(man).digest() == digest):
                raise ValueError("the state's manifest does not match its signed hash")
            return epoch, digest, total, piece, man
        finally:
            writer.close()

    async def _striped(self, peers: Sequence[Any], min_epoch: int) -> Optional[tuple[int, bytearray]]:
        """The state, in stripes from every peer of ``peers`` that holds it (see the module's docstring)."""
        began = time.perf_counter()
        got = await self._first_stripe(peers, min_epoch)
        if got is None:
            return None
        i, first, stripe, hashes, failed = got
        peers = [peers[i]] + [p for j, p in enumerate(peers) if j != i and j not in failed]  # the sender first
        epoch, sha, total, head, _ = first
        kept, self._partial = self._partial, None
        if kept is not None and kept[0] == sha:  # a download of this same state failed part-way: go on from it
            blob, done = kept[1], kept[2]
        else:
            blob, done = bytearray(total), set()  # the stripes land in place: one copy of the state in memory
        resumed = len(done)
        blob[:len(head)] = head
        stripes = len(range(stripe, total, stripe))
        todo = [off for off in range(stripe, total, stripe) if off not in done][::-1]  # offsets, the next one last
        flying: dict = {}  # offset -> [when its first request went out, how many requests are out]
        took = [time.perf_counter() - began]  # seconds each stripe took
        served = {peers[0].to_base58(): len(head)}

        def overdue() -> Optional[int]:
            """A stripe asked of one peer long ago (a holder that hangs, a link that stalls): an idle peer asks
            for it too, and the first answer counts."""
            now, typical = time.perf_counter(), sorted(took)[len(took) // 2]
            late = [(t0, off) for off, (t0, n) in flying.items() if n == 1 and now - t0 > max(HEDGE_S, 4 * typical)]
            return min(late)[1] if late else None

        async def pull(peer) -> None:
            name = peer.to_base58()
            while len(done) < stripes:
                off = todo.pop() if todo else overdue()
                if off is None:  # the rest is in flight: take a stripe over if its peer fails or hangs
                    await asyncio.sleep(0.05)
                    continue
                out = flying.setdefault(off, [time.perf_counter(), 0])
                out[1] += 1
                t0 = time.perf_counter()
                try:
                    got = await self._fetch_state(peer, epoch, off, sha)
                    if got[:3] != (epoch, sha, total):
                        raise ValueError(f"serves another state (epoch {got[0]}, {got[2]} bytes)")
                    _check_stripe(got[3], off, stripe, hashes, total)
                    took.append(time.perf_counter() - t0)
                    if off not in done:
                        blob[off:off + len(got[3])] = got[3]
                        served[name] = served.get(name, 0) + len(got[3])
                        done.add(off)
                except Exception as e:
                    if off not in done and out[1] == 1:
                        todo.append(off)  # another peer fetches it
                    self._failed_download(peer, e)
                    return
                finally:
                    out[1] -= 1
                    if not out[1]:
                        flying.pop(off, None)

        tasks = [asyncio.ensure_future(pull(p)) for p in peers]
        while len(done) < stripes and not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.2)
        for t in tasks:  # a request still out to a hung peer is given up: its stripe came from another
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if len(done) < stripes:
            self._partial = (sha, blob, done)
            log.warning("peer %s: every peer that held the state failed before the download finished; %d of %d "
                        "stripes are kept for the next try", self.me[-8:], len(done) + 1, stripes + 1)
            return None
        if resumed:
            log.info("peer %s: the download went on from %d stripes an earlier try left", self.me[-8:], resumed)
        # every stripe matched the manifest, whose hash the serving peers signed: the state is theirs
        self.state_sources = served
        if len(served) > 1:
            log.info("peer %s: downloaded the state (%d bytes) from %d peers: %s", self.me[-8:], total, len(served),
                     ", ".join(f"{k[-8:]} {v} bytes" for k, v in served.items()))
        return epoch, blob

    async def _first_stripe(self, peers: Sequence[Any], min_epoch: int) -> Optional[tuple[int, tuple, int, bytes, set]]:
        """The first stripe of the newest state ``peers`` hold: (index of the peer that sent it, the reply, the
        stripe size, the stripes' hashes, the indices of the peers that failed), or None when none sends one.
        Asked of one peer at a time, and of the next as well while one is out longer than :data:`HEDGE_S` (a
        holder that hangs would otherwise cost its timeout: 10 s to open a stream, more for a reply); the first
        good answer counts."""
        async def one(peer):
            reply = await self._fetch_state(peer, min_epoch, 0)
            stripe, hashes = _check_manifest(reply[4], reply[2])
            _check_stripe(reply[3], 0, stripe, hashes, reply[2])
            return reply, stripe, hashes

        failed: set[int] = set()
        out: dict = {}  # task -> index of its peer
        nxt = 0
        try:
            while out or nxt < len(peers):
                if nxt < len(peers):
                    out[asyncio.ensure_future(one(peers[nxt]))] = nxt
                    nxt += 1
                done, _ = await asyncio.wait(out, timeout=HEDGE_S if nxt < len(peers) else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = out.pop(task)
                    try:
                        reply, stripe, hashes = task.result()
                    except Exception as e:
                        failed.add(i)
                        self._failed_download(peers[i], e)
                        continue
                    return i, reply, stripe, hashes, failed
            return None
        finally:
            for task in out:  # asked of a slower peer as well: its answer is not needed
                task.cancel()
            await asyncio.gather(*out, return_exceptions=True)

    @property
    def resumable(self) -> bool:
        """Whether a download failed part-way and the next one of the same state goes on from its stripes."""
        return self._partial is not None

    def _failed_download(self, peer, e: Exception) -> None:
        log.warning("peer %s: could not download the state from %s: %s: %s", self.me[-8:], peer.to_base58()[-8:],
                    type(e).__name__, e)

    def download_state(self, peers: Sequence[Any] = (),
                       min_epoch: Optional[int] = None) -> Optional[tuple[int, bytearray]]:
        """The newest state other peers serve: (epoch, blob), or None when no peer has one; striped over every
        peer that holds it.

        ``peers``: PeerIDs to ask (default: the registry's peers, highest epoch first; those that announce this
        peer's settings only, where there are any: a state of other settings would be refused).
        """
        from hivemind.p2p import PeerID

        if not peers:
            live = {pid: v for pid, v in self.peers().items() if pid != self.me}
            if not live:
                return None
            alike = {pid: v for pid, v in live.items() if self._alike(v)}
            live = alike or live  # none alike: the state comes, and the caller refuses it naming what differs
            order = sorted(live, key=lambda pid: -int(live[pid].get("epoch", 0)))
            peers = [PeerID.from_base58(pid) for pid in order]
            min_epoch = int(live[order[0]].get("epoch", 0)) if min_epoch is None else min_epoch
        # the registry says this peer is downloading: peers reaching the next epoch first wait for it (within
        # their cap) rather than for an arrival time that did not count the download
        self.phase = "resync"
        self.announce()
        # each stripe's own timeout (state_timeout of its size) bounds the download; this only catches a hang
        # elsewhere (opening a stream: 10 s; a header: STATE_WAIT_S + 10 s)
        try:
            return self._call(self._striped(list(peers), min_epoch or 0), STATE_CEILING_S + 60)
        except Exception as e:
            log.warning("peer %s: the state download failed: %s: %s", self.me[-8:], type(e).__name__, e)
            return None
        finally:  # its round starts now
            self._round_start = time.perf_counter()
            self.phase, self.eta = "train", (_now() + self.round_s if self.round_s else None)
            self.announce()


class _Later:
    """A state published as a function that makes its bytes (:meth:`StateMixin.publish_state`): made, with its
    manifest, on a thread of its own when :meth:`start` is first called; ``made`` is then the snapshot tuple."""

    def __init__(self, epoch: int, make: Callable[[], bytes]) -> None:
        self.epoch, self._make = epoch, make
        self.made: Optional[tuple[int, bytes, bytes, bytes]] = None
        self._started = threading.Lock()

    def start(self) -> None:
        if self._started.acquire(blocking=False):
            threading.Thread(target=self._run, name="loco-state", daemon=True).start()

    def _run(self) -> None:
        try:
            blob = self._make()
            man = manifest(blob)
            self.made = (self.epoch, blob, hashlib.sha256(man).digest(), man)
        except Exception as e:  # the requests wait and give up; training is not this thread's to stop
            log.warning("the state of epoch %d could not be made for a peer that asked: %s: %s", self.epoch,
                        type(e).__name__, e)
        finally:
            self._make = None  # what it held (a copy of the state) is no longer needed


def manifest(blob: bytes) -> bytes:
    """A state's manifest: its stripe size (u64) and the SHA-256 of each stripe. Stripes are ``STRIPE_BYTES``,
    or larger for a state that would have more than ``MAX_STRIPES`` of them."""
    mib = 1 << 20
    per = -(-len(blob) // MAX_STRIPES)
    stripe = STRIPE_BYTES if per <= STRIPE_BYTES else -(-per // mib) * mib
    view = memoryview(blob)
    return stripe.to_bytes(8, "big") + b"".join(hashlib.sha256(view[o:o + stripe]).digest()
                                                for o in range(0, max(len(view), 1), stripe))


def _check_manifest(man: bytes, total: int) -> tuple[int, bytes]:
    """(stripe size, the stripes' hashes) of a manifest whose own hash was checked, if it describes a state of
    ``total`` bytes."""
    stripe = int.from_bytes(man[:8], "big")
    if stripe <= 0 or len(man) - 8 != 32 * max(1, -(-total // stripe)):
        raise ValueError(f"a manifest of {len(man)} bytes for a {total}-byte state in stripes of {stripe}")
    return stripe, man[8:]


def _check_stripe(piece: bytes, off: int, stripe: int, hashes: bytes, total: int) -> None:
    k = off // stripe
    if len(piece) != min(stripe, total - off) or hashlib.sha256(piece).digest() != hashes[32 * k:32 * k + 32]:
        raise ValueError(f"the stripe at {off} ({len(piece)} bytes) does not match the state's manifest")


def fingerprint(tensors: Sequence[torch.Tensor], per_tensor: int = 8) -> bytes:
    """A sketch of a list of tensors: ``per_tensor`` evenly spaced values of each, as float32 bytes.

    The positions are worked out in float64 on the tensor's device: in float32 the last one of a tensor of more
    than 2^24 values could round past its end. The samples of the tensors on one device are read back together
    (one wait for a GPU, not two per tensor)."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        n = flat.numel()
        idx = torch.linspace(0, max(n - 1, 0), min(per_tensor, n), dtype=torch.float64, device=flat.device)
        by_device.setdefault(flat.device, []).append((i, flat[idx.round().long().clamp_(max=max(n - 1, 0))]))
    parts: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for samples in by_device.values():
        values = torch.cat([x.float() for _, x in samples]).cpu()
        for (i, _), piece in zip(samples, values.split([x.numel() for _, x in samples])):
            parts[i] = piece
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
