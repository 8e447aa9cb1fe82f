"""`loco join` and `loco status`: train with internet peers over hivemind.

A peer is an ordinary training run (its own run folder, checkpoints and
metrics) whose DiLoCo rounds average with whichever peers reach the same round
(the ``hivemind`` transport of ``diloco.comm``). This module adds what a swarm needs around the
loop:

* the state every peer shares (global parameters, outer optimizer, round),
  served to peers that ask and downloaded from the swarm when a peer joins or
  finds after a round that its state differs from the majority's;
* a data stream per peer, seeded by its peer id, so no two peers train on the
  same sequence of batches;
* per round: ``rounds.jsonl`` (group, members, fingerprints, bytes, seconds, the deadline it waited at most),
  ``ledger.json`` (who contributed what, as every member saw it) and a
  heartbeat in the DHT that ``loco status`` reads;
* a clean exit on Ctrl-C or SIGTERM: a local checkpoint, the swarm left, no
  p2pd left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from diloco.comm import check_run_name, fingerprint, make_transport, merge_ledgers, read_swarm, schema_differs
from diloco.compress import make_codec
from launch.config.algorithms import algorithm_class, swarm_names
from launch.config import Config
from launch.data.batches import Batcher, load_data
from launch.errors import RunError
from launch.metrics.log import human_bytes
from launch.metrics.rounds import RoundsLog
from launch.loop.signals import STOP, stop_signals
from launch.loop.trainer import Hooks, Trainer

DEFAULT_RUN = "loco"
# the run's state a peer downloads, per parameter of the model at most: DiLoCo's global copy and outer momentum
# are 8 bytes; twice that leaves room for what else an algorithm shares (an optimizer's moments)
STATE_BYTES_PER_PARAM = 16


@dataclass
class JoinOptions:
    peers: Sequence[str] = ()
    run: str = DEFAULT_RUN
    address_file: Optional[str] = None
    run_key: Optional[bytes] = None
    host: str = "0.0.0.0"
    port: int = 0
    announce: Sequence[str] = ()
    identity: Optional[str] = None
    use_relay: bool = True
    auto_relay: bool = False
    upnp: bool = False
    # this peer takes no incoming connections (behind NAT, no port forward): it never leads a group, and its
    # pushes reach other such peers through a member both reach
    client_mode: bool = False
    # seconds fix a deadline; None (or "auto") derives it from what the peer measures (diloco.comm.hivemind.deadlines)
    matchmaking_time: Union[float, str, None] = 5.0
    round_timeout: Union[float, str, None] = None
    norm_clip: float = 10.0
    clip_action: str = "clip"
    weight_clip: float = 10.0
    extra: dict = field(default_factory=dict)


class OtherSettings(RunError):
    """A state from a run of other settings than this peer's config (see :func:`schema_of`)."""


def read_run_key(key: Optional[str], key_file: Optional[str]) -> Optional[bytes]:
    """The run key from --run-key, --run-key-file or $LOCO_RUN_KEY (in that order); None: an open run."""
    if key:
        return key.encode()
    if key_file:
        path = Path(key_file)
        if not path.is_file():
            raise RunError(f"--run-key-file {key_file}: no such file")
        data = path.read_bytes().strip()
        if not data:
            raise RunError(f"--run-key-file {key_file}: the file is empty")
        return data
    env = os.environ.get("LOCO_RUN_KEY")
    return env.encode() if env else None


