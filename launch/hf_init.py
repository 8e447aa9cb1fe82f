"""``model.init_from`` for loco's own model: a Hugging Face Llama folder (what ``loco export`` writes, or any
Llama loco's model can hold) mapped back to loco's names and rotary layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.nn as nn

from launch.errors import RunError
from launch.hf_models import config_file, read_weights


def _llama_config(folder: str | Path) -> dict[str, Any]:
    f = config_file(folder)
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{f}: not a JSON config ({e})") from None


def maps_to_loco(folder: str | Path) -> bool:
    """Whether loco's own model can hold the folder's model (a Llama it maps), so it trains as loco's."""
    from launch.hf_weights import args_from_llama_config

    raw = _llama_config(folder)
    if raw.get("model_type") != "llama":
        return False
    try:
        args_from_llama_config(raw)
    except RunError:
        return False
    return True


def loco_args_of(folder: str | Path, seq_len: int) -> Any:
    """loco's model arguments for the folder's Llama, with the run's sequence length."""
    from launch.hf_weights import args_from_llama_config

    return replace(args_from_llama_config(_llama_config(folder)), max_seq_len=seq_len)


def load_loco_weights(model: nn.Module, folder: Path) -> None:
    """The folder's tensors into loco's model: every one, every shape (one line naming a tensor otherwise)."""
    from launch.hf_weights import hf_to_loco

    state = hf_to_loco(read_weights(folder), model.args)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RunError(f"{folder}: its weights do not fit this model ({str(e).splitlines()[0][:200]})") from None
