"""``loco sample``: text (or token ids) from a checkpoint, encoded and decoded with the run's own tokenizer,
which the checkpoint holds: a checkpoint moved to another machine samples the same."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from launch.errors import RunError


def prompt_ids(prompt: str, tokenizer: Any, vocab: int, path: Path) -> list[int]:
    """The prompt in the model's ids: encoded text, or ids separated by spaces for a run on bare token ids."""
    if tokenizer is not None:
        return [int(i) for i in tokenizer.encode(prompt)] if prompt else [tokenizer.eos]  # eos: a document starts
    try:
        ids = [int(t) for t in prompt.split()]
    except ValueError:
        raise RunError(f"{path}: trained on token ids (data.source=shards), so --prompt is ids separated by spaces, "
                       f"e.g. --prompt '17 4051 9'; got {prompt[:40]!r} (shards from loco data prepare bring "
                       f"their tokenizer, and take text)") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RunError(f"--prompt: token id {bad[0]} is outside this model's vocabulary of {vocab}")
    return ids or [0]


def sample(checkpoint: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int,
           device_name: str) -> str:
    import torch

    from launch.eval.models import load_checkpoint
    from launch.loop.runtime import resolve_device

    device = resolve_device(device_name)
    loaded = load_checkpoint(checkpoint, device)
    tokenizer = loaded.tokenizer
    ids = prompt_ids(prompt, tokenizer, loaded.vocab_size, Path(checkpoint))
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = loaded.model.generate(idx, max_new_tokens, temperature, top_k or None, gen)[0].tolist()
    if tokenizer is None:
        return " ".join(map(str, out))
    return prompt + tokenizer.decode(out[len(ids) if prompt else 1:])


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    """One line for a flag outside what sampling takes, before the checkpoint loads."""
    if max_new_tokens < 0:
        raise RunError(f"--max-new-tokens {max_new_tokens}: a count of at least 0, e.g. --max-new-tokens 200")
    if not temperature >= 0:
        raise RunError(f"--temperature {temperature:g}: at least 0 (0 is greedy), e.g. --temperature 0.8")
    if top_k < 0:
        raise RunError(f"--top-k {top_k}: a count of at least 0 (0 samples among all tokens), e.g. --top-k 50")


def main_sample(args: Any) -> int:
    check_sampling(args.max_new_tokens, args.temperature, args.top_k)
    sys.stdout.write(sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                            args.seed, args.device) + "\n")
    return 0