def schema_of(cfg: Config, opts: Optional["JoinOptions"] = None) -> str:
    """What peers must share to average together: model, sequence length, algorithm, round length, codec, and
    the outer step's settings. Every peer applies the outer step to the same averaged update, so peers whose
    outer lr or momentum differ would part ways after one round; with this in the schema they never group, and
    a peer refuses a state from a run of other settings (its optimizers keep their own settings on a load).
    ``opts``: a peer's bounds on the others' updates (``--norm-clip``, ``--clip-action``, ``--weight-clip``),
    which decide the mean as much: members of one group must take one."""
    a = cfg.algo
    algo = algorithm_class(a.name)  # it declares the rest: its round's length, its outer step's settings
    schema = {"model": cfg.to_dict()["model"], "seq_len": cfg.data.seq_len, "algo": a.name,
              "codec": cfg.compress.codec, "outer_lr": algo.outer_lr_of(cfg),
              **{key: getattr(a, key) for key in algo.peer_settings}}
    if opts is not None:  # how a member's update is bounded: members that bound alike compute one mean
        schema.update(norm_clip=opts.norm_clip, clip_action=opts.clip_action, weight_clip=opts.weight_clip)
    return json.dumps(schema, sort_keys=True)


def host_maddrs(host: str, port: int) -> list[str]:
    proto = "ip6" if ":" in host else "ip4"
    return [f"/{proto}/{host}/tcp/{port}"]


