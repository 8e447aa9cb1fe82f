"""Internet peers: a transport over hivemind's DHT, matchmaking and libp2p streams.

A swarm has no fixed ranks. Every exchange (a DiLoCo round, a DeMo step) is
one *epoch*: the peers that reach it within the matchmaking window form a
group through hivemind's leader-based matchmaking (one DHT key per run and
epoch, so epochs never mix), and every member pushes its payload (loco's wire
format: int8, fp4, top-k... stay compressed on the wire) to every other
member over a libp2p binary stream. A short commit step makes every survivor
agree on who delivered, so all members average the same payloads in the same
(sorted peer id) order and end the epoch with the same result. A member that
vanishes is left out after the timeout; an epoch nobody else reaches is done
alone, and the log says so.

To the training loop a peer is a run of its own (``rank`` 0 of 1: it writes
its own run folder and checkpoints); the swarm shows in the collectives:

* ``all_reduce_compressed_`` / ``all_reduce_``: every member decodes every
  member's payload, drops what fails validation (wire format, finiteness),
  clips (or drops, ``clip_action``) a contribution whose norm is more than
  ``norm_clip`` times the median of the *other* members' norms, and averages;
* ``all_gather_bytes``: the members' payloads in canonical order (DeMo).

Peers keep the global state consistent: each member states a fingerprint of
its state before the epoch; a member whose fingerprint differs from the
majority still contributes, then downloads the state from a majority member
(``resync_from``). A new peer downloads the current state the same way
(``download_state``). Peers that hold a run key (``run_key``) sign every DHT
request and response (HMAC), their join tokens and every payload; without it a
peer cannot even bootstrap into the DHT. Each member keeps a ledger of who
contributed (tokens, epochs, accepted and rejected updates), built from the
data every member saw alike, and publishes it in the DHT for ``loco status``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
import secrets
import statistics
import struct
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch

from diloco.comm.base import Transport, TransportError, _buckets, _unflatten_into, die_with_parent

log = logging.getLogger("loco.hivemind")

OK, FAIL = b"\x01", b"\x00"
MAX_HEADER = 64 << 10
_WEIGHT = struct.Struct("<d")
RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts (so that part boundaries cannot shift)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def check_run_name(name: str) -> str:
    if not RUN_NAME.match(name or ""):
        raise ValueError(f"run name {name!r}: use 1-64 letters, digits, '-' or '_' (it becomes a DHT key prefix)")
    return name


def _make_authorizer(secret: bytes):
    from hivemind.utils.auth import AuthorizerBase
    from hivemind.utils.timed_storage import TimedStorage, get_dht_time

    class HMACAuthorizer(AuthorizerBase):
        """Shared-key authorization of DHT requests and responses: HMAC, time skew <= 60 s, no nonce replays."""

        MAX_SKEW = 60.0

        def __init__(self) -> None:
            self.nonces = TimedStorage()

        def _digest(self, msg) -> bytes:
            sig = msg.auth.signature
            msg.auth.signature = b""
            d = hmac.new(secret, msg.SerializeToString(), hashlib.sha256).digest()
            msg.auth.signature = sig
            return d

        async def sign_request(self, request, service_public_key) -> None:
            request.auth.time = get_dht_time()
            request.auth.nonce = secrets.token_bytes(8)
            request.auth.signature = b""
            request.auth.signature = self._digest(request)

        async def validate_request(self, request) -> bool:
            if not hmac.compare_digest(request.auth.signature, self._digest(request)):
                return False
            now = get_dht_time()
            if abs(request.auth.time - now) > self.MAX_SKEW:
                return False
            with self.nonces.freeze():
                if request.auth.nonce in self.nonces:
                    return False
            self.nonces.store(request.auth.nonce, None, now + 3 * self.MAX_SKEW)
            return True

        async def sign_response(self, response, request) -> None:
            response.auth.nonce = request.auth.nonce
            response.auth.signature = b""
            response.auth.signature = self._digest(response)

        async def validate_response(self, response, request) -> bool:
            return response.auth.nonce == request.auth.nonce and \
                hmac.compare_digest(response.auth.signature, self._digest(response))

    return HMACAuthorizer()


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


def _dht_class():
    from hivemind.dht import DHT

    class PeerDHT(DHT):
        def run(self) -> None:
            die_with_parent()
            super().run()

    return PeerDHT


@dataclass
class PeerRecord:
    """One peer's column of the contribution ledger."""

    tokens: float = 0.0
    epochs: int = 0
    accepted: int = 0
    rejected: int = 0
    clipped: int = 0

    def as_list(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_list(cls, v: Sequence) -> "PeerRecord":
        return cls(float(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]) if len(v) > 4 else 0)


