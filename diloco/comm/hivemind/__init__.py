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
  ``norm_clip`` times the median of the *other* members' norms, and averages
  (the robust mean of :mod:`diloco.compress.collective`, on ``all_gather_bytes``;
  it tells the transport whom it accepted, left out and clipped);
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

The modules: ``auth`` (run names, HMAC, the DHT's authorizer), ``framing`` (the
logger, stream framing, DHT time), ``limits`` (the payload sizes a run's model
and codec make; what a peer accepts during an epoch: pushes are checked by their
header before any body byte is read, and the inbox is purged when the epoch
ends), ``epoch`` (one exchange: matchmaking, push, collect, commit), ``state`` (serving and downloading state, fingerprints),
``ledger`` (contribution accounting, ``read_swarm``, ``merge_ledgers``) and
``transport`` (:class:`HivemindTransport`, which composes the three mixins of
``epoch``, ``state`` and ``ledger`` with its DHT registry and collectives).
Importing this package does not import hivemind: only starting a peer does.
"""

from diloco.comm.hivemind.auth import RUN_NAME, check_run_name, mac  # noqa: F401 (RUN_NAME: importable as before)
from diloco.comm.hivemind.epoch import EpochResult, schema_differs
from diloco.comm.hivemind.framing import FAIL, MAX_HEADER, OK, log  # noqa: F401 (importable as before)
from diloco.comm.hivemind.ledger import PeerRecord, merge_ledgers, read_swarm
from diloco.comm.hivemind.state import fingerprint, same_state
from diloco.comm.hivemind.transport import HivemindTransport

__all__ = ["HivemindTransport", "PeerRecord", "EpochResult", "fingerprint", "same_state", "mac", "merge_ledgers",
           "read_swarm", "check_run_name", "schema_differs"]
