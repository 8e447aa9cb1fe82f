"""Helpers of ``benchmarks/gpu.sh``: check the environment, stamp reports, put sections together.

    python benchmarks/gpu_tools.py preflight --device cuda --stamp-out S   # imports, device; S: the stamp
    python benchmarks/gpu_tools.py stamp FILE --base-file S --note "stage 1, 42 s"
    python benchmarks/gpu_tools.py merge OUT [LABEL=]PART... --title "Simulator cost" --device cuda

``stamp`` puts one line under the report's title (its first ``# `` line) naming the device
(``torch.cuda.get_device_name`` on CUDA, the processor elsewhere), torch, triton and CUDA versions.
``preflight --stamp-out`` saves the stamp's device and versions once, and ``--base-file`` reuses
them, so stamping does not import torch again. ``merge`` writes one report of several: a title, the stamp, then every part with its own title
turned into a section (``## ``, or ``## LABEL`` for a part given as ``LABEL=PATH``). Neither needs
anything but torch (triton is reported when importable).
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
    args = p.parse_args()
    if args.cmd == "preflight":
        return preflight(args.device, args.stamp_out)
    if args.cmd == "stamp":
        stamp(args.file, args.device, args.note, read_base(args.base_file))
    else:
        merge(args.out, args.parts, args.title, args.device, args.note, read_base(args.base_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
