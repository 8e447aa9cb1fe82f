"""Sending a round's messages to every member: a payload, then a commit, each pushed over a libp2p stream.

A push is one framed message (:mod:`~diloco.comm.hivemind.framing`) whose header names the group, the kind, the
round, sender and receiver, the body's size and hash, under the run key's MAC (:func:`push_mac`); the receiver
checks it before it reads the body (:mod:`~diloco.comm.hivemind.inbox`). A member this peer cannot reach (both
behind NAT, say) is sent the push through another member that took this peer's push directly: the relay streams
it on, and the MAC binds sender and receiver, so a relay can neither forge nor redirect it in a keyed run.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Optional

from diloco.comm.hivemind.auth import mac
from diloco.comm.hivemind.framing import OK, UNREACHED, dht_now, write_framed, log
from diloco.comm.hivemind.node import Node

KINDS = ("ag", "ack")  # a member's payload, then its list of whom it holds payloads from
UNREACHABLE_S = 600.0  # a member no push reached directly is reached through another member for this long


def push_mac(key: bytes, gid: bytes, kind: str, round: int, sender: bytes, receiver: bytes, n: int,
             sha: bytes) -> bytes:
    """The MAC of a push header: group, kind, round, both peer ids, the body's size and hash. It is checked
    before the body is read; the body is then checked against the hash."""
    return mac(key, gid, kind.encode(), str(round).encode(), sender, receiver, str(n).encode(), sha)


class Pusher:
    """This peer's pushes (see the module's docstring).

    ``relayed``: the members the current round's pushes reached only through another member (:meth:`begin`
    empties it); ``unreachable``: base58 -> when a direct push to that peer last failed.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self.relayed: set = set()
        self.unreachable: dict[str, float] = {}

    def begin(self) -> None:
        """A round's pushes start."""
        self.relayed = set()

    async def push_all(self, peers: list, gid: bytes, kind: str, round: int, data: bytes, deadline: float,
                       sha: Optional[bytes] = None) -> list[str]:
        """:meth:`push` to every one of ``peers`` by ``deadline`` (``time.perf_counter()``). A peer this one
        cannot reach is sent ``data`` through another member that took this peer's push directly; such a peer
        is remembered for ``UNREACHABLE_S`` and then reached through a member at once. ``sha``: ``data``'s
        SHA-256 when the caller has it (hashed once for all)."""
        sha = sha or hashlib.sha256(data).digest()
        now = dht_now()
        known = {p for p in peers if now - self.unreachable.get(p.to_base58(), -UNREACHABLE_S) < UNREACHABLE_S}
        direct = [p for p in peers if p not in known]
        sent = dict(zip(direct, await asyncio.gather(*[self.push(p, gid, kind, round, data, deadline, sha=sha)
                                                        for p in direct])))
        via = [p for p in direct if sent[p] == "ok"]
        for p in direct:
            if sent[p] == "failed":
                self.unreachable[p.to_base58()] = now
            else:
                self.unreachable.pop(p.to_base58(), None)

        async def around(peer) -> str:
            relays = [v for v in via if v != peer]
            for relay in relays:
                r = await self.push(peer, gid, kind, round, data, deadline, relay=relay, sha=sha)
                if r != "failed":
                    if r == "ok":
                        self.relayed.add(peer)
                    return r
            if relays or peer not in known:
                return "failed"
            return await self.push(peer, gid, kind, round, data, deadline, sha=sha)

        rest = [p for p in peers if p in known or sent[p] == "failed"]
        sent.update(zip(rest, await asyncio.gather(*[around(p) for p in rest])))
        return [sent[p] for p in peers]

    async def push(self, peer, gid: bytes, kind: str, round: int, data: bytes, deadline: float, relay=None,
                   sha: Optional[bytes] = None) -> str:
        """Send ``data`` to ``peer`` (through the member ``relay`` when given): "ok" (it took it), "refused" (it
        answered, or dropped the stream while connected: it is alive and turned the push away) or "failed" (no
        answer by ``deadline``, libp2p lost it, or the relay could not reach it: a stopped or cut-off peer
        costs the others no more than the deadline). The header names sender and receiver ("f", "t"), under
        the MAC; its "e" is the round."""
        node = self.node
        sha = sha or hashlib.sha256(data).digest()
        me, to = node.peer_id.to_bytes(), peer.to_bytes()
        header = {"g": gid, "k": kind, "e": round, "n": len(data), "sha": sha, "f": me, "t": to,
                  "m": push_mac(node.key, gid, kind, round, me, to, len(data), sha)}
        hop = relay or peer

        def left() -> float:
            return max(0.05, deadline - time.perf_counter())

        for attempt in range(2):
            writer = None
            try:
                if deadline - time.perf_counter() <= 0:
                    raise asyncio.TimeoutError("the exchange's deadline passed")
                _, reader, writer = await asyncio.wait_for(
                    node.p2p.call_binary_stream_handler(hop, f"{node.run}.push"), min(10.0, left()))
                await asyncio.wait_for(write_framed(writer, header, data), left())
                answer = await asyncio.wait_for(reader.readexactly(1), left())
                if answer == UNREACHED:
                    log.info("peer %s: %s could not reach %s with this peer's %s", node.tag,
                             hop.to_base58()[-8:], peer.to_base58()[-8:], kind)
                    return "failed"
                return "ok" if answer == OK else "refused"
            except Exception as e:
                connected = {info.peer_id for info in await node.p2p.list_peers()}
                if attempt == 1 or hop not in connected or deadline - time.perf_counter() < 1.0:
                    log.info("peer %s: sending %s to %s%s failed: %s: %s", node.tag, kind, peer.to_base58()[-8:],
                             f" through {relay.to_base58()[-8:]}" if relay else "", type(e).__name__, e)
                    timed_out = isinstance(e, asyncio.TimeoutError)
                    return "refused" if hop in connected and not timed_out and not relay else "failed"
            finally:
                if writer is not None:
                    writer.close()
        return "failed"
