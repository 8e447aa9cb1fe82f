"""Which of the run's peers this peer can reach over libp2p, and mending what a partition broke.

A peer whose libp2p connection dropped and that cannot be dialled again is not waited for (:meth:`Links.lost`);
a peer never connected to this one (both behind NAT, say) proves nothing by having no connection, and is
reached through members instead. After a partition heals, the two sides' DHT nodes have dropped each other
from their routing tables and nothing refills them by itself: every ``MEND_S`` a peer redials the run's peers
it lost (:meth:`Links.mend`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Iterable

from diloco.comm.hivemind.framing import log
from diloco.comm.hivemind.node import Node

MEND_S = 10.0  # how often a peer redials the run's peers it lost (a partition that healed, a link that came back)
SEEN_S = 600.0  # a peer seen in the registry this recently is redialled when it is no longer connected or in the DHT


async def _redial(maddrs: list, pids: list, connected: set, dht, node) -> int:
    """In the DHT process: dial the bootstrap addresses ``maddrs``, and each of the peers ``pids`` (base58, at the
    addresses libp2p knows for them) that is not ``connected``, missing from this node's routing table or banned
    from its searches; ping each, so that both DHT nodes put the other back in their routing tables and this one
    lifts its ban on it. A partition empties the tables (every request that timed out removed its peer), and
    nothing refills them by itself: not even when libp2p's connection outlived the partition, as one shorter
    than the connection's keepalive does (such a connection resumes at TCP's next retransmission, and a later
    mend pings again). How many answered."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    targets: dict = {}
    for m in maddrs:
        try:
            ma = Multiaddr(m)
            targets[PeerID.from_base58(ma["p2p"])] = [ma.decapsulate(Multiaddr(f"/p2p/{ma['p2p']}"))]
        except Exception:
            continue
    table, banned = node.protocol.routing_table, node.blacklist
    for pid in pids:
        peer = PeerID.from_base58(pid)
        if pid not in connected or peer not in table or peer in banned:
            targets.setdefault(peer, [])

    async def one(pid, addrs) -> bool:
        try:
            await asyncio.wait_for(node.p2p._client.connect(pid, addrs), 5)
            if await asyncio.wait_for(node.protocol.call_ping(pid), 5) is None:
                return False
        except Exception:
            return False
        try:  # its failures during the partition banned it from searches, for 5 s x 2^failures: it answers now
            node.blacklist.register_success(pid)
        except KeyError:
            pass
        return True

    return sum(await asyncio.gather(*(one(p, a) for p, a in targets.items())))


class Links:
    """This peer's libp2p connections to the run's peers (see the module's docstring).

    ``seen``: base58 -> when the registry last listed that peer (:meth:`saw`); ``linked``: peers libp2p has shown
    connected to this one; ``ever``: those of them the registry listed too (the run's peers worth redialling).
    """

    def __init__(self, node: Node, initial_peers: Iterable[str]) -> None:
        self.node = node
        self.initial_peers = [str(m) for m in initial_peers]
        self.seen: dict[str, float] = {}
        self.linked: set[str] = set()
        self.ever: set[str] = set()

    def saw(self, pids: Iterable[str]) -> None:
        """The registry lists these peers now."""
        now = time.monotonic()
        for pid in pids:
            self.seen[pid] = now

    async def connected(self) -> set[str]:
        """The peers libp2p is connected to now (base58)."""
        return {i.peer_id.to_base58() for i in await self.node.p2p.list_peers()}

    async def lost(self, pids: Iterable[str]) -> list[str]:
        """The peers among ``pids`` (base58) that libp2p lost: connected to this peer before, not now, and a
        dial fails. A peer this one never had a connection to proves nothing by having none."""
        from hivemind.p2p import PeerID

        connected = await self.connected()
        self.linked |= connected
        self.ever |= connected & set(self.seen)  # peers mend redials should the DHT lose them
        gone = [pid for pid in pids if pid in self.linked and pid not in connected]

        async def dial(pid: str) -> bool:
            try:  # the daemon dials the addresses it knows for the peer; a dead one refuses at once
                await asyncio.wait_for(self.node.p2p._client.connect(PeerID.from_base58(pid), []), 3)
                return True
            except Exception:
                return False

        alive = await asyncio.gather(*[dial(pid) for pid in gone])
        lost = [pid for pid, ok in zip(gone, alive) if not ok]
        self.linked.difference_update(lost)
        return lost

    async def mend_forever(self) -> None:
        while True:
            await asyncio.sleep(MEND_S)
            try:
                await self.mend()
            except Exception as e:
                log.info("peer %s: redialling lost peers failed: %s", self.node.tag, e)

    async def mend(self) -> None:
        """Redial the peers of this run that libp2p was connected to (if seen in the registry within ``SEEN_S``)
        and that are no longer connected, or no longer in this DHT node's routing table; the bootstrap peers too
        when none is connected. Peers never connected (both behind NAT, say) are not dialled: they reach each
        other through members."""
        now = time.monotonic()
        connected = await self.connected()
        self.ever |= connected & set(self.seen)
        recent = sorted((pid for pid, t in self.seen.items() if pid in self.ever and now - t < SEEN_S),
                        key=lambda pid: -self.seen[pid])[:16]
        boot = self.initial_peers if not (connected & set(self.seen)) else []
        if not recent and not boot:
            return
        found = await self.node.dht.run_coroutine(functools.partial(_redial, boot, recent, connected),
                                                  return_future=True)
        if found:
            log.info("peer %s: redialled %d peer(s) of the run it had lost", self.node.tag, found)
