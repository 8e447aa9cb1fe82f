"""Any ``transformers`` causal LM as loco's model (``model.hf_config``), and weights from a Hugging Face folder
(``model.init_from``).

The model is built with ``AutoModelForCausalLM.from_config`` from a ``config.json`` (nothing is downloaded) and
wrapped so that it maps token ids ``[B, T]`` to logits ``[B, T, V]`` like loco's own ``Transformer``: every
algorithm, transport, codec, the simulator and checkpoints see parameters, nothing more. A checkpoint keeps the
config, so ``loco sample`` and ``loco export`` rebuild the model from it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from launch.errors import RunError
from launch.models.base import RunModel

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _transformers() -> Any:
    from diloco.extras import require

    return require("transformers", "model.hf_config and model.init_from")


def config_file(path: str | Path) -> Path:
    """A ``config.json``: the file named, or the one in the folder named."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise RunError(f"{p}: no config.json there")
    return f


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The fields of a config.json (the file, or its folder), as written."""
    f = config_file(path)
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{f}: not a JSON config ({e})") from None


def read_hf_config(path: str | Path) -> Any:
    """A ``transformers`` config from a config.json; a model type it does not know is one line."""
    return config_from_dict(read_config_json(path), str(config_file(path)))


def config_from_dict(raw: dict[str, Any], where: str) -> Any:
    transformers = _transformers()
    kind = raw.get("model_type")
    if not kind:
        raise RunError(f"{where}: no model_type: not a transformers config")
    rest = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(kind, **rest)
    except (ValueError, KeyError) as e:
        raise RunError(f"{where}: transformers does not know model_type {kind!r} "
                       f"({str(e).splitlines()[0][:80]})") from None


def config_value(config: Any, keys: tuple[str, ...]) -> Optional[int]:
    for k in keys:
        value = getattr(config, k, None)
        if isinstance(value, int):
            return value
    text = getattr(config, "get_text_config", None)  # multimodal configs keep the LM's sizes inside
    if text is not None and text() is not config:
        return config_value(text(), keys)
    return None


def n_layers_of(config: Any) -> int:
    return config_value(config, LAYER_KEYS) or 1


class HFCausalLM(RunModel):
    """A ``transformers`` causal LM taking ids to logits. ``hf`` is the model; its ``state_dict`` keys start
    with ``hf.``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        transformers = _transformers()
        config.use_cache = False
        self.hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.config = config
        self.max_seq_len = config_value(config, POSITION_KEYS)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits

    def output_head(self) -> Optional[nn.Module]:
        """The layer that makes the logits (with tied weights, the embedding's)."""
        return self.hf.get_output_embeddings()

    def config_dict(self) -> dict[str, Any]:
        return self.config.to_dict()

    def recompute_blocks(self, on: bool = True) -> None:
        """``model.activation_checkpointing`` through transformers' own checkpointing of its layers (named
        ``activation_checkpointing_*`` in newer transformers, ``gradient_checkpointing_*`` before)."""
        hf = self.hf
        new = hasattr(hf, "activation_checkpointing_enable")
        if not on:
            (hf.activation_checkpointing_disable if new else hf.gradient_checkpointing_disable)()
        elif not getattr(hf, "supports_gradient_checkpointing", False):
            raise RunError(f"model.activation_checkpointing: transformers' {type(hf).__name__} does not "
                           f"support recomputing its layers; set it to false")
        elif new:
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        from launch.models.transformer import sample_tokens

        return sample_tokens(self, idx, max_new_tokens, self.max_seq_len or idx.shape[1] + max_new_tokens,
                             temperature, top_k, generator)


