"""``loco export``: a checkpoint of loco's ``Transformer`` as a Hugging Face Llama folder.

The folder holds ``config.json``, ``generation_config.json``, the weights as safetensors (one
``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards with ``model.safetensors.index.json`` above
5 GB, as ``transformers`` names them), the run's tokenizer where it has one (``tokenizer.json`` with the config
files ``AutoTokenizer`` reads: a BPE's own file, or for a byte-level run one that encodes a text to its UTF-8
bytes) and a ``README.md``. ``transformers``, vLLM and lm-eval load it without custom code.

The weights are written tensor by tensor: each is converted to the export's dtype and written, then dropped, while
the checkpoint is read through a memory map; the export never holds a second copy of the model. Everything goes
into a temporary folder beside ``out``, renamed at the end, so a failure leaves nothing half written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from launch.store.checkpoint import open_checkpoint
from launch.store.disk import fsync_dir, human_bytes
from launch.errors import RunError
from launch.models.hf.weights import DTYPES, hf_shapes, llama_config, loco_to_hf

SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
BYTES_KIND = "bytes (tokenizer.json)"  # a byte-level run's tokenizer kind: its export carries a tokenizer file


def shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Names grouped into files in order, each group under ``max_bytes`` unless one tensor alone is larger."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _numel(shape) * itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors(folder: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]],
                      shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                      max_shard_bytes: int = SHARD_BYTES, metadata: Optional[dict[str, str]] = None) -> list[str]:
    """Write ``tensors`` (in the order of ``shapes``) as safetensors files in ``folder``, converted to ``dtype``
    one at a time; more than one file gets ``model.safetensors.index.json``. ``metadata`` goes into every file's
    header beside ``format``. Returns the files' names."""
    if sys.byteorder != "little":  # safetensors stores little-endian bytes; the raw copy below assumes the host's
        raise RunError("export writes little-endian safetensors and this machine is big-endian")
    folder = Path(folder)
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups = shard_plan(shapes, itemsize, max_shard_bytes)
    n = len(groups)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    stream = _converted_ahead(iter(tensors), dtype, max(map(_numel, shapes.values()), default=0))
    for file, group in zip(files, groups):
        _write_file(folder / file, [(name, shapes[name]) for name in group], stream, dtype, metadata or {})
    if next(stream, None) is not None:
        raise ValueError("more tensors than shapes")
    if n > 1:
        index = {"metadata": {"total_size": sum(_numel(s) for s in shapes.values()) * itemsize},
                 "weight_map": {name: file for file, group in zip(files, groups) for name in group}}
        _write_text(folder / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return files


def _write_file(path: Path, entries: list[tuple[str, tuple[int, ...]]],
                stream: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, metadata: dict[str, str]) -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header (padded with spaces to a
    multiple of 8, so the data starts aligned), then each tensor's bytes at the offsets the header gives."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {**metadata, "format": "pt"}}
    offset = 0
    for name, shape in entries:
        end = offset + _numel(shape) * itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape in entries:
            got, t = next(stream, (None, None))
            if got != name or t is None or tuple(t.shape) != shape:
                raise ValueError(f"expected tensor {name} {list(shape)}, got {got}")
            fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t
        fh.flush()
        os.fsync(fh.fileno())


def _converted_ahead(stream: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                     largest: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's tensors in ``dtype``, contiguous on the CPU; a thread takes and converts the next while the
    caller writes this one (torch's conversion and the file's write both release the GIL).

    Conversions go into two buffers of ``largest`` elements, used in turn, so memory stays at two tensors and
    no page is faulted in again for each one: a tensor it yields is valid until the caller asks for the next.
    """
    buffers = [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)]
    turn = 0

    def take() -> Optional[tuple[str, torch.Tensor]]:
        nonlocal turn
        item = next(stream, None)
        if item is None:
            return None
        name, t = item[0], item[1].detach()
        if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
            return name, t
        if buffers[turn].numel() == 0:
            buffers[turn] = torch.empty(largest, dtype=dtype)
        out = buffers[turn][:t.numel()].view(t.shape)
        turn = 1 - turn
        return name, out.copy_(t)

    with ThreadPoolExecutor(1, thread_name_prefix="loco-export") as pool:
        ahead = pool.submit(take)
        while (item := ahead.result()) is not None:
            ahead = pool.submit(take)
            yield item
            del item


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _check_out(out: Path, force: bool) -> None:
    if out.is_file() or out.is_symlink():
        raise RunError(f"--out {out}: a file is there; name a folder for the export")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise RunError(f"--out {out}: the folder is not empty; pass --force to replace it, or choose another --out")


def _check_space(parent: Path, need: int) -> None:
    try:
        st = os.statvfs(parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise RunError(f"{parent}: the export needs about {human_bytes(need)} and {human_bytes(free)} is free there; "
                       "free some space or choose another --out")


def export(source: str | os.PathLike, out: str | os.PathLike, dtype: str = "bf16", force: bool = False,
           max_shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Export a checkpoint (a file, or a run folder's newest) to ``out`` as a Hugging Face Llama folder.

    ``dtype``: bf16 or fp32. ``force``: replace a folder that is there. Returns what was written: the folder,
    the checkpoint and its step, the files, the bytes of weights and the tokenizer's kind.
    """
    from launch.models.transformer import ModelArgs
    from launch.data.tokenizer import tokenizer_from_state

    if dtype not in DTYPES:
        raise RunError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    out = Path(out)
    _check_out(out, force)
    path, state = open_checkpoint(source)
    if state.get("hf_config"):
        return _export_hf(path, state, out, dtype)
    if not state.get("model_args"):
        raise RunError(f"{path}: trained with a custom model (the checkpoint has no model_args or hf_config); "
                       "only loco's Transformer and model.hf_config models export")
    try:
        args = ModelArgs(**state["model_args"])
    except TypeError as e:
        raise RunError(f"{path}: model_args this loco cannot read ({e})") from None
    torch_dtype = DTYPES[dtype]
    tensors = loco_to_hf(state.get("model") or {}, args, str(path))  # checks every name and shape first
    tokenizer = tokenizer_from_state(state.get("tokenizer"), str(path))
    eos = tokenizer.eos if tokenizer is not None else None
    kind, file = tokenizer_file(tokenizer)
    shapes = hf_shapes(args)
    weight_bytes = sum(_numel(s) for s in shapes.values()) * torch.empty((), dtype=torch_dtype).element_size()
    step = int(state.get("step", 0))

    def write(tmp: Path) -> list[str]:
        # the step rides in the weights' metadata, where model.init_from's start line finds it
        files = write_safetensors(tmp, tensors, shapes, torch_dtype, max_shard_bytes, {"loco_step": str(step)})
        _write_json(tmp / "config.json", llama_config(args, torch_dtype, eos))
        generation = {"_from_model_config": True, "bos_token_id": eos, "eos_token_id": eos}
        _write_json(tmp / "generation_config.json", generation)
        if file is not None:
            files += write_tokenizer(tmp, file, args.max_seq_len)
        _write_text(tmp / "README.md", readme(path, step, args, dtype, kind, eos))
        return files

    files = _written_whole(out, weight_bytes, write)
    return {"out": out, "checkpoint": path, "step": step, "files": files,
            "weight_bytes": weight_bytes, "tokenizer": kind, "dtype": dtype}


def _export_hf(path: Path, state: dict[str, Any], out: Path, dtype: str) -> dict[str, Any]:
    """A ``model.hf_config`` model: ``transformers``' own ``save_pretrained``, and the run's tokenizer."""
    from launch.models.hf.causal_lm import HFCausalLM, config_from_dict
    from launch.data.tokenizer import tokenizer_from_state

    model = HFCausalLM(config_from_dict(state["hf_config"], str(path)))
    try:
        model.load_state_dict(state.get("model") or {})
    except RuntimeError as e:
        raise RunError(f"{path}: its weights do not fit its hf_config ({str(e).splitlines()[0][:200]})") from None
    model.hf.to(DTYPES[dtype])
    kind, file = tokenizer_file(tokenizer_from_state(state.get("tokenizer"), str(path)))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.hf.parameters())

    def write(tmp: Path) -> list[str]:
        model.hf.save_pretrained(tmp, safe_serialization=True, max_shard_size=SHARD_BYTES)
        files = sorted(f.name for f in tmp.iterdir())
        if file is not None:
            files += write_tokenizer(tmp, file, model.max_seq_len or 0)
        return files

    files = _written_whole(out, weight_bytes, write)
    return {"out": out, "checkpoint": path, "step": int(state.get("step", 0)), "files": files,
            "weight_bytes": weight_bytes, "tokenizer": kind, "dtype": dtype}


def _written_whole(out: Path, weight_bytes: int, write: Any) -> list[str]:
    """``write(folder)`` into a temporary folder beside ``out``, renamed to ``out`` once whole; on any failure
    nothing is left, not even the folders made for ``out``."""
    target = Path(os.path.abspath(out))  # "." has no name to put a temporary folder beside
    made = [d for d in (target.parent, *target.parent.parents) if not d.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.export-tmp{os.getpid()}"
    try:
        _check_space(target.parent, weight_bytes)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = write(tmp)
        fsync_dir(tmp)
        _replace(tmp, target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:  # the folders made for --out, innermost first, where nothing else came into them
            try:
                d.rmdir()
            except OSError:
                break
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise RunError(f"--out {out}: no space left on device for the export's {human_bytes(weight_bytes)} "
                           "of weights; nothing was written there") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2) + "\n")


def _replace(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out``; a folder already there (empty, or replaced with --force) goes only once the new
    one is in place."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = out.parent / f".{out.name}.export-old{os.getpid()}"
        os.rename(out, old)
    try:
        if out.is_dir():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.rename(old, out)
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tokenizer_file(tokenizer: Any) -> tuple[str, Any]:
    """The kind of the run's tokenizer, as the export's summary names it, and the ``BPETokenizer`` written as
    ``tokenizer.json`` (None for a run on bare token ids)."""
    from launch.data.tokenizer import BPETokenizer, bytes_as_file

    if tokenizer is None:
        return "none", None
    if isinstance(tokenizer, BPETokenizer):
        return "bpe", tokenizer
    return BYTES_KIND, bytes_as_file()


def write_tokenizer(folder: Path, tokenizer: Any, max_len: int) -> list[str]:
    """``tokenizer.json`` and the two files with which ``AutoTokenizer`` makes it a ``PreTrainedTokenizerFast``;
    its end-of-document token is eos, and bos too (loco's data puts it before every document)."""
    eos = tokenizer.tok.id_to_token(tokenizer.eos)
    _write_text(folder / "tokenizer.json", tokenizer.json)
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False})
    _write_json(folder / "special_tokens_map.json", {"bos_token": eos, "eos_token": eos})
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


