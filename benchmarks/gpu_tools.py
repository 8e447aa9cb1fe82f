"""Helpers of ``benchmarks/gpu.sh``: check the environment, stamp reports, put sections together.

    python benchmarks/gpu_tools.py preflight --device cuda --stamp-out S   # imports, device; S: the stamp
    python benchmarks/gpu_tools.py stamp FILE --base-file S --note "stage 1, 42 s"
    python benchmarks/gpu_tools.py merge OUT [LABEL=]PART... --title "Simulator cost" --device cuda
    python benchmarks/gpu_tools.py tests OUT JUNIT.xml --title "..." --command "..." --log LOG   # pytest's result

``stamp`` puts one line under the report's title (its first ``# `` line) naming the device
(``torch.cuda.get_device_name`` on CUDA, the processor elsewhere), torch, triton and CUDA versions.
``preflight --stamp-out`` saves the stamp's device and versions once, and ``--base-file`` reuses
them, so stamping does not import torch again. ``merge`` writes one report of several: a title, the stamp, then every part with its own title
turned into a section (``## ``, or ``## LABEL`` for a part given as ``LABEL=PATH``). ``tests`` turns a pytest
JUnit XML file into a report: the counts, every failure with the first lines of its message, the skip reasons
and the slowest tests. None of them needs anything but torch (triton is reported when importable).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.simulator import device_name  # noqa: E402  (the one owner of a report's device name)

# what the benchmarks import (hivemind and wandb are not among them: nothing in gpu.sh needs either)
NEEDED = ["torch", "triton", "numpy", "einops", "zstandard", "xxhash", "tqdm", "yaml", "matplotlib", "greenlet"]
STAMP_MARK = "- produced by `bash benchmarks/gpu.sh`"


def versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "not installed"
    return out


def stamp_base(device: str) -> str:
    v = versions()
    return (f"{STAMP_MARK} on {device_name(device)}; torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}, "
            f"Python {v['python']}")


def stamp_line(device: str, note: str = "", base: str | None = None) -> str:
    line = f"{base or stamp_base(device)}; {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    return line + (f"; {note}" if note else "")


def read_base(base_file: Path | None) -> str | None:
    return base_file.read_text().strip() if base_file is not None and base_file.is_file() else None


def stamp(path: Path, device: str, note: str = "", base: str | None = None) -> None:
    """Insert (or replace) the stamp line right under the report's title."""
    line = stamp_line(device, note, base)
    lines = path.read_text().splitlines()
    lines = [ln for ln in lines if not ln.startswith(STAMP_MARK)]
    at = next((i for i, ln in enumerate(lines) if ln.startswith("# ")), None)
    if at is None:
        lines[:0] = [line, ""]
    else:
        # under the title, before the report's own bullet list (keeping one blank line after the title)
        insert = at + 1
        if insert < len(lines) and not lines[insert].strip():
            insert += 1
        lines.insert(insert, line)
    path.write_text("\n".join(lines) + "\n")


def merge(out: Path, parts: list[str], title: str, device: str, note: str = "", base: str | None = None) -> None:
    """Parts are PATH or LABEL=PATH; a part's own title becomes a section, named LABEL when given."""
    text = [f"# {title}", "", stamp_line(device, note, base), ""]
    for part in parts:
        label, _, path = part.rpartition("=")
        for ln in Path(path).read_text().splitlines():
            if ln.startswith("# "):
                ln = f"## {label}" if label else "#" + ln
            text.append(ln)
        text.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text).rstrip("\n") + "\n")


def _first_lines(text: str, n: int = 3) -> str:
    lines = [ln.rstrip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return " / ".join(lines[:n]).replace("|", "\\|")[:400]


def tests_report(out: Path, junit: Path, title: str, command: str, device: str, note: str = "",
                 base: str | None = None, log: Path | None = None) -> int:
    """Write pytest's JUnit result as a report; returns the number of failures and errors."""
    import xml.etree.ElementTree as ET
    from collections import Counter

    text = [f"# {title}", "", stamp_line(device, note, base), f"- `{command}`", ""]
    if not junit.is_file():
        text += ["pytest wrote no result file: it was stopped before the end (the time limit, or a crash).", ""]
        if log is not None and log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-40:]
            text += ["The last lines of its output:", "", "```", *tail, "```"]
        out.write_text("\n".join(text).rstrip("\n") + "\n")
        return 1
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    outcome: Counter[str] = Counter()
    failed, skipped, times = [], Counter(), []
    for case in cases:
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}".removeprefix("tests/")
        times.append((float(case.get("time") or 0.0), name))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            outcome[bad.tag] += 1
            failed.append((name, bad.tag, _first_lines(bad.get("message") or bad.text or "")))
        elif case.find("skipped") is not None:
            outcome["skipped"] += 1
            skipped[_first_lines(case.find("skipped").get("message") or "", 1)] += 1
        else:
            outcome["passed"] += 1
    wall = sum(t for t, _ in times)
    text += ["| outcome | tests |", "| --- | ---: |"]
    text += [f"| {k} | {outcome[k]} |" for k in ("passed", "failure", "error", "skipped") if outcome[k]]
    text += [f"| all | {len(cases)} (their times add up to {wall:.0f} s) |", ""]
    if failed:
        text += ["Failed:", "", "| test | how | first lines |", "| --- | --- | --- |"]
        text += [f"| `{n}` | {how} | {msg} |" for n, how, msg in failed] + [""]
    if skipped:
        text += ["Skipped, by reason:", "", "| reason | tests |", "| --- | ---: |"]
        text += [f"| {r or '(none given)'} | {c} |" for r, c in skipped.most_common()] + [""]
    text += ["The slowest:", "", "| test | seconds |", "| --- | ---: |"]
    text += [f"| `{n}` | {t:.1f} |" for t, n in sorted(times, reverse=True)[:10]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text).rstrip("\n") + "\n")
    return outcome["failure"] + outcome["error"]


