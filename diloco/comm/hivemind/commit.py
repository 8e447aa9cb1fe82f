"""What the members of a round agree on: whose payloads count (the ack intersection), and whose state is the
group's (state sketches). Both are pure functions of what every member saw, so every member decides alike.

After the payloads, each member tells every other whom it holds a payload from (its commit, an "ack"). A payload
counts when every member that answered holds it (:func:`agree`); so all members average the same payloads, in
the same (sorted peer id) order, and end the round with the same result. A member that did not commit, or whose
commit would narrow the round to little more than its own payload, is left out.

Members also announce a sketch of their state (:func:`fingerprint`). The group's state is the one most members
in step share (:func:`resync_sources`); a member holding another takes the group's after the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch

from diloco.comm.hivemind.framing import unpack


@dataclass(frozen=True)
class Agreement:
    """The outcome of a commit: ``members``, the payloads every member that answered holds (this peer's own at
    least); ``narrowed``: member -> (payloads its commit leaves out, of how many others this peer holds), for
    the members left out for a commit that leaves out most of what this peer holds; ``none_in_common``: no
    payload was held by every member that answered, and this peer goes on with its own alone."""

    members: frozenset
    narrowed: dict = field(default_factory=dict)
    none_in_common: bool = False


def agree(me: Hashable, received: set, held: Mapping[Hashable, set]) -> Agreement:
    """The ack intersection. ``me``: this peer; ``received``: the members whose payload this peer holds (itself
    included); ``held``: for every member that committed, the members whose payload it says it holds (an empty
    set for a commit that could not be read).

    A member that does not hold its own payload made no commit and is left out; so is one whose commit leaves out
    at least two, and more than half, of the other payloads this peer holds (it lies, or nothing reached it: it
    must not make its update the group's). Every other commit narrows the agreed set to what it holds."""
    final = set(received) & ({me} | set(held))
    narrowed = {}
    for p, theirs in held.items():
        base = set(received) - {p}  # what this peer holds of the others' payloads, its own included
        missing = base - theirs
        if p not in theirs:
            final.discard(p)
        elif len(missing) >= 2 and 2 * len(missing) > len(base):
            final.discard(p)
            narrowed[p] = (len(missing), len(base))
        else:
            final &= theirs
    if not final:
        return Agreement(frozenset({me}), narrowed, none_in_common=True)
    return Agreement(frozenset(final), narrowed)


def read_acks(acks: Mapping[Hashable, bytes], peer_id: Callable[[bytes], Hashable]) -> dict:
    """The commits as :func:`agree` takes them: each member's list of peer ids (``peer_id`` makes one from its
    bytes); one that does not read as such a list holds nothing."""
    held = {}
    for p, blob in acks.items():
        try:
            held[p] = {peer_id(b) for b in unpack(blob)}
        except Exception:
            held[p] = set()
    return held


def resync_sources(members: Sequence, meta: Mapping, mine: bytes) -> list:
    """The members holding the group's canonical state, when this peer's sketch ``mine`` differs from it (else
    none): the state most members in step (not behind) share; between equally supported states, the one that
    came out of the larger group the round before (a peer that trained alone gives way to peers that averaged
    together), then the smaller peer id. States compare by their sketches (:func:`same_state`): peers on other
    hardware may round the same average differently in the last bit, which is no reason to download the model
    again. ``meta``: each member's announcement (``fp``, ``stale``, ``g``)."""
    fresh = [p for p in members if not meta[p].get("stale")] or list(members)
    sketches = {p: meta[p].get("fp", b"") for p in fresh}
    support = {p: [q for q in fresh if same_state(sketches[p], sketches[q])] for p in fresh}
    weight = {p: max(int(meta[q].get("g", 1)) for q in support[p]) for p in fresh}
    best = min(fresh, key=lambda p: (-len(support[p]), -weight[p], p))
    return [] if same_state(mine, sketches[best]) else support[best]


def fingerprint(tensors: Sequence[torch.Tensor], per_tensor: int = 8) -> bytes:
    """A sketch of a list of tensors: ``per_tensor`` evenly spaced values of each, as float32 bytes.

    The positions are worked out in float64 on the tensor's device: in float32 the last one of a tensor of more
    than 2^24 values could round past its end. The samples of the tensors on one device are read back together
    (one wait for a GPU, not two per tensor)."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        flat = t.detach().reshape(-1)
        n = flat.numel()
        idx = torch.linspace(0, max(n - 1, 0), min(per_tensor, n), dtype=torch.float64, device=flat.device)
        by_device.setdefault(flat.device, []).append((i, flat[idx.round().long().clamp_(max=max(n - 1, 0))]))
    parts: list[Optional[torch.Tensor]] = [None] * len(tensors)
    for samples in by_device.values():
        values = torch.cat([x.float() for _, x in samples]).cpu()
        for (i, _), piece in zip(samples, values.split([x.numel() for _, x in samples])):
            parts[i] = piece
    return torch.cat(parts).numpy().tobytes() if parts else b""


def same_state(a: bytes, b: bytes, rtol: float = 1e-4) -> bool:
    """Whether two sketches describe the same state up to float rounding (relative ``rtol``)."""
    if len(a) != len(b) or len(a) % 4:
        return False
    if a == b:
        return True
    x = torch.frombuffer(bytearray(a), dtype=torch.float32)
    y = torch.frombuffer(bytearray(b), dtype=torch.float32)
    return bool(((x - y).abs() <= rtol * torch.maximum(x.abs(), y.abs()) + 1e-12).all())
