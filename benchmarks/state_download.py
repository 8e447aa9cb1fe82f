"""A joiner's state download over a network lab: how long until a new peer holds the run's state.

``--holders`` hosts, each on a link of ``--rate`` each way (token buckets on both ends of its cable), serve the
same state of the size of ``--model``'s shared DiLoCo state: its parameters and the outer optimizer's momentum,
both fp32, 8 bytes a parameter. A joiner on a link of ``--joiner-rate`` (0: the lab's veth, unshaped) joins
through the first holder, waits until the registry lists every holder, and downloads the state striped over
all of them (``HivemindTransport.download_state``). Printed per try: seconds, MB/s and each holder's share.

The lab (``tests/netlab.py``) is made of network namespaces: it needs root and iproute2. Each holder and the
joiner is this script re-invoked (``--role``) inside its host; all of them share this machine's cores, so a
small machine measures its own CPU (p2pd's encryption, copies through its unix socket) as much as the links.

With ``--peer-start``, the holders are `loco join` peers of ``--model``'s preset (built as `loco join` builds
them, with their state published, not training) and the joiner is the `loco join` command itself: the time is
from its start to its first training step (imports, the model, the DHT, the download, loading the state). The
data is a slice of the standard library's source (byte-level): ``150m`` has 121M parameters then, not 150M.

    sudo python benchmarks/state_download.py                              # 150m, 4 holders at 1 Gbit/s
    python benchmarks/state_download.py --model small --tries 3 --out benchmarks/results/state_download.md
    python benchmarks/state_download.py --peer-start --tries 2            # a 150m loco join, start to step
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
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
# run as a script, this file's folder would come first on sys.path, where benchmarks/hivemind.py shadows the
# hivemind package: the project, then the lab (tests/netlab.py), instead
sys.path[:] = [str(ROOT), str(ROOT / "tests"), *[p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]]
KEY = b"state-download-bench"
SEED = 20261123


def state_bytes(model: str) -> int:
    from dataclasses import replace

    from launch.models.transformer import SIZES
    from launch.plan.settings import VOCAB

    return 8 * replace(SIZES[model], vocab_size=VOCAB[model]).n_params


def blob_of(size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(SEED).bytes(size)


def serve(ip: str, size: int, addr_file: str, peers: list[str]) -> None:
    """A holder: publish the state and serve it until killed."""
    from diloco.comm.hivemind import HivemindTransport

    t = HivemindTransport("bench", host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=peers, run_key=KEY,
                          startup_timeout=60)
    t.adopted(1)
    t.publish_state(blob_of(size))
    hold(t, ip, addr_file)


def hold(t, ip: str, addr_file: str) -> None:
    """A holder that serves: it says so in the registry, writes its address in the lab for the others, and
    stays until killed."""
    t.heartbeat(holder=True)
    tmp = addr_file + ".tmp"
    Path(tmp).write_text("\n".join(a for a in t.visible_maddrs() if f"/ip4/{ip}/" in a))
    os.replace(tmp, addr_file)
    while True:
        time.sleep(3600)


def join_args(model: str) -> list[str]:
    """`loco join` arguments of the --peer-start runs: the model's preset on a slice of the standard library,
    one short sequence a step, a log line every step, no evaluation, no checkpoints."""
    sets = ["data.source=stdlib", "data.max_docs=40", "data.seq_len=64", "run.batch_size=1", "run.grad_accum=1",
            "log.every=1", "log.progress=plain", "log.plot=false", "run.eval_every=0", "run.checkpoint_every=0",
            "run.device=cpu", "run.compile=false"]
    return ["--config", str(ROOT / "configs" / f"{model}.yaml"), "--run-key", KEY.decode(),
            *[a for kv in sets for a in ("--set", kv)]]


def serve_peer(ip: str, model: str, addr_file: str, peers: list[str], run_dir: str) -> None:
    """A holder built as `loco join` builds a peer (it downloads the run's state when it has --peers, and
    publishes its own), serving until killed without training."""
    from launch.cli.commands import _load, build_parser
    from launch.join.peer import JoinOptions, Peer

    cfg = _load(build_parser().parse_args(["join", *join_args(model), "--run-dir", run_dir]))
    hold(Peer(cfg, JoinOptions(peers=peers, run_key=KEY, host=ip)).transport, ip, addr_file)


def fetch(ip: str, size: int, peers: list[str], holders: int) -> None:
    """The joiner: wait for every holder in the registry, download, print one JSON line."""
    import hashlib

    from diloco.comm.hivemind import HivemindTransport

    t = HivemindTransport("bench", host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=peers, run_key=KEY,
                          startup_timeout=60)
    try:
        end = time.time() + 120
        while sum(1 for v in t.peers().values() if v.get("holder")) < holders and time.time() < end:
            time.sleep(0.5)
        t0 = time.perf_counter()
        got = t.download_state(min_round=1)
        seconds = time.perf_counter() - t0
        ok = got is not None and hashlib.sha256(got[1]).digest() == hashlib.sha256(blob_of(size)).digest()
        print(json.dumps({"seconds": seconds, "ok": ok, "sources": t.state_sources}), flush=True)
    finally:
        t.close()


def one_try(args, size: int) -> dict:
    import netlab

    with netlab.Lab() as lab, tempfile.TemporaryDirectory() as tmp:
        ips = [lab.public(f"h{k}") for k in range(args.holders)]
        joiner = lab.public("j")
        for k in range(args.holders):
            lab.shape(f"h{k}", args.rate)
        if args.joiner_rate:
            lab.shape("j", args.joiner_rate)
        me = [sys.executable, os.path.abspath(__file__), "--size", str(size), "--model", args.model]
        role = "serve-peer" if args.peer_start else "serve"
        first: list[str] = []
        for k, ip in enumerate(ips):
            addr = os.path.join(tmp, f"h{k}.addr")
            peers = [a for p in first for a in ("--peer", p)]
            lab.run(f"h{k}", [*me, "--role", role, "--ip", ip, "--addr-file", addr, "--run-dir",
                              os.path.join(tmp, f"h{k}"), *peers],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            if k == 0 or k == args.holders - 1:  # the first one's address is the others'; then all of them
                for j in range(k + 1):
                    wait_file(os.path.join(tmp, f"h{j}.addr"), f"holder h{j}")
            if not first:
                first = Path(addr).read_text().split()[:1]
        if args.peer_start:
            return start_to_step(lab, args, joiner, first, tmp)
        p = lab.run("j", [*me, "--role", "fetch", "--ip", joiner, "--holders", str(args.holders),
                          *[a for p in first for a in ("--peer", p)]], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        out, _ = p.communicate(timeout=900)
        line = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not line:
            raise SystemExit(f"the joiner printed no result (exit {p.returncode})")
        return json.loads(line[-1])


def wait_file(path: str, what: str, timeout: float = 600) -> None:
    end = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > end:
            raise SystemExit(f"{what} did not start within {timeout:.0f} s")
        time.sleep(0.2)


def start_to_step(lab, args, joiner: str, first: list[str], tmp: str) -> dict:
    """`loco join` in the joiner's host, timed from its start to its state download and its first step."""
    cmd = [sys.executable, "-m", "launch.cli", "join", *join_args(args.model), "--host", joiner, "--max-steps", "1",
           "--run-dir", os.path.join(tmp, "joiner"), *[a for p in first for a in ("--peers", p)]]
    t0 = time.perf_counter()
    p = lab.run("j", cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    marks: dict = {}
    for line in p.stdout:
        now = time.perf_counter() - t0
        if "downloaded the run's state" in line:
            marks["download_done_s"] = now
        elif "loss" in line and "download_done_s" in marks and "first_step_s" not in marks:
            marks["first_step_s"] = now
            break
    p.kill()
    if "first_step_s" not in marks:
        raise SystemExit(f"the joiner did not reach a training step: {marks}")
    return {"seconds": marks["first_step_s"], "ok": True, "sources": {}, **marks}


def report_peer_start(args, size: int) -> None:
    rows = []
    for k in range(args.tries):
        r = one_try(args, size)
        rows.append((r["download_done_s"], r["first_step_s"]))
        print(f"try {k + 1}: state downloaded {r['download_done_s']:.1f} s after the start, first step at "
              f"{r['first_step_s']:.1f} s", flush=True)
    lines = [*heading(args, f"`loco join` of `{args.model}` (standard-library data)", "from the command's start"),
             "| try | state downloaded (s) | first training step (s) |",
             "| --- | --- | --- |",
             *[f"| {k + 1} | {d:.1f} | {f:.1f} |" for k, (d, f) in enumerate(rows)],
             "",
             f"Median first step: {statistics.median(f for _, f in rows):.1f} s after `loco join` started."]
    report(lines, args.out)


def heading(args, what: str, after: str = "") -> list[str]:
    """A report's title (what, the holders' and the joiner's links) and the machine it ran on."""
    joiner = f"{args.joiner_rate / 1e9:g} Gbit/s" if args.joiner_rate else "unshaped"
    return [f"# {what}, {args.holders} holders at {args.rate / 1e9:g} Gbit/s each, joiner {joiner}"
            + (f": {after}" if after else ""),
            "",
            f"{datetime.now(timezone.utc):%Y-%m-%d}, {platform.node() or 'this machine'}: {os.cpu_count()} cores, "
            f"Python {platform.python_version()}; every holder and the joiner on this one machine.",
            ""]


def report(lines: list[str], out: Optional[str]) -> None:
    print("\n".join(lines))
    if out:
        Path(out).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="150m", help="whose state size: tiny, small, 150m or 1b (default 150m)")
    ap.add_argument("--holders", type=int, default=4, help="peers serving the state (default 4)")
    ap.add_argument("--rate", type=float, default=1e9, help="each holder's link, bit/s (default 1e9)")
    ap.add_argument("--joiner-rate", type=float, default=0, help="the joiner's link, bit/s (0: unshaped)")
    ap.add_argument("--tries", type=int, default=1, help="labs built and downloads timed (default 1)")
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--role", choices=("serve", "serve-peer", "fetch"), help=argparse.SUPPRESS)
    ap.add_argument("--ip", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--peer-start", action="store_true",
                    help="time a real `loco join` from its start to its first step (holders: loco join peers)")
    ap.add_argument("--addr-file", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--peer", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "serve":
        return serve(args.ip, args.size, args.addr_file, args.peer)
    if args.role == "serve-peer":
        return serve_peer(args.ip, args.model, args.addr_file, args.peer, args.run_dir)
    if args.role == "fetch":
        return fetch(args.ip, args.size, args.peer, args.holders)

    import netlab

    why = netlab.unavailable()
    if why:
        raise SystemExit(f"no network lab here: {why}")
    size = state_bytes(args.model)
    if args.peer_start:
        return report_peer_start(args, size)
    rows = []
    for k in range(args.tries):
        r = one_try(args, size)
        shares = ", ".join(f"{v / size:.0%}" for v in sorted(r["sources"].values(), reverse=True))
        rows.append((r["seconds"], r["ok"], shares))
        print(f"try {k + 1}: {r['seconds']:.1f} s, {size / r['seconds'] / 1e6:.0f} MB/s, hash ok: {r['ok']}, "
              f"holders' shares: {shares}", flush=True)
    med = statistics.median(s for s, _, _ in rows)
    lines = [*heading(args, f"State download: `{args.model}` state ({size / 1e9:.2f} GB)"),
             "| try | seconds | MB/s | hash ok | holders' shares |",
             "| --- | --- | --- | --- | --- |",
             *[f"| {k + 1} | {s:.1f} | {size / s / 1e6:.0f} | {ok} | {sh} |" for k, (s, ok, sh) in enumerate(rows)],
             "",
             f"Median: {med:.1f} s ({size / med / 1e6:.0f} MB/s); the links allow "
             f"{min(args.holders * args.rate, args.joiner_rate or float('inf')) / 8e6:.0f} MB/s."]
    report(lines, args.out)


if __name__ == "__main__":
    main()