class Peer:
    """A Trainer whose rounds run over a :class:`HivemindTransport`."""

    def __init__(self, cfg: Config, opts: JoinOptions) -> None:
        if not algorithm_class(cfg.algo.name).swarm:
            raise RunError(f"loco join runs algo.name={' or '.join(swarm_names())} (this config has "
                           f"{cfg.algo.name!r}); DeMo and Streaming DiLoCo over internet peers are not supported "
                           f"by 'loco join' yet")
        try:
            check_run_name(opts.run)
        except ValueError as e:
            raise RunError(f"--run: {e}") from None
        self.cfg, self.opts = cfg, opts
        self.run_dir = Path(cfg.run.dir or f"runs/{opts.run}-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.run.dir = str(self.run_dir)
        self.rounds = RoundsLog(self.run_dir)
        identity = Path(opts.identity) if opts.identity else self.run_dir / "identity.key"
        identity.parent.mkdir(parents=True, exist_ok=True)
        if cfg.data.streaming:  # a stream is dealt out by worker index, which peers of a swarm do not have
            raise RunError("data.streaming: loco join reads data held in memory or shards; prepare shards with "
                           "loco data prepare and train on them (data.source: shards)")
        self.data = load_data(cfg.data)  # before the DHT forks: a data error needs no swarm
        self.schema = schema_of(cfg, opts)
        self.transport = make_transport(
            "hivemind", run=opts.run, initial_peers=list(opts.peers), host_maddrs=host_maddrs(opts.host, opts.port),
            announce_maddrs=list(opts.announce), identity_path=str(identity), run_key=opts.run_key,
            use_relay=opts.use_relay, use_auto_relay=opts.auto_relay, nat_port_map=opts.upnp,
            client_mode=opts.client_mode,
            matchmaking_time=opts.matchmaking_time, exchange_timeout=opts.round_timeout, norm_clip=opts.norm_clip,
            clip_action=opts.clip_action, weight_clip=opts.weight_clip, schema=self.schema,
            fingerprint_fn=self.fingerprint,  # from the first round on, when the trainer exists
            stop_requested=lambda: STOP.signum is not None)  # a signal: stop waiting for late peers, save, leave
        try:
            self._start()
        except BaseException:
            self.transport.close()
            raise

    def _start(self) -> None:
        t = self.transport
        addrs = t.visible_maddrs()
        if self.opts.address_file:
            path = Path(self.opts.address_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(a + "\n" for a in addrs))
            os.replace(tmp, path)
        # this peer's own data stream: the batch order follows from its peer id
        seed = int.from_bytes(hashlib.sha256(f"{self.cfg.run.seed}|{t.me}".encode()).digest()[:8], "little")
        run = self.cfg.run
        batcher = Batcher(self.data, self.cfg.data.seq_len, run.batch_size, 0, 1, seed, run.grad_accum)
        self.trainer = Trainer(self.cfg, transport=t, data=self.data, batcher=batcher,
                               hooks=Hooks(on_round=self._on_round))
        tr = self.trainer
        # the run's state is this model's, whatever its size: global parameters and outer momentum (DiLoCo, 8 bytes
        # a parameter), with room for more; a state announced larger than that is refused before it is read
        numel = sum(p.numel() for p in tr.algo.global_parameters())
        t.max_state_bytes = max(t.max_payload_bytes, STATE_BYTES_PER_PARAM * numel + (64 << 20))
        limit = (tr.algo.codec or make_codec()).max_numel  # a round's one payload: the whole pseudo-gradient
        if numel > limit:
            raise RunError(f"this model has {numel:,} parameters and loco join exchanges them in one payload of at "
                           f"most {limit:,} values: train it over torchrun or in loco simulate, or join with a "
                           f"smaller model")
        # hivemind draws group ids and tie-breaks from Python's global random, which run.seed just fixed
        # alike on every peer: give it this machine's entropy back
        random.seed()
        m = tr.metrics
        # the line to paste elsewhere: an announced or public address before loopback and relay ones
        best = sorted(addrs, key=lambda a: ("/p2p-circuit" in a, "/127.0.0.1/" in a or "/::1/" in a))
        run_flag = f" --run {self.opts.run}" if self.opts.run != DEFAULT_RUN else ""
        m.info(f"peer {t.me} in run {self.opts.run!r}; to join from another machine: "
               f"loco join{run_flag} --peers {best[0] if best else '<this machine>'}", 0)
        if len(addrs) > 1:
            m.info(f"all addresses of this peer: {' '.join(addrs)}", 0)
        if self.opts.peers:
            got = t.download_state()
            if got is None and t.resumable:
                m.info("the run's state could not be downloaded: every peer serving it failed part-way; starting "
                       "from this peer's own initialisation, and the next round takes the group's state (going on "
                       "from the stripes already here while the run's state is the same)", 0)
            elif got is None:
                m.info("no peer serves a state yet: starting from this peer's own initialisation", 0)
            elif (refused := self._refused(got[1], "peer " + ", ".join(t.state_sources) if t.state_sources
                                           else "a peer")) is not None:
                m.info(f"the run's state was refused ({refused}): starting from this peer's own initialisation, "
                       f"and a later round takes the group's state", 0)
            else:
                state_round, blob = got
                self._align_step()
                sources = len(t.state_sources)
                m.info(f"downloaded the run's state (round {state_round}, {len(blob) / 1e6:.1f} MB"
                       + (f", in stripes from {sources} peers" if sources > 1 else "")
                       + f"); training from there at the run's step {tr.step}", tr.step)
                if self.cfg.run.max_steps and tr.step >= self.cfg.run.max_steps:
                    m.info(f"the run is past --max-steps {self.cfg.run.max_steps} already: nothing to train "
                           f"(raise --max-steps to take part)", tr.step)
        self.publish()
        t.heartbeat(step=tr.step, tokens=0, tokens_per_s=0.0)

    # ---- the shared state -------------------------------------------------------------------
    def fingerprint(self) -> bytes:
        return fingerprint(self.trainer.algo.global_parameters())

    def load_state(self, blob: bytes, source: str = "a peer") -> None:
        """Take a state another peer served, whole or (RunError) not at all. A state of other settings raises
        :class:`OtherSettings`: this peer's config is not the run's, a mistake to stop at."""
        def same_run(state: dict[str, Any]) -> None:
            if state.get("schema") != self.schema:
                raise OtherSettings(f"{source} trains with other settings than this config "
                                    f"({schema_differs(state.get('schema'), self.schema)}): join with the run's "
                                    f"--config")
            epoch = state.get("epoch")
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise RunError(f"the state from {source} has no round number ('epoch' is {epoch!r})")

        state = self.trainer.load_shared_blob(blob, source, check=same_run)
        self.transport.adopted(int(state["epoch"]))

    def _refused(self, blob: bytes, source: str) -> Optional[str]:
        """:meth:`load_state`, or why the state was refused (it does not load, does not fit this model, holds NaN
        or infinite values): a peer serving a broken state must not stop this one, which keeps its own state
        as it was. A state of other settings still stops it (:class:`OtherSettings`)."""
        try:
            self.load_state(blob, source)
        except OtherSettings:
            raise
        except RunError as e:
            return str(e)
        return None

    def _align_step(self) -> int:
        """After taking another peer's state: this peer's step is the state's (its round x the round's steps,
        for rounds of fixed steps), so the learning-rate schedule and ``run.max_steps`` follow the run's
        progress, and peers holding one state stop at one round, on one model, whenever they joined.
        Returns how far the step moved."""
        tr = self.trainer
        if tr.progress.time_rounds:
            return 0
        step = tr.algo.round * self.cfg.algo.inner_steps
        moved = step - tr.step
        tr.follow_run(step)
        return moved

    def publish(self) -> None:
        """Serve this peer's state as of now: copied now, serialized when a peer first asks for it."""
        self.transport.publish_state(self.trainer.shared_state_later(schema=self.schema, epoch=self.transport.round))

    # ---- after every round ------------------------------------------------------------------
    def _on_round(self, info: dict[str, Any]) -> None:
        t, tr = self.transport, self.trainer
        m = tr.metrics
        report = t.take_report()
        line = report.record() if report is not None else {}
        if report is not None and report.alone:
            m.info(f"round {report.round}: {report.notes[-1] if report.notes else 'alone'}; training on alone", tr.step)
        elif report is not None:
            m.info(f"round {report.round}: group {report.group} of {len(report.members)} peers, sent "
                   f"{human_bytes(report.bytes_sent)} in {report.seconds:.1f}s (matchmaking "
                   f"{report.matchmaking_s:.1f}s, deadline {report.deadline_s:.0f}s)"
                   + "".join(f"; {n}" for n in report.notes), tr.step)
        if report is not None and report.resync_from:
            line.update(self._resync(report))
        self.rounds.write(round=tr.algo.round, step=tr.step, members=line.pop("members", []),
                          weights=report.accepted if report is not None else {},
                          fp_after=hashlib.sha256(self.fingerprint()).hexdigest()[:16], **tr.algo.figures(), **line)
        self.publish()
        elapsed = max(tr.clock.wall_s(), 1e-9)
        mine = (tr.step - tr.progress.followed) * tr.tokens_per_step  # what this peer trained
        t.heartbeat(step=tr.step, tokens=mine, tokens_per_s=round(mine / elapsed, 1), round=tr.algo.round)
        self.write_ledger()

    def _resync(self, report: Any) -> dict[str, Any]:
        """After a round whose report says this peer's state differs from the group's: take theirs, from the
        members holding it. What the round's line of ``rounds.jsonl`` says of it."""
        t, tr = self.transport, self.trainer
        m = tr.metrics
        got = t.download_state(report.resync_from, min_round=report.round + 1)
        refused = None if got is None else self._refused(got[1], f"peer {report.resync_from[0]}")
        if refused is not None:
            m.info(f"round {report.round}: this peer's state differs from the group's, whose state was refused "
                   f"({refused}); training on from this peer's own, and the next round tries again", tr.step)
            return {"resync_pending": True, "resync_refused": refused}
        if got is not None:
            moved = self._align_step()
            m.info(f"round {t.round - 1}: this peer's state differed from the group's; downloaded theirs"
                   + (f" (round {tr.algo.round}: step {tr.step - moved} -> {tr.step})" if moved else ""), tr.step)
            # the state's round: later than this round's next when the others moved on
            return {"resynced": True, "resynced_epoch": t.round}
        m.info(f"round {report.round}: this peer's state differs from the group's, and no member served it; the "
               f"next round tries again", tr.step)
        return {"resync_pending": True}  # its fp_after is not the group's (a download cut off, say)

    def write_ledger(self) -> None:
        t = self.transport
        tmp = self.run_dir / ".ledger.json.tmp"
        # the file's keys are read by scripts: "epoch" is the round this peer is at
        tmp.write_text(json.dumps({"run": self.opts.run, "observer": t.me, "epoch": t.round,
                                   "peers": t.ledger.table()}, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "ledger.json")

    def fit(self) -> dict[str, Any]:
        return self.trainer.fit()

    def close(self) -> None:
        self.transport.close()


def join(cfg: Config, opts: JoinOptions) -> dict[str, Any]:
    """Run one peer until its step budget is spent or it is stopped.

    Ctrl-C and SIGTERM stop it as they stop ``loco train`` (:func:`launch.loop.signals.stop_signals`): at the end of
    the current step (after the round in flight, if one is), with a checkpoint, and then the peer leaves the swarm;
    a second signal stops at once. Both work even where the shell that started the peer ignores SIGINT.
    """
    ignored = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGINT, signal.SIGTERM)
               if signal.getsignal(sig) is signal.SIG_IGN}
    peer = None
    try:
        with stop_signals():
            try:
                peer = Peer(cfg, opts)
                return peer.fit()
            finally:
                if peer is not None:
                    peer.close()
    finally:
        for sig, handler in ignored.items():
            signal.signal(sig, handler)


