"""The ``loco`` command: train | simulate | join | sample | eval | plot | status | plan | tokenizer | data | export.

Also runs as ``python -m launch.cli ...`` (for torchrun: ``torchrun --nproc-per-node 2 -m launch.cli train ...``).
A user mistake (bad config, missing data, unusable checkpoint) prints one line
naming the problem and exits with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from launch.cli.data import add_data_commands, cmd_data, cmd_tokenizer
from launch.cli.evaluate import add_eval_command, main_eval
from launch.cli.export import add_model_commands, cmd_export

EXAMPLES = {
    "train": """examples:
  loco train --config configs/tiny.yaml
  loco train --config configs/tiny.yaml --set optim.lr=1e-3 --max-time 90s --run-dir runs/mine
  loco train --run-dir runs/mine --resume
  loco train --run-dir runs/mine --restart        # start runs/mine over from step 0 (old files moved aside)
  torchrun --nproc-per-node 2 -m launch.cli train --config configs/tiny.yaml --set algo.name=ddp""",
    "simulate": """examples:
  loco simulate                                   # the demo: 4 DiLoCo workers vs DDP, tiny model
  loco simulate --workers 8 --set algo.inner_steps=50 --bandwidth 100Mbit --latency 50ms
  loco simulate --speeds 1,1,0.5,0.25 --set sync.mode=time --set sync.time_budget_s=5s
  loco simulate --config tiny --set algo.name=streaming --set algo.fragments=4 --baseline none
  loco simulate --links configs/links-home-uplink.csv --step-time 30   # home uplinks through a day
  loco simulate --workers 8 --step-time 2 --churn poisson:mtbf=10m,rejoin=2m   # workers leave and come back""",
    "join": """examples:
  loco join --config tiny --port 31337                       # start a run; prints the line others paste
  loco join --config tiny --peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
  loco join --config tiny --run-key-file run.key --peers ... --max-steps 2000""",
    "sample": """examples:
  loco sample --checkpoint runs/mine --prompt "def main():"
  loco sample --checkpoint runs/mine/checkpoints/step_00000600.pt --prompt "import " --max-new-tokens 300""",
    "plot": """examples:
  loco plot runs/ddp runs/diloco --out compare.png""",
    "plan": """examples:
  loco plan --model 150m --workers 8 --bandwidth 100Mbit --latency 40ms --step-time 0.5
  loco plan --model 1.1e9 --workers 16 --bandwidth 1Gbit --latency 80ms --check
  loco plan --model 1b --workers 32 --links configs/links-home-uplink.csv --step-time 2""",
    "status": """examples:
  loco status --peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
  loco status --run fineweb-1b --run-key-file run.key --peers ... --json""",
}


