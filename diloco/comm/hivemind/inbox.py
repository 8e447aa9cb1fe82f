"""What a peer takes from the other members during a round, and the pushes it relays between them.

A push is accepted only during this peer's own round (its :class:`~diloco.comm.hivemind.limits.Window`), and
only on its header's word: the round, the group (once known), the run key's MAC over sender, receiver, size and
hash, and a size this run's model and codec make (:meth:`Inbox.admit`). Only then is the body read, into a buffer
of its announced size, within the inbox's cap; it is kept only when it matches the hash in its header. A push
for another member is streamed on to it (:meth:`Inbox.forward`), never held whole. When the round ends, the
inbox is purged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Optional

from diloco.comm.base import PayloadBound
from diloco.comm.hivemind.deadlines import Deadlines
from diloco.comm.hivemind.framing import FAIL, OK, PIECE, UNREACHED, read_body, read_header, write_head, log
from diloco.comm.hivemind.limits import ACK_MAX, PUSH_HEADER_MAX, Window, accepted, inbox_cap
from diloco.comm.hivemind.node import Node
from diloco.comm.hivemind.push import KINDS, push_mac
from diloco.comm.hivemind.registry import Registry, round_of


class Inbox:
    """This peer's push handler and what it holds (see the module's docstring).

    ``boxes``: (group id, kind, round) -> {sender: bytes}, this round's pushes; ``window``: what this peer
    accepts during its current round (None between rounds); ``ended``: the last round's window, through which
    members may still relay their last messages.
    """

    def __init__(self, node: Node, deadlines: Deadlines, registry: Registry) -> None:
        self.node, self.deadlines, self.registry = node, deadlines, registry
        self.boxes: dict = {}
        self.window: Optional[Window] = None
        self.ended: Optional[Window] = None
        self.arrived: Optional[asyncio.Event] = None

    async def serve(self) -> None:
        """On the loop: take pushes for this run."""
        self.arrived = asyncio.Event()
        await self.node.p2p.add_binary_stream_handler(f"{self.node.run}.push", self.on_push)

    # ---- the round's window -----------------------------------------------------------------
    def open(self, round: int, bound: Optional[PayloadBound], group: int, largest: int) -> Window:
        """Start accepting pushes for ``round``: payloads of the lengths ``bound`` allows, room for ``group``
        members. ``largest`` bounds only payloads handed without a bound: a 1B model's fp32 payload is 4.4 GB."""
        sizes = accepted(bound, largest)
        self.window = Window(round, sizes.least, sizes.most, sizes.exact, inbox_cap(sizes.most, group))
        self.boxes.clear()
        return self.window

    def close(self) -> None:
        """The round is over: nothing more is accepted for it, and what it left in the inbox goes. Its group
        is kept, for the members still relaying their last messages through this peer (:meth:`forward`)."""
        if self.window is not None and self.window.gid is not None:
            self.ended = self.window
        self.window = None
        self.boxes.clear()

    def know_group(self, w: Window, gid: bytes, sizes: dict) -> None:
        """The group is formed: from now on only its members, each with its announced size; the pushes of
        anyone else (strangers that pushed before the group was known) are dropped."""
        w.gid, w.sizes = gid, dict(sizes)
        w.cap = max(w.cap, inbox_cap(w.most, len(sizes)))
        for key in [k for k in self.boxes if k[0] != gid]:
            for sender in self.boxes.pop(key):
                w.held.pop((sender, key[1]), None)
        for key, box in self.boxes.items():
            for sender in [p for p, data in box.items()
                           if p not in sizes or (key[1] == "ag" and len(data) != sizes[p])]:
                del box[sender]
                w.held.pop((sender, key[1]), None)

    def admit(self, w: Optional[Window], sender, header: dict, n: int, receiver=None) -> Optional[str]:
        """Why a push whose header is ``header`` (announcing ``n`` body bytes) to ``receiver`` (this peer, or
        a member it forwards to) is refused, or None: checked before any of the body is read."""
        if w is None:
            return "this peer is not in an exchange"
        why = self._unsigned(w, sender, header, n, receiver)
        if why is None and (sender, header["k"]) in w.reading:
            why = "a second push of one kind while the first is being read"
        return why or self._outside(w, sender, header["g"]) or self._misfit(w, sender, header["k"], n)

    def _unsigned(self, w: Window, sender, header: dict, n: int, receiver) -> Optional[str]:
        """Why a header is not one this run's members send for this round (its shape, round and MAC)."""
        g, kind, e, sha, m = (header.get(f) for f in ("g", "k", "e", "sha", "m"))
        if not (isinstance(g, bytes) and len(g) <= 64 and kind in KINDS and isinstance(e, int)
                and isinstance(sha, bytes) and len(sha) == 32 and isinstance(m, bytes)):
            return "a malformed header"
        if e != w.round:
            return f"a push for round {e}; this peer is at round {w.round}"
        if not hmac.compare_digest(m, push_mac(self.node.key, g, kind, e, sender.to_bytes(),
                                               (receiver or self.node.peer_id).to_bytes(), n, sha)):
            return "bad MAC (no or another run key)"
        return None

    @staticmethod
    def _outside(w: Window, sender, gid: bytes) -> Optional[str]:
        """Why a push is not of this round's group, once the group is known."""
        if w.gid is None:
            return None
        if gid != w.gid:
            return "a push for another group"
        return None if sender in w.sizes else "the sender is not a member of this round's group"

    @staticmethod
    def _misfit(w: Window, sender, kind: str, n: int) -> Optional[str]:
        """Why ``n`` body bytes are not what a push of ``kind`` from ``sender`` can be."""
        if kind == "ack":
            return None if n <= ACK_MAX else f"an ack of {n} bytes (at most {ACK_MAX})"
        if not w.fits(n):
            return f"a payload of {n} bytes; this run's model and codec make {w.expected()}"
        if w.sizes is not None and n != w.sizes[sender]:
            return f"a payload of {n} bytes; the sender announced {w.sizes[sender]} to the group"
        return None

    def drop_held(self, w: Window, slot: tuple) -> None:
        """Forget what ``slot`` (sender, kind) pushed earlier in this round."""
        sender, kind = slot
        for key, box in self.boxes.items():
            if key[1] == kind:
                box.pop(sender, None)
        w.held.pop(slot, None)
        w.hashes.pop(slot, None)

    # ---- the push handler -------------------------------------------------------------------
    async def on_push(self, info, reader, writer) -> None:
        """Take one member's push. Its header is read and checked first (:meth:`admit`, then room in the
        inbox); only an accepted header's body is read, so a refused push costs this peer the header's bytes."""
        me = self.node.peer_id.to_bytes()
        sender = info.peer_id
        w = slot = None
        stored = False
        try:
            header, n = await read_header(reader, PUSH_HEADER_MAX)
            w = self.window
            to, frm = header.get("t", me), header.get("f", sender.to_bytes())
            if to != me:
                if frm != sender.to_bytes():
                    raise PermissionError("a push for another peer that its sender did not send")
                return await self.forward(w, sender, header, n, reader, writer)
            if frm != sender.to_bytes():  # brought by a member that relays for the sender
                sender = await self._relayed_from(w, sender, frm)
            why = self.admit(w, sender, header, n)
            if why is None:
                slot = (sender, header["k"])
                why = await self._reserve(w, slot, n)
            if why is not None:
                if w is not None:
                    w.refuse(sender, header.get("k"), why)
                raise PermissionError(why)
            self._store(w, sender, header, await read_body(reader, n, self.deadlines.exchange_timeout))
            stored = True
            writer.write(OK)
            await writer.drain()
            await asyncio.wait_for(reader.read(1), 10)  # the sender closes first (p2pd may drop our ack otherwise)
        except Exception as e:
            log.info("peer %s: refused a push from %s: %s: %s", self.node.tag, sender.to_base58()[-8:],
                     type(e).__name__, e)
            try:
                writer.write(FAIL)
                await writer.drain()
            except Exception:
                pass
        finally:
            if slot is not None:
                w.reading.discard(slot)
                if not stored:
                    w.held.pop(slot, None)
            writer.close()

    async def _relayed_from(self, w: Optional[Window], relay, frm: bytes):
        """The sender of a push that the member ``relay`` brought (the sender's id ``frm`` is under the MAC),
        once this peer knows its group; PermissionError when that member may not relay."""
        await self.await_group(w)
        why = self.relay_refused(w, relay, "a push for this peer")
        if why is not None:
            raise PermissionError(why)
        return type(relay)(frm)

    async def _reserve(self, w: Window, slot: tuple, n: int) -> Optional[str]:
        """Hold room for the ``n`` body bytes of ``slot``'s (sender, kind) push before the body is read, waiting a
        little when the inbox is full (the group, once known, drops what non-members pushed); why there is
        none, or None. A sender holds one push of a kind: a new one replaces the old."""
        w.reading.add(slot)
        self.drop_held(w, slot)
        end = time.perf_counter() + min(5.0, self.deadlines.matchmaking_time)
        while w.used() + n > w.cap and w.gid is None and self.window is w and time.perf_counter() < end:
            await asyncio.sleep(0.05)
        if w.used() + n > w.cap:
            return f"the inbox is full ({w.used()} of {w.cap} bytes held)"
        w.held[slot] = n
        return None

    def _store(self, w: Window, sender, header: dict, data: bytearray) -> None:
        """Keep a push's body, read whole, if it is what its header announced and still wanted."""
        if hashlib.sha256(data).digest() != header["sha"]:
            raise PermissionError("the payload does not match the hash in its header")
        if self.window is not w:
            raise PermissionError("the exchange it was for is over")
        if w.gid is not None and (header["g"] != w.gid or sender not in w.sizes):
            raise PermissionError("the sender is not a member of this round's group")
        self.boxes.setdefault((header["g"], header["k"], w.round), {})[sender] = data
        w.hashes[(sender, header["k"])] = header["sha"]  # checked: the commit compares it with the announced one
        self.arrived.set()

    async def await_group(self, w: Optional[Window]) -> None:
        """Until this peer knows the group of window ``w`` (members that learnt it first may already relay),
        at most a few seconds."""
        end = time.perf_counter() + min(5.0, self.deadlines.matchmaking_time)
        while w is not None and w.gid is None and self.window is w and time.perf_counter() < end:
            await asyncio.sleep(0.05)

    def relay_refused(self, w: Optional[Window], relay, what: str) -> Optional[str]:
        """Why ``relay`` may not carry ``what`` between two members (None: it may): only a member of this
        peer's known group relays."""
        if w is None:
            return f"{what} through {relay.to_base58()[-8:]}, while this peer is not in an exchange"
        if w.gid is None:
            return f"{what} through {relay.to_base58()[-8:]}, before this peer knows its group"
        if relay not in w.sizes:
            return f"{what} through {relay.to_base58()[-8:]}, which is not a member of this round's group"
        return None

    async def forward(self, w: Optional[Window], sender, header: dict, n: int, reader, writer) -> None:
        """Carry a member's push to another member that the sender cannot reach: the header is checked as the
        receiver will check it, the body is streamed through in pieces (never held whole), and the receiver's
        answer goes back to the sender."""
        from hivemind.p2p import PeerID

        out = None
        answer = FAIL
        try:
            to = PeerID(header["t"]) if isinstance(header.get("t"), bytes) and len(header["t"]) <= 64 else None
            await self.await_group(w)
            ended = self.ended
            if (w is None or w.gid != header.get("g")) and ended is not None and ended.gid == header.get("g"):
                w = ended  # this peer's part of the round is done; the others' still goes through it
            why = "a malformed header" if to is None else self.relay_refused(w, sender, "a push")
            if why is None and to not in w.sizes:
                why = "a push for a peer that is not a member of this round's group"
            if why is None:
                why = self.admit(w, sender, header, n, receiver=to)
            if why is not None:
                raise PermissionError(why)
            answer = UNREACHED  # from here on, a failure is the receiver's or the link's, not a refusal
            _, back, out = await asyncio.wait_for(
                self.node.p2p.call_binary_stream_handler(to, f"{self.node.run}.push"), 10)
            answer = await self._stream_on(reader, out, back, header, n)
        except Exception as e:
            log.info("peer %s: did not forward a push from %s: %s: %s", self.node.tag, sender.to_base58()[-8:],
                     type(e).__name__, e)
        finally:
            if out is not None:
                out.close()
        try:
            writer.write(answer)
            await writer.drain()
            await asyncio.wait_for(reader.read(1), 10)
        except Exception:
            pass
        finally:
            writer.close()

    async def _stream_on(self, reader, out, back, header: dict, n: int) -> bytes:
        """The header, then the body piece by piece, from the sender's stream to the receiver's; its answer."""
        timeout = self.deadlines.exchange_timeout
        write_head(out, header, n)
        left = n
        while left:
            piece = await asyncio.wait_for(reader.readexactly(min(left, PIECE)), timeout)
            out.write(piece)
            await out.drain()
            left -= len(piece)
        return await asyncio.wait_for(back.readexactly(1), timeout)

    # ---- waiting for a round's messages -----------------------------------------------------
    async def collect(self, gid: bytes, kind: str, senders: set, deadline: float, round: int,
                      relayed: set) -> dict:
        """Wait for ``kind`` messages of this group from ``senders`` until ``deadline``; not for peers that died
        or moved on. ``relayed``: members reached only through another member (no connection proves nothing)."""
        last_check = last_registry = 0.0
        while True:
            self.arrived.clear()
            box = self.boxes.get((gid, kind, round), {})
            window = self.window
            if window is not None:  # a member whose push was refused sends nothing more
                senders = {p for p in senders if p in box or (p, kind) not in window.refused}
            missing = {p for p in senders if p not in box}
            if not missing or time.perf_counter() >= deadline:
                return {p: box[p] for p in senders if p in box}
            # what arrived while the checks below awaited counts: a member that delivered and then moved on
            # (its registry entry is at the next round) is not left out
            if time.perf_counter() - last_check > 0.5:  # a peer libp2p lost is not waited for
                last_check = time.perf_counter()
                connected = {i.peer_id for i in await self.node.p2p.list_peers()}
                lost = {p for p in missing - connected - relayed if p not in self.boxes.get((gid, kind, round), {})}
                if lost:
                    senders = senders - lost
                    continue
            if time.perf_counter() - last_registry > 1.0:  # nor one whose matchmaking gave up on this round
                last_registry = time.perf_counter()
                reg = await self.registry.read()
                moved = {p for p in missing if round_of(reg.get(p.to_base58(), {})) > round
                         and p not in self.boxes.get((gid, kind, round), {})}
                if moved:
                    senders = senders - moved
                    continue
            try:
                await asyncio.wait_for(self.arrived.wait(), min(0.25, max(0.0, deadline - time.perf_counter())))
            except asyncio.TimeoutError:
                pass
