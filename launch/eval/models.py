"""Models loaded to be scored: a loco checkpoint (loco's ``Transformer`` or a ``model.hf_config`` model, with the
run's tokenizer and config) or any Hugging Face causal LM folder (``loco export``'s among them, with its
``tokenizer.json``). Either way a :class:`ScoredModel` maps token ids ``[B, T]`` to logits ``[B, T, V]`` in eval
mode on the device asked for, so what scores one scores the other: an fp32 export gives its checkpoint's logits.

Bad input is one ``RunError`` line naming the path: a folder that is not there, one without ``config.json`` or
without weights, a file that is not a checkpoint, a checkpoint of a model only its own code can build.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from launch.config import config_from_dict
from launch.config.schema import Config, ConfigError
from launch.data.tokenizer import BPETokenizer, Tokenizer, tokenizer_from_state
from launch.errors import RunError
from launch.models.hf.causal_lm import POSITION_KEYS, config_value
from launch.store.checkpoint import CheckpointError, open_checkpoint

# the weight files transformers' from_pretrained reads, safetensors or pickled, whole or sharded
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


@dataclass
class ScoredModel:
    """A model ready to score: ``model(ids)`` with ``ids`` a long tensor ``[B, T]`` on ``device``, ``T`` at most
    ``max_len``, gives logits ``[B, T, vocab_size]``."""

    model: nn.Module
    tokenizer: Optional[Tokenizer]  # None: a run on bare token ids
    max_len: int
    vocab_size: int
    description: str  # one line: what was loaded, from where
    config: Optional[Config]  # the run's, for a loco checkpoint that holds one
    step: Optional[int]  # a checkpoint's step; None for a Hugging Face folder


class _HFLogits(nn.Module):
    """A ``transformers`` causal LM as ids to the logits tensor (its output object holds them among others)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids, use_cache=False).logits


def load_checkpoint(path: str | Path, device: torch.device) -> ScoredModel:
    """A loco checkpoint (a file, or a run folder's newest valid one: what ``loco sample`` and ``loco export``
    take, a sharded run's included, whose file holds the whole model) with its tokenizer and the run's config.

    ``config`` is None where the checkpoint holds none (one saved by hand) or one this loco's settings no longer
    read: the model scores all the same."""
    from launch.models.transformer import ModelArgs, Transformer

    try:
        found, state = open_checkpoint(path)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    if state.get("hf_config"):
        from launch.models.hf.causal_lm import HFCausalLM, config_from_dict as hf_config_from_dict

        model: nn.Module = HFCausalLM(hf_config_from_dict(state["hf_config"], str(found)))
        vocab = int(model.hf.get_output_embeddings().weight.shape[0])
        positions, kind = model.max_seq_len, type(model.hf).__name__
    elif state.get("model_args"):
        try:
            args = ModelArgs(**state["model_args"])
        except TypeError as e:
            raise RunError(f"{found}: model_args this loco cannot read ({e})") from None
        model = Transformer(args)
        vocab, positions, kind = args.vocab_size, args.max_seq_len, "loco's Transformer"
    else:
        raise RunError(f"{found}: trained with a custom model (the checkpoint has no model_args or hf_config); "
                       "load it with your own code through the Python API")
    try:
        model.load_state_dict(state.get("model") or {})
    except RuntimeError as e:
        raise RunError(f"{found}: its weights do not fit its model ({str(e).splitlines()[0][:200]})") from None
    config = _run_config(state.get("config"), str(found))
    if not positions:
        positions = config.data.seq_len if config is not None else 0
    if not positions:
        raise RunError(f"{found}: neither its model nor its config says how long a context it takes")
    tokenizer = tokenizer_from_state(state.get("tokenizer"), str(found))
    step = int(state.get("step", 0))
    model.to(device).eval()
    return ScoredModel(model, tokenizer, int(positions), vocab,
                       _describe(f"{found} (step {step})", kind, model, tokenizer), config, step)


def _run_config(saved: Any, source: str) -> Optional[Config]:
    if not isinstance(saved, dict):
        return None
    try:
        return config_from_dict(saved, source)
    except ConfigError:
        return None


def load_hf(folder: str | Path, device: torch.device) -> ScoredModel:
    """A Hugging Face causal LM folder (``config.json``, weights, ``tokenizer.json``), read from disk only, in
    float32 on ``device``. Its tokenizer is loco's reading of the folder's ``tokenizer.json``, with the eos that its
    ``tokenizer_config.json`` names (else the first of loco's end-of-document names the file has)."""
    folder = Path(folder)
    _check_folder(folder)
    from diloco.extras import require

    transformers = require("transformers", "scoring a Hugging Face folder")
    eos = _named_eos(folder)
    tokenizer = BPETokenizer.from_file(folder / "tokenizer.json", eos)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    except Exception as e:  # transformers and safetensors each raise their own types for a folder they cannot read
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RunError(f"{folder}: transformers cannot load a causal LM from it ({first})") from None
    positions = config_value(hf.config, POSITION_KEYS[:2])
    if not positions:
        raise RunError(f"{folder / 'config.json'}: no max_position_embeddings or n_positions: how long a context "
                       "the model takes is unknown")
    vocab = int(hf.get_output_embeddings().weight.shape[0])
    model = _HFLogits(hf).to(device).eval()
    return ScoredModel(model, tokenizer, int(positions), vocab,
                       _describe(str(folder), type(hf).__name__, model, tokenizer), None, None)


def _check_folder(folder: Path) -> None:
    """What ``from_pretrained`` needs of a folder, each missing piece one line."""
    if not folder.is_dir():
        what = "a file, not a folder" if folder.exists() else "no such folder"
        raise RunError(f"{folder}: {what} (a Hugging Face model folder: config.json, weights, tokenizer.json)")
    if not (folder / "config.json").is_file():
        raise RunError(f"{folder}: no config.json there: not a Hugging Face model folder")
    if not any(any(folder.glob(pattern)) for pattern in _WEIGHTS):
        raise RunError(f"{folder}: no weights there (no *.safetensors and no pytorch_model*.bin)")
    if not (folder / "tokenizer.json").is_file():
        raise RunError(f"{folder}: no tokenizer.json there: a model is scored on text through its tokenizer "
                       "(loco export writes one for every run trained on text)")


def _named_eos(folder: Path) -> Optional[str]:
    """The eos that ``tokenizer_config.json`` names, written as a string or as an added token's fields."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError) as e:
        raise RunError(f"{path}: not a JSON object ({str(e)[:120]})") from None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def _describe(source: str, kind: str, model: nn.Module, tokenizer: Optional[Tokenizer]) -> str:
    params = sum(p.numel() for p in model.parameters())
    words = tokenizer.describe() if tokenizer is not None else "bare token ids"
    return f"{source}: {kind}, {params / 1e6:,.2f}M parameters, tokenizer {words}"