@dataclass
class EpochResult:
    """What one exchange agreed on: members in canonical order with their payloads and metadata."""

    epoch: int
    group: str
    members: list  # PeerIDs that delivered and committed, sorted
    payloads: dict  # PeerID -> bytes
    meta: dict  # PeerID -> gathered metadata
    alone: bool = False
    seconds: float = 0.0
    matchmaking_s: float = 0.0
    notes: list = field(default_factory=list)


class HivemindTransport(Transport):
    """One peer of a swarm named ``run``. See the module docstring.

    ``initial_peers``: multiaddrs of peers already in the run (none: this peer starts it).
    ``matchmaking_time``: how long the first peer of an epoch waits for the others.
    ``exchange_timeout``: how long to wait for members' payloads once the group is formed.
    ``norm_clip`` / ``clip_action``: contributions above ``norm_clip`` x the median norm of the other
    members are scaled down to that bound (``clip``) or left out (``drop``); 0 turns this off.
    """

    rank = 0
    world_size = 1

    def __init__(self, run: str = "loco", *, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = (),
                 announce_maddrs: Sequence[str] = (), identity_path: Optional[str] = None,
                 run_key: Optional[bytes] = None, use_relay: bool = True, use_auto_relay: bool = False,
                 nat_port_map: bool = False, client_mode: bool = False, matchmaking_time: float = 5.0,
                 exchange_timeout: float = 60.0, heartbeat_ttl: float = 60.0, norm_clip: float = 10.0,
                 clip_action: str = "clip", schema: str = "", max_payload_bytes: int = 4 << 30,
                 startup_timeout: float = 30.0, observer: bool = False) -> None:
        super().__init__()
        self.run = check_run_name(run)
        if clip_action not in ("clip", "drop"):
            raise ValueError(f"clip_action must be 'clip' or 'drop', got {clip_action!r}")
        if not norm_clip >= 0:
            raise ValueError(f"norm_clip must be >= 0, got {norm_clip}")
        self.key = run_key or b""
        self.matchmaking_time, self.exchange_timeout = float(matchmaking_time), float(exchange_timeout)
        self.heartbeat_ttl, self.norm_clip, self.clip_action = heartbeat_ttl, float(norm_clip), clip_action
        self.max_payload_bytes, self.client_mode = max_payload_bytes, client_mode
        self.schema = hashlib.sha256(f"loco-swarm-v1|{run}|{schema}".encode()).digest()
        self.epoch = 0  # exchanges this peer's state has been through (downloaded state carries it)
        self.stale = False  # True from jumping ahead to the others' epoch until this peer downloads their state
        self.fingerprint_fn: Optional[Callable[[], bytes]] = None
        self.resync_from: list = []  # peers holding the majority state, set when this peer's state differs
        self.ledger: dict[str, PeerRecord] = {}
        self.history: list[dict] = []  # one record per epoch (also written by the driver)
        self.last: Optional[EpochResult] = None
        self.status: dict[str, Any] = {}  # extra fields of this peer's registry entry (throughput, step...)
        self.suspects: dict[str, float] = {}  # peer -> when it last failed us; forgiven once it heartbeats again
        self._inbox: dict = {}
        self._inbox_time: dict = {}
        self._snapshot: Optional[tuple[int, bytes, bytes]] = None  # (epoch, blob, sha256)
        self._closed = False
        self.observer = observer  # only reads the DHT (loco status): no heartbeat, no handlers

        kwargs: dict[str, Any] = dict(
            initial_peers=list(initial_peers), start=True, host_maddrs=list(host_maddrs) or ["/ip4/127.0.0.1/tcp/0"],
            identity_path=identity_path, use_relay=use_relay, use_auto_relay=use_auto_relay,
            nat_port_map=nat_port_map, client_mode=client_mode, startup_timeout=startup_timeout,
            ensure_bootstrap_success=True, await_ready=True)
        if announce_maddrs:
            kwargs["announce_maddrs"] = list(announce_maddrs)
        if self.key:
            kwargs["authorizer"] = _make_authorizer(self.key)
        try:
            self.dht = _dht_class()(**kwargs)
        except Exception as e:
            hint = (" (the run's peers refuse a peer without the run key or with another one: check --run-key)"
                    if "bootstrap" in str(e) else "")
            raise TransportError(f"could not start or join the swarm {run!r}: {e}{hint}") from None
        self.peer_id = self.dht.peer_id  # a blocking round trip: read it before our loop starts
        self.me = self.peer_id.to_base58()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loco-hivemind", daemon=True)
        self._thread.start()
        try:
            self._call(self._setup(), 60)
        except BaseException:
            self.close()
            raise

    # ---- plumbing ---------------------------------------------------------------------------
    def _call(self, coro, timeout: Optional[float] = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    async def _setup(self) -> None:
        from hivemind.averaging.matchmaking import Matchmaking

        self._arrived = asyncio.Event()
        self.p2p = await self.dht.replicate_p2p()
        if self.observer:
            return
        servicer_cls = _servicer_class()
        self.mm = Matchmaking(self.p2p, self.schema, self.dht, servicer_type=servicer_cls, prefix=self.run,
                              target_group_size=None, min_group_size=2,
                              min_matchmaking_time=self.matchmaking_time,
                              request_timeout=max(0.5, min(3.0, self.matchmaking_time / 3)),
                              client_mode=self.client_mode)
        servicer = servicer_cls()
        servicer.mm = self.mm
        await servicer.add_p2p_handlers(self.p2p, namespace=self.run)
        await self.p2p.add_binary_stream_handler(f"{self.run}.push", self._on_push)
        await self.p2p.add_binary_stream_handler(f"{self.run}.state", self._on_state_request)
        await self._heartbeat()
        self._beats = asyncio.create_task(self._beat_forever())

    async def _beat_forever(self) -> None:
        """Keep this peer's registry entry fresh through rounds longer than its time to live."""
        while True:
            await asyncio.sleep(self.heartbeat_ttl / 3)
            try:
                await self._heartbeat()
            except Exception as e:
                log.info("peer %s: heartbeat failed: %s", self.me[-8:], e)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def close(self) -> None:
        """Leave the swarm: stop serving, shut the P2P replica, then the DHT process (and its p2pd)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.is_alive():
                try:
                    self._call(self._shutdown(), 10)
                except Exception as e:
                    log.warning("hivemind: leaving the swarm uncleanly: %s", e)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        finally:
            self.dht.shutdown()

    async def _shutdown(self) -> None:
        if not self.observer:
            try:  # leave the registry now rather than when the entry expires
                await self.dht.store(f"{self.run}.peers", subkey=self.me, value=None,
                                     expiration_time=_now() + 1, return_future=True)
            except Exception:
                pass
        await self.p2p.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- DHT records ------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        value = {"epoch": self.epoch, "time": _now(), **self.status}
        await self.dht.store(f"{self.run}.peers", subkey=self.me, value=value,
                             expiration_time=_now() + self.heartbeat_ttl, return_future=True)

    async def _subkeys(self, key: str) -> dict[str, dict]:
        """A DHT dictionary record as {subkey: value}, keeping only dict values (a leaving peer stores None)."""
        res = await self.dht.get(key, latest=True, return_future=True)
        if res is None or not isinstance(res.value, dict):
            return {}
        return {k: v.value for k, v in res.value.items() if isinstance(getattr(v, "value", None), dict)}

    async def _registry(self) -> dict[str, dict]:
        return await self._subkeys(f"{self.run}.peers")

    def peers(self) -> dict[str, dict]:
        """The run's live peers from the DHT registry: peer id -> {epoch, time, throughput, ...}."""
        return self._call(self._registry(), 30)

    def heartbeat(self, **status: Any) -> None:
        self.status.update(status)
        self._call(self._heartbeat(), 30)

    async def _publish_ledger(self) -> None:
        value = {pid: rec.as_list() for pid, rec in self.ledger.items()}
        await self.dht.store(f"{self.run}.ledger", subkey=self.me, value=value,
                             expiration_time=_now() + 7 * 86400, return_future=True)

    # ---- one epoch --------------------------------------------------------------------------
    def exchange(self, payload: bytes) -> EpochResult:
        """Run one epoch: form a group, send ``payload`` to every member, agree on who delivered."""
        fp = self.fingerprint_fn() if self.fingerprint_fn is not None else b""
        try:
            result = self._call(self._epoch(payload, fp), self.matchmaking_time * 4 + self.exchange_timeout * 3 + 60)
        except Exception as e:  # a failed exchange is a round done alone, never the end of training
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            log.warning("peer %s | epoch %d: the exchange failed (%s); this round is done alone", self.me[-8:],
                        self.epoch, why)
            result = EpochResult(self.epoch, "", [self.peer_id], {self.peer_id: payload},
                                 {self.peer_id: {"fp": fp, "stale": self.stale}}, alone=True,
                                 notes=[f"the exchange failed ({why})"])
        self._after_epoch(result, fp)
        return result

    async def _epoch(self, payload: bytes, fp: bytes) -> EpochResult:
        from hivemind.averaging.control import StepControl
        from hivemind.utils import MPFuture
        from hivemind.utils.serializer import MSGPackSerializer

        start = time.perf_counter()
        notes = []
        live = await self._registry()
        live = {pid: v for pid, v in live.items() if pid == self.me or not self._suspected(pid, v)}
        ahead = max((int(v.get("epoch", -1)) for pid, v in live.items() if pid != self.me), default=-1)
        if ahead > self.epoch:
            # the others finished this epoch already: join theirs with this (older) update, then take their state
            notes.append(f"this peer is behind (epoch {self.epoch}, peers at {ahead}): it joins epoch {ahead} and "
                         f"then downloads the majority's state")
            self.epoch, self.stale = ahead, True
        e = self.epoch
        mine = {"e": e, "fp": fp, "stale": self.stale, "n": len(payload), "sha": hashlib.sha256(payload).digest(),
                "tok": mac(self.key, b"join", self.peer_id.to_bytes(), str(e).encode())}
        await self._heartbeat()
        expected = sum(1 for pid, v in live.items()
                       if pid == self.me or v.get("epoch", -1) >= e - 1)
        group = None
        if expected > 1:
            self.mm.group_key_manager.prefix = f"{self.run}_e{e}"  # one DHT key per epoch: epochs never mix
            self.mm.target_group_size = expected  # assemble at once when every live peer has come
            step = StepControl(scheduled_time=_now() + self.matchmaking_time,
                               deadline=_now() + self.matchmaking_time + 2, allow_retries=False, weight=1.0,
                               data_for_gather=MSGPackSerializer.dumps(mine))
            step.attach(MPFuture(), MPFuture())
            step.allow_allreduce()
            try:
                group = await self.mm.look_for_group(step)
            finally:
                if not step.done():
                    step.set_result(None)
        mm_s = time.perf_counter() - start
        if group is None:
            return EpochResult(e, "", [self.peer_id], {self.peer_id: payload}, {self.peer_id: mine}, alone=True,
                               seconds=time.perf_counter() - start, matchmaking_s=mm_s,
                               notes=notes + [f"no other peer reached epoch {e} within {self.matchmaking_time:g}s"
                                              if expected > 1 else "no other live peer in the run"])
        members, meta = [], {}
        for pid, blob in zip(group.peer_ids, group.gathered):
            try:
                m = MSGPackSerializer.loads(blob)
                good = m["e"] == e and hmac.compare_digest(
                    m["tok"], mac(self.key, b"join", pid.to_bytes(), str(e).encode()))
            except Exception:
                good = False
            if good:
                members.append(pid)
                meta[pid] = m
            else:
                notes.append(f"peer {pid.to_base58()[-8:]} has no valid run-key token: left out")
        members.sort()
        gid = group.group_id
        others = [p for p in members if p != self.peer_id]
        deadline = time.perf_counter() + self.exchange_timeout
        sent = await asyncio.gather(*[self._push(p, gid, "ag", payload) for p in others])
        unreachable = {p for p, ok in zip(others, sent) if not ok}
        got = await self._collect(gid, "ag", {p for p in others if p not in unreachable}, deadline, e)
        received = {self.peer_id: payload}
        for p, data in got.items():
            if hashlib.sha256(data).digest() == meta[p]["sha"]:
                received[p] = data
            else:
                notes.append(f"peer {p.to_base58()[-8:]}: payload does not match its announced hash: left out")
        # commit: tell every member whom we hold a payload from; keep those every answering member holds
        body = MSGPackSerializer.dumps(sorted(p.to_bytes() for p in received))
        await asyncio.gather(*[self._push(p, gid, "ack", body) for p in others])
        acks = await self._collect(gid, "ack", set(others), time.perf_counter() + min(10.0, self.exchange_timeout), e)
        final = set(received) & ({self.peer_id} | set(acks))
        for p, blob in acks.items():
            try:
                final &= {type(self.peer_id)(b) for b in MSGPackSerializer.loads(blob)}
            except Exception:
                final.discard(p)
        for p in others:
            if p in final:
                self.suspects.pop(p.to_base58(), None)
            else:
                self.suspects[p.to_base58()] = _now()
                notes.append(f"peer {p.to_base58()[-8:]} did not complete epoch {e}: left out")
        for k in [k for k in self._inbox if k[0] == gid or time.time() - self._inbox_time[k] > 600]:
            self._inbox.pop(k, None)
            self._inbox_time.pop(k, None)
        self.stats.bytes_sent += len(payload) * sum(1 for ok in sent if ok)
        self.stats.bytes_received += sum(len(d) for p, d in received.items() if p != self.peer_id)
        ordered = sorted(final)
        return EpochResult(e, gid.hex()[:12], ordered, {p: received[p] for p in ordered}, {p: meta[p] for p in ordered},
                           alone=len(ordered) == 1, seconds=time.perf_counter() - start, matchmaking_s=mm_s,
                           notes=notes)

    def _after_epoch(self, result: EpochResult, fp: bytes) -> None:
        """A member whose state differs from the majority's resyncs from the majority after this epoch.

        States compare by their sketches (:func:`same_state`): peers on different hardware may round the
        same average differently in the last bit, which is no reason to download the model again.
        """
        self.stats.collectives += 1
        # the state to keep: the one most members in step (not behind) share; ties to the smaller peer id
        fresh = [p for p in result.members if not result.meta[p].get("stale")] or result.members
        sketches = {p: result.meta[p].get("fp", b"") for p in fresh}
        support = {p: [q for q in fresh if same_state(sketches[p], sketches[q])] for p in fresh}
        best = min(fresh, key=lambda p: (-len(support[p]), p))
        self.resync_from = [] if same_state(fp, sketches[best]) else support[best]
        self.last = result
        self.epoch += 1
        for note in result.notes:
            log.info("peer %s | epoch %d: %s", self.me[-8:], result.epoch, note)

    async def _push(self, peer, gid: bytes, kind: str, data: bytes) -> bool:
        header = {"g": gid, "k": kind, "e": self.epoch, "n": len(data), "m": mac(
            self.key, gid, kind.encode(), str(self.epoch).encode(), self.peer_id.to_bytes(), peer.to_bytes(),
            hashlib.sha256(data).digest())}
        for attempt in range(2):
            writer = None
            try:
                _, reader, writer = await asyncio.wait_for(
                    self.p2p.call_binary_stream_handler(peer, f"{self.run}.push"), 10)
                await _write_framed(writer, header, data)
                return await asyncio.wait_for(reader.readexactly(1), self.exchange_timeout) == OK
            except Exception as e:
                connected = {info.peer_id for info in await self.p2p.list_peers()}
                if attempt == 1 or peer not in connected:
                    log.info("peer %s: sending %s to %s failed: %s: %s", self.me[-8:], kind, peer.to_base58()[-8:],
                             type(e).__name__, e)
                    return False
            finally:
                if writer is not None:
                    writer.close()
        return False

    async def _read_framed(self, reader, limit: int, timeout: float) -> tuple[dict, bytes]:
        from hivemind.utils.serializer import MSGPackSerializer

        hlen = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 10), "big")
        if hlen > MAX_HEADER:
            raise ValueError(f"header of {hlen} bytes")
        header = MSGPackSerializer.loads(await asyncio.wait_for(reader.readexactly(hlen), 10))
        n = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 10), "big")
        if not isinstance(header, dict) or n != header.get("n") or n > limit:
            raise ValueError(f"payload of {n} bytes (limit {limit})")
        return header, await asyncio.wait_for(reader.readexactly(n), timeout)

    async def _on_push(self, info, reader, writer) -> None:
        sender = info.peer_id
        try:
            header, data = await self._read_framed(reader, self.max_payload_bytes, self.exchange_timeout)
            want = mac(self.key, header["g"], header["k"].encode(), str(header["e"]).encode(), sender.to_bytes(),
                       self.peer_id.to_bytes(), hashlib.sha256(data).digest())
            if not hmac.compare_digest(header["m"], want):
                raise PermissionError("bad MAC (no or another run key)")
            k = (header["g"], header["k"], int(header["e"]))
            self._inbox.setdefault(k, {})[sender] = data
            self._inbox_time.setdefault(k, time.time())
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
            writer.close()

    def _suspected(self, pid: str, entry: dict) -> bool:
        return pid in self.suspects and float(entry.get("time", 0)) <= self.suspects[pid]

    async def _collect(self, gid: bytes, kind: str, senders: set, deadline: float, epoch: int) -> dict:
        """Wait for ``kind`` messages of this group from ``senders``; not for peers that died or moved on."""
        last_check = last_registry = 0.0
        while True:
            self._arrived.clear()
            box = self._inbox.get((gid, kind, epoch), {})
            missing = {p for p in senders if p not in box}
            if not missing or time.perf_counter() >= deadline:
                return {p: box[p] for p in senders if p in box}
            if time.perf_counter() - last_check > 0.5:  # a peer libp2p lost is not waited for
                last_check = time.perf_counter()
                connected = {i.peer_id for i in await self.p2p.list_peers()}
                if missing - connected:
                    senders = senders - (missing - connected)
                    continue
            if time.perf_counter() - last_registry > 1.0:  # nor one whose matchmaking gave up on this epoch
                last_registry = time.perf_counter()
                reg = await self._registry()
                moved = {p for p in missing if int(reg.get(p.to_base58(), {}).get("epoch", -1)) > epoch}
                if moved:
                    senders = senders - moved
                    continue
            try:
                await asyncio.wait_for(self._arrived.wait(), min(0.25, max(0.0, deadline - time.perf_counter())))
            except asyncio.TimeoutError:
                pass

    # ---- state for new and out-of-step peers ------------------------------------------------
    def publish_state(self, blob: bytes) -> None:
        """Serve ``blob`` (this peer's state after its latest epoch) to peers that ask for it."""
        self._snapshot = (self.epoch, blob, hashlib.sha256(blob).digest())

    async def _on_state_request(self, info, reader, writer) -> None:
        from hivemind.utils.serializer import MSGPackSerializer

        sender = info.peer_id
        try:
            header, body = await self._read_framed(reader, 1 << 10, 10)
            if not hmac.compare_digest(header.get("m", b""), mac(self.key, b"state", sender.to_bytes(),
                                                                  self.peer_id.to_bytes(), body)):
                raise PermissionError("bad MAC (no or another run key)")
            want = int(MSGPackSerializer.loads(body)["min_epoch"])
            end = time.perf_counter() + 30
            while (self._snapshot is None or self._snapshot[0] < want) and time.perf_counter() < end:
                await asyncio.sleep(0.1)
            if self._snapshot is None or self._snapshot[0] < want:
                raise TimeoutError(f"no state of epoch >= {want} here")
            epoch, blob, sha = self._snapshot
            await _write_framed(writer, {"e": epoch, "n": len(blob), "sha": sha, "m": mac(
                self.key, b"state-reply", self.peer_id.to_bytes(), sender.to_bytes(), str(epoch).encode(), sha)}, blob)
            await asyncio.wait_for(reader.read(1), 60)
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
            header, blob = await self._read_framed(reader, self.max_payload_bytes, 120)
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
                return self._call(self._fetch_state(peer, min_epoch or 0), 180)
            except Exception as e:
                log.warning("peer %s: could not download the state from %s: %s: %s", self.me[-8:],
                            peer.to_base58()[-8:], type(e).__name__, e)
        return None

    # ---- collectives ------------------------------------------------------------------------
    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every member's payload (this peer's included) in canonical order; ``rank`` is this peer's index."""
        result = self.exchange(payload)
        # a member whose own payload did not reach everyone is left out of the agreed set (its update too)
        self.rank = result.members.index(self.peer_id) if self.peer_id in result.members else 0
        self.world_size = len(result.members)
        try:
            return [result.payloads[p] for p in result.members]
        finally:
            self.rank, self.world_size = 0, 1

    def all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        raise TransportError("the hivemind transport has no fixed ranks: it averages with all_reduce_* and "
                             "all_gather_bytes")

    def all_reduce_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        """Sum or average over the members of this epoch (raw fp32 payloads, validated and norm-clipped)."""
        from diloco.compress.codec import make_codec

        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
        codec = make_codec("fp32")
        out = self._robust_mean(flat, codec, b"", key=None)
        if op == "sum":
            out.mul_(self._last_total)
        _unflatten_into(list(tensors), out.to(tensors[0].device))

    def all_reduce_compressed_(self, tensors: Sequence[torch.Tensor], codec, weight: float = 1.0,
                               key: Any = "") -> float:
        """Weighted mean of every member's tensors through ``codec`` (each member encodes once, all decode all)."""
        if not (weight >= 0 and weight < float("inf")):
            raise ValueError(f"the weight of a compressed all-reduce must be finite and >= 0, got {weight}")
        if not tensors:
            return 0.0
        if len(_buckets(tensors, 1 << 62)) > 1:
            raise ValueError("tensors of one compressed all-reduce must share dtype and device")
        one = tensors[0]
        if len(tensors) == 1 and one.dtype == torch.float32 and one.is_contiguous():
            flat = one.detach().reshape(-1)  # no copy: it is read (encoded) before the result is written back
        else:
            flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        out = self._robust_mean(flat, codec, _WEIGHT.pack(weight), key)
        _unflatten_into(list(tensors), out.to(tensors[0].device))
        return self._last_total

    def _robust_mean(self, flat: torch.Tensor, codec, prefix: bytes, key: Any) -> torch.Tensor:
        from diloco.compress.wire import CorruptPayload

        payload = prefix + codec.encode(flat, key=key)
        before = self.stats.bytes_sent
        result = self.exchange(payload)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_sent - before)
        # pass 1: validate every member's update and measure its norm (one decoded vector alive at a time)
        rows: list[tuple[str, memoryview, float, float]] = []  # (peer, body, weight, norm)
        rejected: dict[str, str] = {}
        for p in result.members:
            name, msg = p.to_base58(), memoryview(result.payloads[p])
            try:
                if prefix:
                    if len(msg) < _WEIGHT.size:
                        raise CorruptPayload("no weight")
                    (w,) = _WEIGHT.unpack_from(msg, 0)
                    if not (w >= 0 and w < float("inf")):
                        raise CorruptPayload(f"weight {w}")
                else:
                    w = 1.0
                body = msg[len(prefix):]
                x = codec.decode(body, expect_numel=flat.numel())
                norm = float(torch.linalg.vector_norm(x.float()))
                del x
                if not math.isfinite(norm):
                    raise CorruptPayload("non-finite values")
            except (CorruptPayload, ValueError) as e:
                rejected[name] = f"invalid payload: {e}"
                continue
            rows.append((name, body, float(w), norm))
        # clip (or drop) an update far above the others' median norm; every member decides alike
        scale: dict[str, float] = {}
        clipped: dict[str, float] = {}
        if self.norm_clip > 0 and len(rows) > 1:
            for i, (name, _, _, n) in enumerate(rows):
                others = [r[3] for j, r in enumerate(rows) if j != i and r[3] > 0]  # zeros: members that sat out
                if not others:
                    continue
                bound = self.norm_clip * statistics.median(others)
                if n > bound:
                    if self.clip_action == "drop":
                        rejected[name] = (f"norm {n:.4g} > {self.norm_clip:g} x the others' median "
                                          f"{bound / self.norm_clip:.4g}: dropped")
                    else:
                        scale[name] = bound / n
                        clipped[name] = n / bound
        rows = [r for r in rows if r[0] not in rejected]
        total = sum(r[2] for r in rows)
        # pass 2: the weighted mean, accumulated in the canonical (sorted peer id) order
        out = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        if total > 0:
            for name, body, w, _ in rows:
                codec.decode_accumulate_(body, out, w / total * scale.get(name, 1.0))
        self._last_total = total
        names, weights = [r[0] for r in rows], [r[2] for r in rows]
        for name, why in rejected.items():
            log.warning("peer %s | epoch %d: left peer %s's update out: %s", self.me[-8:], result.epoch, name[-8:], why)
        for name, factor in clipped.items():
            log.warning("peer %s | epoch %d: clipped peer %s's update (its norm was %.3gx the bound)",
                        self.me[-8:], result.epoch, name[-8:], factor)
        self._account(result, dict(zip(names, weights)), rejected, clipped)
        return out

    def _account(self, result: EpochResult, accepted: dict, rejected: dict, clipped: dict) -> None:
        for name, w in accepted.items():
            rec = self.ledger.setdefault(name, PeerRecord())
            rec.tokens += w
            rec.epochs += 1
            rec.accepted += 1
            rec.clipped += int(name in clipped)
        for name in rejected:
            rec = self.ledger.setdefault(name, PeerRecord())
            rec.epochs += 1
            rec.rejected += 1
        self.history.append({
            "epoch": result.epoch, "group": result.group, "alone": result.alone,
            "members": [p.to_base58() for p in result.members], "accepted": sorted(accepted),
            "rejected": rejected, "clipped": clipped, "total_weight": sum(accepted.values()),
            "seconds": round(result.seconds, 3), "matchmaking_s": round(result.matchmaking_s, 3),
            "bytes_sent": self.stats.bytes_sent, "bytes_received": self.stats.bytes_received, "notes": result.notes})
        try:
            self._call(self._publish_ledger(), 30)
        except Exception as e:
            log.info("peer %s: could not publish the ledger: %s", self.me[-8:], e)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        raise TransportError("the hivemind transport averages with all_reduce_ (no fixed ranks)")

    def metrics(self) -> dict[str, Any]:
        if self.last is None:
            return {}
        return {"epoch": self.epoch, "group_size": len(self.last.members)}

    def summary(self) -> dict[str, Any]:
        return {"peer_id": self.me, "epochs": self.epoch,
                "ledger": {pid: rec.as_list() for pid, rec in self.ledger.items()}}


