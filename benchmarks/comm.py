"""Communication per round among real gloo processes: seconds, bytes sent per worker, error; bytes per token.

``--procs`` worker processes (this script re-invoked with a hidden flag, ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR=127.0.0.1`` / ``MASTER_PORT`` set, a free port picked here) join
one gloo group through :class:`diloco.comm.torch_dist.TorchDistTransport` and exchange a
pseudo-gradient:

* the vector: by default the cached 150M pseudo-gradient of ``benchmarks/codecs.py``
  (``benchmarks/results/.cache/pseudo_grad_150m.pt``, made there if missing), cut into the
  ``150m`` model's parameter sizes, the list the DiLoCo outer step hands the transport (views of
  one buffer, end to end, as DiLoCo's pseudo-gradients are with a codec); with
  ``--numel N`` a Gaussian vector of N elements instead (pieces of 1M), for quick runs. Worker r
  multiplies it elementwise by ``1 + spread * z_r`` (``z_r`` Gaussian, seeded by r), so the workers
  differ but keep the vector's heavy-tailed magnitudes, and the exact mean is not any one input.
* **DiLoCo rounds**, one row per codec chain: ``fp32`` through the dense ``all_reduce_`` (the
  ring all-reduce), every other chain through ``collective.weighted_mean(..., 1.0, codec,
  key="bench")``: one codec per worker kept across the rounds, so top-k's error feedback carries
  its residual from round to round as in training. Each round restarts from the same inputs.
  One warm-up round, then ``--repeats`` timed ones; a round's time is the slowest worker's
  (barrier before), the table shows the median. Bytes are the transport's ``stats.bytes_sent``
  delta per round (mean over the workers, median over the rounds). Errors are
  ``|result - exact mean| / |exact mean|`` on rank 0, in the warm-up round (fresh codec state)
  and in the last round (with the residuals of the rounds before).
* **DDP**: the dense fp32 all-reduce of the gradient, every step; the very same collective
  as the ``fp32`` row, so that row's time and bytes are DDP's per step.
* **DeMo**: ``DeMo(model.parameters(), compression_topk=k).bytes_per_step()`` for the
  ``150m`` model (built on the meta device; only shapes matter) is the payload of a step, and
  its time is one ``all_gather_bytes`` of a payload of that size (DeMo's only collective per
  step; the DCT/top-k encode and the decode are not in it).
* **Bytes per token trained** per worker: bytes sent per sync over the tokens a worker trains
  between syncs (``--tokens-per-step`` per step, DiLoCo syncing every ``--inner-steps`` and
  every 500 steps), against DDP.

On one machine over loopback, the times measure CPU-bound encode / decode and memory copies
in processes that share the cores, not a network; bytes are what would cross one.

    python benchmarks/comm.py --numel 2000000 --repeats 2                 # quick look
    python benchmarks/comm.py --repeats 3 --out benchmarks/results/comm_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHAINS = ["fp32", "bf16", "int8", "fp4+zstd", "topk:0.03+int8", "topk:0.02+2bit+zstd", "topk:0.01+2bit+zstd"]
DEFAULT_CACHE = "benchmarks/results/.cache/pseudo_grad_150m.pt"
PIECE = 1 << 20  # piece size of a synthetic --numel vector
STEP = 1 << 22  # elements per chunk when building inputs or comparing vectors (bounds temporaries)
KEY = "bench"
SERIAL = " (one bucket at a time)"  # --serial: the row of a chain exchanged without overlap
SIZED = " (sizes exchanged)"  # --exchange-sizes: the row of a fixed-size chain whose sizes are exchanged all the same


# ---- shared helpers -------------------------------------------------------------------------------

def model_150m():
    import torch

    from launch.models.transformer import SIZES, Transformer

    with torch.device("meta"):
        return Transformer(replace(SIZES["150m"], vocab_size=32768, max_seq_len=128))


def demo_bytes(topks: list[int], chunk: int) -> dict[int, int]:
    from demo_optim.optimizer import DeMo

    model = model_150m()
    return {k: DeMo(model.parameters(), compression_topk=k, compression_chunk=chunk).bytes_per_step() for k in topks}


def peak_rss() -> int | None:
    from benchmarks.train_throughput import proc_status_kib

    kib = proc_status_kib("VmHWM")
    return None if kib is None else kib * 1024


def start_peak() -> int | None:
    """Set this process's peak RSS back to its current RSS (Linux: ``5`` into /proc/self/clear_refs) and
    return that RSS: ``peak_rss() - start_peak()`` is then what the code in between added at its peak.
    None where the peak cannot be reset."""
    from benchmarks.train_throughput import proc_status_kib

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    kib = proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def base_chain(chain: str) -> str:
    """A row's codec chain, without the note of ``--serial`` or ``--exchange-sizes``."""
    return chain.replace(SERIAL, "").replace(SIZED, "")


