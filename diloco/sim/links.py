"""Link traces: each worker's bandwidth and latency over virtual time, replayed by the network model.

A trace is a table of rows ``time, worker, bandwidth, latency``: from ``time`` on, ``worker`` (a rank, or ``*``
for every worker without a row of its own) has that link, until its next row. A CSV file has these four
columns under a header line; a YAML file is a list of mappings with these keys (or a mapping whose ``links``
key holds that list). Times and latencies are durations (``0``, ``90s``, ``6h``, ``40ms``), bandwidths as
``sim.bandwidth`` takes them (``100Mbit``, ``12.5MB/s``). Lines starting with ``#`` are comments.

Before its first row a worker has its first row's link. The trace repeats: its period is its last time plus
the interval before it (rows at 0h, 1h, ..., 23h repeat every 24 h); a trace with a single time holds forever.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from diloco.sim.units import parse_bandwidth, parse_duration


def read_rows(path: Path, key: str, error: type[Exception], fields: str,
              check_header: Callable[[set[str]], None]) -> list[tuple[int, dict[str, Any]]]:
    """The rows of a trace file, each with the line (CSV) or entry (YAML) it came from: a YAML list of mappings
    (or a mapping whose ``key`` holds it), or CSV under a header that ``check_header`` accepts (it raises), with
    ``#`` comment lines and blank lines skipped. ``error`` is raised for a file that is neither; ``fields``
    names the keys a row has, for that message."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a spreadsheet's export may begin with a byte-order mark
    except UnicodeDecodeError:
        raise error(f"{path}: not a text file (not UTF-8): expected CSV rows with {fields}") from None
    except OSError as e:
        raise error(f"{path}: cannot be read: {e.strerror or e}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise error(f"{path}: not valid YAML: {e}") from None
        if isinstance(data, dict):
            data = data.get(key)
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise error(f"{path}: expected a list of rows with {fields}")
        return [(i + 1, r) for i, r in enumerate(data)]
    kept = [(n, l) for n, l in enumerate(text.splitlines(), 1) if l.strip() and not l.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(l for _, l in kept)), skipinitialspace=True)
    check_header(set(reader.fieldnames or []))
    # each row with its line in the file, comments and blank lines counted (the reader counts the kept ones)
    return [(kept[reader.line_num - 1][0], r) for r in reader]


class LinkTraceError(ValueError):
    """A link trace that cannot be read; the message names the file and the row."""


@dataclass(frozen=True)
class LinkRow:
    time: float  # seconds
    worker: Optional[int]  # None: every worker without its own row
    bandwidth: float  # bytes/s
    latency: float  # seconds


class LinkTrace:
    def __init__(self, rows: list[LinkRow], source: str = "trace") -> None:
        if not rows:
            raise LinkTraceError(f"{source}: no rows (expected time, worker, bandwidth, latency)")
        self.rows = sorted(rows, key=lambda r: r.time)
        self.source = source
        times = sorted({r.time for r in self.rows})
        self.period = times[-1] + (times[-1] - times[-2]) if len(times) > 1 else math.inf
        self._series: dict[Optional[int], tuple[list[float], list[LinkRow]]] = {}
        for w in {r.worker for r in self.rows}:
            mine = [r for r in self.rows if r.worker == w]
            self._series[w] = ([r.time for r in mine], mine)

    # ---- reading ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "LinkTrace":
        path = Path(path)
        if not path.is_file():
            raise LinkTraceError(f"{path}: no such file")

        def header(fields: set[str]) -> None:
            missing = {"time", "worker", "bandwidth", "latency"} - fields
            if missing:
                raise LinkTraceError(f"{path}: the header lacks {', '.join(sorted(missing))} "
                                     f"(expected: time,worker,bandwidth,latency)")

        records = read_rows(path, "links", LinkTraceError, "time, worker, bandwidth, latency", header)
        return cls([cls._row(path, line, r) for line, r in records], str(path))

    @staticmethod
    def _row(path: Path, line: int, r: dict[str, Any]) -> LinkRow:
        try:
            worker = r.get("worker")
            worker = None if worker is None or str(worker).strip() == "*" else int(str(worker).strip())
            if worker is not None and worker < 0:
                raise ValueError(f"worker {worker} must be >= 0 or *")
            return LinkRow(parse_duration(r.get("time")), worker, parse_bandwidth(r.get("bandwidth")),
                           parse_duration(r.get("latency")))
        except (TypeError, ValueError) as e:
            raise LinkTraceError(f"{path}, row {line}: {e}") from None

    def check_workers(self, world: int) -> None:
        """Every worker has a link (its own rows or ``*``), and no row names a worker beyond ``world``."""
        beyond = sorted(w for w in self._series if w is not None and w >= world)
        if beyond:
            raise LinkTraceError(f"{self.source}: rows for worker {beyond[0]}, but there are {world} workers "
                                 f"(0 to {world - 1})")
        if None not in self._series:
            lacking = [w for w in range(world) if w not in self._series]
            if lacking:
                raise LinkTraceError(f"{self.source}: worker {lacking[0]} has no rows and there is no '*' row")

    # ---- the link at a time -------------------------------------------------------------------------
    def at(self, worker: int, t: float) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) of ``worker``'s link at virtual time ``t``."""
        times, rows = self._series.get(worker) or self._series[None]
        if math.isfinite(self.period) and self.period > 0:
            t = t % self.period
        i = bisect.bisect_right(times, t) - 1
        row = rows[max(i, 0)]
        return row.bandwidth, row.latency

    def median_bandwidth(self) -> float:
        return statistics.median(r.bandwidth for r in self.rows)

    def effective(self, world: int) -> tuple[float, float]:
        """(bytes/s, latency s) that a collective of ``world`` workers sees over one period of the trace, as the
        simulator times it: at each moment the slowest member's link (lowest bandwidth, highest latency),
        the bandwidth averaged as transfer time is (a harmonic mean weighted by how long each lasts) and the
        latency by duration. A plain median of the rows ignores both: one worker on a 10 Mbit/s link among
        1 Gbit/s ones holds every exchange to 10 Mbit/s."""
        times = sorted({0.0, *(r.time for r in self.rows)})  # before its first row a worker has that row's link
        end = self.period if math.isfinite(self.period) else (times[-1] + 1.0)
        spans = [(t, nxt - t) for t, nxt in zip(times, times[1:] + [end]) if nxt > t] or [(times[0], 1.0)]
        total = sum(d for _, d in spans)
        slow, lat = 0.0, 0.0
        for t, d in spans:
            links = [self.at(w, t) for w in range(world)]
            slow += d / min(bw for bw, _ in links)
            lat += d * max(la for _, la in links)
        return total / slow, lat / total

    def span_s(self) -> float:
        return self.period if math.isfinite(self.period) else 0.0

    def describe(self) -> str:
        bws = [r.bandwidth * 8 / 1e6 for r in self.rows]
        lats = [r.latency * 1e3 for r in self.rows]
        return (f"links from {self.source} ({min(bws):g}-{max(bws):g} Mbit/s, median {self.median_bandwidth() * 8 / 1e6:g}; "
                f"{min(lats):g}-{max(lats):g} ms)")
