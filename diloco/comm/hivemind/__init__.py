"""Internet peers: a transport over hivemind's DHT, matchmaking and libp2p streams.

A swarm has no fixed ranks. Every exchange (a DiLoCo round, a DeMo step) is one *round*: the peers that reach
it within the matchmaking window form a group, every member pushes its payload (loco's wire format: int8, fp4,
top-k... stay compressed on the wire) to every other member over a libp2p stream, and a commit makes every
survivor agree on whose payloads count, so all members average the same payloads in the same (sorted peer id)
order and end the round with the same result. A member that vanishes is left out after the deadline; a round
nobody else reaches is done alone, and its notes say why.

To the training loop a peer is a run of its own (``rank`` 0 of 1: it writes its own run folder and
checkpoints); the swarm shows in the collectives: ``all_gather_bytes`` hands the collective every member's
payload in canonical order, and the robust mean of :mod:`diloco.compress.collective` validates, clips and
averages them, then tells the transport whom it accepted, left out and clipped (``record_contributions``).
After each round the driver takes a :class:`RoundReport` (``take_report``): the members, the verdicts on their
updates, the bytes and seconds, and whether this peer's state differs from the group's (``resync_from``: the
members to download it from; a new peer downloads the run's state the same way, ``download_state``, and says
so with ``adopted``). Peers that hold a run key sign every DHT request and response, their join tokens and
every push; without it a peer cannot even bootstrap into the DHT.

The modules, one per job; a :class:`HivemindTransport` holds one object of each:

* ``node`` -- the DHT process, its p2pd and their sockets, the event loop, the run key and the ``on_phase``
  hook every phase awaits (the fault tests act there);
* ``registry`` -- the run's registry of live peers (heartbeats), the rendezvous before a round, and the peers
  whose settings differ (:func:`diloco.comm.agreement.schema_differs` words how); ``links`` -- which peers
  libp2p reaches, mending partitions;
* ``matchmaking`` -- forming a round's group and vetting each member's announcement;
* ``push`` -- sending a round's messages, through another member where a peer is unreachable; ``inbox`` --
  taking them: a push is checked by its header before any body byte is read, and purged when the round ends;
* ``commit`` -- the ack intersection (a pure function) and which state is the group's (state sketches);
* ``deadlines`` -- the matchmaking window and exchange deadline, fixed or paced by what the peer measures;
  ``limits`` -- the payload sizes a round takes (handed by the collective as numbers), and the inbox's bounds;
* ``round`` -- one exchange walked through those phases; ``report`` -- what it produced;
* ``state`` -- serving this peer's state and downloading the run's, in stripes from every holder;
* ``ledger`` -- who contributed what, published in the DHT for ``loco status`` (``merge_ledgers``);
* ``auth`` -- run names, HMAC and the DHT's authorizer; ``framing`` -- the logger, stream framing, DHT time.

Wire keys, DHT keys and file keys keep the word ``epoch`` for a round (peers and files of a run interoperate);
where one does, a comment says so. Importing this package does not import hivemind: only starting a peer does.
"""

from diloco.comm.hivemind.auth import check_run_name, mac
from diloco.comm.hivemind.commit import fingerprint, same_state
from diloco.comm.hivemind.ledger import PeerRecord, merge_ledgers
from diloco.comm.hivemind.report import RoundReport, RoundResult
from diloco.comm.hivemind.transport import HivemindTransport, read_swarm

__all__ = ["HivemindTransport", "PeerRecord", "RoundReport", "RoundResult", "fingerprint", "same_state", "mac",
           "merge_ledgers", "read_swarm", "check_run_name"]
