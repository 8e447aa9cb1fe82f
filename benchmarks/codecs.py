"""Codec chains on a real pseudo-gradient: bytes per parameter, ratio, error, encode/decode speed.

The pseudo-gradient comes from a short DiLoCo round of the ``150m`` model (12 x 896, 32k
vocabulary, about 146M parameters): ``--inner-steps`` AdamW steps (lr 4e-4, the DiLoCo
default) on the embedded corpus from a seeded initialisation; ``delta = theta_start -
theta_after``, flattened to one fp32 vector. It is cached (``--cache``) so later runs skip
the training.

Two tables:

* **Chains**: for each codec chain, exact bytes on the wire per parameter, compression
  ratio against fp32, relative reconstruction error ``|decode(encode(x)) - x| / |x|`` (one
  round, no error feedback), and end-to-end throughput (fp32 input GB/s, including the copy
  of the payload to host memory, the checksum and zstd) of ``encode`` (tensor to the bytes
  ready to send), ``decode`` (bytes to a new tensor) and ``decode_accumulate_`` (bytes into an
  existing fp32 accumulator, what the compressed all-reduce does), each also as a fraction of
  the device's copy bandwidth, measured in the same run.
* **zstd**: for chains with a zstd stage, what zstd alone costs: its compress and decompress
  time on that chain's sections (single-threaded, and multithreaded where the codec uses it),
  the bytes it saves, and the link speed below which sending the saved bytes takes longer
  than compressing them (zstd pays on slower links).
* **Kernels**: the quantize (+pack) and dequantize (+accumulate) hot paths and top-k, torch
  reference against the Triton kernel (CUDA only), beside the device's measured copy
  bandwidth (``dst.copy_(src)`` of the same fp32 vector; bytes read / seconds).

Medians over ``--repeats`` runs, the chains taking turns in each. Versions, hardware and arguments go above the tables.

    python benchmarks/codecs.py                               # 150m pseudo-gradient, auto device
    python benchmarks/codecs.py --size tiny --repeats 3       # quick look
    python benchmarks/codecs.py --out benchmarks/results/codecs_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.train_throughput import cpu_model  # noqa: E402

CHAINS = ["fp32", "bf16", "fp16", "int8", "int8+zstd", "int4", "fp4", "fp4+zstd", "topk:0.03+int8",
          "topk:0.03+2bit+zstd", "topk:0.02+2bit+zstd", "topk:0.01+2bit+zstd", "dct+topk:0.02+2bit+zstd",
          # SparseLoCo's payload (k = 64 of 4096) with loco's 2bit values and with the published stat2, in chunks of
          # the flat vector and in the published 64 x 64 tiles of each tensor (its default)
          "topk:0.015625+2bit", "topk:0.015625+stat2", "topk:k=64,tile=64+2bit", "topk:k=64,tile=64+stat2"]


def _model(size: str, seq: int, device: torch.device | str) -> torch.nn.Module:
    from launch.models.transformer import SIZES, Transformer

    return Transformer(replace(SIZES[size], vocab_size=32768 if size == "150m" else 256, max_seq_len=seq)).to(device)


def param_shapes(size: str) -> list[tuple[int, ...]]:
    """The shapes of the tensors the pseudo-gradient is, end to end (a chain with tiles cuts each on its own)."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in _model(size, 128, "meta").parameters()]


def pseudo_gradient(size: str, steps: int, device: torch.device, seed: int, cache: Path | None) -> torch.Tensor:
    if cache is not None and cache.exists():
        return torch.load(cache, weights_only=True).to(device)
    import torch.nn.functional as F

    from launch.config.schema import DataConfig
    from launch.data.batches import Batcher, load_data

    torch.manual_seed(seed)
    seq = 128
    model = _model(size, seq, device)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1)
    batcher = Batcher(load_data(DataConfig(source="stdlib", max_docs=400, seq_len=seq)), seq, 4, seed=seed)
    for step in range(steps):
        x, y = (t.to(device) for t in batcher.train_batch(step))
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"  inner step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    with torch.no_grad():
        delta = torch.cat([(s - p.detach()).reshape(-1).float() for s, p in zip(start, model.parameters())])
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(delta.cpu(), cache)
    return delta


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def once(fn, device: torch.device) -> float:
    """Seconds of one ``fn()``, the device's queued work included."""
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    return statistics.median(once(fn, device) for _ in range(repeats))


