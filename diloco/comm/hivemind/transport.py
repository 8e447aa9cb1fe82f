"""The swarm peer: the DHT, its registry of live peers and the collectives, over the epoch, state and ledger mixins."""

from __future__ import annotations

import asyncio
import functools
import glob
import hashlib
import itertools
import os
import re
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from diloco.comm.base import Transport, TransportError, die_with_parent
from diloco.comm.caps import Capabilities, RobustBounds
from diloco.comm.hivemind.auth import _make_authorizer, check_run_name
from diloco.comm.hivemind.epoch import EpochMixin, EpochResult, _servicer_class
from diloco.comm.hivemind.framing import EXCHANGE_DEFAULT_S, Pace, _now, log, matchmaking_window, seconds_or_auto
from diloco.comm.hivemind.ledger import LedgerMixin, PeerRecord
from diloco.comm.hivemind.state import StateMixin


def _dht_class():
    from hivemind.dht import DHT

    class PeerDHT(DHT):
        def run(self) -> None:
            die_with_parent()
            # signals are for the peer's main process, which saves, leaves the swarm and then stops this one
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            super().run()

    return PeerDHT


_TAGS = itertools.count()
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


def _socket_tag() -> str:
    """Give the p2pd this peer starts socket names of its own, so that they can be found and removed later.

    hivemind names the unix sockets of a daemon and its clients ``<prefix>p2pd-<random>.sock`` and
    ``<prefix>p2pclient-<random>.sock``; the DHT process, forked next, inherits the prefix set here.
    """
    from hivemind.p2p import P2P

    tag = f"hivemind-loco{os.getpid()}x{next(_TAGS)}-"
    P2P._UNIX_SOCKET_PREFIX = f"/unix{tempfile.gettempdir()}/{tag}"
    return os.path.join(tempfile.gettempdir(), tag)


def _remove_sockets(prefix: str) -> None:
    for path in glob.glob(glob.escape(prefix) + "*.sock"):
        try:
            os.remove(path)
        except OSError:
            pass


def _tcp_endpoint(maddr: str) -> Optional[tuple[str, int]]:
    parts = str(maddr).split("/")
    try:
        host = next(parts[i + 1] for i, p in enumerate(parts) if p in ("ip4", "ip6", "dns", "dns4", "dns6"))
        port = int(next(parts[i + 1] for i, p in enumerate(parts) if p == "tcp"))
    except (StopIteration, IndexError, ValueError):
        return None
    return host, port


