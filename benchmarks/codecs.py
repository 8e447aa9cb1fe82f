"""Codec chains on a real pseudo-gradient: bytes per parameter, ratio, error, encode/decode speed.

The pseudo-gradient comes from a short DiLoCo round of the ``150m`` model (12 x 896, 32k
vocabulary, about 146M parameters): ``--inner-steps`` AdamW steps (lr 4e-4, the DiLoCo
default) on the embedded corpus from a seeded initialisation; ``delta = theta_start -
theta_after``, flattened to one fp32 vector. It is cached (``--cache``) so later runs skip
the training.

Two tables:

* **Chains**: for each codec chain, exact bytes on the wire per parameter, compression
  ratio against fp32, relative reconstruction error ``|decode(encode(x)) - x| / |x|`` (one
  round, no error feedback), and end-to-end encode / decode throughput (fp32 input GB/s,
  including the copy of the payload to host memory and zstd).
* **Kernels**: the quantize (+pack) and dequantize (+accumulate) hot paths and top-k, torch
  reference against the Triton kernel (CUDA only), beside the device's measured copy
  bandwidth (``dst.copy_(src)`` of the same fp32 vector; bytes read / seconds).

Medians over ``--repeats`` runs. Versions, hardware and arguments go above the tables.

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
          "topk:0.03+2bit+zstd", "topk:0.02+2bit+zstd", "topk:0.01+2bit+zstd", "dct+topk:0.02+2bit+zstd"]


def pseudo_gradient(size: str, steps: int, device: torch.device, seed: int, cache: Path | None) -> torch.Tensor:
    if cache is not None and cache.exists():
        return torch.load(cache, weights_only=True).to(device)
    import torch.nn.functional as F

    from launch.config import DataConfig
    from launch.data import Batcher, load_data
    from launch.models import SIZES, Transformer

    torch.manual_seed(seed)
    seq = 128
    model = Transformer(replace(SIZES[size], vocab_size=32768 if size == "150m" else 256, max_seq_len=seq)).to(device)
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


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def chain_rows(x: torch.Tensor, chains: list[str], repeats: int) -> list[dict]:
    from diloco.compress import make_codec

    rows = []
    n = x.numel()
    for chain in chains:
        codec = make_codec(chain)
        payload = codec.encode(x)
        y = codec.decode(payload, expect_numel=x.numel(), device=x.device)
        err = float((y - x).norm() / x.norm())
        fresh = make_codec(chain)  # encode timing without error feedback state
        enc = timed(lambda: fresh.encode(x), repeats, x.device)
        dec = timed(lambda: codec.decode(payload, expect_numel=x.numel(), device=x.device), repeats, x.device)
        rows.append({"chain": chain, "bytes_per_param": len(payload) / n, "ratio": 4 * n / len(payload), "rel_err": err,
                     "encode_gbs": 4 * n / enc / 1e9, "decode_gbs": 4 * n / dec / 1e9})
        print(f"  {chain:28s} {len(payload) / n:7.4f} B/param  x{4 * n / len(payload):7.1f}  err {err:.4f}  "
              f"enc {4 * n / enc / 1e9:6.2f} GB/s  dec {4 * n / dec / 1e9:6.2f} GB/s", flush=True)
    return rows


def kernel_rows(x: torch.Tensor, repeats: int) -> tuple[float, list[dict]]:
    from diloco.compress.kernels import HAVE_TRITON, quant, topk

    n = x.numel()
    dst = torch.empty_like(x)
    copy = 4 * n / timed(lambda: dst.copy_(x), repeats, x.device) / 1e9
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
    return copy, rows


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def report(args, device: torch.device, n: int, chains: list[dict], copy: float, kernels: list[dict]) -> str:
    import triton

    impls = [k for k in ("torch", "triton") if kernels and k in kernels[0]]
    lines = [
        f"# Codecs on a {n / 1e6:.0f}M-parameter pseudo-gradient ({device.type})", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- device: {device_name(device)}; torch {torch.__version__}, triton {triton.__version__}, "
        f"python {platform.python_version()}, {torch.get_num_threads()} threads",
        f"- pseudo-gradient: model `{args.size}`, {args.inner_steps} AdamW steps (lr 4e-4), seed {args.seed}; "
        f"medians of {args.repeats} runs",
        f"- `python benchmarks/codecs.py {' '.join(sys.argv[1:])}`", "",
        "| chain | bytes/param | ratio vs fp32 | rel. error | encode GB/s | decode GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in chains:
        lines.append(f"| `{r['chain']}` | {r['bytes_per_param']:.4f} | {r['ratio']:.1f}x | {r['rel_err']:.4f} | "
                     f"{r['encode_gbs']:.2f} | {r['decode_gbs']:.2f} |")
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
    p.add_argument("--size", default="150m", help="model size of the pseudo-gradient (launch.models.SIZES)")
    p.add_argument("--inner-steps", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chains", default=",".join(CHAINS), help="comma-separated chains (',' inside a stage: use ';')")
    p.add_argument("--cache", default="benchmarks/results/.cache/pseudo_grad_{size}.pt",
                   help="where the pseudo-gradient is kept between runs ('' to not cache)")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args()
    from launch.trainer import resolve_device

    device = resolve_device(args.device)
    cache = Path(args.cache.format(size=args.size)) if args.cache else None
    print(f"pseudo-gradient of `{args.size}` ({'cached' if cache and cache.exists() else 'training'})", flush=True)
    x = pseudo_gradient(args.size, args.inner_steps, device, args.seed, cache)
    print(f"{x.numel():,} parameters, |delta| = {x.norm():.4f}", flush=True)
    chains = chain_rows(x, [c.replace(";", ",") for c in args.chains.split(",")], args.repeats)
    copy, kernels = kernel_rows(x, args.repeats)
    text = report(args, device, x.numel(), chains, copy, kernels)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