class UserError(Exception):
    """Raised for mistakes the user can fix; printed without a traceback."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from diloco.comm import TransportError
    from diloco.extras import MissingExtra
    from launch.store.checkpoint import CheckpointError
    from launch.config import ConfigError
    from launch.errors import RunError
    from launch.plan.settings import PlanError
    from launch.data.tokens import DataError

    return (UserError, ConfigError, DataError, RunError, CheckpointError, TransportError, MissingExtra, PlanError)


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML file of differences from the defaults; repeat to layer files (e.g. --config configs/tiny.yaml)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="override one key after the files, e.g. --set optim.lr=3e-4 (repeatable)")
    g.add_argument("--run-dir", metavar="DIR", help="run folder (default runs/<run.name>-<time>), e.g. --run-dir runs/exp1")
    g.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps, e.g. --max-steps 600")
    g.add_argument("--max-time", metavar="DURATION",
                   help="train until this much time is spent, then evaluate and save, e.g. --max-time 90s or 24h")
    g.add_argument("--seed", type=int, metavar="N", help="seed for initialisation and data order, e.g. --seed 1")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in --run-dir (skips a broken one, saying so)")
    g.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="continue from this checkpoint file (its run folder unless --run-dir says another); the "
                        "folder's later checkpoints are moved aside, e.g. --resume-from runs/mine/checkpoints/step_00000400.pt")
    g.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning, then exit")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="loco", formatter_class=fmt,
        description="Low-communication training of language models: DDP, DiLoCo, Streaming DiLoCo, SparseLoCo and "
                    "DeMo over torchrun, internet peers, or N workers simulated on one device.",
        epilog="quick start:\n  loco train --config configs/tiny.yaml    # a tiny model on the Python standard library\n"
               "  loco <command> --help                     # flags of one command, with examples")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train (one process, or each rank under torchrun)", formatter_class=fmt,
                       description="Train a model. Under torchrun every rank is one worker (gloo on CPU, NCCL on GPU).",
                       epilog=EXAMPLES["train"])
    _add_training_flags(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved settings, the data, the model and the memory a process needs, then exit")

    _add_restart_flag(p)

    p = sub.add_parser("simulate", help="simulate N workers on one device", formatter_class=fmt,
                       description="Run N workers in one process with the same algorithm objects as real runs, "
                                   "on a virtual clock with per-worker speeds and a network model. With no --config "
                                   "it runs the demo preset configs/simulate.yaml (tiny model, 4 DiLoCo workers, "
                                   "then DDP on the same tokens for comparison).",
                       epilog=EXAMPLES["simulate"])
    _add_training_flags(p)
    g = p.add_argument_group("simulation (each sets a sim.* key)")
    g.add_argument("--workers", type=int, metavar="N", help="number of simulated workers (sim.workers), e.g. --workers 8")
    g.add_argument("--speeds", metavar="LIST", help="relative speed of each worker (sim.speeds), e.g. --speeds 1,1,0.5,0.25")
    g.add_argument("--speed-dist", metavar="DIST",
                   help="draw speeds from lognormal:SIGMA or uniform:LOW (sim.speed_dist), e.g. --speed-dist lognormal:0.5")
    g.add_argument("--bandwidth", metavar="RATE", help="per-worker link (sim.bandwidth), e.g. --bandwidth 1Gbit or 100Mbit/s")
    g.add_argument("--latency", metavar="DURATION", help="one-way latency (sim.latency), e.g. --latency 80ms")
    g.add_argument("--step-time", metavar="DURATION",
                   help="virtual compute seconds per step at speed 1, fixed instead of the median of the measured steps "
                   "(sim.step_time), e.g. --step-time 0.25")
    g.add_argument("--links", metavar="FILE",
                   help="replay per-worker bandwidth and latency over virtual time from a trace (sim.links), "
                        "e.g. --links configs/links-home-uplink.csv")
    g.add_argument("--churn", metavar="SPEC",
                   help="workers leave and come back (sim.churn): a trace file (time or round, worker, leave|join) "
                        "or a distribution, e.g. --churn poisson:mtbf=30m,rejoin=5m")
    g.add_argument("--offload", action="store_true", default=None,
                   help="keep idle workers' state off the accelerator (sim.offload)")
    g.add_argument("--baseline", choices=["ddp", "none"],
                   help="also simulate DDP on the same tokens and compare (sim.baseline), e.g. --baseline none")
    _add_restart_flag(p)

    p = sub.add_parser("join", help="join (or start) a run of internet peers", formatter_class=fmt,
                       description="Train together with peers over hivemind.", epilog=EXAMPLES["join"])
    _add_training_flags(p)
    g = p.add_argument_group("swarm")
    g.add_argument("--peers", nargs="*", default=[], metavar="MULTIADDR",
                   help="multiaddrs of peers already in the run; none starts a new run")
    _add_swarm_flags(g)
    g.add_argument("--address-file", metavar="FILE", help="also write this peer's multiaddrs there, one a line")
    g.add_argument("--host", default="0.0.0.0", help="interface to listen on, e.g. --host 127.0.0.1 (default all)")
    g.add_argument("--port", type=int, default=0, help="TCP port to listen on (default: any free port), e.g. --port 31337")
    g.add_argument("--announce", nargs="*", default=[], metavar="MULTIADDR",
                   help="public addresses to announce (behind NAT or a port forward), e.g. --announce /ip4/203.0.113.5/tcp/31337")
    g.add_argument("--identity", metavar="FILE",
                   help="peer identity key, created on first use (default RUN_DIR/identity.key); keep it private")
    g.add_argument("--no-relay", dest="use_relay", action="store_false",
                   help="do not use libp2p circuit relays to reach peers behind NAT")
    g.add_argument("--auto-relay", action="store_true", help="find and use relays automatically when behind NAT")
    g.add_argument("--upnp", action="store_true", help="ask the router to forward a port (UPnP / NAT-PMP)")
    g.add_argument("--client-mode", action="store_true",
                   help="this peer takes no incoming connections (behind NAT, no port forward): it joins groups "
                        "that a reachable peer leads, and its updates reach other such peers through a member")
    g.add_argument("--matchmaking-time", default="5", metavar="SECONDS|auto",
                   help="how long the first peer at a round waits for the others, e.g. --matchmaking-time 10; "
                        "auto: 3x how long recent groups took to form, 5-60 s")
    g.add_argument("--round-timeout", default="auto", metavar="SECONDS|auto",
                   help="how long a round waits for members' updates before going on without them; auto (the "
                        "default): 3x the time the round's bytes take at this peer's measured rate, 10-600 s "
                        "(60 s until it has measured one), e.g. --round-timeout 120 to fix it")
    g.add_argument("--norm-clip", type=float, default=10.0, metavar="X",
                   help="an update whose norm is above X times the median of the others' is clipped (0: off)")
    g.add_argument("--clip-action", choices=["clip", "drop"], default="clip",
                   help="scale such an update down to the bound, or leave it out")
    g.add_argument("--weight-clip", type=float, default=10.0, metavar="X",
                   help="an update counts at most X times the median of the others' weights (tokens of their "
                        "round), whatever its peer announces (0: off)")

    p = sub.add_parser("sample", help="generate text from a checkpoint", formatter_class=fmt,
                       description="Generate text from a trained checkpoint.", epilog=EXAMPLES["sample"])
    p.add_argument("--checkpoint", "--run-dir", dest="checkpoint", required=True, metavar="PATH",
                   help="a checkpoint file, or a run folder (its newest valid checkpoint), e.g. --checkpoint runs/exp1 "
                        "(--run-dir runs/exp1 says the same)")
    p.add_argument("--prompt", default="", help='text to continue, e.g. --prompt "def main():"')
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate, e.g. --max-new-tokens 300")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="sampling temperature; 0 is greedy, e.g. --temperature 0.5")
    p.add_argument("--top-k", type=int, default=50, metavar="K", help="sample among the K likeliest tokens (0: all), e.g. --top-k 20")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed, e.g. --seed 3")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda, e.g. --device cpu")

    add_data_commands(sub, fmt)
    add_model_commands(sub, fmt)
    add_eval_command(sub, fmt)

    p = sub.add_parser("plot", help="plot loss vs tokens and vs bytes for run folders", formatter_class=fmt,
                       description="Draw loss vs tokens and loss vs bytes communicated for one or more runs into a PNG.",
                       epilog=EXAMPLES["plot"])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders holding metrics.jsonl")
    p.add_argument("--out", default="loss.png", metavar="PNG", help="output file, e.g. --out compare.png")
    p.add_argument("--title", help="figure title")

    p = sub.add_parser("plan", help="predict bytes, time and utilization per setting; recommend one",
                       formatter_class=fmt,
                       description="Predict, for DDP, DiLoCo and Streaming DiLoCo at several H, codecs and fragment "
                                   "counts, SparseLoCo at several H and densities, and DeMo at several k, the bytes "
                                   "per round, the time per round and the compute utilization on the given link (as "
                                   "the simulator counts them), with the loss penalty loco measured; recommend the "
                                   "setting that sends the fewest bytes at >= 95% utilization.",
                       epilog=EXAMPLES["plan"])
    p.add_argument("--model", required=True, metavar="SIZE",
                   help="a named size (tiny, small, 150m, 1b) or a parameter count, e.g. --model 150m or 1.1e9")
    p.add_argument("--workers", required=True, type=int, metavar="N", help="number of workers, e.g. --workers 8")
    p.add_argument("--bandwidth", metavar="RATE", help="per-worker link, e.g. --bandwidth 100Mbit or 50MB/s")
    p.add_argument("--latency", metavar="DURATION", help="one-way latency, e.g. --latency 40ms")
    p.add_argument("--step-time", metavar="DURATION",
                   help="compute seconds per training step of one worker (default 1s, assumed), e.g. --step-time 0.5")
    p.add_argument("--links", metavar="FILE",
                   help="a link trace (CSV or YAML: time, worker, bandwidth, latency); the plan uses the link "
                        "the simulator times (the slowest member's at each moment, averaged over the run), "
                        "e.g. --links configs/links-home-uplink.csv")
    p.add_argument("--shard", type=int, metavar="G",
                   help="also print what one process holds (parameters, gradients, optimizer and algorithm state) "
                        "when G processes shard each worker (run.shard: fsdp), e.g. --shard 8")
    p.add_argument("--check", action="store_true",
                   help="also simulate the recommendation on the tiny model and print predicted and simulated "
                        "utilization side by side")

    p = sub.add_parser("status", help="peers, throughput and contributions of a run", formatter_class=fmt,
                       description="Show the peers of a run of internet peers.", epilog=EXAMPLES["status"])
    p.add_argument("--peers", nargs="*", default=[], metavar="MULTIADDR", help="a peer of the run")
    _add_swarm_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def _add_restart_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--restart", action="store_true",
                   help="start the run in --run-dir over from step 0 with its config.yaml; its checkpoints and "
                        "metrics are moved to RUN_DIR/discarded-<time>/ (e.g. when none of them can be read)")


def _seconds_or_auto(flag: str, text: Any) -> Optional[float]:
    """A deadline flag's value: positive seconds, or None for ``auto`` (the peer derives it from what it
    measures). Checked before the config loads, so a typo costs one line and no start-up."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not (0 < seconds < float("inf")):
        raise UserError(f"{flag} {text}: expected a positive number of seconds or 'auto' "
                        f"(e.g. {flag} 120 or {flag} auto)")
    return seconds