def read_swarm(transport: HivemindTransport) -> dict[str, Any]:
    """The run's registry and every peer's published ledger, as seen from the DHT."""
    async def go():
        return await transport._registry(), await transport._subkeys(f"{transport.run}.ledger")

    peers, ledgers = transport._call(go(), 60)
    return {"peers": peers, "ledgers": ledgers}


def merge_ledgers(ledgers: dict[str, dict]) -> dict[str, PeerRecord]:
    """One ledger from every observer's: per peer, the median of the observers' counts (robust to one liar)."""
    seen: dict[str, list[PeerRecord]] = {}
    for view in ledgers.values():
        for pid, row in view.items():
            try:
                seen.setdefault(pid, []).append(PeerRecord.from_list(row))
            except (TypeError, ValueError, IndexError):
                continue
    out = {}
    for pid, rows in seen.items():
        tokens, *counts = (statistics.median(getattr(r, f.name) for r in rows) for f in fields(PeerRecord))
        out[pid] = PeerRecord(tokens, *map(int, counts))
    return out


async def _write_framed(writer, header: dict, data: bytes) -> None:
    """``u64 len | msgpack header | u64 len | data``, the data in 1 MiB slices (what ``_read_framed`` reads)."""
    from hivemind.utils.serializer import MSGPackSerializer

    head = MSGPackSerializer.dumps(header)
    writer.write(len(head).to_bytes(8, "big") + head + len(data).to_bytes(8, "big"))
    view = memoryview(data)
    for off in range(0, len(view), 1 << 20):
        writer.write(view[off:off + (1 << 20)])
        await writer.drain()
    await writer.drain()


def _now() -> float:
    from hivemind.utils.timed_storage import get_dht_time

    return get_dht_time()


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


__all__ = ["HivemindTransport", "PeerRecord", "EpochResult", "fingerprint", "same_state", "mac", "merge_ledgers",
           "read_swarm", "check_run_name"]
