"""One round of a swarm peer, phase by phase: the rendezvous on the registry, matchmaking, every member's payload
pushed to every other, and the commit on whose payloads count.

Each phase has a module of its own (:mod:`registry`, :mod:`matchmaking`, :mod:`push`, :mod:`inbox`,
:mod:`commit`, :mod:`deadlines`); a :class:`Round` walks one exchange through them and says what it agreed on
(:class:`~diloco.comm.hivemind.report.RoundResult`). A member that vanishes costs the others at most the
exchange deadline; a round that nobody else reaches is done alone, and its notes say why.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from diloco.comm.base import PayloadBound
from diloco.comm.hivemind.commit import agree, read_acks
from diloco.comm.hivemind.deadlines import Deadlines
from diloco.comm.hivemind.framing import dht_now, pack
from diloco.comm.hivemind.inbox import Inbox
from diloco.comm.hivemind.limits import Window
from diloco.comm.hivemind.matchmaking import Matchmaker
from diloco.comm.hivemind.node import Node
from diloco.comm.hivemind.push import Pusher
from diloco.comm.hivemind.registry import Registry, Standing
from diloco.comm.hivemind.report import RoundResult


class Round:
    """One exchange of ``payload`` (see the module's docstring). ``bound``: the lengths the members' payloads may
    have (None: any up to ``largest``); ``fp``: the sketch of this peer's state; ``wait_cap``: how long the
    rendezvous waits at most for peers announced at the round; ``stop_requested``: true when the rendezvous
    should stop waiting (a signal). The steps keep what they learn on the object: the round, the group, its
    members."""

    def __init__(self, *, node: Node, standing: Standing, registry: Registry, deadlines: Deadlines,
                 matchmaker: Matchmaker, inbox: Inbox, pusher: Pusher, payload: bytes, bound: Optional[PayloadBound],
                 fp: bytes, wait_cap: float, largest: int, stop_requested: Optional[Callable[[], bool]] = None) -> None:
        self.node, self.standing, self.registry, self.deadlines = node, standing, registry, deadlines
        self.matchmaker, self.inbox, self.pusher = matchmaker, inbox, pusher
        self.payload, self.bound, self.fp, self.wait_cap, self.largest = payload, bound, fp, wait_cap, largest
        self.stop_requested = stop_requested
        self.peer_id = node.peer_id
        self.notes: list[str] = []

    async def run(self) -> RoundResult:
        self.start = time.perf_counter()
        self.standing.phase, self.standing.eta = "wait", dht_now()
        here, others = await self.registry.rendezvous(self.wait_cap, self.deadlines.matchmaking_time, self.notes,
                                                      self.stop_requested)
        self.round = self.standing.round
        waiting = max(len(here), 1)
        # pushes may come before the group is known: meanwhile, the deadline of a group of everyone waiting here
        self.deadlines.for_exchange(2 * len(self.payload) * waiting, waiting)
        window = self.inbox.open(self.round, self.bound, 1 + len(here), self.largest)
        try:
            return await self._grouped(here, others, window)
        finally:
            self.inbox.close()

    async def _grouped(self, here: dict, others: int, window: Window) -> RoundResult:
        """The round after the rendezvous: matchmaking, the pushes, the commit."""
        s = self.standing
        self.mine = self.matchmaker.announcement(self.round, self.fp, s.stale, s.group, self.payload)
        group = await self._form(1 + len(here)) if here else None
        mm_s = time.perf_counter() - self.start
        if group is None:
            return self._alone(mm_s, others)
        self.window = window
        self.members, self.meta = self.matchmaker.vet(group, self.round, self.fp, window, self.notes)
        self.gid = group.group_id
        self.inbox.know_group(window, self.gid, {p: self.meta[p]["n"] for p in self.members})
        self.peers = [p for p in self.members if p != self.peer_id]
        # the members and their payload sizes are known: what this peer sends and receives in this round
        self.deadlines.for_exchange(len(self.payload) * len(self.peers) + sum(self.meta[p]["n"] for p in self.peers),
                                    len(self.peers))
        await self._payloads()
        final = await self._commit()
        self._settle(final)
        ordered = sorted(final)
        return RoundResult(
            self.round, self.gid.hex()[:12], ordered, {p: self.received[p] for p in ordered},
            {p: self.meta[p] for p in ordered}, alone=len(ordered) == 1, seconds=time.perf_counter() - self.start,
            matchmaking_s=mm_s, notes=self.notes, sent_bytes=len(self.payload) * self.delivered,
            received_bytes=sum(len(d) for p, d in self.received.items() if p != self.peer_id),
            exchange_s=self.exchange_s, deadline_s=self.deadlines.exchange_timeout)

    async def _form(self, expected: int):
        """The group, through matchmaking (the registry says this peer is forming one meanwhile)."""
        self.standing.phase = "group"
        await self.registry.beat()
        return await self.matchmaker.form(self.round, expected, self.mine)

    def _alone(self, mm_s: float, others: int) -> RoundResult:
        me = self.peer_id
        return RoundResult(self.round, "", [me], {me: self.payload}, {me: self.mine}, alone=True,
                           seconds=time.perf_counter() - self.start, matchmaking_s=mm_s,
                           deadline_s=self.deadlines.exchange_timeout,
                           notes=self.notes + [self.registry.why_alone(self.round, mm_s, others)])

    async def _payloads(self) -> None:
        """Push this peer's payload to every member and collect theirs by the exchange deadline. ``received``:
        the payloads that match the hash their sender announced (this peer's own included); ``refusers``: the
        members that turned this peer's payload away (alive, so not waited for with their commit)."""
        began = time.perf_counter()
        deadline = began + self.deadlines.exchange_timeout
        self.pusher.begin()
        pushed = await self.node.phase("push", self.payload)
        sent = await self.pusher.push_all(self.peers, self.gid, "ag", self.round, pushed, deadline,
                                          self.mine["sha"] if pushed is self.payload else None)
        unreachable = {p for p, r in zip(self.peers, sent) if r != "ok"}
        self.refusers = {p for p, r in zip(self.peers, sent) if r == "refused"}
        self.delivered = sum(1 for r in sent if r == "ok")
        got = await self.inbox.collect(self.gid, "ag", {p for p in self.peers if p not in unreachable}, deadline,
                                       self.round, self.pusher.relayed)
        self.exchange_s = time.perf_counter() - began
        if self.peers and not unreachable and len(got) == len(self.peers):  # only a complete round measures a rate
            self.deadlines.measure(len(self.payload) * len(self.peers) + sum(len(d) for d in got.values()),
                                   self.exchange_s)
        for p in self.peers:
            if (p, "ag") in self.window.refused and p not in got:
                self.notes.append(f"peer {p.to_base58()[-8:]}: its payload was refused "
                                  f"({self.window.refused[(p, 'ag')]})")
        self.received = {self.peer_id: self.payload}
        for p, data in got.items():  # each body was checked against its push's hash as it came: compare those
            if self.window.hashes.get((p, "ag")) == self.meta[p]["sha"]:
                self.received[p] = data
            else:
                self.notes.append(f"peer {p.to_base58()[-8:]}: payload does not match its announced hash: left out")

    async def _commit(self) -> set:
        """Tell every member whom this peer holds a payload from; keep those every answering member holds."""
        body = pack(sorted(p.to_bytes() for p in self.received))
        committing = time.perf_counter() + min(10.0, self.deadlines.exchange_timeout)
        await self.pusher.push_all(self.peers, self.gid, "ack", self.round, await self.node.phase("ack", body),
                                   committing)
        acks = await self.inbox.collect(self.gid, "ack", set(self.peers) - self.refusers, committing, self.round,
                                        self.pusher.relayed)
        agreement = agree(self.peer_id, set(self.received), read_acks(acks, type(self.peer_id)))
        for p, (missing, base) in agreement.narrowed.items():
            self.notes.append(f"peer {p.to_base58()[-8:]}'s commit leaves out {missing} of the {base} other "
                              "payloads this peer holds: left out")
        if agreement.none_in_common:
            self.notes.append(f"the members of round {self.round} hold no payload in common: this round is done "
                              "alone")
        return set(agreement.members)

    def _settle(self, final: set) -> None:
        """Name every member left out, and why; one that did not complete the round is suspected until it
        heartbeats again."""
        for p in self.peers:
            name = p.to_base58()
            if p in final:
                self.registry.suspects.pop(name, None)
            elif p in self.refusers:
                self.notes.append(f"peer {name[-8:]} refused this peer's payload: left out")
            else:
                self.registry.suspects[name] = dht_now()
                self.notes.append(f"peer {name[-8:]} did not complete round {self.round}: left out")
