"""What ``loco eval`` does with a loaded model: the text it scores, in the model's own tokens, and the score.

Without ``--data``, a loco checkpoint is scored on its run's validation windows (the run's data settings, its
``data.seq_len`` and ``eval.tokens``), so the figure equals the run's own final validation. With ``--data``,
any source loco reads is scored in bits per byte: models with different tokenizers read the same validation
documents, each in its own tokens, with windows spread over the whole split in the same way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from launch.config import Config
from launch.config.loader import ConfigBuilder
from launch.config.schema import ConfigError, EvalConfig
from launch.data.batches import load_data, to_device
from launch.data.tokens import DataError, TokenData, Windows
from launch.errors import RunError
from launch.eval.models import ScoredModel
from launch.eval.validation import Score, ValidationSet, row_nll, score, scoring_rows


@dataclass
class EvalData:
    """The validation split in the model's tokens, and how it is cut."""

    data: TokenData
    seq_len: int
    tokens: int
    rows: int


def eval_settings(scored: ScoredModel, source: Optional[str], path: Optional[str],
                  overrides: Sequence[str] = ()) -> Config:
    """The run's settings (a default config for a model without them), with ``--data``, ``--path`` and each
    ``--set`` over them. A Hugging Face folder holds no data settings, so it needs ``--data``."""
    if scored.config is None and source is None and not any(o.startswith("data.source=") for o in overrides):
        raise RunError(f"{scored.description}: it holds no run settings to name its validation data; name the text "
                       f"to score with --data SOURCE (stdlib, python, text, hf or shards) and --path P")
    builder = ConfigBuilder()
    if scored.config is not None:
        builder.apply_mapping(scored.config.to_dict(), "the checkpoint's settings")
    else:  # a folder's own context: windows as long as the model takes
        builder.set("data.seq_len", scored.max_len, "the model's context")
    try:
        if source is not None:
            builder.set("data.source", source, "--data")
            builder.set("data.streaming", False, "--data")
            builder.set("data.val_path", None, "--data")
        if path is not None:
            builder.set("data.path", path, "--path")
        for o in overrides:
            builder.apply_override(o)
    except ConfigError as e:
        raise RunError(str(e)) from None
    return builder.config


def eval_data(scored: ScoredModel, cfg: Config, tokens: Optional[int], rows: Optional[int]) -> EvalData:
    """The validation split named by ``cfg.data``, encoded with the model's tokenizer."""
    dcfg = cfg.data
    if tokens is not None and tokens <= 0:
        raise RunError(f"--tokens {tokens}: a count of at least 1 token, e.g. --tokens 65536")
    if dcfg.seq_len > scored.max_len:
        raise RunError(f"data.seq_len={dcfg.seq_len}: longer than the {scored.max_len} positions the model takes; "
                       f"pass --set data.seq_len={scored.max_len}")
    if dcfg.source == "shards" and scored.tokenizer is None and dcfg.vocab_size > scored.vocab_size:
        raise RunError(f"data.vocab_size={dcfg.vocab_size}: more ids than the model's {scored.vocab_size}")
    try:
        data = load_data(dcfg, scored.tokenizer, val_only=True)
    except DataError as e:
        raise RunError(str(e)) from None
    if data.vocab_size > scored.vocab_size:
        raise RunError(f"{data.description}: ids up to {data.vocab_size - 1}, more than the model's vocabulary of "
                       f"{scored.vocab_size}; score text (--data text, hf, stdlib) in the model's own tokens")
    return EvalData(data, dcfg.seq_len, tokens or cfg.eval.tokens or EvalConfig().tokens,
                    rows or scoring_rows(cfg))


def autocast(device: torch.device, precision: str) -> Any:
    """bf16 autocast where the run's loop uses it (``auto``: on CUDA), so a checkpoint scores as its run did."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


@torch.no_grad()
def score_model(scored: ScoredModel, ev: EvalData, device: torch.device, precision: str = "auto"
                ) -> tuple[Score, ValidationSet]:
    """The model's validation on ``ev``'s windows (:func:`launch.eval.validation.score`)."""
    vset = ValidationSet.spread(Windows(ev.data.val, ev.seq_len), ev.tokens)
    vset.check_ids(scored.vocab_size, ev.data.description)
    model = scored.model.eval()

    def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = to_device(x, y, device)
        with autocast(device, precision):
            logits = model(x)
        return row_nll(logits, y)

    lengths = scored.tokenizer.token_bytes() if scored.tokenizer is not None else None
    return score(forward, vset, ev.rows, device, window_bytes=vset.target_bytes(lengths)), vset


__all__ = ["EvalData", "eval_data", "eval_settings", "score_model"]