def status(peers: Sequence[str], run: str = DEFAULT_RUN, run_key: Optional[bytes] = None,
           timeout: float = 30.0) -> dict[str, Any]:
    """The run's peers (from their heartbeats) and the merged contribution ledger, read from the DHT."""
    if not peers:
        raise RunError("loco status needs --peers MULTIADDR (any peer of the run)")
    t = make_transport("hivemind", run=run, initial_peers=list(peers), run_key=run_key, client_mode=True,
                       observer=True, startup_timeout=timeout)
    try:
        swarm = read_swarm(t)
    finally:
        t.close()
    merged = merge_ledgers(swarm["ledgers"])
    return {"run": run, "peers": swarm["peers"], "observers": sorted(swarm["ledgers"]),
            "ledger": {pid: rec.as_dict() for pid, rec in sorted(merged.items())}}


def _settings_apart(peers: dict[str, dict]) -> list[str]:
    """Lines naming the live peers whose announced settings differ from those most peers announce (peers of
    different settings never group); none where they all agree."""
    groups: dict[str, list[str]] = {}
    for pid, v in peers.items():
        if isinstance(v.get("settings"), str) and v["settings"]:
            groups.setdefault(v["settings"], []).append(pid)
    if len(groups) < 2:
        return []
    common = max(groups, key=lambda s: (len(groups[s]), s))
    lines = ["", f"the live peers announce {len(groups)} different settings (peers of different settings never "
                 f"group); where they differ from those of the most peers ({len(groups[common])}), as 'theirs "
                 f"there, the most peers' here':"]
    for settings, pids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if settings != common:
            lines.append(f"  {', '.join('…' + p[-14:] for p in sorted(pids))}: {schema_differs(settings, common)}")
    return lines


