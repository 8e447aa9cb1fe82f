"""A peer's state for new and out-of-step peers: served on request, downloaded in stripes.

A serving peer cuts its state into stripes and publishes a manifest with it: the stripe size and the SHA-256 of
every stripe. The state's SHA-256 is the manifest's, and it is what the run key's MAC signs.

A download is striped over the peers that hold the newest state: the first stripe, from the first peer that
answers (asked of one holder at a time, and of the next as well after :data:`HEDGE_S` without an answer), fixes
the round, the size and the manifest of the state; then every such peer takes the next missing
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

from diloco.comm.hivemind.auth import mac
from diloco.comm.hivemind.deadlines import Deadlines
from diloco.comm.hivemind.framing import read_framed, write_framed, log, pack, unpack
from diloco.comm.hivemind.node import Node

# how long a peer asked for a state of a newer round than it holds waits for that round before refusing (a peer
# that resyncs right after a round asks before the others have published it); the asker waits as long, and more
STATE_WAIT_S = 30.0
STRIPE_BYTES = 16 << 20  # a download asks each peer for this much at a time (larger for a state of 1024+ stripes)
MAX_STRIPES = 1024  # the manifest (32 bytes a stripe) fits a reply's header
PINNED_S = 120.0  # a replaced snapshot stays served this long after the last request for it
HEDGE_S = 2.0  # a stripe out this long (and 4x the typical stripe's time) is asked of an idle peer as well


class StateService:
    """This peer's side of the run's state (see the module's docstring).

    ``snapshot``: (round, blob, SHA-256, manifest) of the state it serves, or a :class:`_Later` that makes it;
    ``pinned``: sha -> (*snapshot, last request), the snapshots a download is using; ``sources``: bytes from
    each peer (base58) of the last state downloaded; ``partial``: (sha, blob, offsets received) of a download
    every holder failed part-way.
    """

    def __init__(self, node: Node, deadlines: Deadlines) -> None:
        self.node, self.deadlines = node, deadlines
        self.snapshot: Union[None, tuple, _Later] = None
        self.pinned: dict[bytes, tuple] = {}
        self.sources: dict[str, int] = {}
        self.partial: Optional[tuple] = None

    async def serve(self) -> None:
        """On the loop: answer state requests of this run."""
        await self.node.p2p.add_binary_stream_handler(f"{self.node.run}.state", self.on_request)

    # ---- serving ----------------------------------------------------------------------------
    def publish(self, round: int, blob: Union[bytes, Callable[[], bytes]]) -> None:
        """Serve ``blob`` (this peer's state after ``round``) to peers that ask for it: its bytes, or a function
        that makes them, called (on a thread of its own) only when a peer first asks for this state."""
        old = self.snapshot
        if callable(blob):
            self.snapshot = _Later(round, blob)
        else:
            man = manifest(blob)
            self.snapshot = (round, blob, hashlib.sha256(man).digest(), man)
        old = old.made if isinstance(old, _Later) else old  # one that was never asked for is dropped
        current = self.snapshot[2] if isinstance(self.snapshot, tuple) else None
        pinned = self.pinned
        now = time.monotonic()
        if old is not None and old[2] in pinned:  # a download of the old one is under way: keep serving it
            pinned[old[2]] = (*old, pinned[old[2]][4])
        for sha, entry in list(pinned.items()):  # a copy: the event loop's thread adds to it meanwhile
            if now - entry[4] > PINNED_S or sha == current:
                pinned.pop(sha, None)

    def served(self, want: int, sha: Optional[bytes]) -> Optional[tuple[int, bytes, bytes, bytes]]:
        """The snapshot a request asks for: the one whose SHA-256 it names (pinned while it is asked for), or the
        current one when it names none and is of round ``want`` or newer. A current one published as a function
        is made on the first such request; until it is, this says None (the request waits, as for a round)."""
        snap = self.snapshot
        if isinstance(snap, _Later):
            if snap.made is None and sha is None and snap.round >= want:
                snap.start()
            snap = snap.made
        pinned = self.pinned
        if sha is not None:
            if snap is not None and snap[2] == sha:
                pinned[sha] = (*snap, time.monotonic())
                return snap
            entry = pinned.get(sha)  # one lookup: publish may drop it from the training thread
            if entry is not None:
                pinned[sha] = (*entry[:4], time.monotonic())
                return entry[:4]
            return None
        if snap is not None and snap[0] >= want:
            pinned[snap[2]] = (*snap, time.monotonic())
            return snap
        return None

    async def on_request(self, info, reader, writer) -> None:
        node, sender = self.node, info.peer_id
        try:
            header, body = await read_framed(reader, 1 << 10, 10)
            if not hmac.compare_digest(header.get("m", b""), mac(node.key, b"state", sender.to_bytes(),
                                                                  node.peer_id.to_bytes(), body)):
                raise PermissionError("bad MAC (no or another run key)")
            request = unpack(body)
            want, asked = int(request["min_epoch"]), request.get("sha")  # the wire's "min_epoch" is a round
            end = time.perf_counter() + STATE_WAIT_S
            while (served := self.served(want, asked)) is None and asked is None and time.perf_counter() < end:
                await asyncio.sleep(0.1)
            if served is None:
                raise TimeoutError(f"no state of round >= {want} here" if asked is None else
                                   "the state asked for is no longer here")
            round, blob, sha, man = served
            stripe, start = int.from_bytes(man[:8], "big"), int(request.get("off", 0))
            if not (0 <= start < max(len(blob), 1) and start % stripe == 0):
                raise ValueError(f"a stripe at {start} of a {len(blob)}-byte state in stripes of {stripe}")
            piece = await node.phase("state", memoryview(blob)[start:start + stripe])
            reply = {"e": round, "n": len(piece), "total": len(blob), "off": start, "sha": sha,
                     "m": mac(node.key, b"state-reply", node.peer_id.to_bytes(), sender.to_bytes(),
                              str(round).encode(), sha)}
            if start == 0:  # the first stripe brings the manifest (its SHA-256 is the signed one)
                reply["man"] = man
            await write_framed(writer, reply, piece)
            # the reader closes when it has it all: over a slow link, long after the last byte left this peer
            await asyncio.wait_for(reader.read(1), self.deadlines.state_timeout(len(piece)))
        except Exception as e:
            log.info("peer %s: state request from %s failed: %s: %s", node.tag, sender.to_base58()[-8:],
                     type(e).__name__, e)
        finally:
            writer.close()

    # ---- downloading ------------------------------------------------------------------------
    @property
    def resumable(self) -> bool:
        """Whether a download failed part-way and the next one of the same state goes on from its stripes."""
        return self.partial is not None

    async def fetch(self, peer, min_round: int, largest: int, off: int = 0,
                    sha: Optional[bytes] = None) -> tuple[int, bytes, int, bytes, Optional[bytes]]:
        """The stripe at ``off`` of ``peer``'s state: (round, SHA-256 of the state, its size, the stripe's bytes,
        the manifest (with the first stripe; else None)). ``sha``: the state wanted (a stripe of another one is
        refused by the peer); else its newest, if of round ``min_round`` or later; at most ``largest`` bytes.
        The reply's MAC (run key) covers the round and the hash, and the hash covers the manifest."""
        node = self.node
        body = pack({"min_epoch": min_round, "off": off, "sha": sha})  # the wire's "min_epoch" is a round
        head = {"n": len(body), "m": mac(node.key, b"state", node.peer_id.to_bytes(), peer.to_bytes(), body)}
        _, reader, writer = await asyncio.wait_for(node.p2p.call_binary_stream_handler(peer, f"{node.run}.state"), 10)
        try:
            await write_framed(writer, head, body)
            # the reply's header may come only once the peer has the round asked for: up to STATE_WAIT_S
            header, piece = await read_framed(reader, largest, self.deadlines.state_timeout,
                                               header_timeout=STATE_WAIT_S + 10)
            round, total, digest = int(header["e"]), int(header.get("total", len(piece))), header["sha"]
            if not hmac.compare_digest(header["m"], mac(node.key, b"state-reply", peer.to_bytes(),
                                                        node.peer_id.to_bytes(), str(round).encode(), digest)):
                raise PermissionError("the state's MAC does not check (no or another run key)")
            if int(header.get("off", 0)) != off or total > largest:
                raise ValueError(f"a stripe at {header.get('off', 0)} of a state of {total} bytes (at most {largest} "
                                 f"taken), asked for one at {off}")
            man = header.get("man")
            if off == 0 and not (isinstance(man, bytes) and hashlib.sha256(man).digest() == digest):
                raise ValueError("the state's manifest does not match its signed hash")
            return round, digest, total, piece, man
        finally:
            writer.close()

    async def download(self, peers: Sequence[Any], min_round: int, largest: int) -> Optional[tuple[int, bytearray]]:
        """The state, in stripes from every peer of ``peers`` (PeerIDs) that holds it, of round ``min_round`` or
        later and at most ``largest`` bytes (see the module's docstring); None when it could not be had."""
        began = time.perf_counter()
        got = await self._first_stripe(peers, min_round, largest)
        if got is None:
            return None
        i, first, stripe, hashes, failed = got
        peers = [peers[i]] + [p for j, p in enumerate(peers) if j != i and j not in failed]  # the sender first
        kept, self.partial = self.partial, None
        stripes = _Stripes(self, first, stripe, hashes, largest, kept if kept is not None and kept[0] == first[1]
                           else None, peers[0], time.perf_counter() - began)
        await stripes.pull_from(peers)
        round, sha, total = first[:3]
        if not stripes.complete():
            self.partial = (sha, stripes.blob, stripes.done)
            log.warning("peer %s: every peer that held the state failed before the download finished; %d of %d "
                        "stripes are kept for the next try", self.node.tag, len(stripes.done) + 1, stripes.count + 1)
            return None
        if stripes.resumed:
            log.info("peer %s: the download went on from %d stripes an earlier try left", self.node.tag,
                     stripes.resumed)
        # every stripe matched the manifest, whose hash the serving peers signed: the state is theirs
        self.sources = stripes.served
        if len(stripes.served) > 1:
            log.info("peer %s: downloaded the state (%d bytes) from %d peers: %s", self.node.tag, total,
                     len(stripes.served), ", ".join(f"{k[-8:]} {v} bytes" for k, v in stripes.served.items()))
        return round, stripes.blob

    async def _first_stripe(self, peers: Sequence[Any], min_round: int,
                            largest: int) -> Optional[tuple[int, tuple, int, bytes, set]]:
        """The first stripe of the newest state ``peers`` hold: (index of the peer that sent it, the reply, the
        stripe size, the stripes' hashes, the indices of the peers that failed), or None when none sends one.
        Asked of one peer at a time, and of the next as well while one is out longer than :data:`HEDGE_S` (a
        holder that hangs would otherwise cost its timeout: 10 s to open a stream, more for a reply); the first
        good answer counts."""
        async def one(peer):
            reply = await self.fetch(peer, min_round, largest, 0)
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
                        self.failed(peers[i], e)
                        continue
                    return i, reply, stripe, hashes, failed
            return None
        finally:
            for task in out:  # asked of a slower peer as well: its answer is not needed
                task.cancel()
            await asyncio.gather(*out, return_exceptions=True)

    def failed(self, peer, e: Exception) -> None:
        log.warning("peer %s: could not download the state from %s: %s: %s", self.node.tag, peer.to_base58()[-8:],
                    type(e).__name__, e)


class _Stripes:
    """One download under way, after its first stripe: the state's bytes as they land (in place, one copy of
    the state in memory), the stripes done, those still to ask for and those in flight, how long each took,
    and how many bytes each peer served. ``first``: the first stripe's reply, from ``sender`` in ``first_s``
    seconds; ``kept``: what an earlier try of the same state left (sha, blob, offsets done)."""

    def __init__(self, service: StateService, first: tuple, stripe: int, hashes: bytes, largest: int,
                 kept: Optional[tuple], sender, first_s: float) -> None:
        self.service, self.stripe, self.hashes, self.largest = service, stripe, hashes, largest
        self.round, self.sha, self.total, head = first[:4]
        self.blob, self.done = (kept[1], kept[2]) if kept is not None else (bytearray(self.total), set())
        self.resumed = len(self.done)
        self.blob[:len(head)] = head
        offsets = range(stripe, self.total, stripe)
        self.count = len(offsets)
        self.todo = [off for off in offsets if off not in self.done][::-1]  # the next one last
        self.flying: dict = {}  # offset -> [when its first request went out, how many requests are out]
        self.took = [first_s]  # seconds each stripe took
        self.served = {sender.to_base58(): len(head)}

    def complete(self) -> bool:
        return len(self.done) >= self.count

    def landed(self, peer, off: int, piece: bytes, seconds: float) -> None:
        """A stripe that matched the manifest arrived from ``peer``."""
        self.took.append(seconds)
        if off not in self.done:
            self.blob[off:off + len(piece)] = piece
            name = peer.to_base58()
            self.served[name] = self.served.get(name, 0) + len(piece)
            self.done.add(off)

    def overdue(self) -> Optional[int]:
        """A stripe asked of one peer long ago (a holder that hangs, a link that stalls): an idle peer asks for
        it too, and the first answer counts."""
        now, typical = time.perf_counter(), sorted(self.took)[len(self.took) // 2]
        late = [(t0, off) for off, (t0, n) in self.flying.items() if n == 1 and now - t0 > max(HEDGE_S, 4 * typical)]
        return min(late)[1] if late else None

    async def pull_from(self, peers: Sequence[Any]) -> None:
        """Every peer takes the next stripe as soon as it has sent its last, until all are done or every peer
        failed; a request still out to a hung peer is then given up (its stripe came from another)."""
        tasks = [asyncio.ensure_future(self._pull(p)) for p in peers]
        while not self.complete() and not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pull(self, peer) -> None:
        while not self.complete():
            off = self.todo.pop() if self.todo else self.overdue()
            if off is None:  # the rest is in flight: take a stripe over if its peer fails or hangs
                await asyncio.sleep(0.05)
                continue
            out = self.flying.setdefault(off, [time.perf_counter(), 0])
            out[1] += 1
            t0 = time.perf_counter()
            try:
                got = await self.service.fetch(peer, self.round, self.largest, off, self.sha)
                if got[:3] != (self.round, self.sha, self.total):
                    raise ValueError(f"serves another state (round {got[0]}, {got[2]} bytes)")
                _check_stripe(got[3], off, self.stripe, self.hashes, self.total)
                self.landed(peer, off, got[3], time.perf_counter() - t0)
            except Exception as e:
                if off not in self.done and out[1] == 1:
                    self.todo.append(off)  # another peer fetches it
                self.service.failed(peer, e)
                return
            finally:
                out[1] -= 1
                if not out[1]:
                    self.flying.pop(off, None)


class _Later:
    """A state published as a function that makes its bytes (:meth:`StateService.publish`): made, with its
    manifest, on a thread of its own when :meth:`start` is first called; ``made`` is then the snapshot tuple."""

    def __init__(self, round: int, make: Callable[[], bytes]) -> None:
        self.round, self._make = round, make
        self.made: Optional[tuple[int, bytes, bytes, bytes]] = None
        self._started = threading.Lock()

    def start(self) -> None:
        if self._started.acquire(blocking=False):
            threading.Thread(target=self._run, name="loco-state", daemon=True).start()

    def _run(self) -> None:
        try:
            blob = self._make()
            man = manifest(blob)
            self.made = (self.round, blob, hashlib.sha256(man).digest(), man)
        except Exception as e:  # the requests wait and give up; training is not this thread's to stop
            log.warning("the state of round %d could not be made for a peer that asked: %s: %s", self.round,
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
