"""The fault matrix (benchmarks/results/faults.md), cell by cell: one fault at one phase of an epoch or of a state
download, among hivemind peers in this process on 127.0.0.1.

A peer's network side is its p2pd daemon (a child of its DHT process). SIGKILL of that daemon is what the others
see of a peer killed with -9: its connections reset. SIGSTOP of it is what they see of a hung peer or one cut off
by a partition: connections that stay open and carry nothing. The fault is put at the phase by the transport's
``on_phase`` hook, which the peer awaits at the start of each phase."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import struct
import threading
import time

import pytest
import torch

pytest.importorskip("diloco.comm.hivemind")
from test_hivemind import three_peers  # noqa: E402 (after the skip: it imports hivemind)

KEY = b"fault-run-key"
DEADLINE = 8.0  # the exchange deadline of these peers (seconds)


def daemon_of(t) -> int:
    """The pid of transport ``t``'s p2pd (a child of its DHT process)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == t.node.dht.pid and name.startswith("p2pd"):
            return int(d)
    raise AssertionError(f"no p2pd under the DHT process {t.node.dht.pid}")


@pytest.fixture
def trio():
    """Three fresh peers (a fault may leave one of them dead); any stopped daemon is resumed before they close."""
    peers = three_peers("faults", KEY, exchange_timeout=DEADLINE)
    daemons = [daemon_of(t) for t in peers]
    yield peers
    for pid in daemons:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    closing = [threading.Thread(target=t.close) for t in peers]
    for th in closing:
        th.start()
    for th in closing:
        th.join()


def payload(seed: int) -> bytes:
    from diloco.compress.codec import make_codec

    values = torch.randn(3000, generator=torch.Generator().manual_seed(seed))
    return bytes(make_codec("int8").encode(values, prefix=struct.pack("<d", 1.0)))


def bound():
    """The lengths of :func:`payload`'s payloads, as the collective hands them to the transport."""
    from diloco.compress.codec import make_codec
    from diloco.compress.message import message_bound

    return message_bound(make_codec("int8"), 3000, True)


def exchange_all(peers, payloads, faulty: int):
    """Every peer runs one epoch at once; the survivors' results and how long each took. The faulty peer's
    thread is not waited for (a dead daemon can keep it in its own timeouts), only checked at the end."""
    out, errors, threads = {}, [], []

    def work(i, t):
        t0 = time.perf_counter()
        try:
            out[i] = (t.exchange(payloads[i], bound()), time.perf_counter() - t0)
        except Exception as e:
            errors.append((i, e))

    for i, t in enumerate(peers):
        threads.append(threading.Thread(target=work, args=(i, t), daemon=True))
        threads[-1].start()
    for i, th in enumerate(threads):
        if i != faulty:
            th.join(120)
            assert not th.is_alive(), f"peer {i} hung"
    assert not errors, errors
    return out, threads[faulty]


def left_out_by_both(out, peers, faulty: int):
    """The two survivors agree on the members, which are the two of them, and each names the faulty peer."""
    (a, _), (b, _) = (out[i] for i in range(3) if i != faulty)
    survivors = sorted(t.peer_id for i, t in enumerate(peers) if i != faulty)
    assert a.members == b.members == survivors
    name = peers[faulty].me[-8:]
    for r in (a, b):
        assert any(name in n for n in r.notes), r.notes
    return a, b


@pytest.mark.parametrize("phase", ["push", "ack"])
def test_a_member_killed_in_an_epoch_is_left_out_by_both_survivors_at_once(trio, phase):
    """kill -9 x push: the member dies as the pushes start; kill -9 x ack: it dies after every payload was
    delivered, before the commit. Either way both survivors leave it out and agree, and neither waits for the
    deadline: libp2p tells them the peer is gone."""
    c = trio[2]
    daemon = daemon_of(c)

    async def die(name, data):
        if name == phase:
            os.kill(daemon, signal.SIGKILL)
        return data

    c.on_phase = die
    out, _ = exchange_all(trio, [payload(i) for i in range(3)], faulty=2)
    a, b = left_out_by_both(out, trio, faulty=2)
    for i in (0, 1):
        assert out[i][1] < DEADLINE, f"a survivor waited {out[i][1]:.1f}s for a dead member"
    if phase == "ack":  # its payload arrived, yet without its commit it is not counted
        assert all(r.received_bytes > 0 and "did not complete" in " ".join(r.notes) for r in (a, b))
    # the dead member's own transport sees its daemon gone, and closes without waiting on it (the leave and the
    # DHT's graceful stop, 3 s each); the survivors' daemons answer
    assert [t.daemon_alive() for t in trio] == [True, True, False]
    # its next round, alone, says why in words a user can act on (not the socket's errno)
    again = c.exchange(payload(2))
    assert again.alone and "p2p daemon (p2pd) is gone" in again.notes[-1], again.notes


