"""Forming a round's group: hivemind's leader-based matchmaking, and vetting what each member announces.

Peers of one run and settings meet under one DHT key per round (``<run>_e<round>``), so rounds never mix; a
group assembles as soon as every peer waiting at the round has come, or when the matchmaking window ends. Each
member's announcement travels with the group: its round and run-key token, its state's sketch, whether it is
behind, how many peers averaged its state, and its payload's size and hash. A member whose announcement does not
check is left out of the round before any payload moves.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import AsyncIterator, Optional

from diloco.comm.hivemind.auth import mac
from diloco.comm.hivemind.deadlines import Deadlines
from diloco.comm.hivemind.framing import dht_now, pack, unpack
from diloco.comm.hivemind.limits import Window
from diloco.comm.hivemind.node import Node

MAX_GROUP = 1 << 16  # the most peers a state can say it was averaged by (``g``)


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


def _malformed(meta: dict, fp: bytes) -> Optional[str]:
    """What is wrong with a member's announcement, as the end of a round reads it, or None: its state's sketch
    (``fp``, as long as this peer's own), whether it is behind (``stale``), the group its state came out of
    (``g``) and its payload's hash. Anything else there (a string, a number of another type) would stop every
    other member in the round's bookkeeping."""
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


class Matchmaker:
    """This peer's side of matchmaking (see the module's docstring); ``schema``: the key of the run's settings."""

    def __init__(self, node: Node, deadlines: Deadlines, schema: bytes, client_mode: bool) -> None:
        self.node, self.deadlines, self.schema, self.client_mode = node, deadlines, schema, client_mode
        self.mm = None

    async def serve(self) -> None:
        """On the loop: hivemind's matchmaking, and its handlers under the run's namespace."""
        from hivemind.averaging.matchmaking import Matchmaking

        window = self.deadlines.matchmaking_time
        servicer_cls = _servicer_class()
        self.mm = Matchmaking(self.node.p2p, self.schema, self.node.dht, servicer_type=servicer_cls,
                              prefix=self.node.run, target_group_size=None, min_group_size=2,
                              min_matchmaking_time=window, request_timeout=max(0.5, min(3.0, window / 3)),
                              client_mode=self.client_mode)
        servicer = servicer_cls()
        servicer.mm = self.mm
        await servicer.add_p2p_handlers(self.node.p2p, namespace=self.node.run)

    def announcement(self, round: int, fp: bytes, stale: bool, group: int, payload: bytes) -> dict:
        """What this peer tells its group: the keys are read by every member (``e`` is the round)."""
        node = self.node
        return {"e": round, "fp": fp, "stale": stale, "g": group, "n": len(payload),
                "sha": hashlib.sha256(payload).digest(),
                "tok": mac(node.key, b"join", node.peer_id.to_bytes(), str(round).encode())}

    async def form(self, round: int, expected: int, mine: dict):
        """The group of this round (hivemind's ``GroupInfo``), or None when no other peer joined in time.
        ``expected``: how many peers wait at the round, this one included (the group assembles once they all
        came; one that did measures how long forming takes)."""
        from hivemind.averaging.control import StepControl
        from hivemind.utils import MPFuture

        window = self.deadlines.matchmaking_time
        self.mm.group_key_manager.prefix = f"{self.node.run}_e{round}"  # one DHT key per round: rounds never mix
        self.mm.target_group_size = expected  # assemble at once when every peer waiting here has come
        step = StepControl(scheduled_time=dht_now() + window, deadline=dht_now() + window + 2, allow_retries=False,
                           weight=1.0, data_for_gather=pack(mine))
        step.attach(MPFuture(), MPFuture())
        step.allow_allreduce()
        began = time.perf_counter()
        try:
            group = await self.mm.look_for_group(step)
        finally:
            if not step.done():
                step.set_result(None)
        if group is not None and len(group.peer_ids) == expected:  # a group short of someone waited it out
            self.deadlines.formed(time.perf_counter() - began)
        return group

    def vet(self, group, round: int, fp: bytes, window: Window, notes: list) -> tuple[list, dict]:
        """The members of ``group`` whose announcement checks (sorted) and their announcements; each one left
        out gets a note."""
        members, meta = [], {}
        for pid, blob in zip(group.peer_ids, group.gathered):
            name = pid.to_base58()[-8:]
            try:
                m = unpack(blob)
                good = m["e"] == round and hmac.compare_digest(
                    m["tok"], mac(self.node.key, b"join", pid.to_bytes(), str(round).encode()))
            except Exception:
                good = False
            if not good:
                notes.append(f"peer {name} has no valid run-key token: left out")
            elif pid != self.node.peer_id and (why := _malformed(m, fp)):
                notes.append(f"peer {name} announces {why}: left out")
            elif not (isinstance(m.get("n"), int) and window.fits(m["n"])):
                notes.append(f"peer {name} announces a payload of {m.get('n')} bytes; this run's model and codec "
                             f"make {window.expected()}: left out")
            else:
                members.append(pid)
                meta[pid] = m
        members.sort()
        return members, meta
