"""Internet peers on 127.0.0.1: the hivemind transport in one process, then `loco join` peers as processes."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import FAST, ROOT, TINY, child_env, free_port
from diloco.compress.collective import weighted_mean

hivemind_transport = pytest.importorskip("diloco.comm.hivemind")
HivemindTransport = hivemind_transport.HivemindTransport
KEY = b"test-run-key"


def run_together(transports, fn, timeout=120):
    """fn(i, transport) on every peer at once (as separate machines would); results by index."""
    out, errors = {}, []

    def work(i, t):
        try:
            out[i] = fn(i, t)
        except Exception as e:  # surfaced below with the peer's index
            errors.append((i, e))

    threads = [threading.Thread(target=work, args=(i, t)) for i, t in enumerate(transports)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a peer hung"
    assert not errors, errors
    return out


def three_peers(run: str, key: bytes, exchange_timeout: float, window: float = 3) -> list:
    """Three peers in this process: the first starts the run, the other two join through it. ``window``: the
    matchmaking window, which is also how long a peer waits at least for one still on its way to the round."""
    peers = [HivemindTransport(run, run_key=key, matchmaking_time=window, exchange_timeout=exchange_timeout)]
    addrs = peers[0].visible_maddrs()
    peers += [HivemindTransport(run, initial_peers=addrs, run_key=key, matchmaking_time=window,
                                exchange_timeout=exchange_timeout) for _ in range(2)]
    return peers


@pytest.fixture(scope="module")
def swarm():
    # the tests read every round as all three peers': a wide window keeps a peer that the loaded machine
    # delayed for a few seconds in its round (a round whose peers all came assembles at once, whatever the window)
    peers = three_peers("unit", KEY, exchange_timeout=20, window=10)
    yield peers
    for p in peers:
        p.close()


def test_a_scaled_up_update_is_clipped_and_every_peer_agrees(swarm):
    from diloco.compress.codec import make_codec

    def step(i, t):
        x = torch.full((3000,), float(i + 1))
        if i == 2:
            x *= 1000  # a faulty or hostile peer
        total = weighted_mean(t, [x], 1.0 + i, make_codec("int8"), key="clip")
        return total, x, t.take_report()

    out = run_together(swarm, step)
    assert all(len(out[i][2].members) == 3 for i in out)
    # weights 1, 2, 3; peer 2's norm is clipped to 10 x the median of the others' (1 and 2 -> 1.5): value 15
    want = (1 * 1 + 2 * 2 + 3 * 15) / 6
    for i in out:
        assert out[i][0] == 6.0
        assert torch.allclose(out[i][1], torch.full((3000,), want), rtol=1e-2)
        assert torch.equal(out[i][1], out[0][1])
    bad = swarm[2].me
    for i, t in enumerate(swarm):
        assert out[i][2].record()["clipped"].keys() == {bad}
        assert t.ledger.records[bad].clipped >= 1


def test_nan_and_corrupt_updates_are_left_out(swarm):
    """A NaN update and junk of the right size reach the collective, which rejects them; junk of another size
    is refused by the transport before it is read: its sender announced that size and is left out of the group."""
    from diloco.compress import wire
    from diloco.compress.codec import make_codec

    codec = make_codec("fp32")
    honest = {0: 1.0, 1: 3.0}
    size = len(codec.encode(torch.zeros(100), prefix=struct.pack("<d", 1.0)))

    def step(i, t):
        if i == 2:  # a NaN update in a well-formed payload (valid header and checksum), then garbage
            values = torch.ones(100)
            values[7] = float("nan")
            t.exchange(struct.pack("<d", 1.0) + wire.pack(values.numpy().tobytes(), torch.float32, (100,), codec.chain))
            t.exchange(struct.pack("<d", 1.0) + b"\x5a" * (size - 8))
            t.exchange(struct.pack("<d", 1.0) + b"garbage")
            return None
        outs, records = [], []
        for _ in range(3):
            x = torch.full((100,), honest[i])
            weighted_mean(t, [x], 1.0, codec, key="nan")
            outs.append(x)
            records.append(t.take_report().record())
        return outs, records

    out = run_together(swarm, step)
    for i in (0, 1):
        for x in out[i][0]:
            assert torch.equal(x, torch.full((100,), 2.0)), x[:4]
    bad = swarm[2].me
    nan, junk, short = out[0][1][-3:]
    assert "invalid payload" in nan["rejected"][bad] and "invalid payload" in junk["rejected"][bad]
    assert bad not in short["members"] and len(short["members"]) == 2
    assert any("announces a payload of 15 bytes" in n for n in short["notes"]), short["notes"]
    assert swarm[0].ledger.records[bad].rejected >= 2


STRANGER = r"""
import asyncio, hashlib, hmac, os, sys
from hivemind.p2p import P2P, PeerID
from hivemind.utils.serializer import MSGPackSerializer


def mac(key, *parts):
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.digest()


