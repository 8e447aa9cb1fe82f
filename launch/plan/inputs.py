"""``loco plan``'s input the user gives: the link (a bandwidth and a latency, or a trace) and the step time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from launch.plan.settings import PlanError

DEFAULT_STEP_TIME = 1.0  # seconds per step when --step-time is not given (said in the output)


@dataclass
class Link:
    bandwidth: Optional[float]  # bytes/s
    latency: float
    note: str = ""  # where the figures come from (a trace, as the plan's workers see it)


def parse_link(bandwidth: Optional[str], latency: Optional[str], links: Optional[str], workers: int = 1) -> Link:
    from diloco.sim import parse_bandwidth
    from diloco.sim.units import parse_duration

    note = ""
    bw = lat = None
    if links:
        from diloco.sim.links import LinkTrace, LinkTraceError

        try:
            trace = LinkTrace.load(links)
        except (OSError, LinkTraceError) as e:
            raise PlanError(f"--links {links}: {e}") from None
        try:
            trace.check_workers(workers)
        except LinkTraceError as e:
            raise PlanError(f"--links {links}: {e}") from None
        bw, lat = trace.effective(workers)
        note = (f"{links} as {workers} workers' exchanges see it: the slowest member's link at each moment, "
                f"{bw * 8 / 1e6:.4g} Mbit/s and {lat * 1e3:.4g} ms averaged over "
                f"{trace.span_s() / 3600:g} h of the trace")
    if bandwidth is not None:
        try:
            bw = parse_bandwidth(bandwidth)
        except ValueError as e:
            raise PlanError(f"--bandwidth: {e}") from None
    if latency is not None:
        try:
            lat = parse_duration(latency)
        except ValueError as e:
            raise PlanError(f"--latency {latency!r}: {e}") from None
        if not (lat >= 0 and math.isfinite(lat)):
            raise PlanError(f"--latency {latency!r}: must be a duration >= 0, e.g. 80ms")
    if bw is None or lat is None:
        raise PlanError("give the link: --bandwidth RATE and --latency DURATION (e.g. --bandwidth 100Mbit "
                        "--latency 40ms), or --links FILE")
    return Link(bw, lat, note)


def parse_step_time(text: Optional[str]) -> tuple[float, bool]:
    """(seconds per step, whether the user gave it)."""
    from diloco.sim.units import parse_duration

    if text is None:
        return DEFAULT_STEP_TIME, False
    try:
        s = parse_duration(text)
    except ValueError as e:
        raise PlanError(f"--step-time {text!r}: {e}") from None
    if not (s > 0 and math.isfinite(s)):
        raise PlanError(f"--step-time {text!r}: must be a duration > 0, e.g. 0.5s")
    return s, True
