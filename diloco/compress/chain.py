"""The codec chain grammar: ``"topk:0.02+2bit+zstd"`` -> a checked :class:`ChainSpec`.

A chain is up to four stages, in this order, joined by ``+``:

==========  ==========================================  ==========================================
stage       what it does                                options (``name:opt=value,...``)
==========  ==========================================  ==========================================
``dct``     orthonormal DCT-II per chunk (1-D)          ``chunk`` (64)
``topk``    per chunk keep the k largest |values|,      ``density`` (0.02) or ``k``, ``chunk`` (4096,
            indices in ceil(log2 chunk) bits, error     a power of two), ``ef`` (1.0: error-feedback
            feedback for what was not sent              decay; 0 turns it off), ``tile`` (none: chunks
                                                        of the flat vector; S: S x S tiles of each
                                                        tensor, chunk = S x S, :mod:`.tiles`)
values      ``fp32`` ``bf16`` ``fp16``                  -
            ``int8`` ``int4`` ``fp4`` ``2bit``          ``block`` (int8 256, others 128)
            ``stat2`` (2 bits, a table of bin means)    ``block`` (1024)
``zstd``    zstandard over the packed bytes             ``level`` (3)
==========  ==========================================  ==========================================

Each stage takes one positional option (``topk:0.02``, ``int8:128``, ``zstd:9``); for
``topk`` a number below 1 is a density and a whole number is k. The value stage
defaults to ``fp32`` (``topk+zstd`` sends fp32 values).

Errors name the stage and option (:class:`CodecSpecError`); :meth:`ChainSpec.canonical` writes a chain back
in one spelling, which payload headers carry and peers compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from diloco.compress import stat2
from diloco.compress.kernels import quant as q
from diloco.compress.kernels import topk as tk

VALUE_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "fp4", "2bit", "stat2")
STAGE_ORDER = ("dct", "topk", "value", "zstd")
DEFAULT_BLOCK = {"int8": 256, "int4": 128, "fp4": 128, "2bit": 128, "stat2": stat2.DEFAULT_BLOCK}
BLOCK_FORMATS = (*q.FORMATS, "stat2")  # the value formats with a block option
STAGE_NAMES = ("dct", "topk", *VALUE_FORMATS, "zstd")


class CodecSpecError(ValueError):
    """A codec chain string that cannot be parsed (unknown stage, bad option, wrong order)."""


@dataclass
class ChainSpec:
    dct_chunk: Optional[int] = None
    topk_chunk: Optional[int] = None
    topk_k: int = 0
    topk_tile: Optional[int] = None
    ef_decay: float = 1.0
    value: str = "fp32"
    block: int = 0
    zstd_level: Optional[int] = None
    options: dict[str, Any] = field(default_factory=dict)

    def canonical(self) -> str:
        parts = []
        if self.dct_chunk is not None:
            parts.append(f"dct:chunk={self.dct_chunk}")
        if self.topk_chunk is not None:
            tile = f",tile={self.topk_tile}" if self.topk_tile else ""
            parts.append(f"topk:chunk={self.topk_chunk},k={self.topk_k},ef={exact_number(self.ef_decay)}{tile}")
        parts.append(f"{self.value}:block={self.block}" if self.value in BLOCK_FORMATS else self.value)
        if self.zstd_level is not None:
            parts.append(f"zstd:level={self.zstd_level}")
        return "+".join(parts)


def exact_number(x: float) -> str:
    """``x`` as short as ``:g`` writes it where that reads back as ``x``, else every digit: a decay of 0.9999995
    must not become 1 (no decay at all) in a chain."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def _number(stage: str, key: str, text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise CodecSpecError(f"codec stage {stage!r}: option {key}={text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if kind is float and not math.isfinite(value):
        raise CodecSpecError(f"codec stage {stage!r}: option {key}={text!r} must be finite")
    return value


def parse_chain(text: str) -> ChainSpec:
    """Parse and check a chain string; errors name the stage and option."""
    if not isinstance(text, str) or not text.strip():
        raise CodecSpecError("the codec chain is empty (examples: fp32, int8, topk:0.02+2bit+zstd)")
    spec = ChainSpec()
    seen: list[str] = []  # roles so far
    names: list[str] = []
    for raw in text.strip().split("+"):
        raw = raw.strip()
        name, _, opts_text = raw.partition(":")
        name = name.strip().lower()
        if name not in STAGE_NAMES:
            raise CodecSpecError(f"unknown codec stage {name!r} in {text!r}; stages: {', '.join(STAGE_NAMES)}")
        role = "value" if name in VALUE_FORMATS else name
        if role in seen:
            raise CodecSpecError(f"codec chain {text!r} has more than one {role} stage")
        if seen and STAGE_ORDER.index(role) < STAGE_ORDER.index(seen[-1]):
            raise CodecSpecError(f"codec chain {text!r}: stage {name!r} must come before {names[-1]!r} "
                                 f"(order: dct, topk, a value format, zstd)")
        seen.append(role)
        names.append(name)
        opts: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in opts_text.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                key, value = "", item
            if key in opts:
                raise CodecSpecError(f"codec stage {name!r}: option {key or 'positional'!r} given twice")
            opts[key.strip()] = value.strip()
        _apply_stage(spec, name, opts)
    if spec.value in BLOCK_FORMATS and not spec.block:
        spec.block = DEFAULT_BLOCK[spec.value]
    if spec.dct_chunk is not None and spec.topk_tile:
        raise CodecSpecError("codec stage 'topk': tile= cuts tensors into tiles, the dct stage works on the flat "
                             "vector: give one of them")
    return spec


def _apply_stage(spec: ChainSpec, name: str, opts: dict[str, str]) -> None:
    def take(allowed: tuple[str, ...]) -> dict[str, str]:
        if "" in opts:
            if not allowed:
                raise CodecSpecError(f"codec stage {name!r} takes no options, got {opts['']!r}")
            if allowed[0] in opts:
                raise CodecSpecError(f"codec stage {name!r}: option {allowed[0]!r} given twice")
            opts[allowed[0]] = opts.pop("")
        unknown = [k for k in opts if k not in allowed]
        if unknown:
            raise CodecSpecError(f"codec stage {name!r}: unknown option {unknown[0]!r} (options: {', '.join(allowed)})")
        return opts

    if name == "dct":
        o = take(("chunk",))
        spec.dct_chunk = _number(name, "chunk", o.get("chunk", "64"), int)
        if not 1 <= spec.dct_chunk <= 4096:
            raise CodecSpecError(f"codec stage 'dct': chunk must be in [1, 4096], got {spec.dct_chunk}")
    elif name == "topk":
        o = take(("density", "k", "chunk", "ef", "tile"))
        tile = _number(name, "tile", o["tile"], int) if "tile" in o else None
        chunk = _number(name, "chunk", o.get("chunk", str(tile * tile if tile else 4096)), int)
        _check_topk(chunk)
        if tile is not None and (tile < 1 or tile * tile != chunk):
            raise CodecSpecError(f"codec stage 'topk': tiles of {tile} x {tile} need chunk={tile * tile}, got "
                                 f"chunk={chunk} (a tile's k is k per chunk scaled to its length)")
        if "density" in o and "k" in o:
            raise CodecSpecError("codec stage 'topk': give density or k, not both")
        if "density" in o:
            d = _number(name, "density", o["density"], float)
            if d >= 1 and d == int(d) and "." not in o["density"]:
                k = int(d)  # topk:41 -> k = 41
            elif 0 < d <= 1:
                k = max(1, round(d * chunk))
            else:
                raise CodecSpecError(f"codec stage 'topk': density must be in (0, 1], got {o['density']}")
        else:
            k = _number(name, "k", o.get("k", str(max(1, round(0.02 * chunk)))), int)
        _check_topk(chunk, k)
        ef = _number(name, "ef", o.get("ef", "1"), float)
        if not 0.0 <= ef <= 1.0:
            raise CodecSpecError(f"codec stage 'topk': ef (error-feedback decay) must be in [0, 1], got {ef}")
        spec.topk_chunk, spec.topk_k, spec.ef_decay, spec.topk_tile = chunk, k, ef, tile
    elif name in BLOCK_FORMATS:
        o = take(("block",))
        spec.value = name
        spec.block = _number(name, "block", o.get("block", str(DEFAULT_BLOCK[name])), int)
        try:
            q.check_block(spec.block, name) if name in q.FORMATS else stat2.check_block(spec.block)
        except ValueError as e:
            raise CodecSpecError(f"codec stage {name!r}: {e}") from None
    elif name in VALUE_FORMATS:
        take(())
        spec.value = name
    else:  # zstd
        o = take(("level",))
        spec.zstd_level = _number(name, "level", o.get("level", "3"), int)
        if not -7 <= spec.zstd_level <= 22:
            raise CodecSpecError(f"codec stage 'zstd': level must be in [-7, 22], got {spec.zstd_level}")


def _check_topk(chunk: int, k: Optional[int] = None) -> None:
    try:
        tk.check_chunk(chunk, k)
    except ValueError as e:
        raise CodecSpecError(f"codec stage 'topk': {e}") from None