async def main(maddr, target, run, size, budget):
    p2p = await P2P.create(initial_peers=[maddr])
    peer = PeerID.from_base58(target)
    junk = os.urandom(1 << 20)
    sent = attempts = 0
    while sent < budget:
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer, run + ".push"), 5)
        except Exception:
            await asyncio.sleep(0.1)
            continue
        attempts += 1
        mode, e = attempts % 3, (attempts // 3) % 8
        try:
            if mode:  # a header announcing 2 GiB, or a well-formed one of the run's size, then junk
                n = 2 << 30 if mode == 1 else size
                sha = hashlib.sha256(junk[:n]).digest() if n <= len(junk) else os.urandom(32)
                gid = os.urandom(8)
                head = MSGPackSerializer.dumps({"g": gid, "k": "ag", "e": e, "n": n, "sha": sha, "m": mac(
                    b"", gid, b"ag", str(e).encode(), p2p.peer_id.to_bytes(), peer.to_bytes(), str(n).encode(),
                    sha)})
                writer.write(len(head).to_bytes(8, "big") + head + n.to_bytes(8, "big"))
            # no framing at all (mode 0): junk from the first byte, read as a header length
            for _ in range(1 if mode == 2 else 256):
                writer.write(junk[:size] if mode == 2 else junk)
                await asyncio.wait_for(writer.drain(), 5)
                sent += len(junk)
            await asyncio.wait_for(reader.read(1), 5)
        except Exception:
            pass
        finally:
            writer.close()
        print(attempts, sent, flush=True)
        await asyncio.sleep(0.05)
    await asyncio.sleep(3600)


asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
"""


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_stranger_streaming_junk_leaves_memory_flat_and_training_unaffected(tmp_path):
    """An open run: a stranger (a libp2p peer of its own) streams junk at a peer's push handler (headers that
    announce 2 GiB, well-formed pushes of the run's size for guessed epochs, unframed bytes) while the peer
    averages with an honest one. The peer's memory stays within 100 MB and every round has both honest peers."""
    from diloco.compress.codec import make_codec

    # a matchmaking window of 5 s costs nothing when both peers arrive (the group forms as soon as both are
    # there), and leaves room for a loaded machine: a round alone here must be the stranger's doing
    peers = [HivemindTransport("open", matchmaking_time=5, exchange_timeout=20)]
    stranger = None
    try:
        addrs = peers[0].visible_maddrs()
        peers.append(HivemindTransport("open", initial_peers=addrs, matchmaking_time=5, exchange_timeout=20))
        codec = make_codec("int8")
        numel = 1 << 19

        def rounds(count):
            def step(i, t):
                got = []
                for _ in range(count):
                    x = torch.full((numel,), float(i + 1))
                    total = weighted_mean(t, [x], 1.0, codec, key="junk")
                    got.append((total, float(x[0]), float(x[-1]), len(t.take_report().members)))
                return got
            return run_together(peers, step)

        def peak_growth(fn):
            """fn's result, and the process's RSS before it and at its peak while it ran."""
            base = rss_mb()
            peak = [base]
            done = threading.Event()

            def watch():
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mb())
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                out = fn()
            finally:
                done.set()
                watcher.join()
            return out, base, peak[0]  # read after the watcher's last sample

        for _ in range(3):  # warm: buffers, codec, connections (the first rounds grow the heap by some 20 MB)
            rounds(1)
        # the same rounds alone first: the heap (and the malloc arenas of the threads that run them) reaches their
        # working set, which late in a long test session can take some 50 MB more than in a fresh process
        _, alone_base, alone_peak = peak_growth(lambda: rounds(4))
        size = len(codec.encode(torch.zeros(numel), prefix=struct.pack("<d", 1.0)))
        log = open(tmp_path / "stranger.log", "w")
        stranger = subprocess.Popen([sys.executable, "-c", STRANGER, addrs[0], peers[0].me, "open", str(size),
                                     str(1 << 30)], stdout=log, stderr=subprocess.STDOUT,
                                    env=child_env(HIVEMIND_LOGLEVEL="ERROR"), cwd=ROOT, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline and len((tmp_path / "stranger.log").read_text().split()) < 6:
            time.sleep(0.2)  # it is connected and pushing
        out, base, peak = peak_growth(lambda: rounds(4))
        assert stranger.poll() is None, (tmp_path / "stranger.log").read_text()[-2000:]
        attempts = int((tmp_path / "stranger.log").read_text().split()[-2])
    finally:
        if stranger is not None and stranger.poll() is None:
            os.killpg(stranger.pid, signal.SIGKILL)
            stranger.wait(10)
        for p in peers:
            p.close()
    grew = peak - base
    print(f"stranger pushes: {attempts}; peer RSS {base:.0f} MB -> peak {peak:.0f} MB (+{grew:.1f} MB); the same "
          f"rounds without the stranger: {alone_base:.0f} -> {alone_peak:.0f} MB")
    # a peer that buffered what the stranger sends would grow by hundreds of MB (one push streams up to 256 MB);
    # the peer's own working set under the stranger's load reached 36 to 50.2 MB late in clean-clone test runs,
    # where an in-process Trainer has glibc keep freed memory, as a loco join peer's does
    assert grew < 100, f"the peer's memory grew by {grew:.0f} MB while a stranger streamed junk"
    assert attempts >= 10, "the stranger hardly pushed anything"
    for i in out:
        for total, first, last, members in out[i]:
            assert members == 2 and total == 2.0
            assert abs(first - 1.5) < 0.02 and abs(last - 1.5) < 0.02


def test_a_payload_larger_than_the_default_limit_is_taken_when_the_model_makes_it(swarm):
    """The window of sizes a peer takes follows from its own payload (its model and codec), however large: a 1B
    model's fp32 payload (4.4 GB) is above ``max_payload_bytes`` (4 GiB), which bounds only payloads whose size
    nothing derives. Here the limit is set below a small model's payload to show it."""
    from diloco.compress.codec import make_codec

    def step(i, t):
        t.max_payload_bytes = 1000  # below the 12 KB payloads of 3,000 fp32 values
        try:
            total = weighted_mean(t, [torch.full((3000,), float(i))], 1.0, make_codec("fp32"), key="big")
        finally:
            t.max_payload_bytes = 4 << 30
        return total, len(t.take_report().members), t._last.payloads

    out = run_together(swarm, step)
    assert all(total == 3.0 and members == 3 for total, members, _ in out.values()), out
    # the payloads were handed to the collective: the result kept until the next epoch holds none of them
    assert all(payloads == {} for _, _, payloads in out.values())


def test_a_member_announcing_a_huge_weight_counts_at_most_weight_clip_times_the_others(swarm):
    """A member's update travels with its weight (the tokens of its round), which nobody can check. One that
    announces a billion tokens counts as ``weight_clip`` (10) times the median of the others' weights: the
    mean is not its own update, the tokens every member adds to the run are bounded, and every member logs it
    and counts it in its ledger alike. Before, the mean was that member's update and the run gained a billion
    tokens."""
    from diloco.compress.codec import make_codec

    def step(i, t):
        weight = 1e9 if i == 2 else 1.0
        x = torch.full((3000,), float(i + 1))
        total = weighted_mean(t, [x], weight, make_codec("fp32"), key="weights")
        return total, x[0].item(), t.take_report().record()

    out = run_together(swarm, step)
    liar = swarm[2].me
    for total, value, rec in out.values():
        assert total == 12.0  # 1 + 1 + 10 x median(1, 1)
        assert value == pytest.approx((1.0 + 2.0 + 10 * 3.0) / 12.0)
        assert rec["weights_clipped"] == {liar: pytest.approx(1e8)}, rec
    assert all(t.ledger.records[liar].clipped >= 1 for t in swarm)
    assert swarm[0].bounds.weight_clip == 10.0


def test_a_member_announcing_a_malformed_state_is_left_out_and_the_others_go_on(swarm):
    """A member's announcement (its state's sketch, whether it is behind, how many peers averaged its state, its
    payload's hash) is checked when the group forms: one that says its state came out of a group of a billion
    peers is left out with a note, the others average without it. A sketch of another type, a flag that is not
    one, a group that is not a number would have stopped the others in the epoch's bookkeeping."""
    from diloco.comm.hivemind.matchmaking import _malformed
    from diloco.compress.codec import make_codec

    good = {"fp": b"\0" * 8, "stale": False, "g": 3, "sha": b"s" * 32}
    assert _malformed(good, b"\1" * 8) is None
    for bad in ({"fp": 5}, {"fp": b"\0" * 4}, {"stale": "no"}, {"g": "x"}, {"g": True}, {"g": 0}, {"g": 10 ** 9},
                {"sha": None}):
        assert _malformed({**good, **bad}, b"\1" * 8), bad

    def step(i, t):
        if i == 2:
            t.standing.group = 10 ** 9
        total = weighted_mean(t, [torch.full((3000,), float(i))], 1.0, make_codec("fp32"), key="meta")
        report = t.take_report()
        t.standing.group = len(report.members)
        return total, list(report.members), list(report.notes)

    out = run_together(swarm, step)
    liar = swarm[2].me
    for i in (0, 1):
        total, members, notes = out[i]
        assert total == 2.0 and liar not in members, out[i]
        assert any(liar[-8:] in n and "averaged by 1000000000 peers" in n for n in notes), notes


def test_a_header_of_nested_msgpack_extensions_is_refused_not_a_crash():
    """A header nesting hundreds of msgpack tuple extensions (1 KB, under every header limit, before any MAC is
    checked) is refused with a ValueError. hivemind's serializer decodes each nested extension with another
    ``unpackb`` on the C stack, which overflows: the whole process died with a segfault. Headers loco sends read
    back alike, and are the bytes hivemind's serializer makes for them (peers of earlier versions read them)."""
    import asyncio

    import msgpack
    from hivemind.utils.serializer import MSGPackSerializer

    from diloco.comm.hivemind.framing import read_header, pack, unpack

    nested = msgpack.packb(1)
    for _ in range(300):
        nested = msgpack.packb(msgpack.ExtType(0x40, b"\x91" + nested))
    assert len(nested) < 2048
    with pytest.raises(ValueError, match="msgpack extension"):
        unpack(nested)

    async def read(data: bytes):
        reader = asyncio.StreamReader()
        reader.feed_data(len(data).to_bytes(8, "big") + data + (0).to_bytes(8, "big"))
        reader.feed_eof()
        return await read_header(reader)

    with pytest.raises(ValueError, match="msgpack extension"):
        asyncio.run(read(nested))
    for bad in (b"\xc1", msgpack.packb([1] * 3)[:-1]):  # a byte msgpack never uses; a cut message
        with pytest.raises(ValueError):
            unpack(bad)
    header = {"g": b"\x01" * 8, "k": "payload", "e": 3, "n": 5, "sha": b"s" * 32, "f": b"a", "t": b"b",
              "m": b"m" * 32}
    assert pack(header) == MSGPackSerializer.dumps(header) and unpack(pack(header)) == header
    assert asyncio.run(read(pack({**header, "n": 0}))) == ({**header, "n": 0}, 0)
    assert unpack(pack([b"x", b"y"])) == [b"x", b"y"]


def test_a_push_header_is_refused_before_its_body_is_read(swarm):
    """A second libp2p peer (no DHT, no run key) opens streams to a keyed peer's push handler and sends only a
    header: one announcing a size this run's model and codec do not make, one without the run key's MAC. The
    peer answers FAIL although no body byte was sent. A header a member would send is not refused: the peer
    waits for its body and takes it."""
    import asyncio
    import hashlib

    from hivemind.p2p import P2P
    from hivemind.utils.serializer import MSGPackSerializer

    from diloco.comm.hivemind.push import push_mac
    from diloco.compress.codec import make_codec
    from diloco.compress.message import message_bound

    t = swarm[0]
    payload = bytes(make_codec("int8").encode(torch.randn(3000), prefix=struct.pack("<d", 1.0)))
    sha = hashlib.sha256(payload).digest()

    async def opened():
        return t.inbox.open(t.round, message_bound(make_codec("int8"), 3000, True), 3, t.max_payload_bytes)

    async def closed():
        t.inbox.close()

    async def probe(p2p, n, key=KEY, body=None, epoch=None):
        """Send a header announcing ``n`` bytes (then ``body``, if given) and return the peer's answer."""
        e = t.round if epoch is None else epoch
        _, reader, writer = await p2p.call_binary_stream_handler(t.peer_id, "unit.push")
        try:
            gid = b"g" * 8
            head = MSGPackSerializer.dumps({"g": gid, "k": "ag", "e": e, "n": n, "sha": sha, "m": push_mac(
                key, gid, "ag", e, p2p.peer_id.to_bytes(), t.peer_id.to_bytes(), n, sha)})
            writer.write(len(head).to_bytes(8, "big") + head + n.to_bytes(8, "big"))
            await writer.drain()
            try:
                answer = await asyncio.wait_for(reader.readexactly(1), 2)
            except asyncio.TimeoutError:
                answer = None  # still waiting for the body
            if answer is None and body is not None:
                writer.write(body)
                await writer.drain()
                answer = await asyncio.wait_for(reader.readexactly(1), 10)
            return answer
        finally:
            writer.close()

    async def stranger():
        p2p = await P2P.create(initial_peers=t.visible_maddrs())
        try:
            sender = p2p.peer_id
            out = {"closed": await probe(p2p, len(payload))}  # between exchanges nothing is accepted
            w = t.node.call(opened(), 10)
            for name, n, key in (("huge", 1 << 40, KEY), ("one more", len(payload) + 1, KEY),
                                 ("no key", len(payload), b""), ("another key", len(payload), b"other")):
                out[name] = (await probe(p2p, n, key), w.refused.get((sender, "ag"), ""))
            out["other epoch"] = (await probe(p2p, len(payload), epoch=t.round + 1), w.refused.get((sender, "ag")))
            out["member"] = await probe(p2p, len(payload), body=payload)
            out["held"] = [box.get(sender) for box in t.inbox.boxes.values()]
            return out
        finally:
            t.node.call(closed(), 10)
            await p2p.shutdown()

    out = asyncio.run(stranger())
    assert out["closed"] == b"\x00"
    assert out["huge"] == (b"\x00", f"a payload of {1 << 40} bytes; this run's model and codec make {len(payload)}")
    assert out["one more"][0] == b"\x00" and f"{len(payload) + 1} bytes" in out["one more"][1]
    assert out["no key"] == (b"\x00", "bad MAC (no or another run key)")
    assert out["another key"] == (b"\x00", "bad MAC (no or another run key)")
    assert out["other epoch"][0] == b"\x00" and "round" in out["other epoch"][1]
    assert out["member"] == b"\x01" and out["held"] == [payload]
    assert t.inbox.boxes == {} and t.inbox.window is None  # the end of the exchange purges the inbox


def test_a_member_relays_a_push_it_can_neither_redirect_nor_carry_for_a_stranger(swarm):
    """Three members of one group: the sender's push reaches the target through the relay, streamed through
    and credited to the sender. A header whose MAC was made for the relay, pointed at the target, is refused by
    the relay, and nothing reaches the target; so is a push for the target that names a sender other than the
    member sending it."""
    import asyncio
    import hashlib

    from hivemind.utils.serializer import MSGPackSerializer

    from diloco.comm.hivemind.push import push_mac
    from diloco.compress.codec import make_codec
    from diloco.compress.message import message_bound

    relay, sender, target = swarm
    payload = bytes(make_codec("int8").encode(torch.randn(3000), prefix=struct.pack("<d", 1.0)))
    sha = hashlib.sha256(payload).digest()
    gid, e = b"r" * 8, max(t.round for t in swarm)
    members = {t.peer_id: len(payload) for t in swarm}

    async def opened(t):
        t.adopted(e)
        bound = message_bound(make_codec("int8"), 3000, True)
        t.inbox.know_group(t.inbox.open(e, bound, 3, t.max_payload_bytes), gid, members)

    async def closed(t):
        t.inbox.close()

    async def redirected(mac_for, claimed):
        """A push for ``target`` whose MAC names ``mac_for`` as receiver and ``claimed`` as sender, sent to the
        relay; the relay's answer."""
        _, reader, writer = await sender.node.p2p.call_binary_stream_handler(relay.peer_id, "unit.push")
        try:
            head = MSGPackSerializer.dumps({"g": gid, "k": "ag", "e": e, "n": len(payload), "sha": sha,
                                            "f": claimed.to_bytes(), "t": target.peer_id.to_bytes(),
                                            "m": push_mac(KEY, gid, "ag", e, claimed.to_bytes(), mac_for.to_bytes(),
                                                          len(payload), sha)})
            writer.write(len(head).to_bytes(8, "big") + head + len(payload).to_bytes(8, "big") + payload)
            await writer.drain()
            return await asyncio.wait_for(reader.readexactly(1), 10)
        finally:
            writer.close()

    for t in swarm:
        t.node.call(opened(t), 10)
    try:
        sent = sender.node.call(sender.pusher.push(target.peer_id, gid, "ag", e, payload, time.perf_counter() + 20,
                                                   relay=relay.peer_id), 30)
        held = dict(target.inbox.boxes.get((gid, "ag", e), {}))
        target.inbox.boxes.clear()
        target.inbox.window.held.clear()
        forged = sender.node.call(redirected(relay.peer_id, sender.peer_id), 30)
        stranger = sender.node.call(redirected(target.peer_id, type(sender.peer_id)(b"\x00" * 34)), 30)
        after = dict(target.inbox.boxes.get((gid, "ag", e), {}))
    finally:
        for t in swarm:
            t.node.call(closed(t), 10)
    assert sent == "ok" and held == {sender.peer_id: payload}
    assert forged == stranger == b"\x00" and after == {}


def test_demo_steps_over_the_swarm_keep_peers_equal(swarm):
    """DeMo over the swarm: peers that meet in every step end on one model. DeMo exchanges no parameters, so a
    peer that missed a step (matchmaking can leave a late thread of a loaded machine to a round of its own) would
    rightly differ: such an attempt proves nothing and is run again."""
    from demo_optim import DeMo

    def step(i, t):  # the peers run as threads here: each uses its own generator, not the global one
        p = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
        opt = DeMo([p], lr=1e-2, transport=t)
        met = []
        for s in range(2):
            p.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(100 * i + s))
            opt.step()
            met.append(opt.last_contributors)
        return p.detach().clone(), met

    for _ in range(3):
        out = run_together(swarm, step)
        if all(out[i][1] == [3, 3] for i in out):
            break
    assert all(out[i][1] == [3, 3] for i in out), [out[i][1] for i in out]
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][0], out[2][0])


