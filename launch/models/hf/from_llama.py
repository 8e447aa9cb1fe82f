"""``model.init_from`` for loco's own model: a Hugging Face Llama folder (what ``loco export`` writes, or any
Llama loco's model can hold) mapped back to loco's names and rotary layout."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch.nn as nn

from launch.errors import RunError
from launch.models.hf.causal_lm import read_config_json, read_weights
from launch.models.hf.weights import args_from_llama_config, hf_to_loco
from launch.models.transformer import ModelArgs


def loco_args_of(folder: str | Path, seq_len: int) -> Optional[ModelArgs]:
    """loco's model arguments for the folder's model, with the run's sequence length; None where loco's own model
    cannot hold it (not a Llama, or a Llama it does not map), which then trains as a ``transformers`` model."""
    raw = read_config_json(folder)
    if raw.get("model_type") != "llama":
        return None
    try:
        return replace(args_from_llama_config(raw), max_seq_len=seq_len)
    except RunError:
        return None


def load_loco_weights(model: nn.Module, folder: Path) -> None:
    """The folder's tensors into loco's model: every one, every shape (one line naming a tensor otherwise)."""
    state = hf_to_loco(read_weights(folder), model.args)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RunError(f"{folder}: its weights do not fit this model ({str(e).splitlines()[0][:200]})") from None