SNIPPET_TEXT = "def main():"  # a byte-level README's prompt after eos: one id a byte


def snippet_tokens(context: int) -> int:
    """The README's ``max_new_tokens``: what the context leaves after the prompt (eos and its text), at most 100;
    past the length the model trained on ``transformers`` warns and the text is worth little."""
    return max(1, min(context - 1 - len(SNIPPET_TEXT.encode()), 100))


def readme(checkpoint: Path, step: int, args: Any, dtype: str, kind: str, eos: Optional[int]) -> str:
    """The folder's README: where it came from, and how to feed it."""
    size = f"{args.n_params / 1e6:,.1f}M parameters, {args.n_layers} layers, width {args.dim}"
    text = [f"# A loco model, step {step}", "",
            f"A Llama-style model trained with loco ({size}), exported from `{checkpoint.name}` in {dtype}. "
            "It loads as a `LlamaForCausalLM` in `transformers`, vLLM and lm-eval, without custom code.", ""]
    if kind == "bpe":
        text += [f"The tokenizer is the run's byte-level BPE; id {eos} ends a document, and begins one.", ""]
    elif kind == BYTES_KIND:
        text += ["## Input: bytes", "",
                 "This model reads UTF-8 bytes: the ids are the text's bytes (256 ids), and id 0, "
                 "`<|endoftext|>`, ends a document (a document begins after it). The folder's tokenizer "
                 "(`tokenizer.json`, which `AutoTokenizer` loads) encodes a text to exactly its bytes and decodes "
                 "them back; a NUL byte in a text has no id of its own (byte 0 is the document separator) and is "
                 "dropped:", "",
                 "```python",
                 "from transformers import AutoModelForCausalLM, AutoTokenizer",
                 "",
                 "tokenizer = AutoTokenizer.from_pretrained(FOLDER)",
                 "model = AutoModelForCausalLM.from_pretrained(FOLDER)",
                 f"ids = tokenizer('<|endoftext|>{SNIPPET_TEXT}', return_tensors='pt').input_ids",
                 f"out = model.generate(ids, max_new_tokens={snippet_tokens(args.max_seq_len)}, do_sample=True, "
                 "top_k=50)",
                 "print(tokenizer.decode(out[0], skip_special_tokens=True))",
                 "```", ""]
    else:
        text += ["The run trained on token ids without a tokenizer: feed it the ids of the shards it trained on.", ""]
    text += [f"Its context is {args.max_seq_len} tokens (the length it trained on).", ""]
    return "\n".join(text)