def copy_bandwidth(x: torch.Tensor, repeats: int) -> float:
    """GB/s of ``dst.copy_(x)`` into a preallocated tensor (fp32 bytes read / seconds). On a CPU the better of
    torch's threads and one thread: on a loaded machine a copy on several threads waits at its barrier for a
    descheduled one, and the codecs are held to the memory's speed, not to that wait."""
    dst = torch.empty_like(x)
    best = 4 * x.numel() / timed(lambda: dst.copy_(x), repeats, x.device) / 1e9
    threads = torch.get_num_threads()
    if x.device.type == "cpu" and threads > 1:
        torch.set_num_threads(1)
        try:
            best = max(best, 4 * x.numel() / timed(lambda: dst.copy_(x), repeats, x.device) / 1e9)
        finally:
            torch.set_num_threads(threads)
    return best


def chain_rows(x: torch.Tensor, chains: list[str], repeats: int,
               shapes: list[tuple[int, ...]] | None = None) -> list[dict]:
    """``shapes``: the tensors ``x`` is (the payload of a chain with tiles follows them). The chains take turns,
    repeat after repeat: a drift of the machine's speed (other work, clocks) falls on all of them alike, so the
    ratios between rows hold even where the absolute figures move."""
    from diloco.compress import make_codec

    n = x.numel()
    acc = torch.zeros_like(x)

    def operations(chain: str) -> tuple[bytes, float, dict]:
        codec = make_codec(chain)
        payload = codec.encode(x, shapes=shapes)
        y = codec.decode(payload, expect_numel=n, device=x.device, shapes=shapes)
        err = float((y - x).norm() / x.norm())
        fresh = make_codec(chain)  # encode timing without error feedback state
        ops = {"encode": lambda: fresh.encode(x, shapes=shapes),
               "decode": lambda: codec.decode(payload, expect_numel=n, device=x.device, shapes=shapes),
               "accumulate": lambda: codec.decode_accumulate_(payload, acc, 0.5, shapes=shapes)}
        for fn in ops.values():  # warm-up
            fn()
        return payload, err, ops

    made = {chain: operations(chain) for chain in chains}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for chain, (_, _, ops) in made.items():
            for op, fn in ops.items():
                times.setdefault((chain, op), []).append(once(fn, x.device))
    rows = []
    for chain, (payload, err, ops) in made.items():
        gbs = {op: 4 * n / statistics.median(times[chain, op]) / 1e9 for op in ops}
        rows.append({"chain": chain, "bytes_per_param": len(payload) / n, "ratio": 4 * n / len(payload), "rel_err": err,
                     "encode_gbs": gbs["encode"], "decode_gbs": gbs["decode"], "accumulate_gbs": gbs["accumulate"]})
        print(f"  {chain:28s} {len(payload) / n:7.4f} B/param  x{4 * n / len(payload):7.1f}  err {err:.4f}  "
              f"enc {gbs['encode']:6.2f} GB/s  dec {gbs['decode']:6.2f} GB/s  dec+acc {gbs['accumulate']:6.2f} GB/s",
              flush=True)
    return rows


