#!/usr/bin/env python
"""
Prototype: round-based group formation + opaque-bytes all-gather / all-to-all over hivemind 1.1.12.

Orchestrator (default):   python proto.py [--mb 1.0] [--rounds 3]
Single peer (internal):   python proto.py peer --idx I --dir DIR ...

Every peer is a separate OS process (started in its own session so that the whole process group,
including the DHT child process and its p2pd, can be SIGKILLed to simulate a crash).

Per peer:
  * hivemind.DHT (background process that owns the p2pd daemon), with an HMAC "run key" authorizer on DHT RPCs
  * a P2P *replica* of the DHT's daemon in this process (dht.replicate_p2p()) on which we register
      - the matchmaking servicer (hivemind.averaging.matchmaking.Matchmaking's rpc_join_group)
      - a raw binary stream handler "<run>.push" that receives opaque payloads
  * rounds: matchmaking -> verify members' HMAC tokens -> all-gather + all-to-all by push -> ack/commit phase
"""
import argparse
import asyncio
import hashlib
import hmac
import json
import os
import random
import resource
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import AsyncIterator, Dict, List, Optional, Set, Tuple

RUN = "protorun"  # must not contain "."
PUSH_HANDLER = f"{RUN}.push"
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 256 * 1024 * 1024
OK, FAIL = b"\x01", b"\x00"


def log(idx, *args):
    print(f"[peer{idx} {time.strftime('%H:%M:%S')}]", *args, flush=True)


def mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


def make_payload(seed: str, nbytes: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


# ----------------------------------------------------------------------------------------------------------------------
# peer side
# ----------------------------------------------------------------------------------------------------------------------
def peer_main(args):
    # hivemind is imported only in peer processes (the orchestrator stays light)
    from hivemind.dht import DHT
    from hivemind.utils.auth import AuthorizerBase
    from hivemind.utils.timed_storage import TimedStorage, get_dht_time

    key = args.key.encode()

    class HMACAuthorizer(AuthorizerBase):
        """Shared-secret authorizer for DHT RPCs (ping/store/find): requests & responses carry an HMAC."""

        MAX_SKEW = 60.0

        def __init__(self, secret: bytes):
            self.secret = secret
            self.nonces = TimedStorage()

        def _digest(self, msg) -> bytes:
            sig = msg.auth.signature
            msg.auth.signature = b""
            d = hmac.new(self.secret, msg.SerializeToString(), hashlib.sha256).digest()
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
            return response.auth.nonce == request.auth.nonce and hmac.compare_digest(
                response.auth.signature, self._digest(response)
            )

    parent = os.getppid()

    def watchdog():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:  # orphaned: orchestrator is gone
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watchdog, daemon=True).start()
    maddrs_file = os.path.join(args.dir, "maddrs.txt")
    identity = os.path.join(args.dir, f"peer{args.idx}.id")
    common = dict(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=identity,  # new file -> P2P.generate_identity(); existing -> deterministic peer id
        authorizer=HMACAuthorizer(key),
        start=True,
    )
    t0 = time.perf_counter()
    if args.idx == 0:
        dht = DHT(**common)
        with open(maddrs_file + ".tmp", "w") as f:
            f.write("\n".join(str(m) for m in dht.get_visible_maddrs()))
        os.replace(maddrs_file + ".tmp", maddrs_file)
    else:
        with open(maddrs_file) as f:
            initial_peers = [line.strip() for line in f if line.strip()]
        dht = DHT(initial_peers=initial_peers, **common)
    peer_id = dht.peer_id  # cache it now (property does a blocking round-trip to the DHT process)
    log(args.idx, f"DHT up in {time.perf_counter() - t0:.2f}s, peer_id={peer_id}")

    try:
        if args.intruder:
            return  # an intruder with a wrong key should not even get here (bootstrap must fail)
        asyncio.run(Peer(args, dht, key).main())
    finally:
        t = time.perf_counter()
        dht.shutdown()  # stops DHTNode and terminates p2pd (the replica in our process was shut down in main())
        log(args.idx, f"dht.shutdown() took {time.perf_counter() - t:.2f}s")


