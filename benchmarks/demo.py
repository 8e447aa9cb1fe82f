"""DeMo against AdamW DDP on the same token budget, and the cost of DeMo's encode.

1. Loss and bytes: ``ddp`` (AdamW, gradients all-reduced every step) and DeMo with k=32 and
   k=8 (``--demo-lr``), all with ``--workers`` simulated workers x ``--batch-size``, the same
   seeds and steps (the runs go through ``benchmarks/convergence.py``), scored on the same
   ``--eval-tokens`` of validation windows. Reported: median final validation loss with its
   standard error, gap to DDP (in percent, and paired over the same windows seed by seed:
   ``benchmarks/paired.py``), bytes sent per worker per step and DDP's over DeMo's.
2. Encode time per step for every parameter of the model: the momentum update and the encode as
   ``DeMo.step`` runs them (``kernels.step_encode_many``: the momentum kept as DCT coefficients,
   one fused Triton launch per run of same-shaped parameters on CUDA, the torch reference batched
   over parameters with the same block elsewhere) against the same update done the published
   way, per parameter: decay and add the gradient, einsum DCT, ``torch.topk``, scatter, einsum
   back, subtract. Medians.

    python benchmarks/demo.py --steps 300 --seeds 0,1,2                       # tiny on CPU
    python benchmarks/demo.py --model small --device cuda --out benchmarks/results/demo_gpu.md
    python benchmarks/demo.py --encode-only --encode-models small,150m,1b --device cuda --out demo_enc.md
    python benchmarks/demo.py --seeds 0 --methods ddp,demo-k32 --demo-lr 1e-3,2e-3 --demo-warmup 100,300   # a sweep
    python benchmarks/demo.py --seeds 1 --out s1.md --merge s0.json --keep runs/   # seeds one invocation each

The runs are saved as JSON beside ``--out``; ``--merge`` adds another invocation's (same settings) to the
table, and ``--keep DIR`` keeps the run folders with their final checkpoints.

A comma-separated list in ``--demo-lr``, ``--demo-warmup``, ``--demo-decay`` or ``--demo-min-lr`` makes a sweep:
every DeMo method runs once per combination (seeds alike), and the report adds a table of every try, best
first. ``--set KEY=VALUE`` (repeatable) overrides the config of every run, DDP's too (``--set model.dim=256``:
a model between the presets).

``--encode-only`` skips part 1 and times the encode alone, for every model of ``--encode-models``
(default: ``--model``); the parameters are only shaped like the model's (random gradients, no model built).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.paired import gap_cell, loss_cell, validation_line  # noqa: E402

# part 1's validation: every simulated worker evaluates EVALS times, which stays under a tenth of a 300-step run
# of tiny on a CPU at a run's default tokens (65,536 took about a quarter of it)
EVALS = 6
EVAL_TOKENS = 16384


def plain_encode(delta: torch.Tensor, chunk: int, topk: int, dct) -> tuple[torch.Tensor, torch.Tensor]:
    """The published style: einsum per parameter, torch.topk, gather, scatter, einsum back, subtract."""
    def div(n: int) -> int:
        return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)

    if delta.dim() == 1:
        s = div(delta.numel())
        d = dct(s)
        c = torch.einsum("xi,ji->xj", delta.reshape(-1, s), d)
        k = min(topk, s)
        idx = torch.topk(c.abs(), k, dim=-1, sorted=False).indices
        val = torch.gather(c, -1, idx)
        sent = torch.zeros_like(c).scatter(-1, idx, val)
        delta.sub_(torch.einsum("xj,ji->xi", sent, d).reshape(delta.shape))
        return idx, val
    r, cdim = delta.shape[-2:]
    s1, s2 = div(r), div(cdim)
    d1, d2 = dct(s1), dct(s2)
    b = delta.reshape(r // s1, s1, cdim // s2, s2)
    c = torch.einsum("hi,yixj,wj->yxhw", d1, b, d2).reshape(r // s1, cdim // s2, -1)
    k = min(topk, s1 * s2)
    idx = torch.topk(c.abs(), k, dim=-1, sorted=False).indices
    val = torch.gather(c, -1, idx)
    sent = torch.zeros_like(c).scatter(-1, idx, val).reshape(r // s1, cdim // s2, s1, s2)
    delta.sub_(torch.einsum("hi,yxhw,wj->yixj", d1, sent, d2).reshape(delta.shape))
    return idx, val


def median_time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up, the device synchronised around each."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def model_demo(model_size: str, device: torch.device, topk: int = 32):
    """DeMo over random parameters shaped like the model's (built on the meta device: nothing initialised), with
    its entries, plans, chain and layout: what its step works on, in its own wire order."""
    from demo_optim import DeMo
    from launch.models.transformer import SIZES, Transformer

    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(replace(SIZES[model_size], vocab_size=256, max_seq_len=128)).parameters()]
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    opt = DeMo(params, lr=1e-3, compression_topk=topk, chunk_rule="divisor")
    entries = opt._entries()
    plans = [plan for _, _, plan in entries]
    chain = opt._chain(plans)
    return opt, params, entries, plans, chain, opt._layout(plans, chain, device)


def encode_times(model_size: str, device: torch.device, repeats: int, topk: int = 32) -> dict[str, float]:
    from demo_optim import kernels
    from diloco.compress.dct import dct_basis

    opt, params, entries, plans, chain, layout = model_demo(model_size, device, topk)
    opt._stack_momenta(entries, layout)  # the momenta as DeMo keeps them, in its wire order
    order = layout.order
    moms = [opt.state[params[j]]["delta" if plans[j].padded else "coeffs"] for j in order]
    grads = [torch.randn(params[j].shape, device=device) for j in order]
    deltas = [torch.zeros(params[j].shape, device=device) for j in order]
    n = len(order)

    def loco():  # as DeMo.step runs it: one call over every parameter in wire order
        kernels.step_encode_many(grads, moms, [plans[j] for j in order], [0.999] * n, [1e-3] * n)

    def plain():
        torch._foreach_mul_(deltas, 0.999)
        torch._foreach_add_(deltas, grads, alpha=1e-3)
        for d in deltas:
            plain_encode(d, 64, topk, lambda s: dct_basis(s, device))

    return {"loco": median_time(loco, device, repeats), "plain": median_time(plain, device, repeats)}


def decode_times(model_size: str, device: torch.device, repeats: int, workers: int = 4,
                 topk: int = 32) -> dict[str, float]:
    """One worker's decode of ``workers`` payloads as ``DeMo.step`` runs it: validate each payload and sum it
    into the flat buffers (``Aggregation.sum_wire``), divide, and apply sign(IDCT(mean)) to every parameter
    (``decode_sign_many``). Returns the median seconds, the dense bytes that pass writes (the sum and count
    buffers, the mean, the parameters) and one payload's size."""
    from demo_optim import kernels

    opt, params, entries, plans, chain, layout = model_demo(model_size, device, topk)
    payloads = []
    for _ in range(workers):  # each "worker" encodes its own random gradients
        for p in params:
            p.grad = torch.randn(p.shape, device=device)
        payloads.append(opt._encode(entries, chain))
    order = layout.order

    @torch.no_grad()
    def decode():
        sums, counts = opt.aggregation.sum_wire(payloads, layout)
        agg = sums.flat.div_(counts.flat.clamp_(min=1))
        kernels.decode_sign_many(agg, [params[j] for j in order], [1e-3] * len(order), [plans[j] for j in order])

    n_params = sum(p.numel() for p in params)
    return {"decode": median_time(decode, device, repeats), "dense_bytes": 4 * (3 * layout.total + n_params),
            "payload_bytes": len(payloads[0]), "workers": workers}


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Bytes read plus written per second by one large device copy (median of 5)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_time(lambda: dst.copy_(src), device, 5)


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def demo_tries(args) -> list[dict]:
    """Every combination of the DeMo settings given (one, unless a flag holds a list), in the order given."""
    warmups = [args.warmup] if args.demo_warmup is None else args.demo_warmup
    return [{"lr": lr, "warmup": w, "decay": d, "min_lr": m}
            for lr in args.demo_lr for w in warmups for d in args.demo_decay for m in args.demo_min_lr]