async def _forget_peer(pid: str, dht, node) -> None:
    """In a DHT process: what requests timing out during a partition do to a peer (out of the routing table,
    banned from searches), while libp2p's connection to it stays up."""
    from hivemind.p2p import PeerID

    peer = PeerID.from_base58(pid)
    uid = node.protocol.routing_table.get(peer_id=peer)
    if uid is not None:
        del node.protocol.routing_table[uid]
    for _ in range(3):
        node.blacklist.register_failure(peer)


async def _knows_peer(pid: str, dht, node) -> tuple[bool, bool]:
    from hivemind.p2p import PeerID

    peer = PeerID.from_base58(pid)
    return peer in node.protocol.routing_table, peer in node.blacklist


def test_mend_puts_back_a_connected_peer_that_the_dht_dropped(swarm):
    """A partition shorter than libp2p's keepalive leaves the connection up but the DHT nodes' routing tables
    without each other: mending pings such a peer back into the table and lifts its ban."""
    import functools

    a, b = swarm[0], swarm[1]
    a.peers()  # the registry lists b
    a.node.dht.run_coroutine(functools.partial(_forget_peer, b.me))
    assert a.node.dht.run_coroutine(functools.partial(_knows_peer, b.me)) == (False, True)
    assert b.me in {i.peer_id.to_base58() for i in a.node.call(a.node.p2p.list_peers(), 10)}
    a.node.call(a.links.mend(), 60)
    assert a.node.dht.run_coroutine(functools.partial(_knows_peer, b.me)) == (True, False)


