"""The run's registry of live peers in the DHT, and the rendezvous of a round.

Every peer keeps an entry in the DHT dictionary ``<run>.peers`` (its heartbeat: its round, what it is doing,
when it expects to reach the next round, its settings), refreshed more often than the entry expires. Before a
round, a peer waits on the registry until every live peer expected at its round has arrived (:meth:`Registry.
rendezvous`): peers still training toward it are waited for until their announced arrival, a bounded number of
this peer's own rounds at most, so peers at different speeds meet; a peer found past this one's round is
followed there. Peers of the run announcing other settings can never group with this one (matchmaking is keyed
by the settings): they are named once, with what differs, and never waited for.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

from diloco.comm.agreement import schema_differs
from diloco.comm.hivemind.framing import dht_now, log
from diloco.comm.hivemind.links import Links
from diloco.comm.hivemind.node import Node


@dataclass
class Standing:
    """Where this peer is in the run, as it announces it.

    ``round``: the rounds its state has been through (a downloaded state carries its own). ``stale``: it
    followed the others to a later round and holds an older state until it takes theirs. ``group``: how many
    peers averaged the state it holds (its latest round's group). ``phase``: "train" (with ``eta``, when it
    expects to reach the next round, from its last round's length ``round_s``), "wait" (at the round, waiting
    for the peers announced there), "group" (forming the group) or "resync" (downloading the group's state).
    """

    round: int = 0
    stale: bool = False
    group: int = 1
    phase: str = "train"
    eta: Optional[float] = None
    round_s: Optional[float] = None


def expects(entry: dict, now: float, waited: float, window: float) -> bool:
    """Whether a peer that has not reached this round yet is still worth waiting for: always for the first
    ``window`` seconds (the matchmaking window), then until its announced arrival time, with slack for a round
    that runs longer than the last one. A peer downloading the group's state (its arrival time did not count the
    download) is waited for up to two of its rounds from the download's start."""
    if waited < window:
        return True
    slack = max(window, 0.5 * float(entry.get("round_s") or 0.0))
    if entry.get("phase") == "resync":  # its download, then a round of training: up to two of its rounds
        return now <= float(entry.get("time", 0.0)) + 2 * float(entry.get("round_s") or 0.0) + slack
    eta = entry.get("eta")
    if eta is None:  # its first round: no estimate yet (the caller's cap bounds the wait)
        return True
    return now <= float(eta) + slack


def round_of(entry: dict) -> int:
    """The round a registry entry announces (its wire key keeps the name ``epoch``)."""
    return int(entry.get("epoch", -1))


