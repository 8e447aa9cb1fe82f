"""``loco export`` against ``safetensors.torch.save_file`` on the same weights.

A randomly initialised model of a named size (fp32, on the CPU) is saved as a loco checkpoint; then, alternating,
``launch.models.hf.export.export`` writes it as a bf16 Hugging Face folder (reading the checkpoint through its memory map,
reordering the rotary rows, converting tensor by tensor, fsyncing, renaming), and ``save_file`` writes the same
tensors, already reordered and converted, from one dict in memory. ``save_file`` does not fsync: its time with an
fsync of the file after it is the third column. The fourth is the part of the export that ``save_file`` is
spared: reading the fp32 checkpoint, reordering the rotary rows and converting to bf16, without writing. Each writer starts after an ``os.sync()``, so neither pays for
the other's write-back. Medians over ``--repeats``. The export's memory is the growth of
the process's anonymous resident memory during it (the checkpoint's mapped pages are file-backed, not counted).

    python benchmarks/export.py --out benchmarks/results/export_cpu.md
    python benchmarks/export.py --size 150m --repeats 1      # quick look
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def rss_anon_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakAnon:
    """The highest anonymous resident memory while entered, sampled every 5 ms, minus the level at entry."""

    def __enter__(self) -> "PeakAnon":
        self.start = self.peak = rss_anon_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_anon_mb())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_mb())

    @property
    def growth_mb(self) -> float:
        return self.peak - self.start


def cpu_s() -> float:
    """The process's CPU seconds so far, every thread, user and system (the kernel's copy into the page cache)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def settle() -> None:
    """Each writer starts with no dirty pages of the other's waiting to be written back."""
    os.sync()
    time.sleep(1.0)


def main() -> None:
    from safetensors.torch import save_file

    from launch.store.checkpoint import load_checkpoint, save_checkpoint
    from launch.models.hf.export import _converted_ahead, export
    from launch.models.hf.weights import loco_to_hf
    from launch.models.transformer import SIZES, Transformer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1b", choices=sorted(SIZES), help="a named size of launch.models.transformer.SIZES")
    p.add_argument("--vocab-size", type=int, default=32000, help="the vocabulary (the named sizes assume 32k)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", help="a folder for the files (default: a temporary one)")
    p.add_argument("--out", help="write the report here too")
    args = p.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="loco-export-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    model_args = replace(SIZES[args.size], vocab_size=args.vocab_size)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = Transformer(model_args)
    state = model.state_dict()
    checkpoint = save_checkpoint(work / "run" / "checkpoints", 1, {"model": state, "model_args": vars(model_args),
                                                                   "tokenizer": "bytes"})
    converted = {name: t.to(torch.bfloat16).contiguous() for name, t in loco_to_hf(state, model_args)}
    del model, state
    weight_bytes = sum(t.numel() * t.element_size() for t in converted.values())
    print(f"{args.size}: {model_args.n_params / 1e9:.3f}B parameters, {weight_bytes / 1e9:.2f} GB in bf16; "
          f"set up in {time.perf_counter() - t0:.0f} s", flush=True)

    times: dict[str, list[float]] = {"export": [], "save_file": [], "save_file + fsync": [],
                                     "export's conversion alone": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    growth: list[float] = []
    for r in range(args.repeats):
        out = work / "export"
        settle()
        start, c0 = time.perf_counter(), cpu_s()
        with PeakAnon() as mem:
            export(checkpoint, out, dtype="bf16", force=True)
        times["export"].append(time.perf_counter() - start)
        cpu["export"].append(cpu_s() - c0)
        growth.append(mem.growth_mb)
        shutil.rmtree(out)

        target = work / "plain" / "model.safetensors"
        target.parent.mkdir(exist_ok=True)
        settle()
        start, c0 = time.perf_counter(), cpu_s()
        save_file(converted, str(target), metadata={"format": "pt"})
        times["save_file"].append(time.perf_counter() - start)
        cpu["save_file"].append(cpu_s() - c0)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        times["save_file + fsync"].append(time.perf_counter() - start)
        cpu["save_file + fsync"].append(cpu_s() - c0)
        target.unlink()

        settle()
        start, c0 = time.perf_counter(), cpu_s()
        state = load_checkpoint(checkpoint)["model"]
        largest = max(t.numel() for t in converted.values())
        for _ in _converted_ahead(loco_to_hf(state, model_args), torch.bfloat16, largest):
            pass
        del state
        times["export's conversion alone"].append(time.perf_counter() - start)
        cpu["export's conversion alone"].append(cpu_s() - c0)
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items())
              + f"; export's anonymous memory +{growth[-1]:.0f} MB", flush=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [f"| {k} | {med[k]:.2f} | {', '.join(f'{t:.2f}' for t in times[k])} | {statistics.median(cpu[k]):.2f} | "
            f"{weight_bytes / 1e9 / med[k]:.2f} | {med['export'] / med[k]:.2f}x |" for k in times]
    text = "\n".join([
        f"# Export of the {args.size} model: `loco export` vs `safetensors.torch.save_file`", "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; CPU: "
        f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs, shared with other jobs)",
        f"- torch {torch.__version__}, safetensors {__import__('safetensors').__version__}, "
        f"Python {platform.python_version()}, Linux {platform.release()}",
        f"- model: `{args.size}` of `launch.models.transformer.SIZES` with a {args.vocab_size:,} vocabulary, "
        f"{model_args.n_params / 1e9:.3f}B parameters, random init, fp32 checkpoint; bf16 out "
        f"({weight_bytes / 1e9:.2f} GB, one file)",
        f"- median of {args.repeats}, alternating; the disk is the machine's virtual disk, so the times include "
        f"its write-back; load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}",
        f"- export's anonymous memory grew by at most {max(growth):,.0f} MB (the largest tensor in bf16 is "
        f"{max(t.numel() * 2 for t in converted.values()) / 1e6:,.0f} MB; the model in bf16 "
        f"{weight_bytes / 1e6:,.0f} MB)",
        f"- command: `python benchmarks/export.py --size {args.size} --repeats {args.repeats}`", "",
        "| writer | s (median) | s, each repeat | CPU s (median; every thread, user + system) | GB/s | "
        "export / this |", "|---|---:|---:|---:|---:|---:|", *rows, ""])
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
