"""The data commands of ``loco``: ``tokenizer train`` (a byte-level BPE, offline), ``data prepare`` (text to
token shards with a manifest) and ``data verify`` (every shard's bytes against its manifest)."""

from __future__ import annotations

import argparse
import os
from typing import Any

EXAMPLES = {
    "tokenizer": """examples:
  loco tokenizer train --data python --vocab-size 8192 --out tokenizer-python-8k.json
  loco tokenizer train --data corpus/ --vocab-size 32768 --out my-tokenizer.json""",
    "data": """examples:
  loco data prepare --source python --tokenizer tokenizer-python-8k.json --out data/python-8k
  loco data prepare --source hf --path fineweb/sample.parquet --tokenizer tok.json --out data/fineweb
  loco data verify --path data/fineweb
  loco train --config configs/small.yaml --set data.source=shards --set data.path=data/python-8k""",
}


def add_data_commands(sub: Any, fmt: type) -> None:
    from launch.config.schema import DataConfig

    defaults = DataConfig()
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (offline)", formatter_class=fmt,
                       description="Train a byte-level BPE with the tokenizers library on a text source.",
                       epilog=EXAMPLES["tokenizer"])
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    t = verbs.add_parser("train", help="train a tokenizer and write its JSON file", formatter_class=fmt,
                         epilog=EXAMPLES["tokenizer"])
    t.add_argument("--data", required=True, metavar="PATH|stdlib|python",
                   help="a text file or folder, or a built-in corpus (stdlib, python), e.g. --data python")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N", help="ids in all, e.g. --vocab-size 8192")
    t.add_argument("--out", required=True, metavar="FILE", help="where the tokenizer's JSON goes, e.g. --out tok.json")
    t.add_argument("--pattern", default=defaults.pattern, metavar="GLOB", help="files to read inside a folder")
    t.add_argument("--max-docs", type=int, metavar="N", help="read at most N documents, e.g. --max-docs 20000")

    p = sub.add_parser("data", help="prepare token shards from text, verify them", formatter_class=fmt,
                       description="Tokenize a text source into shards with a manifest.json, on every core; "
                                   "check a folder of shards against its manifest.",
                       epilog=EXAMPLES["data"])
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    d = verbs.add_parser("prepare", help="text to token shards (resumes an interrupted run)", formatter_class=fmt,
                         epilog=EXAMPLES["data"])
    d.add_argument("--source", required=True, choices=["text", "stdlib", "python", "hf"],
                   help="what data.source means: text, stdlib, python or hf")
    d.add_argument("--path", metavar="PATH", help="what data.path means: a text file or folder; for hf a dataset "
                                                   "folder, a jsonl/parquet/csv file or a dataset name")
    d.add_argument("--tokenizer", required=True, metavar="FILE", help="a tokenizers JSON file, or bytes")
    d.add_argument("--out", required=True, metavar="DIR", help="the folder of shards, e.g. --out data/python-8k")
    d.add_argument("--val-fraction", type=float, default=defaults.val_fraction, metavar="F",
                   help=f"share of documents held out for validation (default {defaults.val_fraction})")
    d.add_argument("--pattern", default=defaults.pattern, metavar="GLOB", help="files to read inside a text folder")
    d.add_argument("--max-docs", type=int, metavar="N", help="read at most N documents")
    d.add_argument("--hf-name", metavar="NAME", help="data.hf_name: the dataset's configuration")
    d.add_argument("--hf-split", default=defaults.hf_split, metavar="SPLIT", help="data.hf_split")
    d.add_argument("--hf-text-field", default=defaults.hf_text_field, metavar="FIELD", help="data.hf_text_field")
    d.add_argument("--hf-data-files", metavar="GLOB", help="data.hf_data_files")
    d.add_argument("--shard-mb", type=float, metavar="MB",
                   help="text per shard, in MB (default: a 64th of the source, from 1 to 64; 64 for hf)")
    d.add_argument("--workers", type=int, metavar="N", help="processes (default: every core this process may use)")
    v = verbs.add_parser("verify", help="read every shard and compare it with the manifest (exit 2 if any differs)",
                         formatter_class=fmt, epilog=EXAMPLES["data"])
    v.add_argument("--path", required=True, metavar="DIR", help="a folder loco data prepare made, e.g. "
                                                                "--path data/python-8k")


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from launch.data.documents import doc_text, documents
    from launch.data.tokens import DataError
    from launch.data.tokenizer import train_bpe

    source = args.data if args.data in ("stdlib", "python") else "text"
    if source == "text" and not os.path.exists(args.data):
        raise DataError(f"--data {args.data}: no such file or folder (or use stdlib or python)")
    if args.vocab_size > 1 << 20:
        raise DataError(f"--vocab-size {args.vocab_size}: at most {1 << 20:,} ids")
    where, docs, total = documents(source, args.data if source == "text" else None, args.pattern, args.max_docs)
    print(f"training a byte-level BPE of {args.vocab_size:,} ids on {where}", flush=True)
    texts = (t for t in map(doc_text, docs) if t)
    tok = train_bpe(texts, args.vocab_size, args.out, total, say=lambda m: print(m, flush=True))
    print(f"wrote {args.out}: {tok.describe()}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    if args.verb == "verify":
        from launch.data.shards import verify_shards

        return 0 if verify_shards(args.path, say=lambda m: print(m, flush=True)) else 2
    from launch.data.documents import HFOptions
    from launch.data.prepare import prepare
    from launch.data.tokens import DataError

    if not 0 < args.val_fraction <= 0.5:
        raise DataError(f"--val-fraction {args.val_fraction}: a share in (0, 0.5]")
    if args.shard_mb is not None and args.shard_mb <= 0:
        raise DataError(f"--shard-mb {args.shard_mb}: a positive size")
    hf = HFOptions(args.hf_name, args.hf_split, args.hf_text_field, args.hf_data_files)
    prepare(args.source, args.path, args.tokenizer, args.out, pattern=args.pattern, val_fraction=args.val_fraction,
            max_docs=args.max_docs, hf=hf, shard_mb=args.shard_mb, workers=args.workers,
            say=lambda m: print(m, flush=True))
    return 0
