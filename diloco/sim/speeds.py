"""Worker speeds for heterogeneity: an explicit list, or a seeded distribution (fastest = 1.0)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def parse_speeds(text: str | Sequence[float]) -> list[float]:
    values = text if not isinstance(text, str) else [v for v in text.replace(" ", "").split(",") if v]
    try:
        speeds = [float(v) for v in values]
    except ValueError:
        raise ValueError(f"speeds {text!r} must be numbers separated by commas, e.g. 1,1,0.5,0.25") from None
    if not speeds or any(not (s > 0) for s in speeds):
        raise ValueError(f"speeds {text!r} must all be > 0")
    return speeds


def sample_speeds(spec: str, workers: int, seed: int = 0) -> list[float]:
    """'lognormal:0.5' (sigma of log-speed) or 'uniform:0.25' (lowest speed); normalised so the fastest is 1."""
    name, _, arg = spec.partition(":")
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"speed distribution {spec!r}: expected lognormal:SIGMA or uniform:LOW, e.g. lognormal:0.5") from None
    rng = np.random.default_rng([seed, 7919])
    if name == "lognormal" and value >= 0:
        raw = np.exp(rng.normal(0.0, value, size=workers))
    elif name == "uniform" and 0 < value <= 1:
        raw = rng.uniform(value, 1.0, size=workers)
    else:
        raise ValueError(f"speed distribution {spec!r}: expected lognormal:SIGMA (>= 0) or uniform:LOW (0 < LOW <= 1)")
    return [float(x) for x in raw / raw.max()]


def resolve_speeds(workers: int, speeds: Optional[str], speed_dist: Optional[str], seed: int = 0) -> list[float]:
    if speeds and speed_dist:
        raise ValueError("give either speeds or a speed distribution, not both")
    if speeds:
        out = parse_speeds(speeds)
        if len(out) != workers:
            raise ValueError(f"{len(out)} speeds given for {workers} workers: give one speed per worker")
        return out
    if speed_dist:
        return sample_speeds(speed_dist, workers, seed)
    return [1.0] * workers