def _answers(endpoint: tuple[str, int], timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            return True
    except OSError:
        return False


def join_failure(error: Exception, initial_peers: Sequence[str], keyed: bool) -> str:
    """One line on why this peer could not join: the bootstrap peers could not be reached, or they answered
    and refused it (another run key), or hivemind's own reason, without its advice about its arguments."""
    text = re.sub(r"\s*\(set ensure_bootstrap_success=False to ignore\)", "", str(error)).strip()
    if not initial_peers or "bootstrap" not in text:
        return text or type(error).__name__
    endpoints = {str(m): _tcp_endpoint(m) for m in initial_peers}
    answered = [m for m, ep in endpoints.items() if ep is not None and _answers(ep)]
    if not answered:
        where = ", ".join(f"{ep[0]}:{ep[1]}" if ep else m for m, ep in endpoints.items())
        return (f"no bootstrap peer could be reached ({where}: nothing answers there); check the address in "
                f"--peers and that the peer is running and reachable from this machine")
    if "none of the initial_peers responded" in text:
        key = ("this peer's run key is not the run's (the run has another one, or none)" if keyed
               else "the run has a run key and this peer has none")
        return (f"the bootstrap peer {answered[0]} answered but refused this peer: {key} (check --run-key or "
                f"--run-key-file)")
    return (f"something answers at {answered[0]} but the libp2p connection failed: is the /p2p/ id in the "
            f"address that peer's? ({text.splitlines()[-1] if text else type(error).__name__})")


class HivemindTransport(EpochMixin, StateMixin, LedgerMixin, Transport):
    """One peer of a swarm named ``run``. See the package docstring (:mod:`diloco.comm.hivemind`).

    ``initial_peers``: multiaddrs of peers already in the run (none: this peer starts it).
    ``matchmaking_time``: how long the first peer of an epoch waits for the others; ``"auto"`` (or None):
    3 x how long recent complete groups took to form, 5 to 60 s.
    ``exchange_timeout``: how long to wait for members' payloads once the group is formed; ``"auto"`` (or
    None, the default): from the bytes the group moves and this peer's measured exchange rate (60 s until it
    has measured one; see :func:`~diloco.comm.hivemind.framing.exchange_deadline`). Seconds fix either.
    ``wait_rounds``: a peer that reaches an epoch first waits for the peers announced there until their
    announced arrival, at most this many of its own rounds (so peers up to that much slower still meet it).
    ``norm_clip`` / ``clip_action``: contributions above ``norm_clip`` x the median norm of the other
    members are scaled down to that bound (``clip``) or left out (``drop``); 0 turns this off.
    ``weight_clip``: a member's announced weight (the tokens of its round) counts at most this many times the
    median of the other members' weights; 0 turns this off.
    """

    rank = 0
    world_size = 1
    caps = Capabilities(fixed_ranks=False)

    def __init__(self, run: str = "loco", *, initial_peers: Sequence[str] = (), host_maddrs: Sequence[str] = (),
                 announce_maddrs: Sequence[str] = (), identity_path: Optional[str] = None,
                 run_key: Optional[bytes] = None, use_relay: bool = True, use_auto_relay: bool = False,
                 nat_port_map: bool = False, client_mode: bool = False,
                 matchmaking_time: Union[float, str, None] = 5.0, exchange_timeout: Union[float, str, None] = None,
                 heartbeat_ttl: float = 60.0, norm_clip: float = 10.0,
                 clip_action: str = "clip", weight_clip: float = 10.0, schema: str = "", max_payload_bytes: int = 4 << 30,
                 startup_timeout: float = 30.0, observer: bool = False, wait_rounds: float = 4.0) -> None:
        super().__init__()
        self.run = check_run_name(run)
        if clip_action not in ("clip", "drop"):
            raise ValueError(f"clip_action must be 'clip' or 'drop', got {clip_action!r}")
        if not norm_clip >= 0:
            raise ValueError(f"norm_clip must be >= 0, got {norm_clip}")
        if not (weight_clip == 0 or weight_clip >= 1):
            raise ValueError(f"weight_clip must be 0 (off) or at least 1, got {weight_clip}")
        self.key = run_key or b""
        # the deadlines: fixed (seconds given) or None, adaptive; the current ones are matchmaking_time and
        # exchange_timeout, which an adaptive peer resets every epoch from its measurements (rate, forming)
        self.fixed_matchmaking_time = seconds_or_auto(matchmaking_time, "matchmaking_time")
        self.fixed_exchange_timeout = seconds_or_auto(exchange_timeout, "exchange_timeout")
        self.matchmaking_time = (self.fixed_matchmaking_time if self.fixed_matchmaking_time is not None
                                 else matchmaking_window(None))
        self.exchange_timeout = (self.fixed_exchange_timeout if self.fixed_exchange_timeout is not None
                                 else EXCHANGE_DEFAULT_S)
        self.rate = Pace()  # bytes/s (sent + received) of this peer's recent complete exchanges
        self.forming = Pace()  # seconds its recent complete groups took to form
        self._live_seen = 0  # how many other live peers its latest rendezvous found (bounds the next group)
        self.heartbeat_ttl = heartbeat_ttl
        self.bounds = RobustBounds(float(norm_clip), clip_action, float(weight_clip))
        self.max_payload_bytes, self.client_mode = max_payload_bytes, client_mode
        # the largest state this peer downloads (None: max_payload_bytes); a driver sets it from its model
        # (launch.join: 16 bytes a parameter), since a 1B DiLoCo state is about 8.8 GB
        self.max_state_bytes: Optional[int] = None
        self.schema = hashlib.sha256(f"loco-swarm-v2|{run}|{schema}".encode()).digest()
        self.settings = schema  # announced in the registry: a peer of this run with other settings is named
        self._foreign: set[str] = set()  # the peers of this run announcing other settings, named once each
        self._apart = 0  # how many of them the latest rendezvous found live
        self.epoch = 0  # exchanges this peer's state has been through (downloaded state carries it)
        self.stale = False  # True from jumping ahead to the others' epoch until this peer downloads their state
        self.fingerprint_fn: Optional[Callable[[], bytes]] = None
        # what the registry announces besides the epoch: "train" (with the time this peer expects to reach the
        # next epoch, eta, from its last round's length round_s), "wait" (at the epoch, waiting for the peers
        # announced there), "group" (forming the group) or "resync" (downloading the group's state)
        self.wait_rounds = float(wait_rounds)
        self.phase, self.eta, self.round_s = "train", None, None
        self._round_start = time.perf_counter()
        self.last_group = 1  # how many peers averaged the state this peer holds (its latest epoch's group)
        self.stop_requested: Optional[Callable[[], bool]] = None  # true: stop waiting for late peers (a signal)
        self.on_phase: Optional[Callable[[str, Any], Any]] = None  # async (phase, data) -> data: see _phase
        self.resync_from: list = []  # peers holding the majority state, set when this peer's state differs
        self.ledger: dict[str, PeerRecord] = {}
        self.history: list[dict] = []  # one record per epoch (also written by the driver)
        self.last: Optional[EpochResult] = None
        self.status: dict[str, Any] = {}  # extra fields of this peer's registry entry (throughput, step...)
        self.suspects: dict[str, float] = {}  # peer -> when it last failed us; forgiven once it heartbeats again
        self._inbox: dict = {}  # (group id, kind, epoch) -> {sender: bytes}: this epoch's pushes, purged at its end
        self._window = None  # what this peer accepts during its current exchange (limits.Window); None between
        self._ended = None  # the last exchange's window: members may still relay through this peer in it
        self._linked: set[str] = set()  # peers libp2p has shown connected to this one (base58)
        self._seen: dict[str, float] = {}  # base58 -> when the registry last listed it (see _mend)
        self._ever: set[str] = set()  # peers of the run libp2p has shown connected to this one (_mend, _lost)
        self.initial_peers = [str(m) for m in initial_peers]
        self._relayed: set = set()  # members this epoch's pushes reached only through another member
        self._unreachable: dict[str, float] = {}  # base58 -> when a direct push to it last failed
        self._snapshot: Optional[tuple[int, bytes, bytes, bytes]] = None  # (epoch, blob, sha256, manifest)
        self._pinned: dict[bytes, tuple] = {}  # sha -> (*snapshot, last request): in use by a download
        self.state_sources: dict[str, int] = {}  # the last downloaded state: bytes from each peer (base58)
        self._partial = None  # (sha, blob, offsets received) of a download every holder failed part-way
        self._closed = False
        self._background: set[asyncio.Task] = set()  # tasks started by announce(), held until they end
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
        self._sockets = _socket_tag()  # this peer's p2pd sockets, removed whatever way it ends
        kwargs["start"] = False
        self.dht = _dht_class()(**kwargs)
        try:
            self.dht.run_in_background(await_ready=True)
        except Exception as e:
            self._abandon_dht()
            raise TransportError(f"could not start or join the swarm {run!r}: "
                                 f"{join_failure(e, initial_peers, bool(self.key))}") from None
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
        self._mending = asyncio.create_task(self._mend_forever())

    async def _beat_forever(self) -> None:
        """Keep this peer's registry entry fresh through rounds longer than its time to live."""
        while True:
            await asyncio.sleep(self.heartbeat_ttl / 3)
            await self._heartbeat_or_log()

    async def _heartbeat_or_log(self) -> None:
        """A heartbeat whose failure is logged: the next one announces the same."""
        try:
            await self._heartbeat()
        except Exception as e:
            log.info("peer %s: heartbeat failed: %s", self.me[-8:], e)

    async def _mend_forever(self) -> None:
        while True:
            await asyncio.sleep(MEND_S)
            try:
                await self._mend()
            except Exception as e:
                log.info("peer %s: redialling lost peers failed: %s", self.me[-8:], e)

    async def _mend(self) -> None:
        """Redial the peers of this run that libp2p was connected to (if seen in the registry within ``SEEN_S``)
        and that are no longer connected, or no longer in this DHT node's routing table; the bootstrap peers too
        when none is connected. Every ``MEND_S`` (_mend_forever). After a partition heals, this is what joins the
        two sides again: their DHT nodes dropped each other meanwhile (see _redial). Peers never connected (both
        behind NAT, say) are not dialled: they reach each other through members."""
        now = time.monotonic()
        connected = {i.peer_id.to_base58() for i in await self.p2p.list_peers()}
        self._ever |= connected & set(self._seen)
        recent = sorted((pid for pid, t in self._seen.items() if pid in self._ever and now - t < SEEN_S),
                        key=lambda pid: -self._seen[pid])[:16]
        boot = self.initial_peers if not (connected & set(self._seen)) else []
        if not recent and not boot:
            return
        found = await self.dht.run_coroutine(functools.partial(_redial, boot, recent, connected), return_future=True)
        if found:
            log.info("peer %s: redialled %d peer(s) of the run it had lost", self.me[-8:], found)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def close(self) -> None:
        """Leave the swarm: stop serving, shut the P2P replica, then the DHT process (and its p2pd)."""
        if self._closed:
            return
        self._closed = True
        # a dead daemon (killed, crashed) can neither carry the leave nor stop the DHT process gracefully: both
        # would wait their timeouts (3 s each) for nothing
        daemon = self.daemon_alive()
        try:
            if self._thread.is_alive():
                try:
                    self._call(self._shutdown(leave=daemon), 10)
                except Exception as e:
                    log.warning("hivemind: leaving the swarm uncleanly: %s", e)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        finally:
            if daemon:
                self.dht.shutdown()
            self._reap_dht(0.5 if daemon else 0.0)  # shutdown() waited its grace period: the rest ignores SIGTERM
            _remove_sockets(self._sockets)

    def daemon_alive(self) -> bool:
        """Whether this peer's p2pd accepts a connection on its control socket (named under ``_sockets``, see
        :func:`_socket_tag`): False once the daemon died (killed, crashed; its socket file stays behind), when
        nothing sent through it can arrive. With no socket file to probe it counts as alive."""
        paths = glob.glob(glob.escape(self._sockets) + "p2pd-*.sock")
        if not paths:
            return True
        for path in paths:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                return True
            except OSError:
                pass
            finally:
                probe.close()
        return False

    def _reap_dht(self, wait: float) -> None:
        """Wait up to ``wait`` s for the DHT process to end, then kill it: hivemind's fallback is SIGTERM, which
        this process ignores (see _dht_class), and it holds nothing to save."""
        self.dht.join(wait)
        if self.dht.is_alive():
            os.kill(self.dht.pid, signal.SIGKILL)
            self.dht.join(5)

    def _abandon_dht(self) -> None:
        """After a failed start: stop the DHT process (and its p2pd) and remove the sockets they made."""
        self._reap_dht(self.dht.shutdown_timeout)
        _remove_sockets(self._sockets)

    async def _shutdown(self, leave: bool = True) -> None:
        if leave and not self.observer:
            try:  # leave the registry now rather than when the entry expires (a dead daemon cannot)
                await asyncio.wait_for(self.dht.store(f"{self.run}.peers", subkey=self.me, value=None,
                                                      expiration_time=_now() + 1, return_future=True), 3)
            except Exception:
                pass
        await self.p2p.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- DHT records ------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        value = {"epoch": self.epoch, "time": _now(), "phase": self.phase, "eta": self.eta, "round_s": self.round_s,
                 "settings": self.settings, **self.status}
        await self.dht.store(f"{self.run}.peers", subkey=self.me, value=value,
                             expiration_time=_now() + self.heartbeat_ttl, return_future=True)

    async def _subkeys(self, key: str) -> dict[str, dict]:
        """A DHT dictionary record as {subkey: value}, keeping only dict values (a leaving peer stores None)."""
        res = await asyncio.wait_for(self.dht.get(key, latest=True, return_future=True), 30)
        if res is None or not isinstance(res.value, dict):
            return {}
        return {k: v.value for k, v in res.value.items() if isinstance(getattr(v, "value", None), dict)}

    async def _registry(self) -> dict[str, dict]:
        reg = await self._subkeys(f"{self.run}.peers")
        now = time.monotonic()
        for pid in reg:
            if pid != getattr(self, "me", None):
                self._seen[pid] = now
        return reg

    def _alike(self, entry: dict) -> bool:
        """Whether a registry entry announces this peer's settings (one of an older version, announcing none,
        counts as alike)."""
        return entry.get("settings", self.settings) == self.settings

    def peers(self) -> dict[str, dict]:
        """The run's live peers from the DHT registry: peer id -> {epoch, time, throughput, ...}."""
        return self._call(self._registry(), 30)

    def heartbeat(self, **status: Any) -> None:
        """Announce ``status`` in the registry. A heartbeat that fails (the DHT unreachable for a while, as
        after this machine was suspended or cut off) is logged, and the next one announces the same: training
        goes on."""
        self.status.update(status)
        try:
            self._call(self._heartbeat(), 30)
        except Exception as e:
            log.warning("peer %s: heartbeat failed (%s); the next round announces this peer again", self.me[-8:],
                        f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    def announce(self) -> None:
        """Heartbeat in the background: a change of phase that must not hold the caller up (a DHT store waits
        on every node it stores to, a hung one included)."""
        self._loop.call_soon_threadsafe(self._in_background, self._heartbeat_or_log)

    def _in_background(self, work: Callable[[], Any]) -> None:
        """Run ``work()`` as a task of this peer's loop, held until it ends: the loop itself keeps only a weak
        reference to a task, and a pending one that nothing else holds is collected mid-way ("Task was
        destroyed but it is pending!", its heartbeat lost)."""
        task = self._loop.create_task(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- collectives ------------------------------------------------------------------------
    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every member's payload (this peer's included) in canonical order (:meth:`member_names`)."""
        result = self.exchange(payload)
        # a member whose own payload did not reach everyone is left out of the agreed set (its update too)
        out = [result.payloads[p] for p in result.members]
        # handed over: ``last`` (kept until the next epoch) holds no payload, or every member's would stay in
        # memory through the next round's training and meet the next round's (2 x 4.4 GB a member for 1B fp32)
        result.payloads = {}
        return out

    def _moved(self, kind: str, sent: Sequence[int], received: Sequence[int]) -> tuple[int, int]:
        """What this peer's pushes really delivered, and what it took from the members it kept."""
        return (self.last.sent_bytes, self.last.received_bytes) if self.last is not None else (0, 0)

    def member_names(self) -> list[str]:
        return [p.to_base58() for p in self.last.members] if self.last is not None else [self.me]

    def _all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        raise TransportError("the hivemind transport has no fixed ranks: it averages with all_reduce_* and "
                             "all_gather_bytes")

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
