"""Bandwidths and durations as people write them (``100Mbit/s``, ``90s``), read in one place for the config, the
network model, link traces, churn schedules and ``loco plan``."""

from __future__ import annotations

import math
import re
from typing import Any

_BW = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMgGtT]?)"
                 r"(bit/s|bits/s|bits|bit|bps|b|B/s|Bps|B|bytes/s|byte/s)?$")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*(ms|s|sec|m|min|h|hr|d)?\s*$")
_SECONDS = {None: 1.0, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0,
            "d": 86400.0}


def parse_duration(value: Any) -> float:
    """Seconds from ``'90s'``, ``'40ms'``, ``'30m'``, ``'24h'``, ``'1.5d'`` or a plain number (``12`` -> 12.0).

    The one parser of durations: config keys, link traces and ``loco plan`` all read them here.
    """
    if isinstance(value, bool):
        raise ValueError("expected a duration, not a boolean")
    if isinstance(value, (int, float)):
        out = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"{value!r} is not a duration (examples: 90s, 30m, 24h, 1.5h, 500ms)")
        out = float(m.group(1)) * _SECONDS[m.group(2)]
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{value!r} must be a duration >= 0")
    return out


def parse_bandwidth(text: str | float | int) -> float:
    """'1Gbit', '100Mbit/s', '10Gbps', '50MB/s', a plain number (bits/s) -> bytes per second.

    Lower-case b / bit / bps are bits, capital B and byte are bytes.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a bandwidth")
    if isinstance(text, (int, float)):
        value, prefix, unit = float(text), "", "bit"
    else:
        m = _BW.match(str(text).strip())
        if not m:
            raise ValueError(f"{text!r} is not a bandwidth (examples: 1Gbit, 100Mbit/s, 10Gbps, 50MB/s)")
        value, prefix, unit = float(m.group(1)), m.group(2).lower(), m.group(3) or "bit"
    in_bytes = unit.startswith("B") or unit.startswith("byte")
    bytes_per_s = value * _PREFIX[prefix] / (1.0 if in_bytes else 8.0)
    if not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return bytes_per_s