def test_sparseloco_rounds_over_the_swarm_keep_peers_equal(swarm):
    """SparseLoCo's sparse 2-bit payloads go through the peers' robust mean: every member ends on one model. The
    inner steps are Muon's on the weight and AdamW's on the bias (MuLoCo's inner optimizer)."""
    from diloco import SparseLoCo
    from diloco.muon import MuonAdamW

    def step(i, t):
        model = torch.nn.Linear(64, 32)
        with torch.no_grad():  # one initialisation on every peer (threads: no global generator)
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        opt = MuonAdamW([model.weight], [{"params": [model.bias]}], lr=0.05, adamw=dict(lr=0.05, fused=True))
        algo = SparseLoCo(model, opt, t, inner_steps=2, chunk=256, topk_density=0.05)
        for s in range(4):
            g = torch.Generator().manual_seed(100 * i + s)
            model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
            algo.step()
            algo.zero_grad()
        return torch.cat([p.reshape(-1) for p in algo.global_params]), algo.round, len(t.take_report().members)

    out = run_together(swarm, step)
    assert all(out[i][1] == 2 and out[i][2] == 3 for i in out)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][0], out[2][0])


def stale_sockets(before: set) -> list[str]:
    """hivemind's unix sockets made since ``before`` that nothing listens on any more."""
    import glob
    import socket
    import tempfile

    stale = []
    for path in set(glob.glob(os.path.join(tempfile.gettempdir(), "hivemind-*.sock"))) - before:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
            except FileNotFoundError:
                continue
            except OSError:
                stale.append(path)
    return stale


def test_a_peer_refuses_a_broken_state_and_trains_on_from_its_own(tmp_path, capfd):
    """A peer serving a broken state (here a NaN in its global parameters) stops nobody: a joiner refuses it,
    says why, and starts from its own initialisation; a peer resyncing after a round refuses it, keeps its own
    state as it was and tries again the next round (``resync_refused`` in ``rounds.jsonl``), and takes the
    group's state once a sound one is served. Before, the joiner stopped with the error, and a resyncing peer
    would have taken the NaN."""
    import io

    from diloco.comm.hivemind import RoundReport
    from launch.config import load_config
    from launch.join.peer import JoinOptions, Peer

    sets = [*FAST, "data.seq_len=64", "run.batch_size=4", "algo.inner_steps=10", "run.eval_every=0",
            "run.checkpoint_every=0", "algo.name=diloco"]

    def peer(name, peers=()):
        cfg, _ = load_config([TINY], [*sets, f"run.dir={tmp_path / name}", f"run.seed={len(name)}"])
        return Peer(cfg, JoinOptions(peers=list(peers), run="refuse", run_key=KEY, host="127.0.0.1",
                                     matchmaking_time=3, round_timeout=20))

    def state_of(p, nan=False):
        state = torch.load(io.BytesIO(p.trainer.shared_state_blob(schema=p.schema, epoch=p.transport.round)),
                           weights_only=True)
        if nan:
            state["global_params"][2][0] = float("nan")
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def params(p):
        return [g.detach().clone() for g in p.trainer.algo.global_parameters()]

    def differs_from(p, holder):
        """p's next report says its state differs from the group's, which ``holder`` holds."""
        report = RoundReport(round=p.transport.round - 1, resync_from=(holder.transport.me,))
        p.transport.take_report = lambda: report

    a = peer("a")
    b = None
    try:
        a.transport.publish_state(state_of(a, nan=True))
        b = peer("bb", a.transport.visible_maddrs()[:1])
        err = capfd.readouterr().err
        assert "the run's state was refused" in err and "holds NaN or infinite values" in err, err[-2000:]
        own = params(b)
        assert not all(torch.equal(x, y) for x, y in zip(own, params(a)))  # its own initialisation, not a's

        differs_from(b, a)
        b._on_round({})
        assert all(torch.equal(x, y) for x, y in zip(own, params(b)))
        rec = rounds(tmp_path, "bb")[-1]
        assert rec["resync_pending"] and "NaN" in rec["resync_refused"] and not rec.get("resynced"), rec
        assert "whose state was refused" in capfd.readouterr().err

        a.transport.publish_state(state_of(a))  # sound again: the next round takes it
        differs_from(b, a)
        b._on_round({})
        assert rounds(tmp_path, "bb")[-1].get("resynced")
        assert all(torch.equal(x, y) for x, y in zip(params(a), params(b)))
    finally:
        for p in (b, a):
            if p is not None:
                p.close()


def test_a_refused_or_unreachable_join_says_why_and_leaves_no_sockets(swarm):
    import glob
    import tempfile

    from diloco.comm import TransportError

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "hivemind-*.sock")))
    addrs = swarm[0].visible_maddrs()
    for key in (None, b"another-key"):  # the peer answers and refuses: the key is to blame
        with pytest.raises(TransportError, match="run key") as info:
            HivemindTransport("unit", initial_peers=addrs, run_key=key, startup_timeout=10)
        assert "answered but refused" in str(info.value) and "ensure_bootstrap_success" not in str(info.value)
    # nothing answers there: the address is to blame, not the key
    port = free_port()
    dead = addrs[0].replace(addrs[0].split("/")[4], str(port))
    with pytest.raises(TransportError, match="could be reached") as info:
        HivemindTransport("unit", initial_peers=[dead], run_key=KEY, startup_timeout=10)
    assert f"127.0.0.1:{port}" in str(info.value) and "run key" not in str(info.value)
    time.sleep(0.5)
    assert stale_sockets(before) == []


# ---- `loco join` peers as processes -----------------------------------------------------------------------------
PEER = ["--config", TINY, "--host", "127.0.0.1", "--run-key", KEY.decode(), "--matchmaking-time", "3",
        "--round-timeout", "20", *[a for kv in FAST + ["data.seq_len=64", "run.batch_size=4", "algo.inner_steps=10",
                                                        "run.eval_every=20", "run.checkpoint_every=0"]
                                   for a in ("--set", kv)]]


def start_peer(tmp: Path, name: str, *extra: str) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "launch.cli", "join", *PEER, "--run-dir", str(tmp / name), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env(HIVEMIND_LOGLEVEL="WARNING"),
                            cwd=ROOT, start_new_session=True)


def rounds(tmp: Path, name: str) -> list[dict]:
    path = tmp / name / "rounds.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ends_on_its_state(r: dict) -> bool:
    """Whether a peer's record of a round ends on that round's state: not when it knew it differed and could not
    download the group's yet (``resync_pending``), nor when its download outlasted later rounds of the others
    and took one of theirs (``resynced_epoch`` past the round's next)."""
    return not r.get("resync_pending") and r.get("resynced_epoch", r["epoch"] + 1) <= r["epoch"] + 1