def format_status(info: dict[str, Any]) -> str:
    lines = [f"run {info['run']!r}: {len(info['peers'])} live peer(s)", ""]
    lines.append(f"{'peer':<16} {'round':>6} {'step':>7} {'tokens/s':>10} {'last seen':>10}")
    now = time.time()
    for pid, v in sorted(info["peers"].items()):
        seen = f"{now - float(v.get('time', now)):.0f}s ago"
        lines.append(f"{'…' + pid[-14:]:<16} {v.get('epoch', 0):>6} {v.get('step', 0):>7} "
                     f"{v.get('tokens_per_s', 0):>10,.0f} {seen:>10}")
    lines += _settings_apart(info["peers"])
    lines += ["", f"contributions (median over {len(info['observers'])} observer(s)):",
              f"{'peer':<16} {'tokens':>12} {'rounds':>7} {'accepted':>9} {'rejected':>9} {'clipped':>8}"]
    for pid, r in sorted(info["ledger"].items(), key=lambda kv: -kv[1]["tokens"]):
        lines.append(f"{'…' + pid[-14:]:<16} {r['tokens']:>12,.0f} {r['epochs']:>7} {r['accepted']:>9} "
                     f"{r['rejected']:>9} {r['clipped']:>8}")
    return "\n".join(lines)


__all__ = ["JoinOptions", "Peer", "join", "status", "format_status", "read_run_key", "schema_of"]