def _add_swarm_flags(g) -> None:
    g.add_argument("--run", default="loco", metavar="NAME", help="the run's name (default loco), e.g. --run fineweb-1b")
    g.add_argument("--run-key", metavar="KEY", help="shared secret of a closed run ($LOCO_RUN_KEY also works)")
    g.add_argument("--run-key-file", metavar="FILE", help="read the run key from this file")


def _load(args: argparse.Namespace):
    from launch.config import load_config

    extra: dict[str, tuple[Any, str]] = {}
    for flag, key in (("run_dir", "run.dir"), ("max_steps", "run.max_steps"), ("max_time", "run.max_time"),
                      ("seed", "run.seed")):
        value = getattr(args, flag)
        if value is not None:
            extra[key] = (value, "--" + flag.replace("_", "-"))
    for flag, key in (("workers", "sim.workers"), ("speeds", "sim.speeds"), ("speed_dist", "sim.speed_dist"),
                      ("bandwidth", "sim.bandwidth"), ("latency", "sim.latency"), ("step_time", "sim.step_time"),
                      ("offload", "sim.offload"), ("baseline", "sim.baseline"), ("links", "sim.links"),
                      ("churn", "sim.churn")):
        value = getattr(args, flag, None)
        if value is not None:
            extra[key] = (value, "--" + flag.replace("_", "-"))
    _one_link(args)
    if getattr(args, "resume_from", None):
        chosen = Path(args.resume_from)
        if not chosen.is_file():
            raise UserError(f"--resume-from {chosen}: no such checkpoint file (a step_*.pt in a run's checkpoints/)")
        if not args.run_dir and chosen.parent.name == "checkpoints":
            args.run_dir = str(chosen.parent.parent)
            extra["run.dir"] = (args.run_dir, "--resume-from")
        extra["run.resume_from"] = (str(chosen), "--resume-from")
        args.resume = True
    if args.resume:
        extra["run.resume"] = (True, "--resume-from" if getattr(args, "resume_from", None) else "--resume")
    restart = getattr(args, "restart", False)
    if args.resume and restart:
        raise UserError("--resume continues the run and --restart starts it over: pass one of them")
    if (args.resume or restart) and not args.config and args.run_dir:
        saved = Path(args.run_dir) / "config.yaml"
        if not saved.is_file():  # a mistyped folder would otherwise start a new run with the default settings
            where = "has no config.yaml" if Path(args.run_dir).is_dir() else "does not exist"
            flag = "--resume" if args.resume else "--restart"
            raise UserError(f"{args.run_dir}: no run to continue there (the folder {where}); check --run-dir, or "
                            f"pass --config FILE without {flag} to start a new run in it")
        args.config = [str(saved)]  # continue with the run's own settings
    elif args.command == "simulate" and not args.config:
        args.config = ["simulate"]  # the demo preset
    elif args.command == "join":
        args.config = ["join"] + args.config  # peers run DiLoCo unless the files say otherwise
    cfg, _ = load_config(args.config, args.overrides, extra)
    return cfg