def zstd_rows(x: torch.Tensor, chains: list[str], repeats: int) -> list[dict]:
    """zstd alone on each zstd chain's sections: single-threaded and (above its threshold) multithreaded."""
    import zstandard

    from diloco.compress import make_codec, wire
    from diloco.compress.zstd import ZSTD_JOB_BYTES, ZSTD_THREADS_ABOVE, threaded_zstd

    rows = []
    for chain in chains:
        codec = make_codec(chain)
        level = codec.spec.zstd_level
        if level is None:
            continue
        stem = make_codec(codec.chain.rsplit("+zstd", 1)[0])  # the same chain without its zstd stage
        payload = stem.encode(x)
        raw = memoryview(payload)[wire.parse_header(payload, stem.max_numel).offset:]
        modes = [("1 thread", zstandard.ZstdCompressor(level=level))]
        if len(raw) > ZSTD_THREADS_ABOVE:
            modes.append((f"all cores, {ZSTD_JOB_BYTES >> 20} MiB jobs", threaded_zstd(level)))
        for mode, zc in modes:
            comp = zc.compress(raw)
            zd = zstandard.ZstdDecompressor()
            c = timed(lambda: zc.compress(raw), repeats, torch.device("cpu"))
            d = timed(lambda: zd.decompress(comp, max_output_size=len(raw)), repeats, torch.device("cpu"))
            saved = len(raw) - len(comp)
            rows.append({"chain": chain, "mode": mode, "raw": len(raw), "compressed": len(comp), "compress_s": c,
                         "decompress_s": d, "pays_below_gbit": 8 * saved / (c + d) / 1e9 if saved > 0 else 0.0})
            print(f"  zstd {chain:24s} {mode:22s} {len(raw) / 1e6:8.2f} -> {len(comp) / 1e6:8.2f} MB  "
                  f"compress {c * 1e3:8.1f} ms  decompress {d * 1e3:8.1f} ms", flush=True)
    return rows


