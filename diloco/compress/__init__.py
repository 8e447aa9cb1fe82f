"""Compression of what crosses the network: codec chains, the wire format, kernels.

``make_codec("topk:0.02+2bit+zstd")`` returns a :class:`Codec` with
``encode(tensor) -> bytes`` and ``decode(bytes) -> tensor``; a malformed payload
raises :class:`CorruptPayload` and nothing else. See ``codec.py`` for the stages.
"""

from diloco.compress.codec import STAGE_NAMES, Codec, CodecSpecError, make_codec, parse_chain
from diloco.compress.wire import CorruptPayload

__all__ = ["Codec", "CodecSpecError", "CorruptPayload", "STAGE_NAMES", "make_codec", "parse_chain"]