def _one_link(args: argparse.Namespace) -> None:
    """--links gives every link its bandwidth and latency: with --bandwidth or --latency beside it, one would be
    unused (simulate and plan alike refuse the pair)."""
    given = [f for f in ("bandwidth", "latency") if getattr(args, f, None) is not None]
    if getattr(args, "links", None) and given:
        raise UserError(f"--links {args.links} gives every worker's bandwidth and latency over time, so "
                        f"--{given[0]} would be unused: pass --links, or --bandwidth and --latency")


def cmd_train(args: argparse.Namespace) -> int:
    if args.dry_run:
        from launch.cli.dry_run import dry_run

        print(dry_run(_load(args)))
        return 0
    from launch.loop.trainer import train

    train(_load(args), restart=args.restart)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from launch.simulate.runner import simulate

    simulate(_load(args), restart=args.restart)
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from diloco.extras import require
    from launch.join.peer import JoinOptions, join, read_run_key

    matchmaking_time = _seconds_or_auto("--matchmaking-time", args.matchmaking_time)
    round_timeout = _seconds_or_auto("--round-timeout", args.round_timeout)
    if not args.norm_clip >= 0:
        raise UserError(f"--norm-clip {args.norm_clip:g}: a factor of at least 0 (0 turns clipping off)")
    if not (args.weight_clip == 0 or args.weight_clip >= 1):
        raise UserError(f"--weight-clip {args.weight_clip:g}: a factor of at least 1 (0 turns it off)")
    cfg = _load(args)
    require("hivemind", "loco join")
    opts = JoinOptions(peers=args.peers, run=args.run, address_file=args.address_file,
                       run_key=read_run_key(args.run_key, args.run_key_file), host=args.host, port=args.port,
                       announce=args.announce, identity=args.identity, use_relay=args.use_relay,
                       auto_relay=args.auto_relay, upnp=args.upnp, client_mode=args.client_mode,
                       matchmaking_time=matchmaking_time,
                       round_timeout=round_timeout, norm_clip=args.norm_clip, clip_action=args.clip_action,
                       weight_clip=args.weight_clip)
    join(cfg, opts)
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from launch.cli.sample import main_sample

    return main_sample(args)


