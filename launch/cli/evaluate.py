"""``loco eval``: a model's validation loss and bits per byte, each with its standard error, and downstream tasks
through lm-eval, for a run's checkpoint or any Hugging Face causal LM folder."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

EXAMPLES = {
    "eval": """examples:
  loco eval --run-dir runs/mine                          # the run's own validation windows
  loco eval --run-dir runs/mine --tokens 262144          # more windows, a smaller error
  loco eval --hf exports/mine --data stdlib              # any causal LM folder, on text, in bits per byte
  loco eval --checkpoint runs/mine/checkpoints/step_00000600.pt --data text --path corpus/ --json
  loco eval --run-dir runs/mine --tasks mytask --include-path tasks/   # lm-eval tasks (pip install 'loco[eval]')""",
}


def add_eval_command(sub: Any, fmt: type) -> None:
    p = sub.add_parser("eval", help="score a checkpoint or a Hugging Face model: validation, bits per byte, tasks",
                       formatter_class=fmt, epilog=EXAMPLES["eval"],
                       description="Score a model on validation windows spread over a whole split: the loss in "
                                   "nats per token and bits per byte, each with its standard error. A run's "
                                   "checkpoint without --data is scored on its run's own windows (the figure the "
                                   "run reported); with --data, models with different tokenizers read the same "
                                   "documents and compare in bits per byte. --tasks runs lm-eval tasks.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", metavar="DIR", help="a run folder: its newest valid checkpoint, e.g. --run-dir runs/mine")
    src.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file, e.g. --checkpoint runs/mine/checkpoints/step_00000600.pt")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face causal LM folder with its tokenizer, e.g. --hf exports/mine")
    p.add_argument("--data", metavar="SOURCE", choices=["stdlib", "python", "text", "hf", "shards"],
                   help="the text to score: stdlib, python, text, hf or shards (default: the run's own)")
    p.add_argument("--path", metavar="P", help="where --data reads: a folder or file of text, a jsonl, a dataset, shards")
    p.add_argument("--tokens", type=int, metavar="N",
                   help="validation tokens to score (default: the run's eval.tokens, else 16384), e.g. --tokens 262144")
    p.add_argument("--batch-size", type=int, metavar="ROWS", help="windows per forward pass (default: the run's micro-batch)")
    p.add_argument("--tasks", metavar="T,...", help="lm-eval tasks, comma-separated, e.g. --tasks arc_easy,hellaswag")
    p.add_argument("--include-path", metavar="DIR", help="a folder of lm-eval task YAMLs (data in local files)")
    p.add_argument("--limit", type=int, metavar="N", help="at most N documents per task")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N], e.g. --device cpu")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a data or eval setting over the run's, e.g. --set data.seq_len=512 --set data.max_docs=")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def main_eval(args: argparse.Namespace) -> int:
    from launch.errors import RunError
    from launch.eval.models import load_checkpoint, load_hf
    from launch.eval.scoring import eval_data, eval_settings, score_model
    from launch.loop.runtime import resolve_device

    if args.batch_size is not None and args.batch_size <= 0:
        raise RunError(f"--batch-size {args.batch_size}: at least 1 window a pass, e.g. --batch-size 16")
    if args.run_dir is not None and not Path(args.run_dir).is_dir():
        raise RunError(f"--run-dir {args.run_dir}: no such run folder" +
                       (" (name a checkpoint file with --checkpoint)" if Path(args.run_dir).is_file() else ""))
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if args.tasks is not None and not tasks:
        raise RunError(f"--tasks {args.tasks!r}: name at least one task, e.g. --tasks arc_easy")
    if tasks:  # a missing extra and an unknown task are said before a model loads
        from launch.eval.harness import check_tasks

        check_tasks(tasks, args.include_path)
    device = resolve_device(args.device)
    scored = load_hf(args.hf, device) if args.hf else load_checkpoint(args.run_dir or args.checkpoint, device)
    cfg = eval_settings(scored, args.data, args.path, args.overrides)
    ev = eval_data(scored, cfg, args.tokens, args.batch_size)
    val, vset = score_model(scored, ev, device, cfg.run.precision)
    out: dict[str, Any] = {"model": scored.description, "step": scored.step, "data": ev.data.description,
                           "validation": {**val.record(), "windows": vset.count, "seq_len": vset.seq_len,
                                          "whole_split": vset.whole}}
    if tasks:
        from launch.eval.harness import run_tasks

        out["tasks"] = run_tasks(scored.model, scored.tokenizer, scored.max_len, device, tasks, args.include_path,
                                 batch_size=ev.rows, limit=args.limit)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_eval(out, vset.describe(), vset.note()))
    return 0


def _pm(value: Any, se: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    err = f" ± {se:.{digits}f}" if isinstance(se, float) and math.isfinite(se) else ""
    return f"{value:.{digits}f}{err}"


def format_eval(out: dict[str, Any], windows: str, note: Any) -> str:
    v = out["validation"]
    lines = [f"model: {out['model']}", f"data: {out['data']}", f"validation: {windows}"]
    if note:
        lines.append(note)
    lines.append(f"val loss {_pm(v['val_loss'], v['val_loss_se'])} nats/token | "
                 f"{_pm(v['val_bpb'], v['val_bpb_se'])} bits/byte")
    tasks = out.get("tasks")
    if tasks:
        rows = [(task, metric, value, scores.get(f"{metric}_stderr"))
                for task, scores in tasks["tasks"].items() for metric, value in scores.items()
                if not metric.endswith("_stderr") and isinstance(value, (int, float))]
        width = max([4] + [len(t) for t, *_ in rows])
        lines += ["", f"{'task':<{width}}  {'metric':<16} {'value':>16}"]
        lines += [f"{t:<{width}}  {m:<16} {_pm(float(v), s):>16}" for t, m, v, s in rows]
        if tasks.get("truncated"):
            lines.append(f"{tasks['truncated']} of {tasks['requests']} requests were longer than the model's "
                         f"context and were cut from the left")
    return "\n".join(lines)
