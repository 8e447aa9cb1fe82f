"""What a transport can do beyond moving bytes among ranked workers (:class:`Capabilities`), and the bounds of the
robust mean its members take where they need not trust each other (:class:`RobustBounds`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do beyond moving bytes among ranked workers. The collective, the algorithms and the
    loop read these, never a transport's type; a transport states its own (``caps``), per instance where they
    depend on its set-up (``dataclasses.replace``)."""

    #: False for peers without fixed ranks (hivemind, the simulator under churn): a weighted mean gathers every
    #: member's payload and takes a validated, clipped mean (:class:`RobustBounds`) instead of a reduce-scatter
    fixed_ranks: bool = True
    #: True where a stop signal reaches every process of the run at once (torchrun passes SIGTERM on to every
    #: rank) and ``broadcast_object`` spans them all, so the processes can agree to stop and save at one step
    shared_stop: bool = False
    #: True where every worker of the group runs in this process and a byte collective hands each of them the
    #: very same result object (the simulator): a consumer may then compute from it once for all of them
    shared_results: bool = False
    #: True where :meth:`Transport.all_gather_tensor` moves tensors where they lie, without a trip through host
    #: bytes (the simulator; NCCL), for payloads that need no wire header: the members are trusted and the
    #: transfer is checked by the transport itself
    device_gather: bool = False
    #: keep the host buffer that buckets are concatenated into from one exchange to the next, so its pages are
    #: faulted in once per run instead of once per exchange (the exchange's peak memory is the same; the buffer
    #: is only not handed back between exchanges); off where many workers share one process (the simulator)
    keep_scratch: bool = False
    #: True where every worker was found to run with the same settings before the run began (torch_dist given
    #: ``settings``), so that payload sizes stated by a fixed-size codec hold on every worker
    settings_agreed: bool = False
    #: True where every worker builds its model in this process, on the one device, from the run's seed (the
    #: simulator): the models start equal, and the start-up broadcast of rank 0's parameters is left out (with
    #: ``sim.offload`` it would hold every worker's model on the GPU at once, as none is parked before it ends)
    seeded_alike: bool = False
    #: True where the byte collectives' ``*_start`` leave the transfer in flight, so that a compressed mean
    #: works on one bucket while others are on the wire (torch_dist on gloo)
    overlaps_exchange: bool = False
    #: True where the transport keeps a clock of its own that each step's compute advances (the simulator's
    #: virtual time): :meth:`Transport.computing` measures the compute and hands it to ``advance_compute``
    measures_compute: bool = False


@dataclass(frozen=True)
class RobustBounds:
    """What the robust mean (peers without fixed ranks) lets one member's update weigh."""

    #: an update whose norm is more than this many times the median of the other members' norms is clipped to
    #: that bound (``clip_action="clip"``) or left out (``"drop"``); 0 turns this off
    norm_clip: float = 0.0
    clip_action: str = "clip"
    #: a member's weight (the tokens it trained) counts at most this many times the median of the other members'
    #: weights (0: off)
    weight_clip: float = 0.0