def kernel_rows(x: torch.Tensor, repeats: int) -> list[dict]:
    from diloco.compress.kernels import HAVE_TRITON, quant, topk

    n = x.numel()
    dst = torch.empty_like(x)
    impls = {"torch": (quant.quantize_ref, quant.dequantize_ref, topk.topk_chunks_ref)}
    if x.is_cuda and HAVE_TRITON:
        impls["triton"] = (quant.quantize_triton, quant.dequantize_triton, topk.topk_chunks_triton)
    rows = []
    for fmt, block in [("int8", 256), ("int4", 128), ("fp4", 128)]:
        packed, scales = quant.quantize_ref(x, block, fmt)
        row = {"op": f"quantize {fmt}"}
        row2 = {"op": f"dequantize+accumulate {fmt}"}
        for name, (qf, df, _) in impls.items():
            row[name] = 4 * n / timed(lambda: qf(x, block, fmt), repeats, x.device) / 1e9
            row2[name] = 4 * n / timed(lambda: df(packed, scales, n, block, fmt, out=dst, weight=0.5, accumulate=True),
                                       repeats, x.device) / 1e9
        rows += [row, row2]
    row = {"op": "topk 2% + error feedback"}
    for name, (_, _, tf) in impls.items():
        res = torch.zeros_like(x)
        row[name] = 4 * n / timed(lambda: tf(x, 4096, 82, res, 1.0), repeats, x.device) / 1e9
    rows.append(row)
    for r in rows:
        print("  " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    return rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def report(args, device: torch.device, n: int, chains: list[dict], copy: float, kernels: list[dict],
           zstd: list[dict]) -> str:
    import triton
    import xxhash
    import zstandard

    impls = [k for k in ("torch", "triton") if kernels and k in kernels[0]]
    lines = [
        f"# Codecs on a {n / 1e6:.0f}M-parameter pseudo-gradient ({device.type})", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- device: {device_name(device)}; torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}, zstandard {zstandard.__version__}, xxhash {xxhash.VERSION}, "
        f"{torch.get_num_threads()} threads",
        f"- pseudo-gradient: model `{args.size}`, {args.inner_steps} AdamW steps (lr 4e-4), seed {args.seed}; "
        f"medians of {args.repeats} runs",
        f"- `python benchmarks/codecs.py {' '.join(sys.argv[1:])}`",
        f"- device copy bandwidth (`dst.copy_(src)`, fp32 bytes read / s), same run, the better of before and after "
        f"the chains (on a CPU also of {torch.get_num_threads()} threads and 1): {copy:.2f} GB/s", "",
        "| chain | bytes/param | ratio vs fp32 | rel. error | encode GB/s | decode GB/s | decode_accumulate_ GB/s "
        "| encode / copy | decode / copy | decode_accumulate_ / copy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in chains:
        lines.append(f"| `{r['chain']}` | {r['bytes_per_param']:.4f} | {r['ratio']:.1f}x | {r['rel_err']:.4f} | "
                     f"{r['encode_gbs']:.2f} | {r['decode_gbs']:.2f} | {r['accumulate_gbs']:.2f} | "
                     f"{r['encode_gbs'] / copy:.0%} | {r['decode_gbs'] / copy:.0%} | {r['accumulate_gbs'] / copy:.0%} |")
    if zstd:
        lines += ["", "zstd alone, on each zstd chain's sections (included in the chain's numbers above; the codec "
                  "uses all cores above the multithreading threshold). It pays on a link slower than the last "
                  "column: below that speed, sending the bytes it saves takes longer than compressing and "
                  "decompressing them.", "",
                  "| chain | zstd mode | sections MB | compressed MB | compress ms | decompress ms | pays below |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in zstd:
            lines.append(f"| `{r['chain']}` | {r['mode']} | {r['raw'] / 1e6:.2f} | {r['compressed'] / 1e6:.2f} | "
                         f"{r['compress_s'] * 1e3:.1f} | {r['decompress_s'] * 1e3:.1f} | "
                         f"{r['pays_below_gbit']:.2f} Gbit/s |")
    if not kernels:
        return "\n".join(lines) + "\n"
    lines += ["", f"Kernels (fp32 input GB/s; device copy bandwidth {copy:.1f} GB/s):", "",
              "| op | " + " | ".join(impls) + " | " + " | ".join(f"{k} / copy" for k in impls)
              + (" | triton / torch |" if "triton" in impls else " |"),
              "|---|" + "---:|" * (2 * len(impls) + ("triton" in impls))]
    for r in kernels:
        cells = [f"{r[k]:.2f}" for k in impls] + [f"{r[k] / copy:.0%}" for k in impls]
        if "triton" in impls:
            cells.append(f"{r['triton'] / r['torch']:.1f}x")
        lines.append(f"| {r['op']} | " + " | ".join(cells) + " |")
    lines += ["", "Relative error is one round without error feedback: top-k chains drop most of the vector "
              "each round and send it later through the residual, which this column does not show."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="150m", help="model size of the pseudo-gradient (launch.models.transformer.SIZES)")
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chains", default=",".join(CHAINS), help="comma-separated chains (',' inside a stage: use ';')")
    p.add_argument("--cache", default="benchmarks/results/.cache/pseudo_grad_{size}.pt",
                   help="where the pseudo-gradient is kept between runs ('' to not cache)")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel table (chains and zstd only)")
    args = p.parse_args()
    from launch.loop.runtime import resolve_device

    device = resolve_device(args.device)
    cache = Path(args.cache.format(size=args.size)) if args.cache else None
    print(f"pseudo-gradient of `{args.size}` ({'cached' if cache and cache.exists() else 'training'})", flush=True)
    x = pseudo_gradient(args.size, args.inner_steps, device, args.seed, cache)
    print(f"{x.numel():,} parameters, |delta| = {x.norm():.4f}", flush=True)
    names = [c.replace(";", ",") for c in args.chains.split(",")]
    copy = copy_bandwidth(x, args.repeats)
    print(f"device copy bandwidth {copy:.2f} GB/s", flush=True)
    chains = chain_rows(x, names, args.repeats, param_shapes(args.size))
    copy = max(copy, copy_bandwidth(x, args.repeats))  # before and after the chains: the better (on shared cores)
    zstd = zstd_rows(x, names, args.repeats) if x.device.type == "cpu" else zstd_rows(x.cpu(), names, args.repeats)
    kernels = [] if args.no_kernels else kernel_rows(x, args.repeats)
    text = report(args, device, x.numel(), chains, copy, kernels, zstd)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