def cmd_plot(args: argparse.Namespace) -> int:
    from launch.metrics.plots import plot_runs

    try:
        out = plot_runs(args.run_dirs, args.out, args.title, advice="free some space, or choose another --out")
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    print(f"wrote {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from launch.plan.planner import check, format_check, format_plan, make_plan

    _one_link(args)
    plan = make_plan(args.model, args.workers, args.bandwidth, args.latency, args.step_time, args.links)
    print(format_plan(plan), flush=True)
    if args.shard:
        from launch.plan.memory import format_memory

        print(format_memory(plan.model.params, args.shard))
    if args.check:
        print(format_check(check(plan)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from diloco.extras import require
    from launch.join.peer import format_status, read_run_key, status

    require("hivemind", "loco status")
    info = status(args.peers, args.run, read_run_key(args.run_key, args.run_key_file))
    print(json.dumps(info, indent=2) if args.json else format_status(info))
    return 0


def _help_config(args: argparse.Namespace) -> int:
    """Every key with its default and meaning, and beside it the value the command's --config and --set resolve
    it to where they differ; a config that does not load still shows the defaults, with one line saying why."""
    from launch.config.schema import describe_fields

    try:
        cfg = _load(args)
    except _user_errors() as e:
        print(f"loco {args.command}: note: showing the defaults only; the config could not be applied: {e}",
              file=sys.stderr)
        cfg = None
    print(describe_fields(cfg))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "help_config", False):
        return _help_config(args)
    handler = {"train": cmd_train, "simulate": cmd_simulate, "join": cmd_join, "sample": cmd_sample,
               "plot": cmd_plot, "status": cmd_status, "plan": cmd_plan, "tokenizer": cmd_tokenizer,
               "data": cmd_data, "export": cmd_export, "eval": main_eval}[args.command]
    warnings.simplefilter("default", UserWarning)
    try:
        if args.command in ("train", "simulate"):  # Ctrl-C and SIGTERM save a checkpoint, then stop
            from launch.loop.signals import stop_signals

            with stop_signals():
                return handler(args)
        return handler(args)
    except _user_errors() as e:
        print(f"loco {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # launch.loop.signals.Interrupted names the signal and the checkpoint it saved
        from launch.loop.signals import Interrupted

        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        saved = f"; saved {e.saved}" if isinstance(e, Interrupted) and e.saved else ""
        who = "the user (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"loco {args.command}: stopped by {who}{saved}", file=sys.stderr)
        return 128 + int(signum)  # 130 for Ctrl-C, 143 for SIGTERM, as a shell reports a process they ended


if __name__ == "__main__":
    sys.exit(main())
