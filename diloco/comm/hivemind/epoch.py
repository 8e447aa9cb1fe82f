"""One epoch of a swarm: matchmaking, every member's payload pushed to every other, a commit on who delivered."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from diloco.comm.base import flat_settings
from diloco.comm.hivemind.auth import mac
from diloco.comm.hivemind.framing import (FAIL, MIN_MEASURED_BYTES, OK, PIECE, UNREACHED, _now, _read_body,
                                          _read_header, _write_framed, _write_head, exchange_deadline, log,
                                          matchmaking_window, pack, unpack)
from diloco.comm.hivemind.limits import ACK_MAX, PUSH_HEADER_MAX, Window, inbox_cap, payload_sizes
from diloco.comm.hivemind.state import same_state

KINDS = ("ag", "ack")  # a member's payload, then its list of whom it holds payloads from
UNREACHABLE_S = 600.0  # a member no push reached directly is reached through another member for this long


def _push_mac(key: bytes, gid: bytes, kind: str, epoch: int, sender: bytes, receiver: bytes, n: int,
              sha: bytes) -> bytes:
    """The MAC of a push header: group, kind, epoch, both peer ids, the body's size and hash. It is checked
    before the body is read; the body is then checked against the hash."""
    return mac(key, gid, kind.encode(), str(epoch).encode(), sender, receiver, str(n).encode(), sha)


def _servicer_class():
    from hivemind.p2p import P2PContext, ServicerBase
    from hivemind.proto import averaging_pb2

    class RoundServicer(ServicerBase):
        """Exposes hivemind's ``Matchmaking.rpc_join_group`` under the run's namespace."""

        mm = None

        async def rpc_join_group(self, request, context):
            async for msg in self.mm.rpc_join_group(request, context):
                yield msg

    # hivemind reads the message types from the annotations (real objects: this module defers annotations)
    RoundServicer.rpc_join_group.__annotations__ = {
        "request": averaging_pb2.JoinRequest, "context": P2PContext,
        "return": AsyncIterator[averaging_pb2.MessageFromLeader]}
    return RoundServicer


MAX_GROUP = 1 << 16  # the most peers a state can say it was averaged by (``g``)


def _malformed(meta: dict, fp: bytes) -> Optional[str]:
    """What is wrong with a member's announcement, as :meth:`EpochMixin._after_epoch` reads it, or None: its
    state's sketch (``fp``, as long as this peer's own), whether it is behind (``stale``), the group its state
    came out of (``g``) and its payload's hash. Anything else there (a string, a number of another type) would
    stop every other member in the epoch's bookkeeping."""
    if not (isinstance(meta.get("fp"), bytes) and len(meta["fp"]) == len(fp)):
        return "a state sketch of another size"
    if not isinstance(meta.get("stale"), bool):
        return "no 'behind' flag"
    g = meta.get("g")
    if not (isinstance(g, int) and not isinstance(g, bool) and 1 <= g <= MAX_GROUP):
        return f"a state averaged by {g!r} peers"
    if not (isinstance(meta.get("sha"), bytes) and len(meta["sha"]) == 32):
        return "no payload hash"
    return None


def schema_differs(theirs: object, mine: str) -> str:
    """The keys of two peers' settings (JSON objects, as ``launch.join.schema_of`` makes them) that differ, as
    ``key: theirs there, mine here; ...`` (the keys of a nested object, the model's, named one by one)."""
    try:
        a, b = json.loads(theirs), json.loads(mine)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        a = b = None
    if not isinstance(a, dict) or not isinstance(b, dict):
        return f"its settings {theirs!r}, this peer's {mine!r}"
    a, b = flat_settings(a), flat_settings(b)
    return "; ".join(f"{k}: {a.get(k, '(none)')!r} there, {b.get(k, '(none)')!r} here"
                     for k in sorted(set(a) | set(b)) if a.get(k, "(none)") != b.get(k, "(none)"))


@dataclass
class EpochResult:
    """What one exchange agreed on: members in canonical order with their payloads and metadata."""

    epoch: int
    group: str
    members: list  # PeerIDs that delivered and committed, sorted
    payloads: dict  # PeerID -> bytes (emptied once the transport hands them to the collective)
    meta: dict  # PeerID -> gathered metadata
    alone: bool = False
    seconds: float = 0.0
    matchmaking_s: float = 0.0
    notes: list = field(default_factory=list)
    sent_bytes: int = 0  # payload bytes this peer delivered to other members
    received_bytes: int = 0  # payload bytes it took from the members it kept
    exchange_s: float = 0.0  # seconds from the group's forming to the last payload delivered and received
    deadline_s: float = 0.0  # how long this peer waited at most for the members' payloads (exchange_timeout)