@pytest.mark.parametrize("fault", ["garbage", "oversized", "wrong-key", "holds-nothing", "holds-only-its-own"])
def test_a_member_whose_commit_is_corrupt_or_unsigned_is_left_out_by_both(trio, fault):
    """corrupt payload x ack, wrong run key x ack: the member's commit message is not msgpack, longer than a
    commit can be, signed with another run key, an empty list (which holds not even the member's own payload,
    and had left the others with no payload in common), or a list of the member's own payload alone (which had
    made its update the whole group's). Both others leave that member out and agree."""
    from diloco.comm.hivemind.limits import ACK_MAX

    c = trio[2]
    key = c.node.key

    async def spoil(name, data):
        if name != "ack":
            return data
        if fault == "wrong-key":
            c.node.key = b"another-run-key"
            return data
        if fault == "holds-nothing":
            return b"\x90"  # msgpack's empty list
        if fault == "holds-only-its-own":
            from hivemind.utils.serializer import MSGPackSerializer

            return MSGPackSerializer.dumps([c.peer_id.to_bytes()])
        return b"\xc1" * 40 if fault == "garbage" else b"\x90" * (ACK_MAX + 1)

    c.on_phase = spoil
    try:
        out, th = exchange_all(trio, [payload(i) for i in range(3)], faulty=2)
        th.join(60)
    finally:
        c.node.key = key
    left_out_by_both(out, trio, faulty=2)


def test_a_member_pushing_another_payload_than_it_announced_is_left_out_by_both(trio):
    """corrupt payload x push, signed: the member pushes a payload of the right size, under a header whose hash
    and MAC match it, but not the payload whose hash it announced when the group formed. The receivers check
    each body against its header as it comes, and that hash against the announced one at the commit."""
    c = trio[2]

    async def swap(name, data):
        return payload(7) if name == "push" else data

    c.on_phase = swap
    out, th = exchange_all(trio, [payload(i) for i in range(3)], faulty=2)
    th.join(60)
    a, b = left_out_by_both(out, trio, faulty=2)
    assert all("does not match its announced hash" in " ".join(r.notes) for r in (a, b)), (a.notes, b.notes)


def test_a_member_announcing_another_payload_size_is_left_out_at_matchmaking(trio):
    """corrupt payload x matchmaking: a member whose model or codec makes payloads of another size (its
    announced size is not what this run makes) is left out when the group forms, before any push."""
    out, th = exchange_all(trio, [payload(0), payload(1), payload(2) + b"\x00" * 64], faulty=2)
    th.join(60)
    a, b = left_out_by_both(out, trio, faulty=2)
    assert all("announces a payload of" in " ".join(r.notes) for r in (a, b))


def serve(peers, blob, epoch=1000):
    for p in peers:
        p.adopted(epoch)
        p.publish_state(blob)


def test_a_state_holder_that_hangs_mid_download_costs_seconds_not_its_timeout(trio, monkeypatch, caplog):
    """SIGSTOP x state transfer: a and b serve the state; a stops for good after its second stripe (a partition
    looks the same to the downloader). c's download takes the stripe a left hanging from b within seconds and
    ends with exactly the state, instead of waiting out a's timeouts (40 s for a reply's header)."""
    from diloco.comm.hivemind import state as st

    monkeypatch.setattr(st, "STRIPE_BYTES", 64 << 10)
    a, b, c = trio
    blob = os.urandom((2 << 20) + 5)
    serve((a, b), blob)
    daemon, asked = daemon_of(a), [0]

    async def hang(name, data):
        asked[0] += 1
        if asked[0] == 2:
            os.kill(daemon, signal.SIGSTOP)
        return data

    a.on_phase = hang
    t0 = time.perf_counter()
    epoch, got = c.download_state([a.me, b.me], min_round=1000)
    took = time.perf_counter() - t0
    assert (epoch, hashlib.sha256(got).digest()) == (1000, hashlib.sha256(blob).digest())
    assert asked[0] >= 2 and c.state_sources[b.me] >= len(blob) - 2 * (64 << 10)
    assert took < 15, f"the download waited {took:.1f}s for a hung holder"


