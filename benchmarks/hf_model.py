"""Training speed of a ``model.hf_config`` model against loco's own model of the same shape.

Both are Llama-style decoders of a named size (``small`` by default: 512 wide, 8 layers, 8 heads, SwiGLU, tied
embeddings): loco's ``Transformer`` and ``transformers``' ``LlamaForCausalLM`` built from the equivalent
``config.json`` (what ``model.hf_config`` builds). Each step is a forward, a backward and a fused AdamW step on
one batch; the two models alternate, step by step, and the table gives median tokens per second and the ratio.
On a GPU both are compiled (``--compile``, the default there) in bf16 autocast, as ``loco train`` runs them.

    python benchmarks/hf_model.py --out benchmarks/results/hf_model_cpu.md
    python benchmarks/hf_model.py --size small --batch 16 --seq 1024 --steps 30     # a GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def llama_config(args) -> dict:
    return {"model_type": "llama", "hidden_size": args.dim, "intermediate_size": args.hidden,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len, "rope_theta": args.rope_theta,
            "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_embeddings}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--out")
    a = p.parse_args()
    from dataclasses import replace

    from launch.models.hf.causal_lm import HFCausalLM, config_from_dict
    from launch.models.transformer import SIZES, Transformer

    device = torch.device(a.device)
    compiled = a.compile if a.compile is not None else device.type == "cuda"
    args = replace(SIZES[a.size], vocab_size=a.vocab, max_seq_len=a.seq)
    torch.manual_seed(0)
    models = {"loco Transformer": Transformer(args).to(device),
              "transformers LlamaForCausalLM (model.hf_config)":
                  HFCausalLM(config_from_dict(llama_config(args), "benchmark")).to(device)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, m in models.items()}
    if compiled:
        for m in models.values():
            m.compile()
    bf16 = device.type == "cuda"
    x = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=device)
    times: dict[str, list[float]] = {k: [] for k in models}
    for step in range(a.steps + 2):
        for name, model in models.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 2:  # the first steps warm the allocator (and compile)
                times[name].append(time.perf_counter() - t0)
    tps = {k: a.batch * a.seq / statistics.median(v) for k, v in times.items()}
    own, theirs = tps.values()
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    lines = [
        "# model.hf_config against loco's own model, same shape",
        "",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; device: {name}; torch {torch.__version__}",
        f"- size {a.size} ({args.dim} wide, {args.n_layers} layers), vocab {a.vocab}, batch {a.batch} x {a.seq}, "
        f"{'compiled, bf16 autocast' if compiled else 'eager, fp32'}; median of {a.steps} steps, alternating",
        f"- command: python benchmarks/hf_model.py {' '.join(sys.argv[1:])}",
        "",
        "| model | parameters | tokens/s (median) |",
        "| --- | --- | --- |",
        *(f"| {k} | {params[k] / 1e6:.2f}M | {v:,.0f} |" for k, v in tps.items()),
        "",
        f"hf_config / loco: **{theirs / own:.2f}x** (target on a GPU, both compiled: at least 0.8x; on a CPU the "
        f"ratio is reported only).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
