"""The deadlines of a swarm peer, derived from what it measures.

A peer measures how fast its exchanges move bytes and how long its groups take to form, and derives its
deadlines from that: one fixed deadline is too short for multi-GB payloads over home links and far too long to
notice a dead member among fast ones. Every deadline is ``margin x`` what the measurements predict, clamped.
A deadline given in seconds (``--matchmaking-time``, ``--round-timeout``) stays fixed.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional, Union

# The exchange: margin 3 lets a round run three times slower than the recent median (a congested link, a busy
# peer) before a member is left out. The floor, 10 s, is where stream set-up, the DHT and scheduling dominate,
# not bytes: a shorter deadline would drop healthy members of a fast group for a hiccup. The ceiling, 600 s,
# is where a member ten minutes late is far likelier gone than slow, and the whole group waits for it. Before
# any measurement the deadline is 60 s: long enough for a first round of a small model over a home link.
EXCHANGE_MARGIN = 3.0
EXCHANGE_FLOOR_S = 10.0
EXCHANGE_CEILING_S = 600.0
EXCHANGE_DEFAULT_S = 60.0
LATENCY_PER_MEMBER_S = 0.5  # per other member: opening its stream, round trips (relays add some), its answer
# The state download (a new or out-of-step peer's only way in): a failed download costs a whole retry, so its
# floor is a generous 120 s and its ceiling an hour. Before this peer has measured anything, a link of 1 MB/s
# is assumed: a 4 GB state then has the hour, which a home link needs.
STATE_MARGIN = 3.0
STATE_FLOOR_S = 120.0
STATE_CEILING_S = 3600.0
ASSUMED_BYTES_PER_S = 1e6
# The matchmaking window (--matchmaking-time auto): margin x how long recent complete groups took to form,
# at least the 5 s default (hivemind's matchmaking needs a few DHT round trips), at most a minute.
MATCHMAKING_MARGIN = 3.0
MATCHMAKING_FLOOR_S = 5.0
MATCHMAKING_CEILING_S = 60.0
# Measurements: the median of the last few, so that one slow round neither stretches nor one fast round
# shrinks the next deadline. A round that moved less than MIN_MEASURED_BYTES measures latency, not throughput
# (its rate would be far too low to predict a large payload's time), and is not counted.
PACE_WINDOW = 5
MIN_MEASURED_BYTES = 256 << 10

AUTO = "auto"


def seconds_or_auto(value: Union[float, int, str, None], name: str) -> Optional[float]:
    """A deadline setting: None for ``auto`` (or None), else positive seconds. ``name`` goes in the error."""
    if value is None or (isinstance(value, str) and value.strip().lower() == AUTO):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds or {AUTO!r}, got {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a positive number of seconds or {AUTO!r}, got {value!r}")
    return seconds


def clamp(x: float, floor: float, ceiling: float) -> float:
    return min(ceiling, max(floor, x))


def exchange_deadline(expected_bytes: float, rate: Optional[float], others: int) -> float:
    """How long a peer waits for its group's payloads: ``expected_bytes`` (what it sends and receives) at the
    measured ``rate`` (bytes/s, both directions counted, as measured), plus a latency allowance per other
    member, times the margin, clamped. Without a measurement: :data:`EXCHANGE_DEFAULT_S`."""
    if not rate or rate <= 0:
        return EXCHANGE_DEFAULT_S
    expected_s = expected_bytes / rate + LATENCY_PER_MEMBER_S * max(others, 1)
    return clamp(EXCHANGE_MARGIN * expected_s, EXCHANGE_FLOOR_S, EXCHANGE_CEILING_S)


def state_timeout(nbytes: float, rate: Optional[float]) -> float:
    """How long a state download of ``nbytes`` may take. ``rate`` is the exchange's measured rate, which counts
    both directions; a download moves bytes one way, so half of it is assumed (on a link that sends and
    receives at once, half is what one direction gets). Unknown: :data:`ASSUMED_BYTES_PER_S`."""
    one_way = rate / 2 if rate and rate > 0 else ASSUMED_BYTES_PER_S
    return clamp(STATE_MARGIN * nbytes / one_way, STATE_FLOOR_S, STATE_CEILING_S)


def matchmaking_window(forming_s: Optional[float]) -> float:
    """The matchmaking window from how long recent complete groups took to form (None: none yet)."""
    if forming_s is None:
        return MATCHMAKING_FLOOR_S
    return clamp(MATCHMAKING_MARGIN * forming_s, MATCHMAKING_FLOOR_S, MATCHMAKING_CEILING_S)


class Pace:
    """The last :data:`PACE_WINDOW` measurements of one quantity; their median is what deadlines follow."""

    def __init__(self, window: int = PACE_WINDOW) -> None:
        self.seen: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if value > 0 and math.isfinite(value):
            self.seen.append(float(value))

    def median(self) -> Optional[float]:
        return statistics.median(self.seen) if self.seen else None


class Deadlines:
    """A peer's current matchmaking window and exchange deadline, and the measurements they follow.

    ``fixed_*``: the seconds a setting gave (None: ``auto``, paced by the measurements); ``matchmaking_time``
    and ``exchange_timeout``: the current values, which an adaptive peer resets before every round and, once
    its group is known, from the group's size (:meth:`for_exchange`). ``rate``: bytes/s (sent and received)
    of this peer's recent complete exchanges; ``forming``: seconds its recent complete groups took to form.
    """

    def __init__(self, matchmaking_time: Union[float, str, None], exchange_timeout: Union[float, str, None]) -> None:
        self.fixed_matchmaking_time = seconds_or_auto(matchmaking_time, "matchmaking_time")
        self.fixed_exchange_timeout = seconds_or_auto(exchange_timeout, "exchange_timeout")
        self.matchmaking_time = (self.fixed_matchmaking_time if self.fixed_matchmaking_time is not None
                                 else matchmaking_window(None))
        self.exchange_timeout = (self.fixed_exchange_timeout if self.fixed_exchange_timeout is not None
                                 else EXCHANGE_DEFAULT_S)
        self.rate = Pace()
        self.forming = Pace()

    def before_round(self, nbytes: int, others: int) -> None:
        """Before a round of a payload of ``nbytes``: the deadlines that are not fixed follow the measurements.
        The exchange deadline assumes ``others`` members besides this peer, an upper bound until the group is
        known."""
        if self.fixed_matchmaking_time is None:
            self.matchmaking_time = matchmaking_window(self.forming.median())
        self.for_exchange(2 * nbytes * others, others)

    def for_exchange(self, expected_bytes: int, others: int) -> None:
        """An adaptive peer's exchange deadline for ``expected_bytes`` (sent and received) with ``others``."""
        if self.fixed_exchange_timeout is None:
            self.exchange_timeout = exchange_deadline(expected_bytes, self.rate.median(), others)

    def measure(self, moved: int, seconds: float) -> None:
        """One exchange in which every member delivered: its rate counts (when it moved enough bytes)."""
        if moved >= MIN_MEASURED_BYTES and seconds > 0:
            self.rate.add(moved / seconds)

    def formed(self, seconds: float) -> None:
        """A group that formed complete (every peer waiting for it came) took ``seconds``."""
        self.forming.add(seconds)

    def state_timeout(self, nbytes: int) -> float:
        """How long a download of a ``nbytes`` state may take: from this peer's measured exchange rate, or an
        assumed slow link before it has one (:func:`state_timeout`). The size is read from the reply's header,
        before its body: a 4 GB state is given the time 4 GB needs."""
        return state_timeout(nbytes, self.rate.median())
