"""What the processes of a run and the peers of a swarm must agree on, compared key by key.

Settings travel as flat ``{"section.key": value}`` mappings (:func:`flat_settings`), so a config, a swarm's
schema and a checkpoint's saved settings compare alike. :func:`settings_differ` words what differs across a
run's processes as one message that names the keys, values, ranks and hosts; :func:`schema_differs` what differs
between two peers' schemas.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence


def flat_settings(nested: Any) -> dict[str, Any]:
    """Settings as ``{"section.key": value}``: one level of nesting (a config's sections, a schema's model)
    flattened, other values kept under their own key; ``{}`` for anything but a dict. What processes, peers and
    checkpoints compare key by key."""
    if not isinstance(nested, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update((f"{key}.{inner}", v) for inner, v in value.items())
        else:
            out[key] = value
    return out


def schema_differs(theirs: object, mine: str) -> str:
    """The keys of two peers' settings (JSON objects, as ``launch.join.peer.schema_of`` makes them) that differ, as
    ``key: theirs there, mine here; ...`` (the keys of a nested object, the model's, named one by one)."""
    try:
        a, b = json.loads(theirs), json.loads(mine)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        a = b = None
    if not isinstance(a, dict) or not isinstance(b, dict):
        return f"its settings {theirs!r}, this peer's {mine!r}"
    a, b = flat_settings(a), flat_settings(b)
    return "; ".join(f"{k}: {a.get(k, '(none)')!r} there, {b.get(k, '(none)')!r} here"
                     for k in sorted(set(a) | set(b)) if a.get(k, "(none)") != b.get(k, "(none)"))


def settings_differ(views: Sequence[tuple[str, Mapping[str, Any]]], shown: int = 6) -> Optional[str]:
    """What differs between the processes' settings (``views[rank]`` is (host, settings)), against rank 0's;
    None where they all agree."""
    ref = views[0][1]
    keys = sorted(set(ref).union(*(set(s) for _, s in views[1:])))
    lines = []
    for key in keys:
        values: dict[str, list[int]] = {}  # repr of the value -> ranks
        for rank, (_, settings) in enumerate(views):
            values.setdefault(repr(settings[key]) if key in settings else "(not set)", []).append(rank)
        if len(values) > 1:
            parts = [f"{value} on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks, views)}"
                     for value, ranks in sorted(values.items(), key=lambda kv: kv[1][0])]
            lines.append(f"{key}: {'; '.join(parts)}")
    if not lines:
        return None
    more = f"\n  ... and {len(lines) - shown} more" if len(lines) > shown else ""
    return (f"the {len(views)} processes of this run were started with different settings, and would stop at the "
            f"first exchange where they part ways:\n  " + "\n  ".join(lines[:shown]) + more
            + "\nStart every node with the same --config and --set options (only paths, logging, devices and "
              "thread counts may differ).")


def _ranks(ranks: list[int], views: Sequence[tuple[str, Any]], shown: int = 4) -> str:
    """"1 (host b), 3 (host c)": the first few ranks of a list, with their hosts."""
    out = ", ".join(f"{r} ({views[r][0]})" for r in ranks[:shown])
    return out + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")