async def _socket_paths(_dht, node) -> List[str]:
    """Runs inside the DHT process (DHT.run_coroutine pickles it by reference): unix sockets of its P2P."""
    return [node.p2p.daemon_listen_maddr["unix"], node.p2p._client_listen_maddr["unix"]]


class Peer:
    def __init__(self, args, dht, key: bytes):
        self.args, self.dht, self.key, self.idx = args, dht, key, args.idx
        self.peer_id = dht.peer_id
        self.inbox: Dict[Tuple[bytes, str], Dict] = {}  # (group_id, kind) -> {sender PeerID: bytes}
        self.inbox_time: Dict[Tuple[bytes, str], float] = {}
        self.arrived = asyncio.Event()
        self.suspects: Set = set()

    # ---------------------------------------------------------------- setup
    async def main(self):
        from hivemind.averaging.matchmaking import Matchmaking

        self.p2p = await self.dht.replicate_p2p()
        # record our unix sockets so that the orchestrator can remove them if we get SIGKILLed
        socks = self.dht.run_coroutine(_socket_paths) + [self.p2p._client_listen_maddr["unix"]]
        with open(os.path.join(self.args.dir, f"peer{self.idx}.socks"), "w") as f:
            f.write("\n".join(socks))
        self.mm = Matchmaking(
            self.p2p,
            hashlib.sha256(f"{RUN}|proto-v1".encode()).digest(),  # schema_hash: peers with another one are rejected
            self.dht,
            servicer_type=RoundServicer,
            prefix=RUN,
            target_group_size=None,
            min_group_size=2,
            min_matchmaking_time=self.args.mm_time,
            request_timeout=min(1.0, self.args.mm_time / 2),
            client_mode=False,
        )
        servicer = RoundServicer()
        servicer.mm = self.mm  # set before registering, so early join requests never see mm=None
        await servicer.add_p2p_handlers(self.p2p, namespace=RUN)  # "<RUN>::RoundServicer.rpc_join_group"
        await self.p2p.add_binary_stream_handler(PUSH_HANDLER, self._on_push)
        await self._heartbeat(round_no=0)
        log(self.idx, "READY")
        go = os.path.join(self.args.dir, "go")
        while not os.path.exists(go):
            await asyncio.sleep(0.05)
        try:
            for r in range(1, self.args.rounds + 1):
                await self.run_round(r)
            if self.idx == 0:
                await self.print_ledger()
        finally:
            t = time.perf_counter()
            await self.p2p.shutdown()  # replica: closes the control client + our unix socket, does not kill p2pd
            log(self.idx, f"p2p replica shutdown took {time.perf_counter() - t:.3f}s")

    # ---------------------------------------------------------------- DHT records
    async def _heartbeat(self, round_no: int, throughput: float = 0.0):
        from hivemind.utils.timed_storage import get_dht_time

        await self.dht.store(
            f"{RUN}.peers",
            subkey=self.peer_id.to_base58(),
            value=dict(idx=self.idx, round=round_no, throughput=throughput),
            expiration_time=get_dht_time() + self.args.ttl,
            return_future=True,
        )

    async def _live_peers(self) -> Dict[str, dict]:
        res = await self.dht.get(f"{RUN}.peers", latest=True, return_future=True)
        if res is None or not isinstance(res.value, dict):
            return {}
        return {sk: v.value for sk, v in res.value.items()}

    async def print_ledger(self):
        rows = []
        for r in range(1, self.args.rounds + 1):
            res = await self.dht.get(f"{RUN}.ledger.r{r}", latest=True, return_future=True)
            entries = {} if res is None else {sk[:8]: v.value for sk, v in res.value.items()}
            rows.append((r, entries))
        log(self.idx, "LEDGER from DHT:", json.dumps(rows))
        log(self.idx, "PEERS from DHT:", json.dumps(await self._live_peers()))

    # ---------------------------------------------------------------- one round
    async def run_round(self, r: int):
        from hivemind.averaging.control import StepControl
        from hivemind.utils import MPFuture
        from hivemind.utils.timed_storage import get_dht_time
        from hivemind.utils.serializer import MSGPackSerializer

        t_start = time.perf_counter()
        nbytes = int(self.args.mb * 2**20)
        my_payload = make_payload(f"ag|{r}|{self.idx}", nbytes)
        await self._heartbeat(r)

        # expected group size = fresh registry entries minus peers that failed us recently
        live = await self._live_peers()  # peers that finished round r-1 (or registered for round r) recently
        expected = len([sk for sk, v in live.items() if v.get("round", 0) >= r - 1 and sk not in self.suspects])
        expected = expected or None
        self.mm.group_key_manager.prefix = f"{RUN}_r{r}"  # per-round DHT key: rounds never mix
        self.mm.target_group_size = expected  # assemble immediately once this many peers joined

        token = mac(self.key, b"join", self.peer_id.to_bytes(), str(r).encode())
        gather = MSGPackSerializer.dumps(
            dict(idx=self.idx, sha=hashlib.sha256(my_payload).hexdigest(), round=r, tok=token)
        )
        step = StepControl(
            scheduled_time=get_dht_time() + self.args.mm_time,
            deadline=get_dht_time() + self.args.mm_timeout,
            allow_retries=False,
            weight=1.0,
            data_for_gather=gather,
        )
        step.attach(MPFuture(), MPFuture())
        step.allow_allreduce()
        group = await self.mm.look_for_group(step)
        step.set_result(None)
        t_group = time.perf_counter()
        if group is None:
            log(self.idx, f"R{r} no group within {self.args.mm_timeout}s (expected={expected})")
            return

        # verify every member's run-key token; GroupInfo is identical on all members, so the filter is too
        members, meta = [], {}
        for pid, g in zip(group.peer_ids, group.gathered):
            try:
                m = MSGPackSerializer.loads(g)
                good = m["round"] == r and hmac.compare_digest(
                    m["tok"], mac(self.key, b"join", pid.to_bytes(), str(r).encode())
                )
            except Exception:
                good = False
            if good:
                members.append(pid)
                meta[pid] = m
        members.sort()  # canonical order (PeerID.__lt__ compares base58) -- same on every member
        gid = group.group_id
        log(
            self.idx,
            f"R{r} GROUP id={gid.hex()[:12]} expected={expected} size={len(group.peer_ids)} "
            f"members(idx, sorted by peer id)={[meta[p]['idx'] for p in members]} mm={t_group - t_start:.2f}s",
        )
        if self.args.stall_round == r:
            log(self.idx, f"R{r} STALL (simulating a crash after joining the group)")
            await asyncio.sleep(120)  # the orchestrator SIGKILLs us meanwhile

        others = [p for p in members if p != self.peer_id]
        deadline = time.perf_counter() + self.args.xchg_timeout
        a2a_out = {p: make_payload(f"a2a|{r}|{self.idx}->{meta[p]['idx']}", nbytes) for p in others}

        # ---- exchange: push my all-gather payload and my per-destination payloads to every other member
        sends = []
        for p in others:
            sends.append(self._push(p, gid, "ag", my_payload))
            sends.append(self._push(p, gid, "a2a", a2a_out[p]))
        results = list(await asyncio.gather(*sends))
        connected = {info.peer_id for info in await self.p2p.list_peers()}
        for i, p in enumerate([p for p in others for _ in (0, 1)]):  # retry once if libp2p still sees the peer
            if not results[i] and p in connected:
                results[i] = await self._push(p, gid, ("ag", "a2a")[i % 2], my_payload if i % 2 == 0 else a2a_out[p])
        unreachable = {p for p, ok in zip([p for p in others for _ in (0, 1)], results) if not ok}
        t_sent = time.perf_counter()
        got_ag = await self._collect(gid, "ag", set(others) - unreachable, deadline)
        got_a2a = await self._collect(gid, "a2a", set(others) - unreachable, deadline)
        t_recv = time.perf_counter()

        # ---- verify (sha from the leader-relayed gather metadata + regenerate expected bytes)
        bad = []
        for p, data in got_ag.items():
            if hashlib.sha256(data).hexdigest() != meta[p]["sha"] or data != make_payload(
                f"ag|{r}|{meta[p]['idx']}", nbytes
            ):
                bad.append(("ag", meta[p]["idx"]))
        for p, data in got_a2a.items():
            if data != make_payload(f"a2a|{r}|{meta[p]['idx']}->{self.idx}", nbytes):
                bad.append(("a2a", meta[p]["idx"]))
        complete = {self.peer_id} | {p for p in others if p in got_ag and p in got_a2a}
        t_verified = time.perf_counter()

        # ---- commit: tell the others whom I got everything from; agree on the intersection
        ack_body = MSGPackSerializer.dumps(sorted(p.to_bytes() for p in complete))
        ack_targets = others  # everyone, even peers we failed to push to: they need our view to agree with us
        await asyncio.gather(*[self._push(p, gid, "ack", ack_body) for p in ack_targets])
        got_ack = await self._collect(gid, "ack", set(ack_targets), time.perf_counter() + self.args.ack_timeout)
        final = set(complete) & ({self.peer_id} | set(got_ack))
        for p, body in got_ack.items():
            final &= {type(self.peer_id)(b) for b in MSGPackSerializer.loads(body)}
        final_idx = sorted(meta[p]["idx"] for p in final)
        t_end = time.perf_counter()
        for p in others:
            if p not in final:
                self.suspects.add(p.to_base58())
            else:
                self.suspects.discard(p.to_base58())
        for k in [k for k in self.inbox if k[0] == gid or time.time() - self.inbox_time[k] > 120]:
            self.inbox.pop(k, None), self.inbox_time.pop(k, None)

        sent_ok = sum(results) * nbytes
        moved = sent_ok + sum(map(len, got_ag.values())) + sum(map(len, got_a2a.values()))
        thr = moved / max(t_recv - t_group, 1e-9) / 2**20  # MiB/s, sent + received through this peer
        res = dict(
            peer=self.idx,
            round=r,
            group=gid.hex()[:12],
            members=[meta[p]["idx"] for p in members],
            final=final_idx,
            ag_from=sorted(meta[p]["idx"] for p in got_ag),
            a2a_from=sorted(meta[p]["idx"] for p in got_a2a),
            unreachable=sorted(meta[p]["idx"] for p in unreachable),
            bad=bad,
            t_matchmaking=round(t_group - t_start, 3),
            t_send=round(t_sent - t_group, 3),
            t_exchange=round(t_recv - t_group, 3),
            t_verify=round(t_verified - t_recv, 3),
            t_commit=round(t_end - t_verified, 3),
            t_round=round(t_end - t_start, 3),
            MiB_s=round(thr, 1),
            maxrss_MiB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        )
        print("RESULT " + json.dumps(res), flush=True)
        from hivemind.utils.timed_storage import get_dht_time as now

        await self.dht.store(
            f"{RUN}.ledger.r{r}",
            subkey=self.peer_id.to_base58(),
            value=dict(idx=self.idx, bytes=nbytes, final=final_idx),
            expiration_time=now() + 3600,
            return_future=True,
        )
        await self._heartbeat(r, throughput=thr)

    # ---------------------------------------------------------------- transport
    async def _push(self, peer, gid: bytes, kind: str, data: bytes) -> bool:
        """Open a libp2p stream to `peer`'s PUSH_HANDLER, send header + payload, wait for a 1-byte ack."""
        from hivemind.utils.serializer import MSGPackSerializer

        digest = hashlib.sha256(data).digest()
        header = MSGPackSerializer.dumps(
            dict(g=gid, k=kind, n=len(data), m=mac(self.key, gid, kind.encode(), self.peer_id.to_bytes(),
                                                   peer.to_bytes(), digest))
        )
        writer = None
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(peer, PUSH_HANDLER), self.args.connect_timeout
            )
            writer.write(len(header).to_bytes(8, "big") + header + len(data).to_bytes(8, "big"))
            view = memoryview(data)
            for off in range(0, len(view), 1 << 20):
                writer.write(view[off: off + (1 << 20)])
                await writer.drain()
            ack = await asyncio.wait_for(reader.readexactly(1), self.args.xchg_timeout)
            return ack == OK
        except Exception as e:
            log(self.idx, f"push {kind} to {str(peer)[-6:]} failed: {type(e).__name__}: {e}")
            return False
        finally:
            if writer is not None:
                writer.close()

    async def _on_push(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """Binary stream handler. stream_info.peer_id is the libp2p-authenticated sender."""
        from hivemind.utils.serializer import MSGPackSerializer

        sender = stream_info.peer_id
        try:
            hlen = int.from_bytes(await asyncio.wait_for(reader.readexactly(8), 10), "big")
            if hlen > MAX_HEADER:
                raise ValueError("header too large")
            header = MSGPackSerializer.loads(await asyncio.wait_for(reader.readexactly(hlen), 10))
            n = int.from_bytes(await reader.readexactly(8), "big")
            if n != header["n"] or n > MAX_PAYLOAD:
                raise ValueError("bad size")
            data = await asyncio.wait_for(reader.readexactly(n), self.args.xchg_timeout)
            expected_mac = mac(self.key, header["g"], header["k"].encode(), sender.to_bytes(),
                               self.peer_id.to_bytes(), hashlib.sha256(data).digest())
            if not hmac.compare_digest(header["m"], expected_mac):
                raise PermissionError("bad MAC")
            k = (header["g"], header["k"])
            self.inbox.setdefault(k, {})[sender] = data
            self.inbox_time.setdefault(k, time.time())
            self.arrived.set()
            writer.write(OK)
            await writer.drain()
            # Let the *sender* close first: closing our end right after writing the ack races with p2pd, which
            # may reset the libp2p stream before the ack byte is delivered (seen as IncompleteReadError there).
            await asyncio.wait_for(reader.read(1), 10)
        except Exception as e:
            log(self.idx, f"rejected push from {str(sender)[-6:]}: {type(e).__name__}: {e}")
            try:
                writer.write(FAIL)
                await writer.drain()
            except Exception:
                pass
        finally:
            writer.close()

    async def _collect(self, gid: bytes, kind: str, senders: set, deadline: float) -> Dict:
        """Wait until all `senders` delivered (gid, kind) or the deadline; give up early on disconnected peers."""
        last_check = 0.0
        while True:
            self.arrived.clear()  # clear *before* looking, so an arrival after the check still wakes us up
            box = self.inbox.get((gid, kind), {})
            missing = {p for p in senders if p not in box}
            if not missing or time.perf_counter() >= deadline:
                return {p: box[p] for p in senders if p in box}
            if time.perf_counter() - last_check > 0.5:  # liveness: has libp2p lost the connection to them?
                last_check = time.perf_counter()
                connected = {info.peer_id for info in await self.p2p.list_peers()}
                gone = missing - connected
                if gone:
                    log(self.idx, f"giving up on {[str(p)[-6:] for p in gone]} ({kind}): not connected")
                    senders = senders - gone
                    continue
            try:
                await asyncio.wait_for(self.arrived.wait(), min(0.25, max(0.0, deadline - time.perf_counter())))
            except asyncio.TimeoutError:
                pass


def _make_servicer_class():
    from hivemind.p2p import P2PContext, ServicerBase
    from hivemind.proto import averaging_pb2

    class RoundServicer(ServicerBase):
        """Exposes Matchmaking.rpc_join_group as '<RUN>::RoundServicer.rpc_join_group'."""

        mm = None

        async def rpc_join_group(
            self, request: averaging_pb2.JoinRequest, context: P2PContext
        ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
            async for msg in self.mm.rpc_join_group(request, context):
                yield msg

    return RoundServicer


# ----------------------------------------------------------------------------------------------------------------------
# orchestrator
# ----------------------------------------------------------------------------------------------------------------------
def orchestrate(args):
    workdir = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"run_{int(time.time())}")
    os.makedirs(workdir)
    key = secrets.token_hex(16)
    env = dict(os.environ, HIVEMIND_LOGLEVEL=args.loglevel, PYTHONUNBUFFERED="1")
    procs: Dict[int, subprocess.Popen] = {}
    lines: List[Tuple[int, str]] = []
    events = {}
    lock = threading.Condition()

    def spawn(idx, extra=(), peer_key=key):
        cmd = [sys.executable, os.path.abspath(__file__), "peer", "--idx", str(idx), "--dir", workdir,
               "--key", peer_key, "--mb", str(args.mb), "--rounds", str(args.rounds + 2), *extra,
               "--mm-time", str(args.mm_time), "--mm-timeout", str(args.mm_timeout)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)  # own process group: killpg() takes DHT child + p2pd too

        def pump():
            for line in p.stdout:
                line = line.rstrip()
                try:
                    print(line, flush=True)
                except (BrokenPipeError, ValueError):
                    pass
                with lock:
                    lines.append((idx, line))
                    lock.notify_all()

        threading.Thread(target=pump, daemon=True).start()
        procs[idx] = p
        return p

    def wait_for(pred, timeout):
        end = time.time() + timeout
        with lock:
            while not pred():
                if time.time() > end:
                    raise TimeoutError("orchestrator timed out")
                lock.wait(0.2)

    def seen(idx, text):
        return any(i == idx and text in l for i, l in lines)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    t0 = time.time()
    exit_code = 0
    try:
        spawn(0)
        wait_for(lambda: os.path.exists(os.path.join(workdir, "maddrs.txt")), 60)
        print(f"# maddrs: {open(os.path.join(workdir, 'maddrs.txt')).read().split()}", flush=True)
        spawn(1)
        spawn(2, extra=("--stall-round", str(args.rounds + 1)) if args.kill_mode == "in-group" else ())
        wait_for(lambda: all(seen(i, "READY") for i in range(3)), 90)
        print(f"# all 3 peers ready after {time.time() - t0:.1f}s; starting rounds", flush=True)

        if args.intruder:  # a peer with the wrong run key must not be able to join the DHT
            p = spawn(3, extra=("--intruder",), peer_key="wrong-key")
            rc = p.wait(60)
            print(f"# intruder exit code {rc}, bootstrap refused: {seen(3, 'bootstrap failed')}", flush=True)

        open(os.path.join(workdir, "go"), "w").close()
        # kill peer 2 (whole process group: python + DHT process + p2pd), either once it is inside round
        # rounds+1's group ("in-group") or right after it finished round `rounds` ("between" rounds)
        if args.kill_mode == "in-group":
            wait_for(lambda: seen(2, f"R{args.rounds + 1} STALL"), 120)
            time.sleep(args.kill_delay)  # let the others' pushes to peer2 succeed first: it dies holding data
        else:
            wait_for(lambda: seen(2, f'"round": {args.rounds},'), 120)
        os.killpg(procs[2].pid, signal.SIGKILL)
        print(f"# SIGKILLed peer2's process group (pgid {procs[2].pid})", flush=True)
        for i in (0, 1):
            procs[i].wait(timeout=180)
            exit_code |= procs[i].returncode
    except (Exception, KeyboardInterrupt) as e:
        print(f"# orchestrator error: {e!r}", flush=True)
        exit_code = 1
    finally:
        for i, p in procs.items():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(5)
                except Exception:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # anything left in that group (e.g. an orphaned p2pd)
            except ProcessLookupError:
                pass

    # stale unix sockets of SIGKILLed peers (a clean shutdown removes its own)
    for name in os.listdir(workdir):
        if name.endswith(".socks"):
            for path in open(os.path.join(workdir, name)).read().split():
                if os.path.exists(path):
                    os.remove(path)
                    print(f"# removed stale socket {path}", flush=True)

    # summary
    results = [json.loads(l[len("RESULT "):]) for _, l in lines if l.startswith("RESULT ")]
    print("\n==== summary ====")
    print(f"{'round':>5} {'peer':>4} {'members':>10} {'final':>8} {'mm_s':>6} {'xchg_s':>6} {'verify_s':>8} "
          f"{'commit_s':>8} {'round_s':>7} {'MiB/s':>6} {'rssMiB':>6} bad")
    ok = True
    for r in range(1, args.rounds + 3):
        rr = [x for x in results if x["round"] == r]
        for x in sorted(rr, key=lambda x: x["peer"]):
            print(f"{r:>5} {x['peer']:>4} {str(x['members']):>10} {str(x['final']):>8} {x['t_matchmaking']:>6} "
                  f"{x['t_exchange']:>6} {x['t_verify']:>8} {x['t_commit']:>8} {x['t_round']:>7} {x['MiB_s']:>6} "
                  f"{x['maxrss_MiB']:>6} {x['bad']}")
        want = [0, 1, 2] if r <= args.rounds else [0, 1]
        consistent = (
            len(rr) == len(want)
            and len({x["group"] for x in rr}) == 1
            and all(x["final"] == want and not x["bad"] for x in rr)
        )
        ok &= consistent
        print(f"      round {r}: {'OK' if consistent else 'FAILED'} (expected final members {want})")
    for _ in range(20):  # a SIGKILLed group's p2pd may show up as <defunct> until init reaps it
        leftovers = subprocess.run(["pgrep", "-fa", "p2pd"], capture_output=True, text=True).stdout.strip()
        if not leftovers:
            break
        time.sleep(0.25)
    print(f"# leftover p2pd processes: {leftovers or 'none'}")
    print(f"# total wall time {time.time() - t0:.1f}s; overall {'SUCCESS' if ok and not exit_code else 'FAILURE'}")
    return 0 if ok and not exit_code else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="orchestrate", choices=["orchestrate", "peer"])
    ap.add_argument("--idx", type=int, default=0)
    ap.add_argument("--dir", default="")
    ap.add_argument("--key", default="")
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mm-time", type=float, default=3.0, help="matchmaking window (min_matchmaking_time)")
    ap.add_argument("--mm-timeout", type=float, default=20.0, help="give up matchmaking after this many seconds")
    ap.add_argument("--xchg-timeout", type=float, default=20.0)
    ap.add_argument("--ack-timeout", type=float, default=5.0)
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--ttl", type=float, default=30.0, help="expiration of the peer-registry record")
    ap.add_argument("--stall-round", type=int, default=-1)
    ap.add_argument("--intruder", action="store_true")
    ap.add_argument("--no-intruder", dest="intruder_test", action="store_false")
    ap.add_argument("--loglevel", default="WARNING")
    ap.add_argument("--kill-mode", default="in-group", choices=["in-group", "between"])
    ap.add_argument("--kill-delay", type=float, default=1.0, help="in-group mode: seconds between STALL and kill")
    args = ap.parse_args()
    if args.mode == "peer":
        global RoundServicer
        RoundServicer = _make_servicer_class()
        peer_main(args)
    else:
        args.intruder = args.intruder_test
        sys.exit(orchestrate(args))


if __name__ == "__main__":
    main()
