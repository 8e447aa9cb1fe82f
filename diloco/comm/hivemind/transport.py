"""The swarm peer: :class:`HivemindTransport` composes the phases of a round (each a module of this package)
over one :class:`~diloco.comm.hivemind.node.Node`, runs one round per collective, and reports each round."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

import torch

from diloco.comm.base import PayloadBound, Transport, TransportError
from diloco.comm.caps import Capabilities, RobustBounds
from diloco.comm.hivemind.auth import check_run_name
from diloco.comm.hivemind.commit import resync_sources
from diloco.comm.hivemind.deadlines import STATE_CEILING_S, Deadlines
from diloco.comm.hivemind.framing import dht_now, log
from diloco.comm.hivemind.inbox import Inbox
from diloco.comm.hivemind.ledger import Ledger
from diloco.comm.hivemind.links import Links
from diloco.comm.hivemind.matchmaking import Matchmaker
from diloco.comm.hivemind.node import Node
from diloco.comm.hivemind.push import Pusher
from diloco.comm.hivemind.registry import Registry, Standing
from diloco.comm.hivemind.report import RoundReport, RoundResult
from diloco.comm.hivemind.round import Round
from diloco.comm.hivemind.state import StateService


class HivemindTransport(Transport):
    """One peer of a swarm named ``run``. See the package docstring (:mod:`diloco.comm.hivemind`).

    ``initial_peers``: multiaddrs of peers already in the run (none: this peer starts it).
    ``matchmaking_time``: how long the first peer of a round waits for the others; ``"auto"`` (or None):
    3 x how long recent complete groups took to form, 5 to 60 s.
    ``exchange_timeout``: how long to wait for members' payloads once the group is formed; ``"auto"`` (or
    None, the default): from the bytes the group moves and this peer's measured exchange rate (60 s until it
    has measured one; see :func:`~diloco.comm.hivemind.deadlines.exchange_deadline`). Seconds fix either.
    ``wait_rounds``: a peer that reaches a round first waits for the peers announced there until their
    announced arrival, at most this many of its own rounds (so peers up to that much slower still meet it).
    ``norm_clip`` / ``clip_action``: contributions above ``norm_clip`` x the median norm of the other
    members are scaled down to that bound (``clip``) or left out (``drop``); 0 turns this off.
    ``weight_clip``: a member's announced weight (the tokens of its round) counts at most this many times the
    median of the other members' weights; 0 turns this off.
    ``observer``: only read the DHT (``loco status``): no heartbeat, no handlers.
    ``fingerprint_fn``: the sketch of this peer's state, announced every round (called from the first round on).
    ``stop_requested``: true when this peer should stop waiting for late peers (a signal came).

    Set by the driver once it knows its model: ``max_state_bytes`` (the largest state this peer downloads; None:
    ``max_payload_bytes``); and by the fault tests, ``on_phase`` (see :meth:`Node.phase`).
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
                 startup_timeout: float = 30.0, observer: bool = False, wait_rounds: float = 4.0,
                 fingerprint_fn: Optional[Callable[[], bytes]] = None,
                 stop_requested: Optional[Callable[[], bool]] = None) -> None:
        super().__init__()
        check_run_name(run)
        if clip_action not in ("clip", "drop"):
            raise ValueError(f"clip_action must be 'clip' or 'drop', got {clip_action!r}")
        if not norm_clip >= 0:
            raise ValueError(f"norm_clip must be >= 0, got {norm_clip}")
        if not (weight_clip == 0 or weight_clip >= 1):
            raise ValueError(f"weight_clip must be 0 (off) or at least 1, got {weight_clip}")
        self.deadlines = Deadlines(matchmaking_time, exchange_timeout)
        self.bounds = RobustBounds(float(norm_clip), clip_action, float(weight_clip))
        self.max_payload_bytes = max_payload_bytes
        self.max_state_bytes: Optional[int] = None
        self.fingerprint_fn, self.stop_requested = fingerprint_fn, stop_requested
        self.wait_rounds = float(wait_rounds)
        self.observer = observer
        options: dict[str, Any] = dict(
            host_maddrs=list(host_maddrs) or ["/ip4/127.0.0.1/tcp/0"], identity_path=identity_path,
            use_relay=use_relay, use_auto_relay=use_auto_relay, nat_port_map=nat_port_map, client_mode=client_mode,
            startup_timeout=startup_timeout)
        if announce_maddrs:
            options["announce_maddrs"] = list(announce_maddrs)
        self.node = Node(run, run_key or b"", initial_peers, options)
        self.peer_id, self.me = self.node.peer_id, self.node.me
        self.standing = Standing()
        self.links = Links(self.node, initial_peers)
        self.registry = Registry(self.node, self.links, self.standing, schema, heartbeat_ttl)
        self.inbox = Inbox(self.node, self.deadlines, self.registry)
        self.pusher = Pusher(self.node)
        self.matchmaker = Matchmaker(self.node, self.deadlines,
                                     hashlib.sha256(f"loco-swarm-v2|{run}|{schema}".encode()).digest(), client_mode)
        self.state = StateService(self.node, self.deadlines)
        self.ledger = Ledger(self.node)
        self._last: Optional[RoundResult] = None  # the latest round's (its payloads handed to the collective)
        self._report: Optional[RoundReport] = None  # the latest round's report, until the driver takes it
        self._round_start = time.perf_counter()
        self._tasks: list[asyncio.Task] = []
        try:
            self.node.call(self._setup(), 60)
        except BaseException:
            self.close()
            raise

    async def _setup(self) -> None:
        await self.node.replicate()
        if self.observer:
            return
        await self.matchmaker.serve()
        await self.inbox.serve()
        await self.state.serve()
        await self.registry.beat()
        self._tasks = [asyncio.create_task(self.registry.beat_forever()),
                       asyncio.create_task(self.links.mend_forever())]

    @property
    def on_phase(self) -> Optional[Callable[[str, Any], Any]]:
        return self.node.on_phase

    @on_phase.setter
    def on_phase(self, hook: Optional[Callable[[str, Any], Any]]) -> None:
        self.node.on_phase = hook

    @property
    def round(self) -> int:
        """The rounds this peer's state has been through (a downloaded state carries its own)."""
        return self.standing.round

    @property
    def stale(self) -> bool:
        """Whether this peer followed the others to a later round and holds an older state until it takes
        theirs."""
        return self.standing.stale

    def adopted(self, round: int) -> None:
        """This peer took a state of ``round`` (downloaded, or its own set back): it is in step at that round."""
        self.standing.round, self.standing.stale = round, False

    def take_report(self) -> Optional[RoundReport]:
        """The report of the latest round, once (None when no round ended since the last call)."""
        report, self._report = self._report, None
        if report is None:
            return None
        # the run's bytes as counted by now: the collective counted this round's once it took the payloads
        return replace(report, total_sent=self.stats.bytes_sent, total_received=self.stats.bytes_received)

    def visible_maddrs(self) -> list[str]:
        return self.node.visible_maddrs()

    def daemon_alive(self) -> bool:
        return self.node.daemon_alive()

    def close(self) -> None:
        """Leave the swarm: stop serving, shut the P2P replica, then the DHT process (and its p2pd)."""
        self.node.close(None if self.observer else self.registry.leave)

    # ---- one round --------------------------------------------------------------------------
    def exchange(self, payload: bytes, bound: Optional[PayloadBound] = None) -> RoundResult:
        """Run one round: form a group, send ``payload`` to every member, agree on who delivered. ``bound``: the
        lengths the members' payloads may have (None: any up to ``max_payload_bytes``)."""
        fp = self.fingerprint_fn() if self.fingerprint_fn is not None else b""
        compute_s = time.perf_counter() - self._round_start
        s, d = self.standing, self.deadlines
        d.before_round(len(payload), max(s.group - 1, self.registry.live_seen, 1))
        # how long this peer waits for slower peers announced at this round: a few of its own rounds, each its
        # training and its last exchange (on a slow link the exchange is most of a round)
        last_exchange = self._last.seconds if self._last is not None and not self._last.alone else 0.0
        wait_cap = max(d.matchmaking_time, self.wait_rounds * (compute_s + last_exchange))
        rnd = Round(node=self.node, standing=s, registry=self.registry, deadlines=d, matchmaker=self.matchmaker,
                    inbox=self.inbox, pusher=self.pusher, payload=payload, bound=bound, fp=fp, wait_cap=wait_cap,
                    largest=self.max_payload_bytes, stop_requested=self.stop_requested)
        try:
            result = self.node.call(rnd.run(), wait_cap + d.matchmaking_time * 4 + d.exchange_timeout * 3 + 60)
        except Exception as e:  # a failed exchange is a round done alone, never the end of training
            result = self._failed(payload, fp, e)
        self._finish(result, fp)
        # the next round starts now: announce when this peer expects to reach the next round
        s.round_s = compute_s
        self._round_start = time.perf_counter()
        s.phase, s.eta = "train", dht_now() + compute_s
        try:
            self.node.call(self.registry.beat(), 30)
        except Exception as e:
            log.info("peer %s: heartbeat failed: %s", self.node.tag, e)
        return result

    def _failed(self, payload: bytes, fp: bytes, e: Exception) -> RoundResult:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if not self.node.daemon_alive():  # for good: say what happened and what to do, not the socket's errno
            why = ("this peer's p2p daemon (p2pd) is gone, killed or crashed: it cannot reach the swarm again "
                   "until it is started again (Ctrl-C saves a checkpoint; then run loco join again)")
        s = self.standing
        log.warning("peer %s | round %d: the exchange failed (%s); this round is done alone", self.node.tag, s.round,
                    why)
        return RoundResult(s.round, "", [self.peer_id], {self.peer_id: payload},
                           {self.peer_id: {"fp": fp, "stale": s.stale, "g": s.group}}, alone=True,
                           notes=[f"the exchange failed ({why})"], deadline_s=self.deadlines.exchange_timeout)

    def _finish(self, result: RoundResult, fp: bytes) -> None:
        """After a round: this peer is at the next one, and knows whose state is the group's (its report says
        whom to download it from when this peer's differs)."""
        s = self.standing
        resync = resync_sources(result.members, result.meta, fp)
        if not resync:
            s.stale = False
        s.group = len(result.members)
        s.round += 1
        self._last = result
        for note in result.notes:
            log.info("peer %s | round %d: %s", self.node.tag, result.round, note)
        self._report = result.report(resync)

    def record_contributions(self, accepted: dict[str, float], rejected: dict[str, str],
                             clipped: dict[str, float], weights_clipped: Optional[dict[str, float]] = None) -> None:
        weights_clipped = weights_clipped or {}
        self.ledger.warn(self._last.round if self._last is not None else self.standing.round, accepted, rejected,
                         clipped, weights_clipped)
        if self._last is None:
            return
        self.ledger.account(accepted, rejected, clipped, weights_clipped)
        if self._report is not None:
            self._report = self._report.weighed(accepted, rejected, clipped, weights_clipped)
        try:
            self.node.call(self.ledger.publish(), 30)
        except Exception as e:
            log.info("peer %s: could not publish the ledger: %s", self.node.tag, e)

    # ---- the registry and the state ---------------------------------------------------------
    def peers(self) -> dict[str, dict]:
        """The run's live peers from the DHT registry: peer id -> its entry ({epoch: its round, time, ...})."""
        return self.node.call(self.registry.read(), 30)

    def heartbeat(self, **status: Any) -> None:
        """Announce ``status`` in the registry. A heartbeat that fails (the DHT unreachable for a while, as
        after this machine was suspended or cut off) is logged, and the next one announces the same: training
        goes on."""
        self.registry.status.update(status)
        try:
            self.node.call(self.registry.beat(), 30)
        except Exception as e:
            log.warning("peer %s: heartbeat failed (%s); the next round announces this peer again", self.node.tag,
                        f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    def publish_state(self, blob: Union[bytes, Callable[[], bytes]]) -> None:
        """Serve ``blob`` (this peer's state after its latest round) to peers that ask for it: its bytes, or a
        function that makes them, called only when a peer first asks for this state."""
        self.state.publish(self.standing.round, blob)

    @property
    def state_sources(self) -> dict[str, int]:
        """The last downloaded state: bytes from each peer (base58)."""
        return self.state.sources

    @property
    def resumable(self) -> bool:
        """Whether a download failed part-way and the next one of the same state goes on from its stripes."""
        return self.state.resumable

    def download_state(self, peers: Sequence[str] = (),
                       min_round: Optional[int] = None) -> Optional[tuple[int, bytearray]]:
        """The newest state other peers serve: (round, blob), or None when no peer has one; striped over every
        peer that holds it.

        ``peers``: peer ids (base58) to ask (default: the registry's peers, highest round first; those that
        announce this peer's settings only, where there are any).
        """
        from hivemind.p2p import PeerID

        if not peers:
            peers, newest = self.registry.holders(self.peers())
            if not peers:
                return None
            min_round = newest if min_round is None else min_round
        # the registry says this peer is downloading: peers reaching the next round first wait for it (within
        # their cap) rather than for an arrival time that did not count the download
        s = self.standing
        s.phase = "resync"
        self.registry.announce()
        largest = self.max_state_bytes or self.max_payload_bytes
        # each stripe's own timeout (state_timeout of its size) bounds the download; this only catches a hang
        # elsewhere (opening a stream: 10 s; a header: STATE_WAIT_S + 10 s)
        try:
            return self.node.call(self.state.download([PeerID.from_base58(p) for p in peers], min_round or 0,
                                                      largest), STATE_CEILING_S + 60)
        except Exception as e:
            log.warning("peer %s: the state download failed: %s: %s", self.node.tag, type(e).__name__, e)
            return None
        finally:  # its round starts now
            self._round_start = time.perf_counter()
            s.phase, s.eta = "train", (dht_now() + s.round_s if s.round_s else None)
            self.registry.announce()

    # ---- collectives ------------------------------------------------------------------------
    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        return self._start_all_gather_bytes(payload)()

    def _start_all_gather_bytes(self, payload: bytes, sizes: Optional[Sequence[int]] = None,
                                bound: Optional[PayloadBound] = None) -> Callable[[], list[bytes]]:
        """One round, done before this returns; the callable hands every member's payload (this peer's included)
        in canonical order (:meth:`member_names`). A member's payload of a length ``bound`` does not allow is
        refused unread."""
        result = self.exchange(payload, bound)
        # a member whose own payload did not reach everyone is left out of the agreed set (its update too)
        out = [result.payloads[p] for p in result.members]
        # handed over: the result kept until the next round holds no payload, or every member's would stay in
        # memory through the next round's training and meet the next round's
        result.payloads = {}
        return lambda: out

    def _moved(self, kind: str, sent: Sequence[int], received: Sequence[int]) -> tuple[int, int]:
        """What this peer's pushes really delivered, and what it took from the members it kept."""
        return (self._last.sent_bytes, self._last.received_bytes) if self._last is not None else (0, 0)

    def member_names(self) -> list[str]:
        return [p.to_base58() for p in self._last.members] if self._last is not None else [self.me]

    def _all_to_all_bytes(self, payloads: Sequence[bytes]) -> list[bytes]:
        raise TransportError("the hivemind transport has no fixed ranks: it averages with weighted_mean and "
                             "all_gather_bytes")

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def _all_reduce_sum_(self, flat: torch.Tensor) -> None:
        raise TransportError("the hivemind transport averages with weighted_mean (no fixed ranks)")

    # metrics.jsonl and summary.json keep their keys: "epoch" is this peer's round, "epochs" its rounds
    def metrics(self) -> dict[str, Any]:
        if self._last is None:
            return {}
        return {"epoch": self.standing.round, "group_size": len(self._last.members)}

    def summary(self) -> dict[str, Any]:
        return {"peer_id": self.me, "epochs": self.standing.round, "ledger": {pid: rec.as_list() for pid, rec in
                                                                             self.ledger.records.items()}}


def read_swarm(transport: HivemindTransport) -> dict[str, Any]:
    """The run's registry and every peer's published ledger, as seen from the DHT (``loco status``)."""
    async def both():
        return await transport.registry.read(), await transport.registry.subkeys(transport.ledger.key)

    peers, ledgers = transport.node.call(both(), 60)
    return {"peers": peers, "ledgers": ledgers}
