"""The data path: ``loco data prepare`` against the tokenizer alone, the data's cost per training step, and a
streamed dataset's memory.

Three tables, each measured side by side in one run:

* **prepare**: tokens per second of ``loco data prepare`` (reading the files, encoding on every core, writing the
  shards and the manifest) against ``tokenizers``' own ``encode_batch_fast`` on the same documents, already in
  memory, with the same cores (Rayon's threads). Medians over ``--repeats``, alternating.
* **per step**: milliseconds a ``tiny`` training step waits for its batch, from prepared shards (memory-mapped)
  and from a streamed jsonl dataset (tokenized by the reader thread), against the step itself on the CPU; and
  the whole step (batch, forward, backward, AdamW) with each source, since the stream's thread shares the cores.
* **stream memory**: resident memory before and at its peak while a streamed jsonl dataset of ``--stream-mb`` MB
  (generated, byte tokens so the whole file passes quickly) is read to its end.

    python benchmarks/data.py --out benchmarks/results/data_cpu.md
    python benchmarks/data.py --docs 2000 --repeats 1 --stream-mb 50      # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def tokenizer_file(args, work: Path) -> str:
    from launch.data.documents import doc_text, documents
    from launch.data.tokenizer import train_bpe

    if args.tokenizer:
        return args.tokenizer
    out = work / "bench-tokenizer.json"
    _, docs, _ = documents("stdlib", None, max_docs=1500)
    train_bpe((t for t in map(doc_text, docs) if t), args.vocab_size, out, say=lambda m: None)
    return str(out)


def bench_prepare(args, tok_path: str, work: Path) -> dict:
    from tokenizers import Tokenizer

    from launch.data.documents import doc_text, documents
    from launch.data.prepare import prepare

    _, docs, _ = documents("python", None, max_docs=args.docs)
    texts = [t for t in map(doc_text, docs) if t]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    tok = Tokenizer.from_file(tok_path)
    cores = len(os.sched_getaffinity(0))
    ours, theirs, tokens = [], [], 0
    for r in range(args.repeats):
        out = work / f"prepared-{r}"
        t0 = time.perf_counter()
        m = prepare("python", None, tok_path, str(out), max_docs=args.docs, shard_mb=args.shard_mb,
                    say=lambda msg: None)
        ours.append(time.perf_counter() - t0)
        tokens = m["tokens"]["train"] + m["tokens"]["val"]
        t0 = time.perf_counter()
        encs = tok.encode_batch_fast(texts, add_special_tokens=False)
        theirs.append(time.perf_counter() - t0)
        lib_tokens = sum(len(e.ids) for e in encs) + len(texts)  # with one end-of-document id each, as the shards
        if r < args.repeats - 1:
            shutil.rmtree(out)
    return {"docs": len(texts), "mb": mb, "cores": cores, "tokens": tokens, "lib_tokens": lib_tokens,
            "ours_s": statistics.median(ours), "lib_s": statistics.median(theirs), "shards": str(out)}


def write_jsonl(path: Path, mb: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ("data stream token shard worker round merge tensor model loss batch step eval the of and to in "
             "for with return value index class import self").split()
    target = int(mb * 1e6)
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        i = 0
        while written < target:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(50, 600)))
            line = json.dumps({"id": i, "text": text}) + "\n"
            fh.write(line)
            written += len(line)
            i += 1


def bench_steps(args, tok_path: str, shards: str, work: Path) -> dict:
    from launch.config import load_config
    from launch.data.batches import load_data, make_batcher
    from launch.models.transformer import Transformer, model_args_from_config

    jsonl = work / "steps.jsonl"
    write_jsonl(jsonl, 20)
    base = [f"data.tokenizer={tok_path}", "run.device=cpu"]
    sources = {
        "shards": base[1:] + ["data.source=shards", f"data.path={shards}"],
        "stream": base + ["data.source=hf", f"data.path={jsonl}", "data.streaming=true"],
    }
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    runs = {}
    for name, sets in sources.items():
        cfg, _ = load_config([str(ROOT / "configs" / "tiny.yaml")], sets)
        data = load_data(cfg.data)
        torch.manual_seed(0)
        model = Transformer(model_args_from_config(cfg.model, data.vocab_size, cfg.data.seq_len))
        runs[name] = {"batcher": make_batcher(data, cfg.data.seq_len, cfg.run.batch_size), "model": model,
                      "opt": torch.optim.AdamW(model.parameters(), lr=1e-3), "fetch": [], "whole": [],
                      "batch": f"{cfg.run.batch_size} x {cfg.data.seq_len}"}
    for step in range(args.steps + 5):  # the sources alternate, step by step, so the machine's load hits both
        for r in runs.values():
            t0 = time.perf_counter()
            x, y = r["batcher"].train_batch(step)
            t1 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(r["model"](x).flatten(0, 1), y.flatten())
            loss.backward()
            r["opt"].step()
            r["opt"].zero_grad()
            t2 = time.perf_counter()
            if step >= 5:  # the first steps warm the allocator and fill the stream's queue
                r["fetch"].append(t1 - t0)
                r["whole"].append(t2 - t0)
    for r in runs.values():
        getattr(r["batcher"], "close", lambda: None)()
    return {name: {"fetch_ms": 1e3 * statistics.median(r["fetch"]), "step_ms": 1e3 * statistics.median(r["whole"]),
                   "batch": r["batch"]} for name, r in runs.items()}


def bench_stream_memory(args, work: Path) -> dict:
    from launch.data.documents import HFOptions
    from launch.data.stream import StreamBatcher, load_stream
    from launch.data.tokenizer import ByteTokenizer

    path = work / "big.jsonl"
    write_jsonl(path, args.stream_mb, seed=1)
    size_mb = path.stat().st_size / 1e6
    before = rss_mb()
    data = load_stream(str(path), HFOptions(), ByteTokenizer(), 50)
    batcher = StreamBatcher(data, 1023, 16)
    peak, batches, start = before, 0, time.perf_counter()
    while True:
        batcher.train_batch(batches)
        batches += 1
        if batches % 200 == 0:
            peak = max(peak, rss_mb())
            if batcher.position["epoch"] > 0:  # the whole file has passed
                break
    batcher.close()
    return {"file_mb": size_mb, "before_mb": before, "peak_mb": peak, "batches": batches,
            "s": time.perf_counter() - start}


def report(args, prep: dict, steps: dict, mem: dict) -> str:
    import tokenizers

    ratio = (prep["tokens"] / prep["ours_s"]) / (prep["lib_tokens"] / prep["lib_s"])
    lines = [
        "# Data path: prepare, per-step cost, stream memory",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; CPU: {platform.processor() or platform.machine()}, "
        f"{prep['cores']} cores; torch {torch.__version__}, tokenizers {tokenizers.__version__}, Python {platform.python_version()}",
        f"- command: python benchmarks/data.py {' '.join(sys.argv[1:])}",
        "",
        "## loco data prepare against tokenizers' encode_batch_fast",
        "",
        f"The first {prep['docs']:,} documents of the `python` corpus ({prep['mb']:.1f} MB), a byte-level BPE of "
        f"{args.vocab_size:,} ids, {prep['cores']} cores; median of {args.repeats}. prepare reads the files, encodes "
        f"in a pool of processes and writes shards and manifest; the library's call encodes texts already in memory.",
        "",
        "| what | tokens | seconds | tokens/s |",
        "| --- | --- | --- | --- |",
        f"| loco data prepare | {prep['tokens']:,} | {prep['ours_s']:.2f} | {prep['tokens'] / prep['ours_s'] / 1e6:.2f}M |",
        f"| tokenizers encode_batch_fast | {prep['lib_tokens']:,} | {prep['lib_s']:.2f} | "
        f"{prep['lib_tokens'] / prep['lib_s'] / 1e6:.2f}M |",
        "",
        f"prepare reaches **{100 * ratio:.0f}%** of the library's throughput (target: at least 80%).",
        "",
        "## Per training step (configs/tiny.yaml on the CPU)",
        "",
        "| source | batch | waiting for the batch (ms, median) | whole step (ms, median) | batch / step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in steps.items():
        lines.append(f"| {name} | {s['batch']} | {s['fetch_ms']:.3f} | {s['step_ms']:.1f} | "
                     f"{100 * s['fetch_ms'] / s['step_ms']:.2f}% |")
    lines += [
        "",
        "Target: under 1% of a tiny step. The stream's reader thread tokenizes beside the step on the same cores; "
        "the whole-step column shows what that costs the step.",
        "",
        "## Streamed dataset memory",
        "",
        f"A generated jsonl of {mem['file_mb']:,.0f} MB streamed to its end with byte tokens ({mem['batches']:,} "
        f"micro-batches of 16 x 1024 in {mem['s']:.0f} s): resident memory {mem['before_mb']:.0f} MB before, "
        f"{mem['peak_mb']:.0f} MB at the peak, **+{mem['peak_mb'] - mem['before_mb']:.0f} MB** (target: under +300 MB).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=6000, help="documents of the python corpus to prepare")
    p.add_argument("--tokenizer", help="a tokenizers JSON (default: a BPE trained on the standard library)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--shard-mb", type=float, help="text per shard (default: prepare's own choice)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="training steps per source")
    p.add_argument("--stream-mb", type=float, default=1024.0, help="size of the generated jsonl to stream")
    p.add_argument("--out", help="write the report here too")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loco-bench-data-"))
    try:
        tok = tokenizer_file(args, work)
        print("[data] prepare ...", flush=True)
        prep = bench_prepare(args, tok, work)
        print("[data] per step ...", flush=True)
        steps = bench_steps(args, tok, prep["shards"], work)
        print("[data] stream memory ...", flush=True)
        mem = bench_stream_memory(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report(args, prep, steps, mem)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