def build_hf_model(path: str, vocab_size: int, seq_len: int, key: str = "model.hf_config") -> HFCausalLM:
    """The model of ``model.hf_config`` (or of ``model.init_from``'s folder, ``key``), checked against the data's
    vocabulary and the sequence length."""
    config = read_hf_config(path)
    vocab = config_value(config, ("vocab_size",))
    if vocab is not None and vocab < vocab_size:
        fix = ("start from a folder trained on the data's tokenizer" if key == "model.init_from"
               else "raise its vocab_size")
        raise RunError(f"{key} {config_file(path)}: vocab_size {vocab} is smaller than the tokenizer's {vocab_size} "
                       f"ids; {fix}")
    positions = config_value(config, POSITION_KEYS)
    if positions is not None and positions < seq_len:
        raise RunError(f"{config_file(path)}: {positions} positions, fewer than data.seq_len={seq_len}")
    try:
        return HFCausalLM(config)
    except (ValueError, TypeError, RuntimeError) as e:
        raise RunError(f"{config_file(path)}: transformers cannot build a causal LM of it ({str(e)[:160]})") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: one ``model.safetensors``, or every file its index names (a
    missing or partial index is one line)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RunError(f"{index}: not a safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise RunError(f"{index}: names {missing[0]}, which is not in {folder}"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
        return [folder / f for f in files]
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS]
    raise RunError(f"{folder}: no {SAFETENSORS} and no {INDEX}: not a Hugging Face model folder in safetensors")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (an index's tensors must all be there)."""
    from diloco.extras import require

    safetensors = require("safetensors", "model.init_from")
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            tensors.update(load_file(str(f)))
        except (safetensors.SafetensorError, OSError) as e:
            raise RunError(f"{f}: unreadable safetensors file ({e})") from None
    index = folder / INDEX
    if index.is_file():
        wanted = json.loads(index.read_text())["weight_map"]
        absent = [k for k in wanted if k not in tensors]
        if absent:
            raise RunError(f"{index}: names tensor {absent[0]}, which its file {wanted[absent[0]]} does not hold")
    return tensors


def check_init_tokenizer(folder: str | Path, tokenizer: Any) -> None:
    """``model.init_from``'s folder was trained on the run's tokenizer, where both are known: under another one
    of the same size every id would mean other text. Compared as a shard manifest's tokenizer is, by the SHA-256
    of the canonical JSON; a byte-level run's JSON is the one its export carries (``bytes_as_file``)."""
    path = Path(folder) / "tokenizer.json"
    if tokenizer is None or not path.is_file():
        return
    from tokenizers import Tokenizer as HFTokenizer

    from launch.data.tokenizer import bytes_as_file

    try:
        text = HFTokenizer.from_file(str(path)).to_str()
    except Exception as e:  # the Rust side raises plain Exceptions with serde's message
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise RunError(f"model.init_from {path}: not a tokenizers JSON file ({first})") from None
    theirs = hashlib.sha256(text.encode("utf-8")).hexdigest()
    ours = tokenizer.sha256 or bytes_as_file().sha256
    if theirs != ours:
        raise RunError(f"model.init_from {folder}: its tokenizer.json (sha256 {theirs[:12]}) is not the run's "
                       f"tokenizer {tokenizer.describe()}, so its ids would mean other text; set data.tokenizer to "
                       f"{path} (preparing shards again with it), or start from a folder trained on this tokenizer")


def init_from_step(folder: str | Path) -> Optional[int]:
    """The training step a ``loco export`` folder was written at (its weights' safetensors metadata); None for a
    folder that does not record one."""
    try:
        with open(safetensors_files(Path(folder))[0], "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(min(n, 1 << 26)))
        return int(header["__metadata__"]["loco_step"])
    except (RunError, OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def folder_sha256(folder: Path) -> str:
    """One hash over a folder's weight files, in name order (what the summary records as the source)."""
    h = hashlib.sha256()
    for f in safetensors_files(folder):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def load_hf_weights(model: HFCausalLM, folder: Path) -> None:
    """``folder``'s weights into an ``hf_config`` model: the same architecture, every tensor, every shape."""
    theirs = read_weights(folder)
    own = model.hf.state_dict()
    unknown = [k for k in theirs if k not in own]
    if unknown:
        raise RunError(f"{folder}: tensor {unknown[0]} is not in this {type(model.hf).__name__} "
                       f"(model.init_from of another architecture?)")
    for k, t in theirs.items():
        if tuple(t.shape) != tuple(own[k].shape):
            raise RunError(f"{folder}: tensor {k} has shape {tuple(t.shape)}, the config's model "
                           f"{tuple(own[k].shape)}")
    tied = {k for k in own if k not in theirs and _shares_storage(own, k)}
    missing = [k for k in own if k not in theirs and k not in tied]
    if missing:
        raise RunError(f"{folder}: has no tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                                                  else ""))
    with torch.no_grad():
        for k, t in theirs.items():
            own[k].copy_(t)


def _shares_storage(state: dict[str, torch.Tensor], key: str) -> bool:
    """Whether ``key`` is another name of a tensor the state holds under an earlier name (tied embeddings)."""
    ptr = state[key].data_ptr()
    return any(state[k].data_ptr() == ptr for k in state if k != key)