def label(chain: str) -> str:
    """A row's chain in Markdown: the chain as code, and the note of ``--serial`` or ``--exchange-sizes`` after it."""
    return f"`{base_chain(chain)}`" + chain[len(base_chain(chain)):]


def fmt_b(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def fmt_x(v: float) -> str:
    return fmt_num(v) + "x"


def fmt_s(s: float) -> str:
    return f"{s:.3f}" if s >= 0.01 else f"{s * 1e3:.2f} ms"


# ---- worker process ---------------------------------------------------------------------------------

def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress import make_codec
    from diloco.compress.collective import all_reduce_, weighted_mean

    torch.set_num_threads(cfg["threads"])
    # the settings every worker states (as loco train does): fixed-size codecs then skip the size exchanges
    tr = TorchDistTransport(backend="gloo", timeout=cfg["collective_timeout"], settings={"chains": cfg["chains"]})
    overlaps = tr.caps.overlaps_exchange  # what the backend allows; a serial row turns it off
    rank, world = tr.rank, tr.world_size
    lead = rank == 0

    def say(msg: str) -> None:
        if lead:
            print(f"[comm] {msg}", flush=True)

    # this worker's input: the shared vector times (1 + spread * z_rank), built chunk by chunk
    if cfg["numel"]:
        n = cfg["numel"]
        base = torch.randn(n, generator=torch.Generator().manual_seed(cfg["seed"]))
    else:
        base = torch.load(cfg["cache"], mmap=True, weights_only=True).reshape(-1)  # pages shared, not copied
        n = base.numel()
    if sum(cfg["sizes"]) != n:
        raise SystemExit(f"piece sizes add up to {sum(cfg['sizes'])}, the vector has {n} elements")
    gen = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    x = torch.empty(n, dtype=torch.float32)
    for a in range(0, n, STEP):
        b = min(a + STEP, n)
        z = torch.randn(b - a, generator=gen).mul_(cfg["spread"]).add_(1.0)
        torch.mul(base[a:b].float(), z, out=x[a:b])
    del base, z

    # the exact mean, on rank 0 only (reduced chunk by chunk through torch.distributed: not counted)
    exact = torch.empty(n, dtype=torch.float32) if lead else None
    for a in range(0, n, STEP):
        b = min(a + STEP, n)
        part = x[a:b].clone()
        dist.reduce(part, dst=0)
        if lead:
            exact[a:b] = part.div_(world)
    del part
    exact_norm = float(exact.norm()) if lead else 0.0

    def rel_err(y: torch.Tensor) -> float:
        sq = 0.0
        for a in range(0, n, STEP):
            b = min(a + STEP, n)
            sq += float((y[a:b] - exact[a:b]).pow(2).sum())
        return sq ** 0.5 / exact_norm

    work = torch.empty_like(x)
    # sum of the rounds' results (error feedback pays off over rounds)
    acc = torch.empty_like(x) if lead and not cfg["interleave"] else None
    pieces = list(work.split(cfg["sizes"]))
    say(f"{world} workers ready, {n:,} elements in {len(pieces)} pieces; peak RSS of rank 0 "
        f"{(peak_rss() or 0) / 2**30:.2f} GiB")

    def timed_rounds(fn, rounds: int, after=None) -> tuple[list[float], list[int], list[float]]:
        """Per round: the slowest worker's seconds, the mean bytes sent per worker, and after(round) on rank 0."""
        times, sent, extra = [], [], []
        for r in range(rounds):
            tr.barrier()
            before = tr.stats.bytes_sent
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            mine = tr.stats.bytes_sent - before
            if lead and after is not None:
                extra.append(after(r))
            everyone = tr.all_gather_object((dt, mine))  # control plane, not counted
            times.append(max(t for t, _ in everyone))
            sent.append(round(sum(s for _, s in everyone) / world))
        return times, sent, extra

    def one_round(codec, chain: str = "") -> None:
        work.copy_(x)
        tr.caps = replace(tr.caps, overlaps_exchange=overlaps and SERIAL not in chain,
                          settings_agreed=SIZED not in chain)
        if codec is None:
            all_reduce_(tr, pieces, op="mean")
        else:
            weighted_mean(tr, pieces, 1.0, codec, key=KEY)

    def check(r: int) -> float:
        if r == 0:
            acc.copy_(work)
        else:
            acc.add_(work)
        return rel_err(work)

    def row_of(chain: str, times: list[float], sent: list[int], errs: list[float], err_avg) -> dict:
        row = {"chain": chain, "warmup_s": times[0], "round_s": statistics.median(times[1:]), "times": times[1:],
               "bytes_sent": int(statistics.median(sent[1:])), "bytes_all": sent, "errs": errs, "err_avg": err_avg}
        if lead:
            mean = "n/a" if err_avg is None else f"{err_avg:.2e}"
            say(f"{chain:24s} {fmt_s(row['round_s']):>9s} s/round  {fmt_b(row['bytes_sent']):>10s} sent/worker  "
                f"err {errs[0]:.2e} -> {errs[-1]:.2e}, of the mean of the rounds {mean}")
        return row

    rows = []
    rounds = 1 + cfg["repeats"]
    if cfg["interleave"]:  # round r of every chain, then round r + 1: side by side, in the same machine state
        codecs = {c: None if c == "fp32" else make_codec(base_chain(c)) for c in cfg["chains"]}
        got: dict[str, tuple[list, list, list]] = {c: ([], [], []) for c in cfg["chains"]}
        for _ in range(rounds):
            for chain, codec in codecs.items():
                one = timed_rounds(lambda: one_round(codec, chain), 1, lambda _: rel_err(work))
                for into, value in zip(got[chain], one):
                    into += value
        rows = [row_of(c, *got[c], None) for c in cfg["chains"]]
        del codecs
    else:
        for chain in cfg["chains"]:
            codec = None if chain == "fp32" else make_codec(base_chain(chain))
            times, sent, errs = timed_rounds(lambda: one_round(codec, chain), rounds, check)
            rows.append(row_of(chain, times, sent, errs, rel_err(acc.div_(rounds)) if lead else None))
            codec = None  # drop its error-feedback state before the next chain

    demo = []
    for k, size in cfg["demo_bytes"].items():
        payload = bytes(size)
        for sized in ([False, True] if cfg["exchange_sizes"] else [False]):  # DeMo states its payloads' size
            tr.caps = replace(tr.caps, settings_agreed=not sized)
            times, sent, _ = timed_rounds(lambda: tr.all_gather_bytes(payload, [size] * world), 1 + cfg["repeats"])
            demo.append({"topk": f"{k}{SIZED if sized else ''}", "payload": size, "step_s": statistics.median(times[1:]),
                         "times": times[1:], "bytes_sent": int(statistics.median(sent[1:]))})
            say(f"DeMo k={demo[-1]['topk']:<18} {fmt_s(demo[-1]['step_s']):>9s} s/step   "
                f"{fmt_b(demo[-1]['bytes_sent']):>10s} sent/worker")
        tr.caps = replace(tr.caps, settings_agreed=True)

    peaks = tr.all_gather_object(peak_rss())
    tr.barrier()
    if lead:
        Path(cfg["result"]).write_text(json.dumps({"rows": rows, "demo": demo, "peak_rss": peaks, "numel": n,
                                                   "pieces": len(pieces), "threads": torch.get_num_threads()}))
    tr.close()


# ---- parent: launch, watch, report --------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _netlab():
    """The network lab of the tests (``tests/netlab.py``): namespaces, a switch, token-bucket links."""
    sys.path.insert(0, str(ROOT / "tests"))
    import netlab

    return netlab


def launch(cfg: dict, procs: int, timeout: float, tmp: Path, link: float = 0.0, delay: float = 0.0) -> dict:
    """Run the workers (on 127.0.0.1, or each in a lab host behind a link of ``link`` bit/s, whose packets take
    ``delay`` seconds more each way) and return rank 0's results."""
    if not link:
        return _launch(cfg, procs, timeout, tmp, None)
    with _netlab().Lab() as lab:
        for rank in range(procs):
            if delay:
                lab.far(f"w{rank}", delay, link)
            else:
                lab.public(f"w{rank}")
                lab.shape(f"w{rank}", link)
        return _launch(cfg, procs, timeout, tmp, lab)


def _launch(cfg: dict, procs: int, timeout: float, tmp: Path, lab) -> dict:
    from diloco.comm.base import die_with_parent

    port = free_port()
    cfg_path = tmp / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    children: list[tuple[subprocess.Popen, Path | None]] = []
    start = time.monotonic()
    master = "127.0.0.1" if lab is None else lab.hosts["w0"]
    try:
        for rank in range(procs):
            env = dict(os.environ, MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(procs), LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(cfg["threads"]))
            if lab is not None:
                env["GLOO_SOCKET_IFNAME"] = "eth0"  # the host's link to the switch
            log = None if rank == 0 else tmp / f"rank{rank}.log"
            out = None if log is None else open(log, "w")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", str(cfg_path)]
            if lab is not None:
                p = lab.run(f"w{rank}", cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
            else:
                p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
            if out is not None:
                out.close()
            children.append((p, log))
        while True:
            codes = [p.poll() for p, _ in children]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                log = children[r][1]
                tail = log.read_text()[-3000:] if log is not None and log.exists() else "(its output is above)"
                raise SystemExit(f"[comm] worker {r} failed (exit {c}); stopping the others.\n{tail}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - start > timeout:
                raise SystemExit(f"[comm] the workers did not finish within --timeout {timeout:g}s; stopped them")
            time.sleep(0.5)
    finally:
        for p, _ in children:
            if p.poll() is None:
                p.kill()
        for p, _ in children:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    return json.loads(Path(cfg["result"]).read_text())


def render(res: dict, args, started: str, wall: float, load: tuple[float, float], demo_chunk: int,
           source: str) -> str:
    import torch

    from benchmarks.train_throughput import cpu_model
    from diloco.comm.base import Transport

    W, T, n = args.procs, args.tokens_per_step, res["numel"]
    where = (f"over {args.link / 1e9:g} Gbit/s links between network namespaces" if args.link else "on 127.0.0.1") + (
        f", {args.delay * 1e3:g} ms more each way on each link (a round trip between two workers: "
        f"{4 * args.delay * 1e3:g} ms)" if args.delay else "")
    rows, demo = res["rows"], res["demo"]
    peaks = [p for p in res["peak_rss"] if p]
    lines = [
        f"# Communication per round: {W} gloo processes {where}, {n / 1e6:.1f}M-parameter vector", "",
        f"- date: {started}",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs, shared with other jobs); "
        f"{res['threads']} torch thread(s) per worker",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.system()} {platform.release()}",
        f"- workers: {W} processes, `TorchDistTransport` (gloo) {where}; {wall:.0f} s wall for the whole run; "
        f"peak RSS per worker {fmt_b(max(peaks)) if peaks else 'n/a'}"
        + ("" if args.numel else " (the pages of the mmap'd cache count in each)"),
        f"- vector: {source}, sent as {res['pieces']} pieces (bucketed by the transport, "
        f"{Transport.bucket_bytes >> 20} MiB buckets); worker r's input is it times (1 + {args.spread:g} z_r), "
        "z_r Gaussian",
        f"- one warm-up round, then median of {args.repeats} timed rounds; a round is the slowest worker's time"
        + ("; the chains' rounds interleaved (round r of every chain, then round r + 1), and time / fp32 is the "
           "median of the per-round ratios" if args.interleave else ""),
        f"- load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f}",
        f"- command: `python benchmarks/comm.py {' '.join(sys.argv[1:])}`",
        "",
        ("Each worker in a network namespace of its own, its link to a switch limited to "
         f"{args.link / 1e9:g} Gbit/s each way (token buckets, `tests/netlab.py`); the processes still share "
         "the CPU cores, so CPU work counts too. " if args.link else
         "Loopback gloo among processes on shared CPU cores: the times measure CPU-bound encode / decode and "
         "memory copies (and the processes contending for the cores), not a network. ")
        + "Bytes are what a worker would put on a network, counted by the transport (dense all-reduce: the "
        "ring's 2 (W-1)/W x the buffer; byte collectives: the exact payloads).",
        "",
        "## DiLoCo outer round, by codec chain", "",
        "| chain | s / round (median) | time / fp32 | warm-up round s | bytes sent / worker / round | vs fp32 | "
        f"rel. error, first round | rel. error, last round | rel. error of the mean of the {1 + args.repeats} rounds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fp32 = next((r for r in rows if r["chain"] == "fp32"), None)
    for r in rows:
        ratio = f"{fmt_x(fp32['bytes_sent'] / r['bytes_sent'])} less" if fp32 and r is not fp32 else "1x"
        if fp32 is None:
            slower = "n/a"
        elif args.interleave:
            slower = f"{statistics.median(a / b for a, b in zip(r['times'], fp32['times'])):.2f}x"
        else:
            slower = f"{r['round_s'] / fp32['round_s']:.2f}x"
        mean = "n/a" if r["err_avg"] is None else f"{r['err_avg']:.2e}"
        lines.append(f"| {label(r['chain'])} | {fmt_s(r['round_s'])} | {slower} | {fmt_s(r['warmup_s'])} "
                     f"| {fmt_b(r['bytes_sent'])} | {ratio} | {r['errs'][0]:.2e} | {r['errs'][-1]:.2e} | {mean} |")
    lines += ["", "fp32 goes through the dense `all_reduce_` (its error is float summation order); the others through "
              "`weighted_mean` (encode each shard, all-to-all, decode + mean, re-encode, all-gather, decode). "
              "Top-k chains keep error feedback under one fixed key, and every round restarts from the same inputs: "
              "the first round starts with empty residuals, later rounds also send what earlier ones held back (so a "
              "single round's error does not shrink), and the mean of the rounds' results shows what error feedback "
              "delivers over time." + (" With interleaved chains the mean of the rounds is not kept (n/a)."
                                       if args.interleave else ""), ""]

    lines += ["## Per training step: DDP and DeMo", "",
              "| scheme | payload / step | bytes sent / worker / step | s / step (median) |", "|---|---:|---:|---:|"]
    if fp32:
        lines.append(f"| DDP (fp32 gradient all-reduce) | {fmt_b(4 * n)} | {fmt_b(fp32['bytes_sent'])} "
                     f"| {fmt_s(fp32['round_s'])} |")
    for d in demo:
        lines.append(f"| DeMo k={d['topk']} (chunk {demo_chunk}, `all_gather_bytes`) | {fmt_b(d['payload'])} "
                     f"| {fmt_b(d['bytes_sent'])} | {fmt_s(d['step_s'])} |")
    lines += ["", "DDP's row is the fp32 row above: the same collective on the same vector, once per step instead of "
              "once per round. DeMo's payload is `DeMo(...).bytes_per_step()` for the `150m` model's parameter shapes "
              "(independent of the vector above); its time is the all-gather alone (no DCT, top-k or decode). An "
              "all-gather sends the payload to each of the W-1 others, so DeMo's bytes per worker grow with W, "
              "while an all-reduce stays below 2x the buffer.", ""]

    hs = sorted({args.inner_steps, 500})
    lines += ["## Bytes per token trained, per worker", "",
              f"Assumption: {T:,} tokens per step per worker (`--tokens-per-step`, default 4 sequences x 2048 tokens); "
              f"DiLoCo syncs every H inner steps (H = {', '.join(map(str, hs))}). bytes/token = bytes sent per worker "
              "per sync / tokens a worker trains between syncs. Comm s/step spreads a round's time over its H steps.",
              "", "| scheme | sync every | bytes sent / worker / sync | bytes / token | DDP / this | comm s / step |",
              "|---|---:|---:|---:|---:|---:|"]
    ddp_bpt = fp32["bytes_sent"] / T if fp32 else None

    def row(name: str, every: int, sent: int, secs: float) -> str:
        bpt = sent / (every * T)
        vs = fmt_x(ddp_bpt / bpt) if ddp_bpt else "n/a"
        return (f"| {name} | {every} step{'s' if every > 1 else ''} | {fmt_b(sent)} | {fmt_num(bpt)} | {vs} "
                f"| {fmt_s(secs / every)} |")

    if fp32:
        lines.append(row("DDP (fp32 all-reduce)", 1, fp32["bytes_sent"], fp32["round_s"]))
    for d in demo:
        lines.append(row(f"DeMo k={d['topk']}", 1, d["bytes_sent"], d["step_s"]))
    for h in hs:
        for r in rows:
            lines.append(row(f"DiLoCo H={h}, {label(r['chain'])}", h, r["bytes_sent"], r["round_s"]))
    if n != sum(p.numel() for p in model_150m().parameters()):
        lines += ["", f"Note: the DDP and DiLoCo rows use the {n:,}-element vector of this run, DeMo's the `150m` "
                  "model's shapes; compare them only in a run on the 150M vector."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="gloo worker processes")
    p.add_argument("--chains", default=",".join(CHAINS), help="comma-separated codec chains (',' inside a stage: ';')")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up; the median is reported")
    p.add_argument("--numel", type=int, default=0, help="a Gaussian vector of N elements instead of the cache")
    p.add_argument("--cache", default=DEFAULT_CACHE, help="the 150m pseudo-gradient (made by benchmarks/codecs.py)")
    p.add_argument("--inner-steps", type=int, default=100, help="DiLoCo H for the bytes-per-token table (and 500)")
    p.add_argument("--tokens-per-step", type=int, default=4 * 2048, help="tokens per step per worker")
    p.add_argument("--demo-topk", default="32,8", help="DeMo top-k values per chunk")
    p.add_argument("--demo-chunk", type=int, default=64, help="DeMo chunk size")
    p.add_argument("--spread", type=float, default=0.5, help="per-worker multiplicative noise on the vector")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds before the workers are killed")
    p.add_argument("--collective-timeout", type=float, default=900, help="gloo timeout of one collective")
    p.add_argument("--interleave", action="store_true",
                   help="alternate the chains round by round (side by side ratios; no mean-of-rounds error)")
    p.add_argument("--serial", action="store_true",
                   help="also time each compressed chain with its buckets exchanged one after the other (rows "
                        f"ending '{SERIAL}'), against the default, which overlaps one bucket's transfer with "
                        "another's encode and decode")
    p.add_argument("--link", type=float, default=0.0,
                   help="bit/s: each worker in a network namespace of its own behind a link of this rate each way "
                        "(needs root and iproute2; tests/netlab.py); 0: loopback")
    p.add_argument("--delay", type=float, default=0.0,
                   help="seconds: with --link, each worker's link also delays every packet this long each way (a "
                        "delay line of tests/netlab.py, rate-limited itself), so a round trip between two workers "
                        "takes 4x this")
    p.add_argument("--exchange-sizes", action="store_true",
                   help=f"also time each compressed chain without zstd, and DeMo's all-gather, with the payload "
                        f"sizes exchanged before every transfer (rows ending '{SIZED}'), as where the workers' "
                        "settings were not agreed; by default fixed-size payloads skip that exchange")
    p.add_argument("--out", default=None, help="also write the Markdown report here")
    p.add_argument("--_worker", dest="worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    if args.procs < 2 or args.repeats < 1 or args.numel < 0 or args.tokens_per_step < 1 or args.inner_steps < 1:
        p.error("need --procs >= 2, --repeats >= 1, --numel >= 0, --tokens-per-step >= 1, --inner-steps >= 1")
    if args.delay and not args.link:
        p.error("--delay needs --link (the delay line carries the link's rate too)")
    if args.link:
        why = _netlab().unavailable()
        if why:
            p.error(f"--link needs a network lab, and this machine cannot make one: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally that kills the workers

    import torch

    from diloco.compress import make_codec

    chains = [c.strip().replace(";", ",") for c in args.chains.split(",") if c.strip()]
    for c in chains:
        make_codec(c)  # a bad chain fails here, before any process starts
    if args.serial:  # each compressed chain again, its buckets exchanged one after the other
        chains = [x for c in chains for x in ([c] if c == "fp32" else [c, c + SERIAL])]
    if args.exchange_sizes:  # each fixed-size chain again, with the size exchanges a fixed size makes needless
        chains = [x for c in chains for x in ([c] if c == "fp32" or "zstd" in c else [c, c + SIZED])]
    topks = [int(k) for k in args.demo_topk.split(",") if k.strip()]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.monotonic()

    if args.numel:
        n = args.numel
        sizes = [min(PIECE, n - a) for a in range(0, n, PIECE)]
        source = f"synthetic Gaussian, {n:,} elements (seed {args.seed})"
    else:
        cache = Path(args.cache)
        if not cache.is_absolute():
            cache = ROOT / cache
        if not cache.exists():
            from benchmarks.codecs import pseudo_gradient

            print(f"[comm] {cache} is missing: making it (4 AdamW steps of the 150m model)", flush=True)
            pseudo_gradient("150m", 4, torch.device("cpu"), 0, cache)
        sizes = [q.numel() for q in model_150m().parameters()]
        n = torch.load(cache, mmap=True, weights_only=True).numel()
        if sum(sizes) != n:
            p.error(f"{cache} holds {n:,} values, the 150m model has {sum(sizes):,} parameters")
        source = f"the 150m pseudo-gradient `{args.cache}` (4 AdamW steps, from benchmarks/codecs.py)"
    dbytes = demo_bytes(topks, args.demo_chunk)
    print(f"[comm] {args.procs} workers, {n:,} elements, chains {', '.join(chains)}; DeMo payloads "
          + ", ".join(f"k={k}: {fmt_b(b)}" for k, b in dbytes.items()), flush=True)

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory(prefix="loco-comm-") as tmp:
        cfg = {"chains": chains, "repeats": args.repeats, "numel": args.numel, "cache": str(ROOT / args.cache),
               "sizes": sizes, "seed": args.seed,
               "spread": args.spread, "threads": args.threads, "collective_timeout": args.collective_timeout,
               "demo_bytes": dbytes, "result": str(Path(tmp) / "result.json"), "interleave": args.interleave,
               "exchange_sizes": args.exchange_sizes}
        res = launch(cfg, args.procs, args.timeout, Path(tmp), args.link, args.delay)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = render(res, args, started, time.monotonic() - t0, (load_before, load_after), args.demo_chunk, source)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
