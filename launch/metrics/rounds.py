"""``rounds.jsonl``: one line per round of a run whose members change, a ``loco join`` peer's or a simulated run
with churn, written here for both.

Every line holds ``round`` (the run's rounds done after this one: 1 for the first, as the algorithm counts them
and a churn trace keys its events), ``step`` (the writer's step after it), ``members`` (who took part), their
``weights`` (what each member's update counted with), ``total_weight`` and ``time`` (Unix seconds). What the
writer knows besides follows: a swarm peer's group, bytes, deadline, resync and fingerprint (``epoch`` is the
swarm's number for the round, from 0, as its ``notes`` number rounds); a simulated run's virtual time and who left
or joins; and the algorithm's own figures (SparseLoCo's senders per position and share of positions moved).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from launch.store.disk import append_line, write_file


class RoundsLog:
    """Appends the lines of ``run_dir/rounds.jsonl``; ``fresh`` starts the file over (a run's own rounds only)."""

    def __init__(self, run_dir: Path, fresh: bool = False) -> None:
        self.path = Path(run_dir) / "rounds.jsonl"
        if fresh:
            write_file(self.path, "")

    def write(self, *, round: int, step: int, members: Sequence[Any], weights: Mapping[str, float],
              **more: Any) -> dict[str, Any]:
        line = {"round": round, "step": step, "members": list(members),
                "weights": {str(k): float(v) for k, v in weights.items()},
                "total_weight": float(sum(weights.values())), "time": time.time(), **more}
        append_line(self.path, json.dumps(line) + "\n")  # a full disk: one DiskFull line
        return line
