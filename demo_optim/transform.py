"""Alias module: DeMo's chunk plan and chunked transform now live in :mod:`diloco.compress.chunks`."""

from diloco.compress import (RULES, ChunkPlan, block_side, from_chunks, largest_divisor_at_most, plan_for,
                             to_chunks)

__all__ = ["RULES", "ChunkPlan", "block_side", "from_chunks", "largest_divisor_at_most", "plan_for", "to_chunks"]