def try_label(t: dict) -> str:
    return f"lr{t['lr']:g}_wu{t['warmup']}_decay{t['decay']:g}_min{t['min_lr']:g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW lr of the DDP baseline")
    p.add_argument("--demo-lr", type=_floats, default=[3e-3], help="DeMo's peak lr (a comma list: a sweep)")
    p.add_argument("--warmup", type=int, default=50, help="warmup steps of the DDP baseline (and of DeMo by default)")
    p.add_argument("--demo-warmup", type=_ints, help="warmup steps of the DeMo runs (default: --warmup; a list: a sweep)")
    p.add_argument("--demo-decay", type=_floats, default=[0.999], help="DeMo's compression_decay (a list: a sweep)")
    p.add_argument("--demo-min-lr", type=_floats, default=[0.1],
                   help="DeMo's final lr as a fraction of its peak (the DDP baseline decays to 0.1; a list: a sweep)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run, DDP's too (repeatable)")
    p.add_argument("--methods", default="ddp,demo-k32,demo-k8")
    p.add_argument("--device", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/demo_cpu.md", help="the table; the runs go beside it as .json")
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS,
                   help=f"validation tokens (eval.tokens), windows spread over the whole split (default {EVAL_TOKENS})")
    p.add_argument("--keep", metavar="DIR",
                   help="keep the run folders, final checkpoints included, under DIR (default: a temporary folder)")
    p.add_argument("--merge", action="append", default=[], metavar="JSON",
                   help="add the runs another invocation saved (same settings; e.g. one invocation per seed)")
    p.add_argument("--encode-only", action="store_true", help="only part 2: the encode times, no training runs")
    p.add_argument("--encode-models", default=None,
                   help="comma-separated sizes for the encode times (default: --model)")
    args = p.parse_args()
    if args.encode_only:
        encode_report(args)
        return

    from benchmarks import convergence as conv
    from benchmarks.simulator import device_name
    from launch.config import load_config
    from launch.data.batches import load_data
    from launch.metrics.log import human_bytes
    from launch.loop.runtime import resolve_device

    args.seeds = [int(s) for s in args.seeds.split(",")]
    asked = args.methods.split(",")
    unknown = [m for m in asked if m not in conv.METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(conv.METHODS)}")
    args.evals, args.bandwidth, args.latency = EVALS, "1Gbit", "80ms"
    tries = demo_tries(args)
    sweep, t0 = len(tries) > 1, tries[0]
    # every DeMo method once per try; a sweep names each run after its settings
    args.methods, args.method_set, settings = [], {}, {}
    for m in asked:
        if not m.startswith("demo"):
            args.methods.append(m)
            continue
        for t in tries:
            name = f"{m}@{try_label(t)}" if sweep else m
            conv.METHODS.setdefault(name, conv.METHODS[m])
            args.methods.append(name)
            settings[name] = (m, t)
            args.method_set[name] = [f"optim.lr={t['lr']}", "optim.weight_decay=0", f"optim.warmup_steps={t['warmup']}",
                                     f"algo.compression_decay={t['decay']}", f"optim.min_lr_ratio={t['min_lr']}"]
    device = resolve_device(args.device or "auto")
    saved = Path(args.out).with_suffix(".json")
    mine = settings_of(args, tries)
    merged = [conv._load_runs(Path(f), mine, "benchmarks/demo.py") for f in args.merge]
    conv.check_keep(args.keep, args.methods, args.seeds)
    cfg, _ = load_config([], conv._base(args, 0) + args.set)
    data = load_data(cfg.data)
    # merged runs took their virtual step time from a measurement: these take the same, as their JSON must agree
    step_time = merged[0]["step_time"] if merged else conv.measure_step_time(args, data)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for m in args.methods:
                r = conv.run_one(args, m, seed, data, step_time, Path(args.keep or tmp))
                results.append(r)
                print(f"[demo] {m} seed {seed}: val {r['val_loss']:.4f}, sent {r['bytes']:,} B, {r['real_s']:.0f}s",
                      file=sys.stderr, flush=True)
                conv._save(saved, mine, step_time, results)  # survives Ctrl-C
    if merged:
        results, step_time = conv._combine([{"step_time": step_time, "settings": mine, "results": results}] + merged)
        conv._save(saved, mine, step_time, results)
        args.seeds = sorted({r["seed"] for r in results})
        args.methods += [m for m in dict.fromkeys(r["method"] for r in results) if m not in args.methods]
    times = encode_times(args.model, device, args.repeats)
    by = {m: sorted((r for r in results if r["method"] == m), key=lambda r: r["seed"]) for m in args.methods}
    med = {m: statistics.median(r["val_loss"] for r in by[m]) for m in args.methods}
    per_step = {m: statistics.median(r["bytes"] for r in by[m]) / args.steps for m in args.methods}
    lines = [
        "# DeMo vs AdamW DDP", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; device: {device_name(args.device or 'auto')}; "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        f"- model {args.model}, {args.workers} workers x batch {args.batch_size} x {args.seq_len}, {args.steps} steps, "
        f"seeds {','.join(map(str, args.seeds))}; DDP: AdamW lr {args.lr}, warmup {args.warmup}; DeMo: "
        + (f"lr {t0['lr']}, decay {t0['decay']}, chunk 64, no weight decay, warmup {t0['warmup']}; cosine to 10% "
           f"of the peak (DeMo: to {100 * t0['min_lr']:g}%)" if not sweep else
           f"a sweep of {len(tries)} settings (below), chunk 64, no weight decay; cosine to 10% of the peak (DeMo: "
           f"to its min lr)") + (f"; overrides {' '.join(args.set)}" if args.set else ""),
        f"- `python benchmarks/demo.py {' '.join(sys.argv[1:])}`",
        validation_line(mine, results), "",
        "| method | val loss (median) | seeds | vs DDP | gap to DDP, paired | bytes / worker / step | DDP bytes / these "
        "| wall s (median) | wall / DDP's |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: |",
    ]
    wall = {m: statistics.median(r["real_s"] for r in by[m]) for m in args.methods}
    for m in args.methods:
        seeds = ", ".join(f"{r['val_loss']:.3f}" for r in by[m])
        fewer = f"{per_step['ddp'] / per_step[m]:.0f}x" if "ddp" in per_step and per_step[m] else ""
        slower = f"{wall[m] / wall['ddp']:.2f}x" if "ddp" in wall and wall["ddp"] else ""
        lines.append(f"| {m} | {loss_cell(by[m])} | {seeds} | {vs_ddp(m, med)} | {paired(m, by)} | "
                     f"{human_bytes(per_step[m])} | {fewer} | {wall[m]:.1f} | {slower} |")
    if sweep:
        lines += ["", "Every try, best first (DeMo lr, warmup steps, compression_decay, final lr as a fraction of "
                  "the peak):", "", "| method | lr | warmup | decay | min lr | val loss (median) | seeds | vs DDP "
                  "| gap to DDP, paired |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
        for name in sorted(settings, key=lambda n: med[n]):
            m, t = settings[name]
            seeds = ", ".join(f"{r['val_loss']:.3f}" for r in by[name])
            lines.append(f"| {m} | {t['lr']:g} | {t['warmup']} | {t['decay']:g} | {t['min_lr']:g} | "
                         f"{loss_cell(by[name])} | {seeds} | {vs_ddp(name, med)} | {paired(name, by)} |")
    lines += ["", f"Encode (all parameters of `{args.model}`, k=32, median of {args.repeats}): loco "
              f"{times['loco'] * 1e3:.1f} ms ({'Triton kernel' if device.type == 'cuda' else 'torch reference'}), "
              f"plain einsum+topk {times['plain'] * 1e3:.1f} ms: {times['plain'] / times['loco']:.2f}x."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


def settings_of(args, tries: list[dict]) -> dict:
    """What runs saved by different invocations must share to sit in one table."""
    return {"model": args.model, "workers": args.workers, "steps": args.steps, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup, "eval_tokens": args.eval_tokens,
            "demo_lr": sorted({t["lr"] for t in tries}), "demo_warmup": sorted({t["warmup"] for t in tries}),
            "demo_decay": sorted({t["decay"] for t in tries}), "demo_min_lr": sorted({t["min_lr"] for t in tries}),
            "set": list(args.set)}


def vs_ddp(method: str, med: dict) -> str:
    return f"{100 * (med[method] / med['ddp'] - 1):+.1f}%" if "ddp" in med else ""


def paired(method: str, by: dict) -> str:
    return gap_cell(by[method], by["ddp"]) if "ddp" in by and method != "ddp" else ""


def encode_report(args) -> None:
    """``--encode-only``: the encode table for every model of ``--encode-models``."""
    from benchmarks.simulator import device_name
    from launch.metrics.log import human_bytes
    from launch.models.transformer import SIZES, Transformer, count_params
    from launch.loop.runtime import resolve_device

    device = resolve_device(args.device or "auto")
    models = [m for m in (args.encode_models or args.model).split(",") if m]
    unknown = [m for m in models if m not in SIZES]
    if unknown:
        raise SystemExit(f"--encode-models: unknown {', '.join(unknown)}; sizes: {', '.join(SIZES)}")
    impl = "Triton kernel" if device.type == "cuda" else "torch reference"
    lines = [
        "# DeMo encode time", "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; device: {device_name(args.device or 'auto')}; "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        f"- one encode of every parameter of the model (random fp32 deltas of the parameters' shapes, vocab 256): "
        f"DCT over chunks of 64, top-32 per chunk, the sent part subtracted; loco's encode ({impl}) against a "
        f"plain per-parameter einsum + torch.topk + scatter like the published one; median of {args.repeats} after "
        f"one warm-up",
        f"- `python benchmarks/demo.py {' '.join(sys.argv[1:])}`", "",
        f"- decode: one worker's decode of {args.workers} payloads as `DeMo.step` runs it (validate and sum each "
        f"into flat buffers, the mean, sign(IDCT) applied to every parameter); dense bytes written: the sum, "
        f"count and mean buffers and the parameters; against one large device copy (bytes read + written per s)",
        "",
        "| model | parameters | payload / worker | loco encode | plain einsum+topk | plain / loco | decode of "
        f"{args.workers} | decode dense GB/s | decode / copy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    copy = copy_bandwidth(device)
    for m in models:
        t = encode_times(m, device, args.repeats)
        d = decode_times(m, device, args.repeats, args.workers)
        with torch.device("meta"):
            n = count_params(Transformer(replace(SIZES[m], vocab_size=256, max_seq_len=128)))
        rate = d["dense_bytes"] / d["decode"]
        print(f"[demo] {m}: encode loco {t['loco'] * 1e3:.1f} ms, plain {t['plain'] * 1e3:.1f} ms; decode "
              f"{d['decode'] * 1e3:.1f} ms ({rate / 1e9:.1f} GB/s)", file=sys.stderr, flush=True)
        lines.append(f"| {m} | {n / 1e6:.1f}M | {human_bytes(d['payload_bytes'])} | {t['loco'] * 1e3:.1f} ms | "
                     f"{t['plain'] * 1e3:.1f} ms | {t['plain'] / t['loco']:.2f}x | {d['decode'] * 1e3:.1f} ms | "
                     f"{rate / 1e9:.1f} | {100 * rate / copy:.0f}% |")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines += ["", f"Device copy: {copy / 1e9:.1f} GB/s (bytes read + written)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