class Registry:
    """This peer's entry in the run's registry, and what it reads there (see the module's docstring).

    ``status``: extra fields of this peer's entry (throughput, step...). ``suspects``: peer -> when it last
    failed this one; forgiven once it heartbeats again. ``live_seen``: how many other live peers the latest
    rendezvous found (a bound on the next group).
    """

    def __init__(self, node: Node, links: Links, standing: Standing, settings: str, ttl: float) -> None:
        self.node, self.links, self.standing = node, links, standing
        self.settings = settings  # announced: a peer of this run with other settings is named
        self.ttl = ttl
        self.key = f"{node.run}.peers"
        self.status: dict = {}
        self.suspects: dict[str, float] = {}
        self.live_seen = 0
        self._foreign: set[str] = set()  # the peers of this run announcing other settings, named once each
        self._apart = 0  # how many of them the latest rendezvous found live

    # ---- this peer's entry ------------------------------------------------------------------
    async def beat(self) -> None:
        s = self.standing
        # the entry's keys are read by every peer and by `loco status`: "epoch" is this peer's round
        value = {"epoch": s.round, "time": dht_now(), "phase": s.phase, "eta": s.eta, "round_s": s.round_s,
                 "settings": self.settings, **self.status}
        await self.node.dht.store(self.key, subkey=self.node.me, value=value, expiration_time=dht_now() + self.ttl,
                                  return_future=True)

    async def beat_or_log(self) -> None:
        """A heartbeat whose failure is logged: the next one announces the same."""
        try:
            await self.beat()
        except Exception as e:
            log.info("peer %s: heartbeat failed: %s", self.node.tag, e)

    async def beat_forever(self) -> None:
        """Keep this peer's entry fresh through rounds longer than its time to live."""
        while True:
            await asyncio.sleep(self.ttl / 3)
            await self.beat_or_log()

    def announce(self) -> None:
        """Heartbeat in the background: a change of phase that must not hold the caller up (a DHT store waits
        on every node it stores to, a hung one included)."""
        self.node.soon(self.beat_or_log)

    async def leave(self) -> None:
        """Leave the registry now rather than when the entry expires."""
        await self.node.dht.store(self.key, subkey=self.node.me, value=None, expiration_time=dht_now() + 1,
                                  return_future=True)

    # ---- reading it -------------------------------------------------------------------------
    async def subkeys(self, key: str) -> dict[str, dict]:
        """A DHT dictionary record as {subkey: value}, keeping only dict values (a leaving peer stores None)."""
        res = await asyncio.wait_for(self.node.dht.get(key, latest=True, return_future=True), 30)
        if res is None or not isinstance(res.value, dict):
            return {}
        return {k: v.value for k, v in res.value.items() if isinstance(getattr(v, "value", None), dict)}

    async def read(self) -> dict[str, dict]:
        """The run's live peers: peer id (base58) -> its entry."""
        reg = await self.subkeys(self.key)
        self.links.saw(pid for pid in reg if pid != self.node.me)
        return reg

    def alike(self, entry: dict) -> bool:
        """Whether an entry announces this peer's settings (one announcing none counts as alike)."""
        return entry.get("settings", self.settings) == self.settings

    def holders(self, entries: dict[str, dict]) -> tuple[list[str], int]:
        """The other peers to download the run's state from, the newest round first, and that round: those that
        announce this peer's settings only, where there are any (a state of other settings would be refused);
        where there are none, the state comes, and the caller refuses it naming what differs."""
        live = {pid: v for pid, v in entries.items() if pid != self.node.me}
        live = {pid: v for pid, v in live.items() if self.alike(v)} or live
        rounds = {pid: max(round_of(v), 0) for pid, v in live.items()}
        order = sorted(live, key=lambda pid: -rounds[pid])
        return order, rounds[order[0]] if order else 0

    def other_settings(self, pid: str, entry: dict, notes: list) -> bool:
        """Whether a peer of this run announces other settings (another model, codec or outer step: matchmaking
        never puts it in a group with this peer). It is not waited for, nor followed to its round; the first
        time, the notes and the log name it and what differs."""
        if self.alike(entry):
            return False
        if pid not in self._foreign:
            self._foreign.add(pid)
            note = (f"peer {pid[-8:]} of run '{self.node.run}' trains with other settings "
                    f"({schema_differs(entry['settings'], self.settings)}): it never groups with this peer and is "
                    f"not waited for; start every peer with the run's --config")
            notes.append(note)
            log.warning("peer %s: %s", self.node.tag, note)
        return True

    def suspected(self, pid: str, entry: dict) -> bool:
        return pid in self.suspects and float(entry.get("time", 0)) <= self.suspects[pid]

    def why_alone(self, round: int, waited: float, others: int) -> str:
        if others:
            return f"no other peer reached round {round} within {waited:.0f}s"
        apart = self._apart
        if apart:  # named, with what differs, the first time each was seen
            return (f"no other live peer trains with this peer's settings ({apart} of the run's live peers "
                    f"{'has' if apart == 1 else 'have'} other settings)")
        return "no other live peer in the run"

    # ---- the rendezvous ---------------------------------------------------------------------
    async def rendezvous(self, wait_cap: float, window: float, notes: list,
                         stop_requested: Optional[Callable[[], bool]] = None) -> tuple[dict, int]:
        """Wait on the registry until every live peer expected at this peer's round has arrived.

        A peer that finds others past its round joins theirs (``stale``: it contributes its older update
        and takes the group's state afterwards). Peers still training toward this round (or an earlier one,
        from which they will move up) are waited for until their announced arrival time (:func:`expects`, with
        the matchmaking ``window``), at most ``wait_cap`` seconds, or until ``stop_requested()``. Returns the
        live peers waiting at this round (by peer id) and how many other live peers the registry lists.
        """
        begin = time.perf_counter()
        announced = None
        links_checked = 0.0
        while True:
            live = await self._live(notes)
            if time.perf_counter() - links_checked >= 0.5:  # a peer whose libp2p connection dropped is not waited for
                links_checked = time.perf_counter()
                await self._drop_lost(live, notes)
            self._follow(live, notes)
            s = self.standing
            if announced != (s.round, s.phase):
                await self.beat()
                announced = (s.round, s.phase)
            here = {pid: v for pid, v in live.items()
                    if round_of(v) == s.round and v.get("phase") not in ("train", "resync")}
            now, waited = dht_now(), time.perf_counter() - begin
            pending = [pid for pid, v in live.items() if pid not in here and round_of(v) <= s.round
                       and expects(v, now, waited, window)]
            grouping = any(v.get("phase") == "group" for v in here.values())
            stopping = stop_requested is not None and stop_requested()
            if not pending or grouping or stopping or time.perf_counter() >= begin + wait_cap:
                if pending and not grouping and not stopping:
                    notes.append(f"{len(pending)} peer(s) announced for round {s.round} did not arrive within "
                                 f"{wait_cap:.0f}s: going on without them")
                self.live_seen = len(live)
                return here, len(live)
            await asyncio.sleep(0.25)

    async def _live(self, notes: list) -> dict[str, dict]:
        """The other live peers of this peer's settings that have not failed it since their last heartbeat;
        those of other settings are counted (and named once)."""
        live, apart = {}, 0
        for pid, v in (await self.read()).items():
            if pid == self.node.me or self.suspected(pid, v):
                continue
            if self.other_settings(pid, v, notes):
                apart += 1
            else:
                live[pid] = v
        self._apart = apart  # live peers of the run with other settings (the lone round's note counts them)
        return live

    async def _drop_lost(self, live: dict, notes: list) -> None:
        for pid in await self.links.lost(live):
            self.suspects[pid] = dht_now()
            live.pop(pid)
            notes.append(f"peer {pid[-8:]}: its libp2p connection dropped and it cannot be dialled: not waited for")

    def _follow(self, live: dict, notes: list) -> None:
        """Move up to the latest round a live peer announces, if it is past this peer's."""
        ahead = max((round_of(v) for v in live.values()), default=-1)
        s = self.standing
        if ahead > s.round:
            notes.append(f"this peer is behind (round {s.round}, peers at {ahead}): it joins round {ahead} and "
                         f"then takes the group's state")
            s.round, s.stale = ahead, True