def wait_for(cond, what: str, procs: dict, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        for name, p in procs.items():
            if p.poll() is not None and name not in ("c",):
                raise AssertionError(f"peer {name} exited early ({p.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def group_alive(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pgid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[0] == str(pgid)]


def test_peers_train_together_survive_a_crash_and_a_late_joiner_starts_from_the_run(tmp_path):
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["a"] = start_peer(tmp_path, "a", "--address-file", str(tmp_path / "a.addr"), "--max-steps", "100000")
        wait_for(lambda: (tmp_path / "a.addr").is_file(), "a's address file", procs)
        addrs = (tmp_path / "a.addr").read_text().split()
        assert addrs and all(a.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in a for a in addrs)
        join = ["--peers", addrs[0]]
        procs["b"] = start_peer(tmp_path, "b", *join, "--max-steps", "100000")
        procs["c"] = start_peer(tmp_path, "c", *join, "--max-steps", "100000")
        three = lambda: sum(len(r["members"]) == 3 for r in rounds(tmp_path, "b")) >= 2  # noqa: E731
        wait_for(three, "two rounds of all three peers", procs, timeout=180)

        # a crash: only c's main process dies; its DHT process and p2pd must follow it
        os.kill(procs["c"].pid, signal.SIGKILL)
        procs["c"].wait(10)
        killed_at = max(r["epoch"] for r in rounds(tmp_path, "a"))
        after = lambda: sum(r["epoch"] > killed_at + 1 and len(r["members"]) == 2  # noqa: E731
                            for r in rounds(tmp_path, "a")) >= 2
        wait_for(after, "two rounds of a and b after c died", procs)
        time.sleep(1.0)
        assert group_alive(procs["c"].pid) == [], "the killed peer left processes behind"

        # a late joiner downloads the run's state and joins at the current round. Its end is not a step budget: a
        # budget counts the run's steps, and a and b go on while it starts, so a slow start can spend all of it
        # before d's first round. loco status reads the swarm meanwhile.
        procs["d"] = start_peer(tmp_path, "d", *join, "--max-steps", "100000")
        status = subprocess.Popen([sys.executable, "-m", "launch.cli", "status", "--peers", addrs[0], "--run-key",
                                   KEY.decode(), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=child_env(HIVEMIND_LOGLEVEL="WARNING"), cwd=ROOT)
        out, err = status.communicate(timeout=120)
        assert status.returncode == 0, err
        info = json.loads(out)
        ids = {name: json.loads((tmp_path / name / "ledger.json").read_text())["observer"] for name in "ab"}
        assert set(ids.values()) <= set(info["peers"])
        assert all(info["ledger"][pid]["tokens"] > 0 for pid in ids.values())

        d_met = lambda: sum(len(r["members"]) >= 2 for r in rounds(tmp_path, "d")) >= 2  # noqa: E731
        wait_for(d_met, "two rounds of the late joiner with the others", procs, timeout=180)
        assert "downloaded the run's state" in (tmp_path / "d.log").read_text()
        assert rounds(tmp_path, "d")[0]["epoch"] > killed_at

        # Ctrl-C and SIGTERM: a checkpoint, then the swarm is left cleanly (exit 130 and 143, as for loco train)
        for name, sig in (("d", signal.SIGTERM), ("b", signal.SIGINT), ("a", signal.SIGTERM)):
            os.kill(procs[name].pid, sig)
            t0 = time.time()
            assert procs[name].wait(30) == 128 + sig, (tmp_path / f"{name}.log").read_text()[-3000:]
            assert time.time() - t0 < 20
            assert list((tmp_path / name / "checkpoints").glob("*.pt")), f"{name} saved no checkpoint"
            time.sleep(0.5)
            assert group_alive(procs[name].pid) == [], f"peer {name} left processes behind"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    # every member of a group ends the round with the same global parameters
    by_group: dict[tuple, set] = {}
    for name in "abcd":
        for r in rounds(tmp_path, name):
            if r["group"] and ends_on_its_state(r):
                by_group.setdefault((r["epoch"], r["group"]), set()).add(r["fp_after"])
    assert len(by_group) >= 6
    assert all(len(fps) == 1 for fps in by_group.values()), by_group
    # and the model learns
    vals = [json.loads(line)["val_loss"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
            if '"val_loss"' in line]
    assert vals[-1] < vals[0] - 0.1, vals
    # the ledger of a survivor credits the crashed peer for its rounds
    ledger = json.loads((tmp_path / "a" / "ledger.json").read_text())["peers"]
    assert len(ledger) == 4 and all(v["tokens"] > 0 for v in ledger.values())
    # the simulator replays this swarm's churn (c killed, d joining in its place) with the same members and
    # weights per round
    simulated_churn_matches(tmp_path)


def simulated_churn_matches(tmp: Path) -> None:
    """From the first round of a, b and c to d's last: each round's members as a saw them, with c and d as one
    worker slot (a peer killed and another started in its place, as a restart is), become a churn trace; a
    simulation of 3 workers on that trace must record the same members per round, each weighted by the tokens
    of a full round, as the peers' rounds did."""
    from launch.config import load_config
    from launch.simulate.runner import simulate_once

    ids = {json.loads((tmp / n / "ledger.json").read_text())["observer"]: n for n in "abcd"}
    slot = {"a": 0, "b": 1, "c": 2, "d": 2}
    a = sorted(rounds(tmp, "a"), key=lambda r: r["epoch"])
    first = next(r["epoch"] for r in a if {ids.get(m) for m in r["members"]} >= {"a", "b", "c"})
    last = rounds(tmp, "d")[-1]["epoch"]
    window = [r for r in a if first <= r["epoch"] <= last]
    assert [r["epoch"] for r in window] == list(range(first, last + 1)), "a skipped an epoch"
    seen = [sorted(slot[ids[m]] for m in r["members"]) for r in window]
    events, present = [], {0, 1, 2}
    for k, members in enumerate(seen):
        for w in (1, 2):
            if (w in members) != (w in present):
                events.append(f"{k},{w},{'join' if w in members else 'leave'}")
        present = set(members)
    assert any(e.endswith(",2,leave") for e in events) and any(e.endswith(",2,join") for e in events), seen
    trace = tmp / "churn.csv"
    trace.write_text("round,worker,event\n" + "".join(e + "\n" for e in events))
    sets = [kv for kv in PEER[PEER.index("--set"):] if kv != "--set"]
    cfg, _ = load_config([TINY], [*sets, "algo.name=diloco", "sim.workers=3", "sim.baseline=none",
                                  "sim.step_time=1", "run.eval_every=0", f"run.max_steps={10 * len(window)}",
                                  f"sim.churn={trace}", f"run.dir={tmp / 'sim'}"])
    simulate_once(cfg)
    sim = [json.loads(l) for l in (tmp / "sim" / "rounds.jsonl").read_text().splitlines()]
    assert [r["members"] for r in sim] == seen
    full = 10 * 4 * 64  # a round's tokens: H steps of batch 4 x 64
    assert all(set(r["weights"].values()) == {float(full)} for r in sim)
    assert [r["total_weight"] for r in window] == [full * len(m) for m in seen]


def summary(tmp: Path, name: str) -> dict:
    return json.loads((tmp / name / "summary.json").read_text())


def test_peers_at_different_speeds_and_start_times_meet_every_round_and_end_on_one_model(tmp_path):
    """a runs on; b joins rounds later at a's speed, c with it at a third of the speed (3x the micro-batches per
    step). Each peer that joins meets the others in its first round or at most two rounds later, every later round
    has all three (but for one round at most, which names whom it missed), and b and c stop at the run's step
    budget on one model: the state a holds after that epoch too."""
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["a"] = start_peer(tmp_path, "a", "--address-file", str(tmp_path / "a.addr"), "--max-steps", "100000")
        wait_for(lambda: len(rounds(tmp_path, "a")) >= 2, "two rounds of a alone", procs)
        # the run's steps, 10 a round: enough rounds left that a (training on alone meanwhile) cannot reach the
        # budget while b and c start up on a loaded machine (their first round would then be past it)
        budget = (max(r["epoch"] for r in rounds(tmp_path, "a")) + 20) * 10
        join = ["--peers", (tmp_path / "a.addr").read_text().split()[0], "--max-steps", str(budget)]
        procs["b"] = start_peer(tmp_path, "b", *join)
        procs["c"] = start_peer(tmp_path, "c", *join, "--set", "run.batch_size=12", "--set", "run.grad_accum=3")
        for name in "bc":
            assert procs[name].wait(120) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        os.kill(procs["a"].pid, signal.SIGINT)
        assert procs["a"].wait(30) == 130, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    a, b, c = (rounds(tmp_path, n) for n in "abc")
    assert len(b) >= 3 and len(c) >= 3, (b, c)
    # each joiner meets the peers already there at once: in its first round, or, on a starved machine where the
    # slow one's first round comes later than the others wait for a newcomer (a few of their own rounds), in the
    # next round it reaches (it trains the first one alone and says why). From the round both joiners have met
    # the others, every round has all three, but for one at most: now and then hivemind's matchmaking gives up
    # on a member whom the group's leader still counts, and that round names it. The ends below must agree.
    met = [next((r["epoch"] for r in rs if not r["alone"]), None) for rs in (b, c)]
    assert None not in met and max(met) <= max(b[0]["epoch"], c[0]["epoch"]) + 2, (met, b[:3], c[:3])
    assert all(r["notes"] for r in b + c if r["alone"]), [r for r in b + c if r["alone"]]
    both = max(met)
    missed = {(name, r["epoch"]): r["notes"] for name, rs in (("b", b), ("c", c)) for r in rs
              if r["epoch"] >= both and (r["alone"] or len(r["members"]) < 3)}
    assert len({e for _, e in missed}) <= 1 and all(missed.values()), missed
    b, c = [r for r in b if r["epoch"] >= both], [r for r in c if r["epoch"] >= both]
    assert [r["epoch"] for r in b] == [r["epoch"] for r in c]
    assert b[-1]["step"] == c[-1]["step"] == budget
    assert b[-1]["fp_after"] == c[-1]["fp_after"]
    at_end = [r for r in a if r["epoch"] == b[-1]["epoch"]]
    assert at_end and at_end[0]["fp_after"] == b[-1]["fp_after"]
    assert summary(tmp_path, "b")["val_loss"] == summary(tmp_path, "c")["val_loss"]


def test_payload_sizes_follow_from_the_model_and_codec():
    """Exact for a chain without zstd, with or without the collective's weight; a bound that every zstd payload
    of the tensor's size respects (incompressible values included) and that junk of any other size misses. The
    collective computes them from its codec and hands the transport numbers; a payload handed without them may
    be of any length up to the largest the peer takes."""
    from diloco.comm import PayloadBound
    from diloco.comm.hivemind.limits import accepted
    from diloco.compress.codec import make_codec
    from diloco.compress.message import message_bound

    def sizes(bound: PayloadBound) -> tuple[int, int, bool]:
        return bound.least, bound.most, bound.exact

    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    shapes = [(50, 64), (1800,)]
    for chain in ("fp32", "int8", "topk:0.05+2bit", "topk:k=205,tile=64+2bit"):
        codec = make_codec(chain)
        for prefix in (b"", struct.pack("<d", 2.0)):
            # tiles: the size follows the tensors' shapes, which the members share and the header does not carry
            p = codec.encode(x, key="a", prefix=prefix, shapes=shapes)
            assert sizes(message_bound(codec, 5000, bool(prefix), shapes)) == (len(p), len(p), True), chain
    zc = make_codec("fp32+zstd")
    least, most, exact = sizes(message_bound(zc, 5000, False))
    assert not exact and least < len(zc.encode(torch.zeros(5000))) <= most
    assert least <= len(zc.encode(x)) <= most and most < 4 * 5000 + 256
    assert sizes(accepted(None, 1 << 20)) == (0, 1 << 20, False)


@pytest.mark.parametrize("algo, apart, together", [
    ("diloco", ["algo.outer_lr=0.5", "algo.outer_momentum=0.8", "algo.nesterov=false", "algo.inner_steps=20",
                "compress.codec=int8", "model.n_layers=2"], ["optim.lr=1e-3", "optim.weight_decay=0.0", "run.seed=3"]),
    ("sparseloco", ["algo.outer_lr=0.5", "algo.topk_density=0.05"], ["algo.outer_momentum=0.5", "optim.lr=1e-3"]),
])
def test_peers_whose_outer_step_differs_do_not_share_a_schema(algo, apart, together):
    """Every peer applies the outer step to one averaged update: peers of another outer lr or momentum would
    part ways after a round, so they never group (the schema keys matchmaking) and a state of theirs is
    refused; settings each peer keeps to itself (its inner optimizer, its seed) do not count."""
    from launch.config import load_config
    from diloco.comm.agreement import schema_differs
    from launch.join.peer import schema_of

    def schema(*overrides):
        return schema_of(load_config([TINY], [f"algo.name={algo}", *overrides])[0])

    base = schema()
    for setting in apart:
        assert schema(setting) != base, setting
    for setting in together:
        assert schema(setting) == base, setting
    # a peer refusing another run's state names what differs
    assert schema_differs(schema("algo.outer_lr=0.5", "model.n_layers=2"), base) == \
        "model.n_layers: 2 there, None here; outer_lr: 0.5 there, 1.0 here"
    assert "this peer's" in schema_differs(None, base)
    assert schema_differs('{"codec": "int8"}', '{"codec": "fp32"}') == "codec: 'int8' there, 'fp32' here"
    # so do the bounds a peer puts on the others' updates: members that bound otherwise take other means
    from launch.join.peer import JoinOptions

    cfg = load_config([TINY], [f"algo.name={algo}"])[0]
    joined = schema_of(cfg, JoinOptions())
    assert schema_of(cfg, JoinOptions()) == joined
    for other in (JoinOptions(weight_clip=0.0), JoinOptions(norm_clip=5.0), JoinOptions(clip_action="drop")):
        assert schema_of(cfg, other) != joined, other
    assert schema_differs(schema_of(cfg, JoinOptions(weight_clip=0.0)), joined) == "weight_clip: 0.0 there, 10.0 here"


def test_peers_of_one_run_with_other_settings_are_named_and_neither_waits_for_the_other():
    """Two peers of one run whose settings differ (here the outer lr) can never form a group: each goes on
    alone at once, rather than waiting for the other or following it to its epoch, and its notes and log name
    the other peer and the setting."""
    settings = ['{"codec": "int8", "outer_lr": 0.7}', '{"codec": "int8", "outer_lr": 0.5}']
    a = HivemindTransport("mixed", run_key=KEY, matchmaking_time=2, exchange_timeout=10, schema=settings[0])
    b = HivemindTransport("mixed", initial_peers=a.visible_maddrs(), run_key=KEY, matchmaking_time=2,
                          exchange_timeout=10, schema=settings[1])
    try:
        b.adopted(5)  # ahead: a peer of the same settings would be followed there
        b.heartbeat()
        out = run_together([a, b], lambda i, t: t.exchange(b"x" * 64))
        for i, (t, there, here) in enumerate(((a, "0.5", "0.7"), (b, "0.7", "0.5"))):
            r = out[i]
            assert r.members == [t.peer_id] and t.stale is False, r.notes
            named = [n for n in r.notes if "trains with other settings" in n]
            assert len(named) == 1 and f"outer_lr: {there} there, {here} here" in named[0], r.notes
            assert not any("did not arrive" in n or "is behind" in n for n in r.notes), r.notes
        assert a.round == 1 and b.round == 6
        again = a.exchange(b"y" * 64)  # named once; each lone round says why it is alone
        assert not any("trains with other settings" in n for n in again.notes), again.notes
        assert again.alone and again.notes[-1] == ("no other live peer trains with this peer's settings (1 of the "
                                                   "run's live peers has other settings)"), again.notes
        # a newcomer takes the state of a peer of its own settings, though the other's epoch is later
        a.publish_state(b"state of a")
        b.publish_state(b"state of b")
        c = HivemindTransport("mixed", initial_peers=a.visible_maddrs(), run_key=KEY, schema=settings[0])
        try:
            assert c.download_state() == (2, bytearray(b"state of a"))
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_state_sketches_tolerate_rounding_but_not_a_different_round():
    from diloco.comm.hivemind import fingerprint, same_state

    torch.manual_seed(0)
    params = [torch.randn(64, 64), torch.randn(64), torch.randn(3)]
    a = fingerprint(params)
    assert len(a) == 4 * (8 + 8 + 3)
    rounded = [p * (1 + 1e-7) for p in params]  # another machine's last-bit rounding
    assert same_state(a, fingerprint(rounded)) and a != fingerprint(rounded)
    moved = [p - 1e-3 * torch.randn_like(p) for p in params]  # one more outer step
    assert not same_state(a, fingerprint(moved))
    assert not same_state(a, fingerprint(params[:2]))
    # a tensor of more than 2^24 values (an embedding of a 50k vocabulary): its last sample is its last value
    # (float32 positions rounded 2^24 + 3 up to 2^24 + 4, one past the end, and the round ended in an IndexError)
    big = torch.zeros(2 ** 24 + 4, dtype=torch.uint8)
    big[-1] = 7
    sketch = torch.frombuffer(bytearray(fingerprint([params[0], big])), dtype=torch.float32)
    assert sketch.numel() == 16 and sketch[-1] == 7 and torch.equal(sketch[:8], torch.frombuffer(
        bytearray(fingerprint(params[:1])), dtype=torch.float32))


def test_the_ledger_merges_observers_by_median():
    from diloco.comm.hivemind import merge_ledgers
    from launch.join.peer import format_status

    honest = {"p1": [100.0, 2, 2, 0, 0], "p2": [50.0, 2, 1, 1, 1]}
    liar = {"p1": [1e9, 99, 99, 0, 0], "p2": [0.0, 0, 0, 9, 0]}
    merged = merge_ledgers({"o1": honest, "o2": honest, "o3": liar, "o4": {"p1": "junk"}})
    assert merged["p1"].tokens == 100.0 and merged["p1"].epochs == 2
    assert merged["p2"].rejected == 1 and merged["p2"].clipped == 1
    info = {"run": "r", "peers": {"p1": {"epoch": 3, "step": 30, "tokens_per_s": 1234.0, "time": time.time()}},
            "observers": ["o1", "o2", "o3"],
            "ledger": {k: v.as_dict() for k, v in merged.items()}}
    text = format_status(info)
    assert "1 live peer" in text and "1,234" in text and "median over 3 observer(s)" in text
    assert "different settings" not in text
    # peers that announce other settings than most are named with what differs
    alike, apart = '{"codec": "int8", "outer_lr": 0.7}', '{"codec": "int8", "outer_lr": 0.5}'
    info["peers"] = {f"peer{i}": {"epoch": 3, "time": time.time(), "settings": s}
                     for i, s in enumerate([alike, alike, apart, ""])}
    text = format_status(info)
    assert "the live peers announce 2 different settings" in text and "of the most peers (2)" in text
    assert "  …peer2: outer_lr: 0.5 there, 0.7 here" in text.splitlines(), text


# ---- adaptive deadlines -----------------------------------------------------------------------------------------
def test_a_peer_downloading_the_state_is_waited_for_two_of_its_rounds():
    """The rendezvous waits for a peer that announced its arrival until then (with slack); for one that
    announced a download of the group's state (not in its arrival time) up to two of its rounds from the
    download's start; for any peer, the first matchmaking window."""
    from diloco.comm.hivemind.registry import expects as expects_in

    expects = lambda entry, now, waited=10.0: expects_in(entry, now, waited, 3.0)  # noqa: E731
    training = {"phase": "train", "time": 100.0, "eta": 110.0, "round_s": 10.0}
    assert expects(training, 114.0) and not expects(training, 116.0)  # eta + max(3, 0.5 x 10)
    resync = {"phase": "resync", "time": 100.0, "eta": 101.0, "round_s": 10.0}
    assert expects(resync, 124.0) and not expects(resync, 126.0)  # time + 2 x 10 + 5
    assert expects(resync, 300.0, waited=1.0)  # within the first window, anyone is waited for
    assert not expects({"phase": "resync", "time": 100.0, "round_s": None}, 104.0)  # a joiner: no rounds yet


def test_deadlines_follow_the_measured_rate_within_their_bounds():
    from diloco.comm.hivemind import deadlines as f

    # no measurement yet: the exchange keeps the old constant; a state download assumes a slow link
    assert f.exchange_deadline(1e9, None, 3) == f.EXCHANGE_DEFAULT_S == 60.0
    assert f.state_timeout(1e6, None) == f.STATE_FLOOR_S
    # margin x (bytes / rate + latency per member), clamped
    assert f.exchange_deadline(100e6, 10e6, 2) == pytest.approx(f.EXCHANGE_MARGIN * (10 + 2 * f.LATENCY_PER_MEMBER_S))
    assert f.exchange_deadline(1e3, 1e9, 2) == f.EXCHANGE_FLOOR_S  # a fast link: the floor
    assert f.exchange_deadline(1e12, 1e6, 2) == f.EXCHANGE_CEILING_S  # a hopeless one: the ceiling
    assert f.exchange_deadline(100e6, 5e6, 2) > f.exchange_deadline(100e6, 10e6, 2)  # slower link, more time
    # a 4 GB state over an unmeasured (1 MB/s) link, or a measured 2 MB/s both ways: far beyond the old 120 s
    assert f.state_timeout(4e9, None) == f.STATE_CEILING_S
    assert f.state_timeout(4e9, 2e6) == f.STATE_CEILING_S
    assert f.state_timeout(100e6, 2e6) == pytest.approx(f.STATE_MARGIN * 100)  # one way: half the measured rate
    assert f.state_timeout(10e6, 1e9) == f.STATE_FLOOR_S
    assert f.matchmaking_window(None) == f.MATCHMAKING_FLOOR_S == 5.0
    assert f.matchmaking_window(4.0) == 12.0 and f.matchmaking_window(600.0) == f.MATCHMAKING_CEILING_S
    pace = f.Pace()
    for v in (1.0, 100.0, 2.0, 0.0, float("nan"), 3.0):  # nonsense is not a measurement; one outlier moves nothing
        pace.add(v)
    assert pace.median() == 2.5 and f.Pace().median() is None
    assert [f.seconds_or_auto(v, "x") for v in ("auto", None, "AUTO", 30, "7.5")] == [None, None, None, 30.0, 7.5]
    for bad in ("soon", 0, -1, "inf"):
        with pytest.raises(ValueError, match="x must be"):
            f.seconds_or_auto(bad, "x")


def test_an_adaptive_peer_sets_its_deadline_from_measured_exchanges(swarm):
    """The fixture's peers have fixed deadlines; made adaptive, a few rounds of 256 KiB payloads give each a
    measured rate and a deadline from it, within the bounds (on one machine: the floor, far below 60 s)."""
    from diloco.comm.hivemind import deadlines as f

    payload = os.urandom(256 << 10)
    fixed = [(t.deadlines.fixed_exchange_timeout, t.deadlines.exchange_timeout) for t in swarm]
    try:
        for t in swarm:
            t.deadlines.fixed_exchange_timeout = None
        out = run_together(swarm, lambda i, t: [t.exchange(payload) for _ in range(3)])
        for i, t in enumerate(swarm):
            assert all(len(r.members) == 3 for r in out[i]), [r.notes for r in out[i]]
            assert t.deadlines.rate.median() is not None and t.deadlines.rate.median() > 0
            last = out[i][-1]
            assert f.EXCHANGE_FLOOR_S <= last.deadline_s <= f.EXCHANGE_CEILING_S
            assert last.deadline_s < f.EXCHANGE_DEFAULT_S and last.deadline_s == t.deadlines.exchange_timeout
            assert last.exchange_s > 0 and last.sent_bytes == last.received_bytes == 2 * len(payload)
            assert t.deadlines.state_timeout(4 << 30) > f.STATE_FLOOR_S
    finally:
        for t, (setting, current) in zip(swarm, fixed):
            t.deadlines.fixed_exchange_timeout, t.deadlines.exchange_timeout = setting, current
    assert all(t.deadlines.exchange_timeout == 20 for t in swarm)


def test_round_timeout_takes_auto_or_seconds_and_names_the_flag_otherwise():
    from conftest import run_cli
    from launch.cli.commands import _seconds_or_auto, build_parser

    args = build_parser().parse_args(["join", "--round-timeout", "auto", "--matchmaking-time", "auto"])
    assert _seconds_or_auto("--round-timeout", args.round_timeout) is None
    assert _seconds_or_auto("--matchmaking-time", args.matchmaking_time) is None
    default = build_parser().parse_args(["join"])
    assert _seconds_or_auto("--round-timeout", default.round_timeout) is None  # adaptive unless told otherwise
    assert _seconds_or_auto("--matchmaking-time", default.matchmaking_time) == 5.0
    assert _seconds_or_auto("--round-timeout", "90") == 90.0
    res = run_cli(["join", "--config", TINY, "--round-timeout", "soon"], timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("loco join: error: --round-timeout soon:"), res.stderr


def test_a_state_reply_held_back_for_a_newer_epoch_is_waited_for():
    """A peer asked for a state newer than it holds waits up to STATE_WAIT_S before it answers, so the asker
    reads the reply's header with a timeout of its own (STATE_WAIT_S + 10; the fixed 10 s gave up first)."""
    import asyncio

    from diloco.comm.hivemind.framing import read_framed
    from hivemind.utils.serializer import MSGPackSerializer

    head = MSGPackSerializer.dumps({"n": 3})
    message = len(head).to_bytes(8, "big") + head + (3).to_bytes(8, "big") + b"abc"

    async def read_after(delay: float, header_timeout: float):
        reader = asyncio.StreamReader()
        asyncio.get_running_loop().call_later(delay, lambda: (reader.feed_data(message), reader.feed_eof()))
        return await read_framed(reader, 1 << 10, 5, header_timeout=header_timeout)

    assert asyncio.run(read_after(0.3, 1.0)) == ({"n": 3}, b"abc")
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(read_after(0.3, 0.1))


def test_a_body_is_read_into_one_buffer_of_its_size():
    """A 32 MiB body over a real socket: what reading it allocates peaks near the body's own size (asyncio's
    ``readexactly(n)`` held all n bytes in the stream's buffer and then copied them out, twice the body for
    every push being received), the bytes are the ones sent, and a stream that ends early says how far it got."""
    import asyncio
    import socket
    import tracemalloc

    from diloco.comm.hivemind.framing import read_body

    n = 32 << 20
    body = os.urandom(n)

    async def receive(sent: int):
        a, b = socket.socketpair()
        reader, kept = await asyncio.open_connection(sock=a)  # kept: a dropped writer closes its socket
        _, writer = await asyncio.open_connection(sock=b)

        async def send() -> None:
            view = memoryview(body)[:sent]
            for off in range(0, sent, 1 << 20):
                writer.write(view[off:off + (1 << 20)])
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            tracemalloc.reset_peak()
            got = await read_body(reader, n, 60)
            # a small result: handing a large one back through asyncio.run peaks at 9x its size (CPython 3.11)
            return got == body, tracemalloc.get_traced_memory()[1]
        finally:
            await sender
            kept.close()

    tracemalloc.start()
    try:
        same, peak = asyncio.run(receive(n))
    finally:
        tracemalloc.stop()
    assert same
    assert peak < 1.25 * n, f"reading a body of {n >> 20} MiB peaked at {peak / 2**20:.1f} MiB"
    with pytest.raises(ConnectionError, match=f"after {n // 2} of the {n} bytes"):
        asyncio.run(receive(n // 2))


def test_a_state_published_as_a_function_is_made_once_when_a_peer_first_asks(swarm, monkeypatch, caplog):
    """A ``loco join`` peer publishes its state after every round as a function (``Trainer.shared_state_later``):
    nothing is serialized or hashed until a peer asks for it, then it is made once, on a thread of its own, and
    served as bytes are. One never asked for is never made; one whose making fails is refused, with a warning."""
    import logging
    import threading

    from diloco.comm.hivemind import state as st

    monkeypatch.setattr(st, "STATE_WAIT_S", 2.0)
    a, b, c = swarm
    kept = [(p.round, p.state.snapshot, dict(p.state.pinned)) for p in swarm]
    blob = os.urandom((1 << 20) + 7)
    made: list[str] = []

    def make(data: bytes):
        def later() -> bytes:
            made.append(threading.current_thread().name)
            if data is None:
                raise OSError("the disk is full")
            return data
        return later

    try:
        b.adopted(2000)
        b.publish_state(make(blob))
        time.sleep(0.3)
        assert made == []
        epoch, got = a.download_state([b.me], min_round=2000)
        assert (epoch, bytes(got)) == (2000, blob)
        assert c.download_state([b.me], min_round=2000)[1] == blob
        assert made == ["loco-state"]

        b.adopted(2001)
        b.publish_state(make(b"never asked for"))
        b.adopted(2002)
        b.publish_state(make(None))
        with caplog.at_level(logging.WARNING, logger="loco.hivemind"):
            assert a.download_state([b.me], min_round=2002) is None
        assert made == ["loco-state"] * 2  # 2001 was never made; 2002 was tried once
        assert "the state of round 2002 could not be made for a peer that asked: OSError: the disk is full" in caplog.text
    finally:
        for p, (e, snap, pinned) in zip(swarm, kept):
            p.adopted(e)
            p.state.snapshot, p.state.pinned = snap, pinned


def test_a_state_download_is_striped_over_its_holders_and_finishes_when_one_fails_or_moves_on(swarm, monkeypatch,
                                                                                               caplog):
    """Peers b and c serve the same state: a downloads it in stripes from both. Then c fails after one stripe
    (its stripes come from b instead), and b publishes a newer state in the middle of the download (the one
    the download began from stays served): a still gets exactly the state it started, each stripe once."""
    import logging

    from diloco.comm.hivemind import state as st

    monkeypatch.setattr(st, "STRIPE_BYTES", 64 << 10)
    a, b, c = swarm
    kept = [(p.round, p.state.snapshot, dict(p.state.pinned)) for p in swarm]
    blob = os.urandom((1 << 20) + 123)  # 17 stripes, the last one short
    try:
        for p in (b, c):
            p.adopted(1000)
            p.publish_state(blob)
        epoch, got = a.download_state([b.me, c.me], min_round=1000)
        assert (epoch, bytes(got)) == (1000, blob)
        assert set(a.state_sources) == {b.me, c.me} and sum(a.state_sources.values()) == len(blob)

        served_b, served_c = b.state.served, c.state.served
        calls = {"b": 0, "c": 0}

        def b_moves_on(want, sha):
            calls["b"] += 1
            if calls["b"] == 3:  # a round ends on b in the middle of the download
                b.adopted(1001)
                b.publish_state(os.urandom(1000))
            return served_b(want, sha)

        def c_fails(want, sha):
            calls["c"] += 1
            return served_c(want, sha) if calls["c"] == 1 else None

        monkeypatch.setattr(b.state, "served", b_moves_on)
        monkeypatch.setattr(c.state, "served", c_fails)
        with caplog.at_level(logging.WARNING, logger="diloco.comm.hivemind"):
            epoch, got = a.download_state([b.me, c.me], min_round=1000)
        assert (epoch, bytes(got)) == (1000, blob)
        assert set(a.state_sources) == {b.me, c.me} and sum(a.state_sources.values()) == len(blob)
        assert 0 < a.state_sources[c.me] <= 64 << 10  # one stripe from c, every other one from b
        assert f"could not download the state from {c.me[-8:]}" in caplog.text
        assert calls["b"] > 3
    finally:
        for p, (e, snap, pinned) in zip(swarm, kept):
            p.adopted(e)
            p.state.snapshot, p.state.pinned = snap, pinned
