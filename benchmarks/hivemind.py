"""Averaging a pseudo-gradient among internet peers (hivemind) and among gloo processes, side by side.

``--peers`` processes (this script re-invoked with a hidden ``--role``) average the same
vector per codec chain, first as one gloo group (:class:`TorchDistTransport`, the torchrun
path), then as hivemind peers (:class:`HivemindTransport`, the `loco join` path), all on
127.0.0.1:

* the vector: the cached 150M pseudo-gradient of ``benchmarks/codecs.py``
  (``benchmarks/results/.cache/pseudo_grad_150m.pt``) when it exists, else (or with ``--numel``)
  a Gaussian vector; peer r multiplies it by ``1 + 0.5 z_r`` (``z_r`` Gaussian, seeded by r);
* per chain: one warm-up round, then ``--repeats`` timed ones. A round's time is the slowest
  peer's (hivemind: from the call, matchmaking included, to the average in hand); bytes are the
  transport's ``stats.bytes_sent`` per peer per round. gloo runs fp32 through the dense ring
  all-reduce and other chains through the compressed all-reduce (reduce-scatter of shards,
  re-encode, all-gather); hivemind has each peer encode its update once and push it to every
  other member over a libp2p stream, then every member decodes all of them (validation, norm
  clipping, weighted mean);
* on one machine the times measure CPU-bound encode / decode and copies through the p2pd
  daemons (TLS, yamux) of processes sharing the cores, not a network.

    python benchmarks/hivemind.py --numel 4000000 --repeats 2               # quick look
    python benchmarks/hivemind.py --out benchmarks/results/hivemind_cpu.md  # the 150M vector
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# run as a script, this file's folder comes first on sys.path, where it would shadow the hivemind package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

from benchmarks.comm import free_port, peak_rss, start_peak  # noqa: E402

CACHE = ROOT / "benchmarks/results/.cache/pseudo_grad_150m.pt"
CHAINS = ["fp32", "int8", "topk:0.02+2bit+zstd"]


def load_vector(args, rank: int):
    import torch

    if args.numel:
        base = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    else:
        base = torch.load(CACHE, mmap=True, weights_only=True).reshape(-1)
    z = torch.randn(base.numel(), generator=torch.Generator().manual_seed(1000 + rank))
    return base.float() * z.mul_(0.5).add_(1.0)


def emit(**row) -> None:
    print("ROW " + json.dumps(row), flush=True)


def role_gloo(args) -> None:
    import torch

    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress import make_codec
    from diloco.compress.collective import all_reduce_, weighted_mean

    torch.set_num_threads(1)
    t = TorchDistTransport(backend="gloo", timeout=1800)
    x = load_vector(args, t.rank)
    for chain in args.chains:
        codec = make_codec(chain)
        for r in range(1 + args.repeats):
            y = x.clone()
            t.barrier()
            rss = start_peak()
            before, start = t.stats.bytes_sent, time.perf_counter()
            if chain == "fp32":
                all_reduce_(t, [y], op="mean")
            else:
                weighted_mean(t, [y], 1.0, codec, key="bench")
            emit(transport="gloo", chain=chain, round=r, rank=t.rank, s=time.perf_counter() - start,
                 bytes=t.stats.bytes_sent - before, numel=x.numel(), peak_rss=peak_rss(),
                 round_peak=None if rss is None else peak_rss() - rss)
            del y
    t.close()


def role_hivemind(args) -> None:
    import torch

    from diloco.comm.hivemind import HivemindTransport
    from diloco.compress import make_codec
    from diloco.compress.collective import weighted_mean

    torch.set_num_threads(1)
    rank, folder = args.rank, Path(args.dir)
    addr = folder / "peer0.addr"
    if rank == 0:
        t = HivemindTransport("bench", matchmaking_time=60, exchange_timeout=1800, norm_clip=0)
        addr.write_text("\n".join(t.visible_maddrs()))
    else:
        while not addr.is_file():
            time.sleep(0.1)
        t = HivemindTransport("bench", initial_peers=addr.read_text().split(), matchmaking_time=60,
                              exchange_timeout=1800, norm_clip=0)
    (folder / f"ready{rank}").touch()
    while len(list(folder.glob("ready*"))) < args.peers:
        time.sleep(0.1)
    for chain in args.chains:
        codec = make_codec(chain)
        for r in range(1 + args.repeats):
            y = load_vector(args, rank)  # afresh each round (not timed): one copy of the vector per peer
            rss = start_peak()
            before, start = t.stats.bytes_sent, time.perf_counter()
            weighted_mean(t, [y], 1.0, codec, key="bench")
            emit(transport="hivemind", chain=chain, round=r, rank=rank, s=time.perf_counter() - start,
                 bytes=t.stats.bytes_sent - before, numel=y.numel(), members=len(t.take_report().members),
                 peak_rss=peak_rss(), round_peak=None if rss is None else peak_rss() - rss)
            del y
    t.close()


def launch(args, role: str, folder: str) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(args.peers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.peers), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", HIVEMIND_LOGLEVEL="ERROR")
        cmd = [sys.executable, __file__, "--role", role, "--rank", str(rank), "--dir", folder,
               "--peers", str(args.peers), "--repeats", str(args.repeats), "--chains", ",".join(args.chains)]
        if args.numel:
            cmd += ["--numel", str(args.numel)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=args.timeout)
        if p.returncode:
            raise SystemExit(f"a {role} peer failed (exit {p.returncode})")
        rows += [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
        print(f"[hivemind-bench] {role}: {sum(1 for line in out.splitlines() if line.startswith('ROW '))} rows",
              flush=True)
    return rows


def table(args, rows: list[dict], wall: float) -> str:
    import torch

    numel = rows[0]["numel"]
    lines = [
        f"# Averaging among {args.peers} peers on 127.0.0.1: hivemind (`loco join`) next to gloo (torchrun)",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; CPU: {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} logical CPUs, shared by all peers and their p2pd daemons); torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        f"- vector: {numel / 1e6:.1f}M fp32 values "
        f"({'Gaussian' if args.numel else 'the 150m pseudo-gradient from benchmarks/codecs.py'}), peer r's input "
        f"times (1 + 0.5 z_r); one warm-up round, median of {args.repeats} timed rounds; a round is the slowest peer's",
        f"- command: `python benchmarks/hivemind.py {' '.join(sys.argv[1:])}`; {wall:.0f} s wall",
        "",
        "| chain | transport | s / round (median) | warm-up s | bytes sent / peer / round | vs fp32 (same transport) "
        "| peak RSS / peer (highest in a round) | a round's peak above its start / peer (x vector) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    fp32 = {}
    for chain in args.chains:
        for transport in ("gloo", "hivemind"):
            rs = [r for r in rows if r["chain"] == chain and r["transport"] == transport]
            if not rs:
                continue
            per_round = {}
            for r in rs:
                per_round.setdefault(r["round"], []).append(r)
            times = [max(x["s"] for x in per_round[k]) for k in sorted(per_round) if k > 0]
            sent = statistics.median(statistics.mean(x["bytes"] for x in per_round[k]) for k in per_round if k > 0)
            if chain == "fp32":
                fp32[transport] = sent
            ratio = f"{fp32[transport] / sent:.1f}x less" if transport in fp32 and sent and chain != "fp32" else "1x"
            warm = max(x["s"] for x in per_round[0])
            rss = max((x.get("peak_rss") or 0 for x in rs), default=0)
            peaks = [[x.get("round_peak") for x in per_round[k]] for k in sorted(per_round) if k > 0]
            added = (statistics.median(max(p) for p in peaks)
                     if peaks and all(None not in p for p in peaks) else None)
            lines.append(f"| `{chain}` | {transport} | {statistics.median(times):.2f} | {warm:.2f} | "
                         f"{sent / 1e6:.2f} MB | {ratio} | {f'{rss / 1e9:.2f} GB' if rss else '-'} | "
                         f"{'-' if added is None else f'{added / 1e6:.0f} MB ({added / (4 * numel):.1f}x)'} |")
    lines += ["", "gloo sends about 2 (W-1)/W of a payload per peer (reduce-scatter + all-gather); hivemind sends "
              "each peer's payload to the W-1 others (W-1 payloads), which a round with changing members can "
              "complete without every shard owner. Top-k's payload is small enough that encode and decode "
              "dominate either way.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--numel", type=int, default=0, help="a Gaussian vector of this size instead of the 150M cache")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chains", default=",".join(CHAINS))
    p.add_argument("--transports", default="gloo,hivemind")
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--out", default=None)
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.chains = args.chains.split(",")
    if args.role == "gloo":
        return role_gloo(args)
    if args.role == "hivemind":
        return role_hivemind(args)
    if not args.numel and not CACHE.is_file():
        raise SystemExit(f"{CACHE} is missing: run benchmarks/codecs.py once to make it, or pass --numel N")
    start = time.perf_counter()
    rows = []
    for transport in args.transports.split(","):
        with tempfile.TemporaryDirectory() as folder:
            rows += launch(args, transport, folder)
    text = table(args, rows, time.perf_counter() - start)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
