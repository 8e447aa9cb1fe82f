"""A result computed once from a gathered payload list, for every worker that received that very list.

Where every worker of a group runs in one process (``Capabilities.shared_results``: the simulator), a byte
collective hands each of them the same list object: the first to compute from it keeps the result for the others,
which take it instead of computing it again. Elsewhere each worker computes its own. The robust mean and DeMo's
mean both go through :meth:`SharedResult.once`, so neither asks where it runs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

from diloco.comm.base import Transport

T = TypeVar("T")


class SharedResult:
    """One slot: the result of the latest list it was filled for, until each of the other workers took it."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.payloads: Optional[list] = None  # held, so that the identity check cannot meet a reused id
        self.key: Any = None
        self.value: Any = None
        self.left = 0

    def take(self, payloads: list, key: Any) -> Any:
        """The value filled for ``payloads`` (this very list) and ``key``, or None."""
        if self.payloads is not payloads or self.key != key:
            return None
        value = self.value
        self.left -= 1
        if self.left <= 0:
            self.clear()
        return value

    def fill(self, payloads: list, key: Any, value: Any, others: int) -> None:
        """Keep ``value`` for the ``others`` workers that will ask with the same list and key."""
        if others > 0:
            self.payloads, self.key, self.value, self.left = payloads, key, value, others

    def once(self, transport: Transport, payloads: list, key: Any, compute: Callable[[bool], T]) -> tuple[T, bool]:
        """(the result for ``payloads`` and ``key``, whether it was computed here). ``compute(shared)`` makes it;
        ``shared``: other workers may read it too (it must then be left as it is, and hold no buffer of this
        worker's). A result taken from another worker is read only."""
        shared = transport.caps.shared_results
        if shared:
            value = self.take(payloads, key)
            if value is not None:
                return value, False
        value = compute(shared)
        if shared:
            self.fill(payloads, key, value, len(payloads) - 1)
        return value, True
