"""The mean over senders: each position averaged over the workers whose payload holds it, weighted by their
tokens (SparseLoCo as published: the authors' code concatenates every worker's (index, value) pairs and takes a
``scatter_reduce`` mean that leaves out the workers that did not send a position). With top-k payloads whose
positions barely overlap, this is 1.4 to 2.5 times the mean over all W workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch


@dataclass
class Senders:
    """What the exchanges averaging over senders saw since :meth:`restart`: ``pairs``, the values received from
    workers of positive weight (one per worker and position it sent); ``covered``, the positions at least one of
    them sent (a 0-d tensor on the exchange's device, read back only where a figure is wanted)."""

    pairs: int = 0
    covered: Union[int, torch.Tensor] = 0

    def restart(self) -> None:
        self.pairs, self.covered = 0, 0

    def per_position(self) -> Optional[float]:
        """The mean number of senders of a position that was sent (None before any)."""
        covered = int(self.covered)
        return self.pairs / covered if covered else None


def divide_by_senders_(codec: Any, mean: torch.Tensor, counts: torch.Tensor, senders: Senders,
                       payloads: int, shapes: Any = None) -> None:
    """``mean`` (the weighted sum of ``payloads`` payloads of positive weight, decoded by ``codec``; tensors of
    ``shapes`` end to end) divided, position by position, by ``counts`` (the weight of its senders; consumed); a
    position nobody sent stays zero."""
    senders.pairs += payloads * codec.values_held(mean.numel(), shapes)
    sent = counts > 0
    senders.covered = senders.covered + sent.sum()
    mean.div_(counts.masked_fill_(~sent, 1.0))


def add_support(support: Optional[torch.Tensor], weight: float, flat: Optional[torch.Tensor],
                dct: Optional[int]) -> None:
    """``support += weight`` where a payload holds a value: at ``flat``, the positions a top-k payload's decode
    wrote (distinct, checked: none is counted twice); everywhere for a dense one or a DCT top-k's coefficients."""
    if support is None:
        return
    if flat is None or dct:
        support.add_(weight)
    else:
        support[flat] += weight