def test_a_state_holder_that_hangs_before_the_first_stripe_costs_seconds_not_its_timeout(trio, monkeypatch):
    """SIGSTOP x the first stripe: a, the first holder asked, is stopped before the download begins (a peer
    stopped or cut off while a joiner asks). The first stripe is asked of b as well once a has not answered for
    HEDGE_S, and the download ends with exactly the state, instead of waiting out a's stream (10 s) first."""
    from diloco.comm.hivemind import state as st

    monkeypatch.setattr(st, "STRIPE_BYTES", 64 << 10)
    a, b, c = trio
    blob = os.urandom((1 << 20) + 3)
    serve((a, b), blob)
    os.kill(daemon_of(a), signal.SIGSTOP)
    t0 = time.perf_counter()
    epoch, got = c.download_state([a.me, b.me], min_round=1000)
    took = time.perf_counter() - t0
    assert (epoch, hashlib.sha256(got).digest()) == (1000, hashlib.sha256(blob).digest())
    assert c.state_sources == {b.me: len(blob)}
    assert took < 8, f"the download waited {took:.1f}s for a hung holder"


@pytest.mark.parametrize("fault", ["corrupt", "wrong-key"])
def test_a_state_holder_serving_bad_stripes_is_dropped_and_the_download_ends_right(trio, monkeypatch, caplog, fault):
    """corrupt payload x state transfer: b flips a byte in every stripe it serves; wrong run key x state
    transfer: b signs its replies with another key. Each of b's stripes is refused as it arrives (the manifest's
    hash, or the MAC), b is named in the log, and its stripes come from a."""
    from diloco.comm.hivemind import state as st

    monkeypatch.setattr(st, "STRIPE_BYTES", 64 << 10)
    a, b, c = trio
    blob = os.urandom((1 << 20) + 77)
    serve((a, b), blob)
    key = b.node.key

    async def spoil(name, data):
        if fault == "wrong-key":  # the reply's MAC, made right after this returns, with another key
            b.node.key = b"another-run-key"
            asyncio.get_running_loop().call_soon(setattr, b.node, "key", key)
            return data
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        return bytes(bad)

    b.on_phase = spoil
    try:
        with caplog.at_level(logging.WARNING, logger="loco.hivemind"):
            epoch, got = c.download_state([a.me, b.me], min_round=1000)
    finally:
        b.node.key = key
    assert (epoch, bytes(got)) == (1000, blob)
    assert c.state_sources == {a.me: len(blob)}  # the first stripe came from a, and b's were all refused
    why = "does not match the state's manifest" if fault == "corrupt" else "MAC does not check"
    assert f"could not download the state from {b.me[-8:]}" in caplog.text and why in caplog.text


def test_a_download_every_holder_drops_part_way_goes_on_from_what_it_got(trio, monkeypatch, caplog):
    """kill x state transfer, every holder at once: both refuse after some stripes, so the download fails.
    The stripes received are kept, and the next download of the same state asks only for the rest (and the
    first stripe again, which names the newest state)."""
    from diloco.comm.hivemind import state as st

    monkeypatch.setattr(st, "STRIPE_BYTES", 64 << 10)
    a, b, c = trio
    blob = os.urandom((1 << 20) + 9)  # 17 stripes
    serve((a, b), blob)
    asked = {a.me: 0, b.me: 0}
    dropping = [True]

    def holder(t):
        async def count(name, data):
            asked[t.me] += 1
            if dropping[0] and asked[t.me] > 4:
                raise ConnectionResetError("the holder's link dropped")
            return data
        return count

    a.on_phase, b.on_phase = holder(a), holder(b)
    with caplog.at_level(logging.WARNING, logger="loco.hivemind"):
        assert c.download_state([a.me, b.me], min_round=1000) is None
    assert "stripes are kept for the next try" in caplog.text and c.resumable
    first = dict(asked)
    dropping[0] = False
    epoch, got = c.download_state([a.me, b.me], min_round=1000)
    assert (epoch, bytes(got)) == (1000, blob) and not c.resumable
    again = sum(asked.values()) - sum(first.values())
    kept = sum(min(n, 4) for n in first.values())  # stripes served before the drop (the first one among them)
    assert again == 17 - kept + 1, (first, asked)