class EpochMixin:
    """The exchange of :class:`~diloco.comm.hivemind.HivemindTransport`: one call of :meth:`exchange` per epoch."""

    def exchange(self, payload: bytes) -> EpochResult:
        """Run one epoch: form a group, send ``payload`` to every member, agree on who delivered."""
        fp = self.fingerprint_fn() if self.fingerprint_fn is not None else b""
        compute_s = time.perf_counter() - self._round_start
        self._pace_deadlines(len(payload))
        # how long this peer waits for slower peers announced at this epoch: a few of its own rounds, each its
        # training and its last exchange (on a slow link the exchange is most of a round)
        last_exchange = self.last.seconds if self.last is not None and not self.last.alone else 0.0
        wait_cap = max(self.matchmaking_time, self.wait_rounds * (compute_s + last_exchange))
        try:
            result = self._call(self._epoch(payload, fp, wait_cap),
                                wait_cap + self.matchmaking_time * 4 + self.exchange_timeout * 3 + 60)
        except Exception as e:  # a failed exchange is a round done alone, never the end of training
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not self.daemon_alive():  # for good: say what happened and what to do, not the socket's errno
                why = ("this peer's p2p daemon (p2pd) is gone, killed or crashed: it cannot reach the swarm again "
                       "until it is started again (Ctrl-C saves a checkpoint; then run loco join again)")
            log.warning("peer %s | epoch %d: the exchange failed (%s); this round is done alone", self.me[-8:],
                        self.epoch, why)
            result = EpochResult(self.epoch, "", [self.peer_id], {self.peer_id: payload},
                                 {self.peer_id: {"fp": fp, "stale": self.stale, "g": self.last_group}}, alone=True,
                                 notes=[f"the exchange failed ({why})"], deadline_s=self.exchange_timeout)
        self._after_epoch(result, fp)
        # the next round starts now: announce when this peer expects to reach the next epoch
        self.round_s = compute_s
        self._round_start = time.perf_counter()
        self.phase, self.eta = "train", _now() + compute_s
        try:
            self._call(self._heartbeat(), 30)
        except Exception as e:
            log.info("peer %s: heartbeat failed: %s", self.me[-8:], e)
        return result

    async def _phase(self, name: str, data):
        """The start of a phase of an epoch ("push": this peer's payload, "ack": its commit) or of serving a
        state stripe ("state"): ``on_phase`` may act there (the fault tests stop or kill this peer's daemon,
        or corrupt what it sends) and returns what is sent."""
        return data if self.on_phase is None else await self.on_phase(name, data)

    def _pace_deadlines(self, nbytes: int) -> None:
        """Before an epoch: the deadlines that are not fixed follow this peer's measurements. The exchange
        deadline assumes the largest group this epoch can have (every live peer of the last rendezvous), an
        upper bound until the group is known (:meth:`_deadline_for` then sets it from the members)."""
        if self.fixed_matchmaking_time is None:
            self.matchmaking_time = matchmaking_window(self.forming.median())
        others = max(self.last_group - 1, self._live_seen, 1)
        self._deadline_for(2 * nbytes * others, others)

    def _deadline_for(self, expected_bytes: int, others: int) -> None:
        """An adaptive peer's exchange deadline for ``expected_bytes`` (sent and received) with ``others``."""
        if self.fixed_exchange_timeout is None:
            self.exchange_timeout = exchange_deadline(expected_bytes, self.rate.median(), others)

    def _measure(self, moved: int, seconds: float) -> None:
        """One exchange in which every member delivered: its rate counts (when it moved enough bytes)."""
        if moved >= MIN_MEASURED_BYTES and seconds > 0:
            self.rate.add(moved / seconds)

    def _expects(self, entry: dict, now: float, waited: float) -> bool:
        """Whether a peer that has not reached this epoch yet is still worth waiting for: always for the first
        ``matchmaking_time`` seconds, then until its announced arrival time, with slack for a round that runs
        longer than the last one. A peer downloading the group's state (its arrival time did not count the
        download) is waited for up to two of its rounds from the download's start."""
        if waited < self.matchmaking_time:
            return True
        slack = max(self.matchmaking_time, 0.5 * float(entry.get("round_s") or 0.0))
        if entry.get("phase") == "resync":  # its download, then a round of training: up to two of its rounds
            return now <= float(entry.get("time", 0.0)) + 2 * float(entry.get("round_s") or 0.0) + slack
        eta = entry.get("eta")
        if eta is None:  # its first round: no estimate yet (the caller's cap bounds the wait)
            return True
        return now <= float(eta) + slack

    async def _rendezvous(self, wait_cap: float, notes: list) -> tuple[dict, int]:
        """Wait on the registry until every live peer expected at this peer's epoch has arrived.

        A peer that finds others past its epoch joins theirs (``stale``: it contributes its older update
        and takes the group's state afterwards). Peers still training toward this epoch (or an earlier one,
        from which they will move up) are waited for until their announced arrival time, at most
        ``wait_cap`` seconds. Returns the live peers waiting at this epoch (by peer id) and how many other
        live peers the registry lists.
        """
        begin = time.perf_counter()
        end = begin + wait_cap
        announced = None
        last_links = 0.0
        while True:
            live, apart = {}, 0
            for pid, v in (await self._registry()).items():
                if pid == self.me or self._suspected(pid, v):
                    continue
                if self._other_settings(pid, v, notes):
                    apart += 1
                else:
                    live[pid] = v
            self._apart = apart  # live peers of the run with other settings (the lone round's note counts them)
            if time.perf_counter() - last_links >= 0.5:  # a peer whose libp2p connection dropped is not waited for
                last_links = time.perf_counter()
                for pid in await self._lost(live):
                    self.suspects[pid] = _now()
                    live.pop(pid)
                    notes.append(f"peer {pid[-8:]}: its libp2p connection dropped and it cannot be dialled: "
                                 f"not waited for")
            ahead = max((int(v.get("epoch", -1)) for v in live.values()), default=-1)
            if ahead > self.epoch:
                notes.append(f"this peer is behind (epoch {self.epoch}, peers at {ahead}): it joins epoch {ahead} "
                             f"and then takes the group's state")
                self.epoch, self.stale = ahead, True
            e = self.epoch
            if announced != (e, self.phase):
                await self._heartbeat()
                announced = (e, self.phase)
            here = {pid: v for pid, v in live.items()
                    if int(v.get("epoch", -1)) == e and v.get("phase") not in ("train", "resync")}
            now = _now()
            pending = [pid for pid, v in live.items() if pid not in here and int(v.get("epoch", -1)) <= e
                       and self._expects(v, now, time.perf_counter() - begin)]
            grouping = any(v.get("phase") == "group" for v in here.values())
            stopping = self.stop_requested is not None and self.stop_requested()
            if not pending or grouping or stopping or time.perf_counter() >= end:
                if pending and not grouping and not stopping:
                    notes.append(f"{len(pending)} peer(s) announced for epoch {e} did not arrive within "
                                 f"{wait_cap:.0f}s: going on without them")
                return here, len(live)
            await asyncio.sleep(0.25)

    async def _lost(self, pids) -> list[str]:
        """The peers among ``pids`` (base58) that libp2p lost: connected to this peer before, not now, and a
        dial fails. A peer this one never had a connection to proves nothing by having none."""
        from hivemind.p2p import PeerID

        connected = {i.peer_id.to_base58() for i in await self.p2p.list_peers()}
        self._linked |= connected
        self._ever |= connected & set(self._seen)  # peers _mend redials should the DHT lose them
        gone = [pid for pid in pids if pid in self._linked and pid not in connected]

        async def dial(pid: str) -> bool:
            try:  # the daemon dials the addresses it knows for the peer; a dead one refuses at once
                await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(pid), []), 3)
                return True
            except Exception:
                return False

        alive = await asyncio.gather(*[dial(pid) for pid in gone])
        lost = [pid for pid, ok in zip(gone, alive) if not ok]
        self._linked.difference_update(lost)
        return lost

    def _open_window(self, epoch: int, payload: bytes, group: int) -> Window:
        """Start accepting pushes for ``epoch``: sizes from this peer's own payload, room for ``group`` members."""
        # sizes from this peer's own payload (its model and codec), however large: a 1B model's fp32 payload is
        # 4.4 GB; max_payload_bytes bounds only a payload whose size nothing derives
        least, most, exact = payload_sizes(payload, self.max_payload_bytes)
        self._window = Window(epoch, least, most, exact, inbox_cap(most, group))
        self._inbox.clear()
        return self._window

    def _close_window(self) -> None:
        """The epoch is over: nothing more is accepted for it, and what it left in the inbox goes. Its group
        is kept, for the members still relaying their last messages through this peer (:meth:`_forward`)."""
        if self._window is not None and self._window.gid is not None:
            self._ended = self._window
        self._window = None
        self._inbox.clear()

    def _know_group(self, w: Window, gid: bytes, sizes: dict) -> None:
        """The group is formed: from now on only its members, each with its announced size; the pushes of
        anyone else (strangers that pushed before the group was known) are dropped."""
        w.gid, w.sizes = gid, dict(sizes)
        w.cap = max(w.cap, inbox_cap(w.most, len(sizes)))
        for key in [k for k in self._inbox if k[0] != gid]:
            for sender in self._inbox.pop(key):
                w.held.pop((sender, key[1]), None)
        for key, box in self._inbox.items():
            for sender in [p for p, data in box.items()
                           if p not in sizes or (key[1] == "ag" and len(data) != sizes[p])]:
                del box[sender]
                w.held.pop((sender, key[1]), None)

    def _admit(self, w: Optional[Window], sender, header: dict, n: int, receiver=None) -> Optional[str]:
        """Why a push whose header is ``header`` (announcing ``n`` body bytes) to ``receiver`` (this peer, or
        a member it forwards to) is refused, or None: checked before any of the body is read."""
        if w is None:
            return "this peer is not in an exchange"
        g, kind, e, sha, m = (header.get(f) for f in ("g", "k", "e", "sha", "m"))
        if not (isinstance(g, bytes) and len(g) <= 64 and kind in KINDS and isinstance(e, int)
                and isinstance(sha, bytes) and len(sha) == 32 and isinstance(m, bytes)):
            return "a malformed header"
        if e != w.epoch:
            return f"a push for epoch {e}; this peer is at epoch {w.epoch}"
        if not hmac.compare_digest(m, _push_mac(self.key, g, kind, e, sender.to_bytes(),
                                                (receiver or self.peer_id).to_bytes(), n, sha)):
            return "bad MAC (no or another run key)"
        if (sender, kind) in w.reading:
            return "a second push of one kind while the first is being read"
        if w.gid is not None:
            if g != w.gid:
                return "a push for another group"
            if sender not in w.sizes:
                return "the sender is not a member of this epoch's group"
        if kind == "ack":
            return None if n <= ACK_MAX else f"an ack of {n} bytes (at most {ACK_MAX})"
        if not w.fits(n):
            return f"a payload of {n} bytes; this run's model and codec make {w.expected()}"
        if w.sizes is not None and n != w.sizes[sender]:
            return f"a payload of {n} bytes; the sender announced {w.sizes[sender]} to the group"
        return None

    async def _epoch(self, payload: bytes, fp: bytes, wait_cap: float) -> EpochResult:
        start = time.perf_counter()
        notes: list = []
        self.phase, self.eta = "wait", _now()
        here, others = await self._rendezvous(wait_cap, notes)
        self._live_seen = others
        e = self.epoch
        # pushes may come before the group is known: meanwhile, the deadline of a group of everyone waiting here
        self._deadline_for(2 * len(payload) * max(len(here), 1), max(len(here), 1))
        window = self._open_window(e, payload, 1 + len(here))
        try:
            return await self._grouped(payload, fp, e, here, others, window, start, notes)
        finally:
            self._close_window()

    async def _grouped(self, payload: bytes, fp: bytes, e: int, here: dict, others: int, window: Window,
                       start: float, notes: list) -> EpochResult:
        """The epoch after the rendezvous: matchmaking, the pushes, the commit."""
        from hivemind.averaging.control import StepControl
        from hivemind.utils import MPFuture

        mine = {"e": e, "fp": fp, "stale": self.stale, "g": self.last_group, "n": len(payload),
                "sha": hashlib.sha256(payload).digest(),
                "tok": mac(self.key, b"join", self.peer_id.to_bytes(), str(e).encode())}
        expected = 1 + len(here)
        group = None
        if expected > 1:
            self.phase = "group"
            await self._heartbeat()
            self.mm.group_key_manager.prefix = f"{self.run}_e{e}"  # one DHT key per epoch: epochs never mix
            self.mm.target_group_size = expected  # assemble at once when every peer waiting here has come
            step = StepControl(scheduled_time=_now() + self.matchmaking_time,
                               deadline=_now() + self.matchmaking_time + 2, allow_retries=False, weight=1.0,
                               data_for_gather=pack(mine))
            step.attach(MPFuture(), MPFuture())
            step.allow_allreduce()
            forming = time.perf_counter()
            try:
                group = await self.mm.look_for_group(step)
            finally:
                if not step.done():
                    step.set_result(None)
            if group is not None and len(group.peer_ids) == expected:  # a group short of someone waited it out
                self.forming.add(time.perf_counter() - forming)
        mm_s = time.perf_counter() - start
        if group is None:
            return EpochResult(e, "", [self.peer_id], {self.peer_id: payload}, {self.peer_id: mine}, alone=True,
                               seconds=time.perf_counter() - start, matchmaking_s=mm_s,
                               deadline_s=self.exchange_timeout,
                               notes=notes + [self._why_alone(e, mm_s, others)])
        members, meta = [], {}
        for pid, blob in zip(group.peer_ids, group.gathered):
            try:
                m = unpack(blob)
                good = m["e"] == e and hmac.compare_digest(
                    m["tok"], mac(self.key, b"join", pid.to_bytes(), str(e).encode()))
            except Exception:
                good = False
            if not good:
                notes.append(f"peer {pid.to_base58()[-8:]} has no valid run-key token: left out")
            elif pid != self.peer_id and (why := _malformed(m, fp)):
                notes.append(f"peer {pid.to_base58()[-8:]} announces {why}: left out")
            elif not (isinstance(m.get("n"), int) and window.fits(m["n"])):
                notes.append(f"peer {pid.to_base58()[-8:]} announces a payload of {m.get('n')} bytes; this run's "
                             f"model and codec make {window.expected()}: left out")
            else:
                members.append(pid)
                meta[pid] = m
        members.sort()
        gid = group.group_id
        self._know_group(window, gid, {p: meta[p]["n"] for p in members})
        others = [p for p in members if p != self.peer_id]
        # the members and their payload sizes are known: what this peer sends and receives in this epoch
        self._deadline_for(len(payload) * len(others) + sum(meta[p]["n"] for p in others), len(others))
        began = time.perf_counter()
        deadline = began + self.exchange_timeout
        self._relayed = set()
        pushed = await self._phase("push", payload)
        sent = await self._push_all(others, gid, "ag", pushed, deadline, mine["sha"] if pushed is payload else None)
        unreachable = {p for p, r in zip(others, sent) if r != "ok"}
        refusers = {p for p, r in zip(others, sent) if r == "refused"}  # alive, but turned this peer's payload away
        got = await self._collect(gid, "ag", {p for p in others if p not in unreachable}, deadline, e)
        exchange_s = time.perf_counter() - began
        if others and not unreachable and len(got) == len(others):  # a round that waited out a member measures it
            self._measure(len(payload) * len(others) + sum(len(d) for d in got.values()), exchange_s)
        for p in others:
            if (p, "ag") in window.refused and p not in got:
                notes.append(f"peer {p.to_base58()[-8:]}: its payload was refused ({window.refused[(p, 'ag')]})")
        received = {self.peer_id: payload}
        for p, data in got.items():  # each body was checked against its push's hash as it came: compare those
            if window.hashes.get((p, "ag")) == meta[p]["sha"]:
                received[p] = data
            else:
                notes.append(f"peer {p.to_base58()[-8:]}: payload does not match its announced hash: left out")
        # commit: tell every member whom we hold a payload from; keep those every answering member holds
        body = pack(sorted(p.to_bytes() for p in received))
        committing = time.perf_counter() + min(10.0, self.exchange_timeout)
        await self._push_all(others, gid, "ack", await self._phase("ack", body), committing)
        acks = await self._collect(gid, "ack", set(others) - refusers, committing, e)
        final = set(received) & ({self.peer_id} | set(acks))
        for p, blob in acks.items():
            try:
                held = {type(self.peer_id)(b) for b in unpack(blob)}
            except Exception:
                held = set()
            base = set(received) - {p}  # what this peer holds of the others' payloads, its own included
            missing = base - held
            if p not in held:  # not a commit (a member holds its own payload): that member is left out
                final.discard(p)
            elif len(missing) >= 2 and 2 * len(missing) > len(base):
                # a commit that would narrow the round to little more than the member's own payload (it lies, or
                # nothing reached it): that member is left out, so that it cannot make its update the group's
                final.discard(p)
                notes.append(f"peer {p.to_base58()[-8:]}'s commit leaves out {len(missing)} of the {len(base)} "
                             "other payloads this peer holds: left out")
            else:
                final &= held
        if not final:  # no payload that every member who answered holds: nothing was agreed
            notes.append(f"the members of epoch {e} hold no payload in common: this round is done alone")
            final = {self.peer_id}
        for p in others:
            if p in final:
                self.suspects.pop(p.to_base58(), None)
            elif p in refusers:
                notes.append(f"peer {p.to_base58()[-8:]} refused this peer's payload: left out")
            else:
                self.suspects[p.to_base58()] = _now()
                notes.append(f"peer {p.to_base58()[-8:]} did not complete epoch {e}: left out")
        ordered = sorted(final)
        return EpochResult(e, gid.hex()[:12], ordered, {p: received[p] for p in ordered}, {p: meta[p] for p in ordered},
                           alone=len(ordered) == 1, seconds=time.perf_counter() - start, matchmaking_s=mm_s,
                           notes=notes, sent_bytes=len(payload) * sum(1 for r in sent if r == "ok"),
                           received_bytes=sum(len(d) for p, d in received.items() if p != self.peer_id),
                           exchange_s=exchange_s, deadline_s=self.exchange_timeout)

    def _after_epoch(self, result: EpochResult, fp: bytes) -> None:
        """A member whose state differs from the group's canonical one takes it after this epoch.

        The canonical state is the one most members in step (not behind) share; between equally supported
        states, the one that came out of the larger group last epoch (a peer that trained alone gives way
        to peers that averaged together), then the smaller peer id. States compare by their sketches
        (:func:`same_state`): peers on different hardware may round the same average differently in the last
        bit, which is no reason to download the model again.
        """
        fresh = [p for p in result.members if not result.meta[p].get("stale")] or result.members
        sketches = {p: result.meta[p].get("fp", b"") for p in fresh}
        support = {p: [q for q in fresh if same_state(sketches[p], sketches[q])] for p in fresh}
        weight = {p: max(int(result.meta[q].get("g", 1)) for q in support[p]) for p in fresh}
        best = min(fresh, key=lambda p: (-len(support[p]), -weight[p], p))
        self.resync_from = [] if same_state(fp, sketches[best]) else support[best]
        if not self.resync_from:
            self.stale = False
        self.last_group = len(result.members)
        self.last = result
        self.epoch += 1
        for note in result.notes:
            log.info("peer %s | epoch %d: %s", self.me[-8:], result.epoch, note)

    async def _push_all(self, peers: list, gid: bytes, kind: str, data: bytes, deadline: float,
                        sha: Optional[bytes] = None) -> list[str]:
        """:meth:`_push` to every one of ``peers`` by ``deadline`` (``time.perf_counter()``). A peer this one
        cannot reach (both behind NAT, say) is sent ``data`` through another member that took this peer's push
        directly (:meth:`_forward` there); such a peer is remembered for ``UNREACHABLE_S`` and then reached
        through a member at once. ``sha``: ``data``'s SHA-256 when the caller has it (hashed once for all)."""
        sha = sha or hashlib.sha256(data).digest()
        now = _now()
        known = {p for p in peers if now - self._unreachable.get(p.to_base58(), -UNREACHABLE_S) < UNREACHABLE_S}
        direct = [p for p in peers if p not in known]
        sent = dict(zip(direct, await asyncio.gather(*[self._push(p, gid, kind, data, deadline, sha=sha)
                                                        for p in direct])))
        via = [p for p in direct if sent[p] == "ok"]
        for p in direct:
            if sent[p] == "failed":
                self._unreachable[p.to_base58()] = now
            else:
                self._unreachable.pop(p.to_base58(), None)

        async def around(peer) -> str:
            relays = [v for v in via if v != peer]
            for relay in relays:
                r = await self._push(peer, gid, kind, data, deadline, relay=relay, sha=sha)
                if r != "failed":
                    if r == "ok":
                        self._relayed.add(peer)
                    return r
            return "failed" if relays or peer not in known else await self._push(peer, gid, kind, data, deadline,
                                                                                 sha=sha)

        rest = [p for p in peers if p in known or sent[p] == "failed"]
        sent.update(zip(rest, await asyncio.gather(*[around(p) for p in rest])))
        return [sent[p] for p in peers]

    async def _push(self, peer, gid: bytes, kind: str, data: bytes, deadline: float, relay=None,
                    sha: Optional[bytes] = None) -> str:
        """Send ``data`` to ``peer`` (through the member ``relay`` when given): "ok" (it took it), "refused" (it
        answered, or dropped the stream while connected: it is alive and turned the push away) or "failed" (no
        answer by ``deadline``, libp2p lost it, or the relay could not reach it: a stopped or cut-off peer
        costs the others no more than the deadline). The header names sender and receiver ("f", "t"), under
        the MAC."""
        sha = sha or hashlib.sha256(data).digest()
        header = {"g": gid, "k": kind, "e": self.epoch, "n": len(data), "sha": sha, "f": self.peer_id.to_bytes(),
                  "t": peer.to_bytes(),
                  "m": _push_mac(self.key, gid, kind, self.epoch, self.peer_id.to_bytes(), peer.to_bytes(), len(data),
                                 sha)}
        hop = relay or peer

        def left() -> float:
            return max(0.05, deadline - time.perf_counter())

        for attempt in range(2):
            writer = None
            try:
                if deadline - time.perf_counter() <= 0:
                    raise asyncio.TimeoutError("the exchange's deadline passed")
                _, reader, writer = await asyncio.wait_for(
                    self.p2p.call_binary_stream_handler(hop, f"{self.run}.push"), min(10.0, left()))
                await asyncio.wait_for(_write_framed(writer, header, data), left())
                answer = await asyncio.wait_for(reader.readexactly(1), left())
                if answer == UNREACHED:
                    log.info("peer %s: %s could not reach %s with this peer's %s", self.me[-8:],
                             hop.to_base58()[-8:], peer.to_base58()[-8:], kind)
                    return "failed"
                return "ok" if answer == OK else "refused"
            except Exception as e:
                connected = {info.peer_id for info in await self.p2p.list_peers()}
                if attempt == 1 or hop not in connected or deadline - time.perf_counter() < 1.0:
                    log.info("peer %s: sending %s to %s%s failed: %s: %s", self.me[-8:], kind, peer.to_base58()[-8:],
                             f" through {relay.to_base58()[-8:]}" if relay else "", type(e).__name__, e)
                    timed_out = isinstance(e, asyncio.TimeoutError)
                    return "refused" if hop in connected and not timed_out and not relay else "failed"
            finally:
                if writer is not None:
                    writer.close()
        return "failed"

    async def _on_push(self, info, reader, writer) -> None:
        """Take one member's push. Its header is read and checked first (:meth:`_admit`, then room in the
        inbox); only an accepted header's body is read, so a refused push costs this peer the header's bytes."""
        sender = info.peer_id
        w = slot = None
        stored = False
        try:
            header, n = await _read_header(reader, PUSH_HEADER_MAX)
            w = self._window
            to, frm = header.get("t", self.peer_id.to_bytes()), header.get("f", sender.to_bytes())
            if to != self.peer_id.to_bytes():
                if frm != sender.to_bytes():
                    raise PermissionError("a push for another peer that its sender did not send")
                return await self._forward(w, sender, header, n, reader, writer)
            if frm != sender.to_bytes():  # brought by a member that relays for the sender
                await self._await_group(w)
                why = self._relay_refused(w, sender, "a push for this peer")
                if why is not None:
                    raise PermissionError(why)
                sender = type(sender)(frm)
            why = self._admit(w, sender, header, n)
            if why is None:
                slot = (sender, header["k"])
                w.reading.add(slot)
                self._drop_held(w, slot)  # a sender holds one push of a kind: a new one replaces the old
                end = time.perf_counter() + min(5.0, self.matchmaking_time)
                while w.used() + n > w.cap and w.gid is None and self._window is w and time.perf_counter() < end:
                    await asyncio.sleep(0.05)  # the group, once known, drops what non-members pushed
                if w.used() + n > w.cap:
                    why = f"the inbox is full ({w.used()} of {w.cap} bytes held)"
            if why is not None:
                if w is not None:
                    w.refuse(sender, header.get("k"), why)
                raise PermissionError(why)
            w.held[slot] = n  # reserved before the body is read
            data = await _read_body(reader, n, self.exchange_timeout)
            if hashlib.sha256(data).digest() != header["sha"]:
                raise PermissionError("the payload does not match the hash in its header")
            if self._window is not w:
                raise PermissionError("the exchange it was for is over")
            if w.gid is not None and (header["g"] != w.gid or sender not in w.sizes):
                raise PermissionError("the sender is not a member of this epoch's group")
            self._inbox.setdefault((header["g"], header["k"], w.epoch), {})[sender] = data
            w.hashes[slot] = header["sha"]  # checked above: the commit compares it with the announced one
            stored = True
            self._arrived.set()
            writer.write(OK)
            await writer.drain()
            await asyncio.wait_for(reader.read(1), 10)  # the sender closes first (p2pd may drop our ack otherwise)
        except Exception as e:
            log.info("peer %s: refused a push from %s: %s: %s", self.me[-8:], sender.to_base58()[-8:],
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

    async def _await_group(self, w: Optional[Window]) -> None:
        """Until this peer knows the group of window ``w`` (members that learnt it first may already relay),
        at most a few seconds."""
        end = time.perf_counter() + min(5.0, self.matchmaking_time)
        while w is not None and w.gid is None and self._window is w and time.perf_counter() < end:
            await asyncio.sleep(0.05)

    def _relay_refused(self, w: Optional[Window], relay, what: str) -> Optional[str]:
        """Why ``relay`` may not carry ``what`` between two members (None: it may): only a member of this
        peer's known group relays."""
        if w is None:
            return f"{what} through {relay.to_base58()[-8:]}, while this peer is not in an exchange"
        if w.gid is None:
            return f"{what} through {relay.to_base58()[-8:]}, before this peer knows its group"
        if relay not in w.sizes:
            return f"{what} through {relay.to_base58()[-8:]}, which is not a member of this epoch's group"
        return None

    async def _forward(self, w: Optional[Window], sender, header: dict, n: int, reader, writer) -> None:
        """Carry a member's push to another member that the sender cannot reach: the header is checked as the
        receiver will check it (the MAC binds sender and receiver, so a relay can neither forge nor redirect
        it in a keyed run), the body is streamed through in pieces (never held whole), and the receiver's
        answer goes back to the sender."""
        from hivemind.p2p import PeerID

        out = None
        answer = FAIL
        try:
            to = PeerID(header["t"]) if isinstance(header.get("t"), bytes) and len(header["t"]) <= 64 else None
            await self._await_group(w)
            ended = self._ended
            if (w is None or w.gid != header.get("g")) and ended is not None and ended.gid == header.get("g"):
                w = ended  # this peer's part of the epoch is done; the others' still goes through it
            why = "a malformed header" if to is None else self._relay_refused(w, sender, "a push")
            if why is None and to not in w.sizes:
                why = "a push for a peer that is not a member of this epoch's group"
            if why is None:
                why = self._admit(w, sender, header, n, receiver=to)
            if why is not None:
                raise PermissionError(why)
            answer = UNREACHED  # from here on, a failure is the receiver's or the link's, not a refusal
            _, back, out = await asyncio.wait_for(self.p2p.call_binary_stream_handler(to, f"{self.run}.push"), 10)
            _write_head(out, header, n)
            left = n
            while left:
                piece = await asyncio.wait_for(reader.readexactly(min(left, PIECE)), self.exchange_timeout)
                out.write(piece)
                await out.drain()
                left -= len(piece)
            answer = await asyncio.wait_for(back.readexactly(1), self.exchange_timeout)
        except Exception as e:
            log.info("peer %s: did not forward a push from %s: %s: %s", self.me[-8:], sender.to_base58()[-8:],
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

    def _drop_held(self, w: Window, slot: tuple) -> None:
        """Forget what ``slot`` (sender, kind) pushed earlier in this epoch."""
        sender, kind = slot
        for key, box in self._inbox.items():
            if key[1] == kind:
                box.pop(sender, None)
        w.held.pop(slot, None)
        w.hashes.pop(slot, None)

    def _other_settings(self, pid: str, entry: dict, notes: list) -> bool:
        """Whether a peer of this run announces other settings (another model, codec or outer step: matchmaking
        never puts it in a group with this peer). It is not waited for, nor followed to its epoch; the first
        time, the notes and the log name it and what differs."""
        if self._alike(entry):
            return False
        if pid not in self._foreign:
            self._foreign.add(pid)
            note = (f"peer {pid[-8:]} of run '{self.run}' trains with other settings "
                    f"({schema_differs(entry['settings'], self.settings)}): it never groups with this peer and is "
                    f"not waited for; start every peer with the run's --config")
            notes.append(note)
            log.warning("peer %s: %s", self.me[-8:], note)
        return True

    def _why_alone(self, e: int, waited: float, others: int) -> str:
        if others:
            return f"no other peer reached epoch {e} within {waited:.0f}s"
        apart = self._apart
        if apart:  # named, with what differs, the first time each was seen
            return (f"no other live peer trains with this peer's settings ({apart} of the run's live peers "
                    f"{'has' if apart == 1 else 'have'} other settings)")
        return "no other live peer in the run"

    def _suspected(self, pid: str, entry: dict) -> bool:
        return pid in self.suspects and float(entry.get("time", 0)) <= self.suspects[pid]

    async def _collect(self, gid: bytes, kind: str, senders: set, deadline: float, epoch: int) -> dict:
        """Wait for ``kind`` messages of this group from ``senders``; not for peers that died or moved on."""
        last_check = last_registry = 0.0
        while True:
            self._arrived.clear()
            box = self._inbox.get((gid, kind, epoch), {})
            window = self._window
            if window is not None:  # a member whose push was refused sends nothing more
                senders = {p for p in senders if p in box or (p, kind) not in window.refused}
            missing = {p for p in senders if p not in box}
            if not missing or time.perf_counter() >= deadline:
                return {p: box[p] for p in senders if p in box}
            # what arrived while the checks below awaited counts: a member that delivered and then moved on
            # (its registry entry is at the next epoch) is not left out
            if time.perf_counter() - last_check > 0.5:  # a peer libp2p lost is not waited for
                last_check = time.perf_counter()
                connected = {i.peer_id for i in await self.p2p.list_peers()}
                lost = {p for p in missing - connected - self._relayed
                        if p not in self._inbox.get((gid, kind, epoch), {})}
                if lost:
                    senders = senders - lost
                    continue
            if time.perf_counter() - last_registry > 1.0:  # nor one whose matchmaking gave up on this epoch
                last_registry = time.perf_counter()
                reg = await self._registry()
                moved = {p for p in missing if int(reg.get(p.to_base58(), {}).get("epoch", -1)) > epoch
                         and p not in self._inbox.get((gid, kind, epoch), {})}
                if moved:
                    senders = senders - moved
                    continue
            try:
                await asyncio.wait_for(self._arrived.wait(), min(0.25, max(0.0, deadline - time.perf_counter())))
            except asyncio.TimeoutError:
                pass