def record(out: Path, times: list[str], commands: list[str], total: str, device: str, quick: bool,
           base: str | None = None) -> None:
    """The stage times and commands of this call, with the rows an earlier call wrote for other stages kept
    (a run in two calls, ``--skip suite`` then ``--only suite``, leaves one record of both)."""
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    ran = {t.split("=", 1)[0] for t in times}
    rows, cmds = [], []
    same = base or stamp_base(device)  # only a record of the same device and versions is carried on
    if out.is_file() and any(ln.startswith(same + ";") for ln in out.read_text().splitlines()):
        for ln in out.read_text().splitlines():
            cells = [c.strip() for c in ln.strip().strip("|").split("|")]
            if ln.startswith("| ") and len(cells) == 3 and cells[0] not in ran | {"stage", "---"}:
                rows.append(ln)
            elif ln.startswith("- `") and ln.rsplit("(", 1)[-1].rstrip(")") not in ran:
                cmds.append(ln)
    rows += [f"| {t.split('=', 1)[0]} | {t.split('=', 1)[1]} | {when}, {total} s in all |" for t in times]
    cmds += [f"- `{c.split('=', 1)[1].strip()}` ({c.split('=', 1)[0]})" for c in commands]
    text = ["# benchmarks/gpu.sh: stage times", "", stamp_line(device, f"quick {int(quick)}", base), "",
            "| stage | seconds | call |", "| --- | ---: | --- |", *rows, "", "Commands:", "", *cmds]
    out.write_text("\n".join(text) + "\n")


def preflight(device: str, stamp_out: Path | None = None) -> int:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an import that fails for any reason counts as missing
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    if missing:
        print("[gpu.sh] missing Python packages: " + "; ".join(missing), file=sys.stderr)
        print(f"[gpu.sh] python: {sys.executable}; install the project's dependencies (pip install -e .) "
              f"or set PYTHON to an interpreter that has them", file=sys.stderr)
        return 1
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"[gpu.sh] --device {device}: torch {torch.__version__} sees no CUDA device "
              f"(run with --device cpu for a smoke run)", file=sys.stderr)
        return 1
    v = versions()
    extra = ""
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        extra = f", {total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free)"
    print(f"[gpu.sh] device: {device_name(device)}{extra}; torch {v['torch']}, triton {v['triton']}, "
          f"CUDA {v['cuda']}, Python {v['python']} ({sys.executable})", flush=True)
    if stamp_out is not None:
        stamp_out.write_text(stamp_base(device) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("preflight")
    a.add_argument("--device", default="cuda")
    a.add_argument("--stamp-out", type=Path, help="save the stamp's device and versions here")
    a = sub.add_parser("stamp")
    a.add_argument("file", type=Path)
    a.add_argument("--device", default="cuda")
    a.add_argument("--note", default="")
    a.add_argument("--base-file", type=Path, help="a file preflight --stamp-out wrote (else: asked of torch)")
    a = sub.add_parser("merge")
    a.add_argument("out", type=Path)
    a.add_argument("parts", nargs="+", help="PATH or LABEL=PATH")
    a.add_argument("--title", required=True)
    a.add_argument("--device", default="cuda")
    a.add_argument("--note", default="")
    a.add_argument("--base-file", type=Path, help="a file preflight --stamp-out wrote (else: asked of torch)")
    a = sub.add_parser("tests")
    a.add_argument("out", type=Path)
    a.add_argument("junit", type=Path)
    a.add_argument("--title", required=True)
    a.add_argument("--command", required=True)
    a.add_argument("--log", type=Path, help="pytest's output, quoted when it wrote no result file")
    a.add_argument("--device", default="cuda")
    a.add_argument("--note", default="")
    a.add_argument("--base-file", type=Path, help="a file preflight --stamp-out wrote (else: asked of torch)")
    a = sub.add_parser("record")
    a.add_argument("out", type=Path)
    a.add_argument("--time", action="append", default=[], help="STAGE=SECONDS")
    a.add_argument("--command", action="append", default=[], help="STAGE=COMMAND")
    a.add_argument("--total", required=True)
    a.add_argument("--quick", type=int, default=0)
    a.add_argument("--device", default="cuda")
    a.add_argument("--base-file", type=Path, help="a file preflight --stamp-out wrote (else: asked of torch)")
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out, args.time, args.command, args.total, args.device, bool(args.quick), read_base(args.base_file))
        return 0
    if args.cmd == "tests":
        bad = tests_report(args.out, args.junit, args.title, args.command, args.device, args.note,
                           read_base(args.base_file), args.log)
        print(f"[gpu.sh] {args.out}: {bad} failed", file=sys.stderr)
        return 1 if bad else 0
    if args.cmd == "preflight":
        return preflight(args.device, args.stamp_out)
    if args.cmd == "stamp":
        stamp(args.file, args.device, args.note, read_base(args.base_file))
    else:
        merge(args.out, args.parts, args.title, args.device, args.note, read_base(args.base_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
