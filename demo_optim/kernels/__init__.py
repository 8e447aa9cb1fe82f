"""DeMo's hot paths, each a Triton kernel beside a torch reference with the same signature.

* ``step_encode_many(grads, moms, plans, decays, lrs)``: one step of DeMo's momentum and its encode for
  every parameter, the (indices int32, values fp32) concatenated. Where a parameter's blocks are whole (no
  padding) its momentum is kept as its DCT coefficients, ``(num_chunks, s1*s2)``::

      C = decay * C + DCT(lr * grad)      (the DCT is linear: C stays the DCT of the momentum)
      send the top-k |C| of each chunk, then set them to 0 in C

  which is the published update (``delta = decay*delta + lr*grad``, send the top-k of ``DCT(delta)``,
  ``delta -= IDCT(sent)``) without its inverse DCT: what was sent leaves the momentum by zeroing its
  coefficients. A padded parameter keeps its momentum ``delta`` in the parameter's own shape (cropping after
  the inverse DCT drops what fell on the padding) and goes through ``encode_many``.
* ``encode_many(deltas, plans)``: per parameter, the DCT of every chunk, the top-k per chunk by magnitude (ties:
  lowest index), and ``delta -= IDCT(what was kept)`` in the same pass; (indices, values), ``plan.k`` per chunk,
  indices ascending within their chunk.
* ``decode_sign_many(agg, params, lrs, plans)``: ``param -= lr * sign(IDCT(agg))`` for every parameter.
* ``signs_many(agg, outs, plans)``: ``sign(IDCT(agg))`` of every parameter into parameter-shaped outputs, the
  direction ``decode_sign_many`` applies, for workers that share one mean.

The batched entry points and how they group parameters into runs: :mod:`~demo_optim.kernels.dispatch`. The
kernels and their launchers: :mod:`~demo_optim.kernels.fused`. The torch references (``encode_ref``,
``decode_sign_ref`` and their batched forms) and the block layout helpers: :mod:`~demo_optim.kernels.reference`.
"""

from demo_optim.kernels.reference import decode_sign_ref, encode_ref, stacked_view
from demo_optim.kernels.fused import decode_sign_triton, encode_triton, kernel_fits
from demo_optim.kernels.dispatch import decode_sign_many, encode_many, signs_many, step_encode_many

__all__ = ["step_encode_many", "encode_many", "decode_sign_many", "signs_many", "encode_ref", "decode_sign_ref",
           "encode_triton", "decode_sign_triton", "kernel_fits", "stacked_view"]
