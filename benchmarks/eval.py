"""What validation costs and how fast ``loco eval`` scores.

1. In-loop validation's share of ``loco train --config configs/tiny.yaml``: the median time of one evaluation
   (``eval.tokens`` windows) times the evaluations the preset makes (every ``run.eval_every`` steps and at the
   end), against the median training step times ``run.max_steps``. Target: at most 5%.
2. ``loco eval``'s scoring against the training step's forward pass at the same batch (tokens per second,
   medians of rounds taken in turns). Target: at least 0.8x.

    python benchmarks/eval.py [--device cpu] [--rounds 7] [--out benchmarks/results/eval_cpu.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.train_throughput import cpu_model  # noqa: E402
from launch.config import load_config  # noqa: E402
from launch.eval.models import ScoredModel  # noqa: E402
from launch.eval.scoring import EvalData, score_model  # noqa: E402
from launch.loop.trainer import Trainer  # noqa: E402


def _timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, _ = load_config(["tiny"], [f"run.dir={tmp}", f"run.device={args.device}", f"run.threads={args.threads}",
                                        "log.progress=off", "log.plot=false", "run.checkpoint_every=0"])
        trainer = Trainer(cfg)
        for _ in range(3):  # warm up
            trainer.train_step()
        steps, evals, fwd, scored = [], [], [], []
        x, y = trainer.batcher.train_batch(0)
        model = ScoredModel(trainer.model, trainer.data.tokenizer, cfg.data.seq_len, trainer.data.vocab_size,
                            "tiny", cfg, None)
        ev = EvalData(trainer.data, cfg.data.seq_len, cfg.eval.tokens, cfg.run.batch_size)
        for _ in range(args.rounds):  # in turns, so a busy moment of the machine touches both alike
            steps.append(_timed(trainer.train_step, sync))
            evals.append(_timed(trainer.evaluate, sync))
            trainer.model.train()
            fwd.append(_timed(lambda: trainer.compute.loss_on(x, y), sync))
            scored.append(_timed(lambda: score_model(model, ev, device, cfg.run.precision), sync))
            trainer.model.train()
        trainer.close_data()
    step, one_eval = statistics.median(steps), statistics.median(evals)
    n_evals = cfg.run.max_steps // cfg.run.eval_every + 1
    share = n_evals * one_eval / (cfg.run.max_steps * step + n_evals * one_eval)
    fwd_tps = x.numel() / statistics.median(fwd)
    eval_tps = cfg.eval.tokens / statistics.median(scored)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    lines = [
        "# Validation's cost and loco eval's speed", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; device: {dev}, {args.threads} thread(s); "
        f"torch {torch.__version__}",
        f"- `configs/tiny.yaml`: {cfg.run.max_steps} steps of batch {cfg.run.batch_size} x {cfg.data.seq_len}, "
        f"validation every {cfg.run.eval_every} steps and at the end ({n_evals} evaluations) of eval.tokens="
        f"{cfg.eval.tokens:,}; medians of {args.rounds} rounds taken in turns", "",
        "| figure | measured | target |", "| --- | --- | --- |",
        f"| training step | {1e3 * step:.1f} ms | |",
        f"| one evaluation ({cfg.eval.tokens:,} tokens) | {1e3 * one_eval:.1f} ms | |",
        f"| validation's share of the run | {100 * share:.2f}% | at most 5% ({'met' if share <= 0.05 else 'missed'}) |",
        f"| training forward pass, batch {cfg.run.batch_size} | {fwd_tps / 1e3:.1f}k tokens/s | |",
        f"| loco eval's scoring, {cfg.run.batch_size} windows a pass | {eval_tps / 1e3:.1f}k tokens/s | |",
        f"| scoring / training forward | {eval_tps / fwd_tps:.2f}x | at least 0.8x "
        f"({'met' if eval_tps / fwd_tps >= 0.8 else 'missed'}) |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
