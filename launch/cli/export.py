"""The model commands of ``loco``: ``export`` (a checkpoint as a Hugging Face Llama folder)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

EXAMPLES = {
    "export": """examples:
  loco export --run-dir runs/mine --out exports/mine             # the newest valid checkpoint, in bf16
  loco export --checkpoint runs/mine/checkpoints/step_00000600.pt --out exports/mine-600 --dtype fp32
  loco export --run-dir runs/mine --out exports/mine --force      # replace an earlier export""",
}


def add_model_commands(sub: Any, fmt: type) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama folder", formatter_class=fmt,
                       description="Write a checkpoint of loco's model as a Hugging Face LlamaForCausalLM folder "
                                   "(config.json, safetensors weights, the run's tokenizer) that transformers, vLLM "
                                   "and lm-eval load without custom code.",
                       epilog=EXAMPLES["export"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run-dir", metavar="DIR", help="a run folder: its newest valid checkpoint, e.g. --run-dir runs/mine")
    src.add_argument("--checkpoint", metavar="FILE",
                     help="a checkpoint file, e.g. --checkpoint runs/mine/checkpoints/step_00000600.pt")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write, e.g. --out exports/mine")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="the weights' type in the folder (default bf16; fp32 keeps the checkpoint's values exactly)")
    p.add_argument("--force", action="store_true", help="replace --out if it is a folder with files in it")


def cmd_export(args: argparse.Namespace) -> int:
    from launch.errors import RunError
    from launch.models.hf.export import export
    from launch.metrics.log import human_bytes

    if args.run_dir is not None and Path(args.run_dir).is_file():
        raise RunError(f"--run-dir {args.run_dir}: a file, not a run folder (name a checkpoint with --checkpoint)")
    if args.run_dir is not None and not Path(args.run_dir).is_dir():
        raise RunError(f"--run-dir {args.run_dir}: no such run folder")
    done = export(args.run_dir or args.checkpoint, args.out, dtype=args.dtype, force=args.force)
    print(f"wrote {done['out']}: step {done['step']} of {done['checkpoint']}, {human_bytes(done['weight_bytes'])} "
          f"of {done['dtype']} weights in {len([f for f in done['files'] if f.endswith('.safetensors')])} file(s), "
          f"tokenizer: {done['tokenizer']}")
    return 0
