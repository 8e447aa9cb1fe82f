"""Compression of what crosses the network: codec chains, the wire format, kernels, DCT chunking.

``make_codec("topk:0.02+2bit+zstd")`` returns a :class:`Codec` with
``encode(tensor) -> bytearray`` (one buffer) and ``decode(bytes) -> tensor``; a malformed payload
raises :class:`CorruptPayload` and nothing else. See ``chain.py`` for the stages.

The pieces other packages (DeMo in ``demo_optim``) build on are exported here too:
the wire header (``wire``, ``tensor_bytes``), bit packing (``bits.py``), the per-chunk
index check, the top-k reference, the DCT basis and the 2-D chunk plan (``chunks.py``), flat
views of tensors that lie end to end (``flat.py``) and a result computed once for every worker
that received the same payload list (``shared.py``).

The weighted mean that fp32 and every codec run through is ``collective.weighted_mean``.
"""

from diloco.compress import wire
from diloco.compress.bits import bits_for, pack_bits, packed_size, unpack_bits
from diloco.compress.chunks import (RULES, ChunkPlan, block_side, from_chunks, largest_divisor_at_most, plan_for,
                                    to_chunks)
from diloco.compress.chain import STAGE_NAMES, CodecSpecError, parse_chain
from diloco.compress.checked import chunk_indices_ok
from diloco.compress.codec import Codec, make_codec
from diloco.compress.dct import dct_basis
from diloco.compress.flat import end_to_end
from diloco.compress.kernels import topk_chunks_ref
from diloco.compress.shared import SharedResult
from diloco.compress.wire import CorruptPayload, tensor_bytes

__all__ = [
    "Codec", "CodecSpecError", "CorruptPayload", "STAGE_NAMES", "make_codec", "parse_chain",
    "wire", "tensor_bytes", "bits_for", "pack_bits", "packed_size", "unpack_bits", "chunk_indices_ok",
    "topk_chunks_ref", "dct_basis", "end_to_end", "SharedResult",
    "RULES", "ChunkPlan", "block_side", "largest_divisor_at_most", "plan_for", "to_chunks", "from_chunks",
]
