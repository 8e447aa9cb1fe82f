"""Codec chains: round trips, exact sizes, bit packing, DCT, error feedback, chain parsing, hostile payloads."""

from __future__ import annotations

import math
import random
import re
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch
import zstandard

from conftest import ROOT, child_env
from diloco.compress import CodecSpecError, CorruptPayload, make_codec, wire
from diloco.compress.zstd import ZSTD_FREE_BYTES, ZSTD_MAX_RATIO, ZSTD_THREADS_ABOVE, threaded_zstd, zstd_min_bytes
from diloco.compress.bits import bits_for, pack_bits, packed_size, unpack_bits
from diloco.compress.dct import dct_basis, dct_blocks, dct_chunks, idct_blocks, idct_chunks

CHAINS = ["fp32", "fp32+zstd", "bf16", "fp16", "int8", "int4", "fp4", "2bit", "int8:block=64+zstd", "topk:0.1",
          "topk:0.1+2bit+zstd", "topk:k=3,chunk=16,ef=0.5+fp4", "dct+topk:0.25+int8", "dct:chunk=16+fp16+zstd:1",
          "stat2", "topk:0.1+stat2:block=64+zstd", "topk:k=3,tile=4,ef=0.9+2bit"]
NO_ZSTD = [c for c in CHAINS if "zstd" not in c]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _header_size(codec, t: torch.Tensor) -> int:
    return len(wire.pack(b"", t.dtype, tuple(t.shape), codec.chain))


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax (the quantization scale's basis)."""
    n = x.numel()
    pad = -n % block
    return torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, block).amax(dim=1).repeat_interleave(block)[:n]


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("chain", ["fp32", "fp32+zstd", "zstd:19"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_lossless_chains_round_trip_exactly(chain, dtype):
    codec = make_codec(chain)
    for shape in [(), (1,), (257,), (3, 5, 11), (0,), (4, 0, 2)]:
        t = _randn(*shape).to(dtype)
        out = codec.decode(codec.encode(t))
        assert out.dtype == dtype and out.shape == t.shape
        assert torch.equal(out, t if dtype != torch.float64 else t.float().double())


# per-element error bounds for a 1-D fp32 input
BOUNDS = {
    "bf16": lambda x: x.abs() * 2**-8,
    "fp16": lambda x: x.abs() * 2**-11 + 2**-24,
    "int8": lambda x: _block_amax(x, 256) / 254,
    "int8:block=64+zstd": lambda x: _block_amax(x, 64) / 254,
    "int4": lambda x: _block_amax(x, 128) / 14,
    "fp4": lambda x: x.abs() / 3 + _block_amax(x, 128) / 128,
    "2bit": lambda x: _block_amax(x, 128) / 3,
    "topk:1.0": lambda x: torch.zeros_like(x),
    "dct:chunk=16+topk:1.0": lambda x: torch.full_like(x, 1e-5),
    "dct:chunk=16+fp32+zstd": lambda x: torch.full_like(x, 1e-5),
    "topk:k=16,chunk=16+bf16": lambda x: x.abs() * 2**-8,
}


@pytest.mark.parametrize("chain", list(BOUNDS))
def test_lossy_chains_round_trip_within_bound(chain):
    x = _randn(1000, seed=1) * torch.logspace(-2, 1, 1000)
    x[100:200] = 0.0
    err = (make_codec(chain).decode(make_codec(chain).encode(x)) - x).abs()
    assert bool((err <= BOUNDS[chain](x) * (1 + 1e-5) + 1e-30).all()), err.max()


def test_stat2_decodes_each_value_to_its_bins_mean_and_errs_less_than_absmax_levels_on_a_top_k():
    """stat2 (SparseLoCo's published values): four bins of 1.5 standard deviations around each block's mean,
    each decoded to the mean of its values, so a block keeps its sum; on the heavy-tailed values a top-k
    selects, its error is about half that of 2bit's absmax levels, which overshoot the many small ones. It
    works at any magnitude, and refuses what is not finite."""
    torch.manual_seed(0)
    x = torch.distributions.StudentT(4.0).sample((32, 4096))
    top = x.gather(1, x.abs().topk(64, dim=1).indices.sort(1).values).reshape(-1)  # 2,048 values
    errors = {}
    for chain in ("stat2", "2bit"):
        codec = make_codec(chain)
        for scale in (1e-30, 1.0, 1e30):
            payload = codec.encode(top * scale)
            y = codec.decode(payload) / scale
            errors.setdefault(chain, float((y - top).norm() / top.norm()))
        if chain == "stat2":
            assert len(payload) - _header_size(codec, top) == 2 * 16 + 2048 // 4  # two tables, four codes a byte
            blocks = y.view(2, 1024)
            torch.testing.assert_close(blocks.double().sum(1), top.view(2, 1024).double().sum(1), rtol=1e-4, atol=0)
            assert all(len(torch.unique(b)) <= 4 for b in blocks)
    assert errors["stat2"] < 0.6 * errors["2bit"], errors
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="NaN or Inf"):
            make_codec("topk:0.5+stat2").encode(torch.tensor([1.0, bad, 2.0, 3.0]))


def test_topk_sends_exact_values_of_the_largest_entries():
    x = _randn(5000, seed=2)
    codec = make_codec("topk:0.1")  # k = 410 per 4096-chunk
    y = codec.decode(codec.encode(x))
    sent = y != 0
    assert int(sent.sum()) == 410 + 410
    assert torch.equal(y[sent], x[sent])
    assert x[:4096][sent[:4096]].abs().min() >= x[:4096][~sent[:4096]].abs().max()


@pytest.mark.parametrize("chain", ["topk:0.1", "topk:0.1+2bit+zstd", "topk:k=1,chunk=16,ef=0.5+fp4"])
def test_sparse_payloads_add_their_values_in_place(chain):
    """A top-k payload's values go straight to their places: no operation of a decode makes a tensor of the
    whole vector (before, a dense copy of every payload was made and added: on a GPU, 4 GB more memory per
    decode for a 1B model). Accumulated and fresh decodes agree with the dense reconstruction."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        """The most elements of any tensor an operation made (in-place ones write what exists)."""

        def __init__(self) -> None:
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func._schema.name.endswith("_") and not func._schema.is_mutable:
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != acc.data_ptr():
                        self.numel = max(self.numel, t.numel())
            return out

    n = 40_000
    codec = make_codec(chain)
    payload = codec.encode(_randn(n, seed=4), key="w")
    dense = codec.decode(payload)
    sent = int((dense != 0).sum())
    acc = _randn(n, seed=5)
    expect = acc + 0.25 * dense
    with Largest() as seen:
        codec.decode_accumulate_(payload, acc, 0.25)
    assert torch.equal(acc, expect)
    assert seen.numel <= 4 * sent < n // 2, f"an operation made a tensor of {seen.numel} elements"
    with Largest() as seen:
        codec.decode_into_(payload, acc, 0.5)
    assert torch.equal(acc, 0.5 * dense)
    assert seen.numel <= 4 * sent < n // 2, f"an operation made a tensor of {seen.numel} elements"
    half = torch.ones(n, dtype=torch.bfloat16)  # another dtype: summed in fp32, rounded once, as a dense add does
    codec.decode_accumulate_(payload, half, 0.25)
    assert torch.equal(half, torch.ones(n, dtype=torch.bfloat16).add_(dense, alpha=0.25))


@pytest.mark.parametrize("chain", CHAINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shape_and_dtype_preserved(chain, dtype):
    for shape in [(), (1,), (300,), (2, 3, 50), (0,), (3, 0)]:
        t = _randn(*shape, seed=3).to(dtype)
        out = make_codec(chain).decode(make_codec(chain).encode(t))
        assert out.shape == t.shape and out.dtype == dtype, shape
        assert bool(torch.isfinite(out).all())


# ---- sizes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("chain", NO_ZSTD)
def test_wire_size_is_header_plus_payload_bytes(chain):
    codec = make_codec(chain)
    for shape in [(0,), (1,), (5,), (129,), (1000,), (5000,), (4, 7, 9), (12, 20)]:
        t = _randn(*shape, seed=4)
        n = t.numel()
        # a chain with tiles cuts the tensor by its shape: its sizes are the shape's
        assert len(codec.encode(t)) - _header_size(codec, t) == codec.payload_bytes(n, [shape]), shape
        # what receivers expect without asking (the transports skip their size exchange on it), whatever the values
        for values in (t, torch.zeros_like(t), t * 1e30):
            assert len(codec.encode(values, key="k", prefix=b"12345678")) - 8 == codec.wire_size(n, t.dim(), [shape])


def test_a_chain_with_zstd_states_no_wire_size():
    assert make_codec("int8+zstd").wire_size(1000) is None and make_codec("topk+zstd").wire_size(1000) is None


@pytest.mark.parametrize("chain,per_value,block", [("fp32", 4, None), ("bf16", 2, None), ("int8", 1, 256),
                                                   ("int4", 0.5, 128), ("fp4", 0.5, 128), ("2bit", 0.25, 128)])
def test_bytes_per_value(chain, per_value, block):
    codec, n = make_codec(chain), 100_003
    scales = 4 * -(-n // block) if block else 0
    assert codec.payload_bytes(n) == math.ceil(n * per_value) + scales
    assert per_value <= codec.payload_bytes(n) / n <= per_value + 0.032


def test_sparse_2bit_zstd_is_100x_smaller_than_fp32():
    n = 1 << 20
    x = _randn(n, seed=5) * torch.linspace(0.1, 3.0, n)
    codec = make_codec("topk:0.01+2bit+zstd")
    payload = codec.encode(x)
    assert len(payload) * 100 <= 4 * n
    assert codec.stats.tensors == 1 and codec.stats.wire_bytes == len(payload) and codec.stats.ratio >= 100
    assert codec.decode(payload, expect_numel=n).shape == x.shape


# ---- bit packing ------------------------------------------------------------------------------
@pytest.mark.parametrize("width", range(1, 21))
def test_pack_bits_round_trip_and_layout(width):
    g = torch.Generator().manual_seed(width)
    for count in [0, 1, 2, 3, 7, 8, 9, 1001]:
        values = torch.randint(0, 1 << width, (count,), generator=g)
        if count:
            values[0] = (1 << width) - 1
        packed = pack_bits(values, width)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_size(count, width) == -(-count * width // 8)
        assert torch.equal(unpack_bits(packed, width, count), values)
        # value i sits at bits [i*width, (i+1)*width), least significant first
        stream = sum(int(v) << (i * width) for i, v in enumerate(values.tolist()))
        assert packed.numpy().tobytes() == stream.to_bytes(packed.numel(), "little")
        # rows of streams (one per payload) unpack as each row alone, also from a slice of a wider tensor
        rows = torch.stack([packed, pack_bits(values.flip(0), width), pack_bits(values // 2, width)])
        wide = torch.cat([torch.full((3, 5), 0xFF, dtype=torch.uint8), rows], dim=1)[:, 5:]
        assert torch.equal(unpack_bits(wide, width, count), torch.stack([values, values.flip(0), values // 2]))


def test_bits_helpers():
    assert [bits_for(n) for n in (1, 2, 3, 16, 4096, 4097, 65536)] == [0, 1, 2, 4, 12, 13, 16]
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]
    with pytest.raises(ValueError):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 12, 2)


# ---- DCT --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_dct_basis_is_orthonormal(n):
    d = dct_basis(n, dtype=torch.float64)
    assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(d[0], torch.full((n,), n ** -0.5, dtype=torch.float64))


def test_dct_chunks_round_trip_with_padding():
    x = _randn(100, seed=6)
    coeffs = dct_chunks(x, 16)
    assert coeffs.numel() == 112
    assert torch.allclose(coeffs.norm(), x.norm(), rtol=1e-5)  # orthonormal: energy preserved
    assert torch.allclose(idct_chunks(coeffs, 16, 100), x, atol=1e-5)
    const = dct_chunks(torch.full((32,), 2.0), 16).view(2, 16)
    assert torch.allclose(const[:, 0], torch.full((2,), 8.0))  # a constant chunk is all DC
    assert torch.allclose(const[:, 1:], torch.zeros(2, 15), atol=1e-6)


def test_dct_blocks_round_trip():
    x = _randn(2, 16, 24, seed=7)
    coeffs = dct_blocks(x, 8, 4)
    assert coeffs.shape == (2, 2, 6, 8, 4)
    block = x[1, 8:16, 4:8]
    assert torch.allclose(coeffs[1, 1, 1], dct_basis(8) @ block @ dct_basis(4).T, atol=1e-5)
    assert torch.allclose(idct_blocks(coeffs), x, atol=1e-5)
    with pytest.raises(ValueError):
        dct_blocks(_randn(10, 16), 8, 4)


# ---- error feedback ---------------------------------------------------------------------------
def _mean_errors(chain: str, rounds: int) -> list[float]:
    codec, x = make_codec(chain), _randn(4096, seed=8)
    total, errors = torch.zeros_like(x), []
    for r in range(1, rounds + 1):
        total += codec.decode(codec.encode(x, key="w"))
        errors.append(float((total / r - x).norm() / x.norm()))
    return errors


def test_error_feedback_running_mean_converges():
    errors = _mean_errors("topk:0.05+fp32", 100)
    assert errors[0] > 0.5
    assert errors[9] < errors[0] and errors[49] < errors[9] and errors[99] < 0.1


def test_without_error_feedback_the_mean_does_not_converge():
    errors = _mean_errors("topk:0.05,ef=0+fp32", 20)
    assert min(errors) > 0.5 and errors[-1] == pytest.approx(errors[0])


@pytest.mark.parametrize("chain", ["topk:0.25+fp32", "topk:1.0+int4", "topk:0.25+2bit", "topk:0.1+bf16+zstd"])
def test_residual_holds_what_was_not_sent(chain):
    codec, x = make_codec(chain), _randn(3000, seed=9)
    y = codec.decode(codec.encode(x, key="a"))
    assert torch.allclose(y + codec.residuals["a"], x, atol=1e-6)
    assert bool(codec.residuals["a"].abs().sum() > 0)


def test_residual_survives_state_dict():
    chain = "topk:0.05+fp32"
    a = make_codec(chain)
    a.encode(_randn(1000, seed=10), key="w")
    a.encode(_randn(500, seed=11), key="b")
    state = a.state_dict()
    # the live residuals, as torch's state_dict hands out tensors (a checkpoint copies them to host memory)
    assert state["residuals"]["w"].data_ptr() == a.residuals["w"].data_ptr()
    b = make_codec(chain)
    b.load_state_dict(state)
    assert set(b.residuals) == {"w", "b"}
    assert b.residuals["w"].data_ptr() != a.residuals["w"].data_ptr()  # a load takes a copy
    x = _randn(1000, seed=12)
    expected = a.encode(x, key="w")
    assert b.encode(x, key="w") == expected
    assert make_codec(chain).encode(x, key="w") != expected  # the residual matters
    # what was held back carries over to another k, value format or decay (a resume with another density) ...
    c = make_codec("topk:0.1+int8")
    c.load_state_dict(state)
    assert torch.equal(c.residuals["w"], state["residuals"]["w"])
    # ... not to another transform, nor to a codec without error feedback
    for other in ("dct+topk:0.05+fp32", "int8"):
        with pytest.raises(ValueError, match="mean nothing here"):
            make_codec(other).load_state_dict(state)
    make_codec("int8").load_state_dict(make_codec("fp4").state_dict())  # no residuals either side: nothing lost


# ---- chain parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize("chain,message", [
    ("", "empty"),
    ("foo", "unknown codec stage 'foo'"),
    ("int8+lz4", "unknown codec stage 'lz4'"),
    ("zstd+int8", "stage 'int8' must come before 'zstd'"),
    ("int8+topk", "stage 'topk' must come before 'int8'"),
    ("int8+fp16", "more than one value stage"),
    ("topk+topk:0.1", "more than one topk stage"),
    ("int8:foo=1", "unknown option 'foo'"),
    ("int8:block=64,block=32", "given twice"),
    ("zstd:level=x", "is not an integer"),
    ("topk:1.5", "density must be in (0, 1]"),
    ("topk:0", "density must be in (0, 1]"),
    ("topk:density=-0.1", "density must be in (0, 1]"),
    ("topk:density=nan", "must be finite"),
    ("topk:0.1,k=4", "density or k, not both"),
    ("topk:k=5000", "k must be in [1, chunk=4096]"),
    ("topk:chunk=1000", "chunk must be a power of two"),
    ("topk:ef=2", "ef (error-feedback decay) must be in [0, 1]"),
    ("int8:block=100", "block size must be a power of two"),
    ("zstd:99", "level must be in [-7, 22]"),
    ("dct:chunk=0", "chunk must be in [1, 4096]"),
    ("topk:tile=8,chunk=32", "tiles of 8 x 8 need chunk=64"),
    ("dct+topk:tile=8", "give one of them"),
])
def test_bad_chains_name_the_problem(chain, message):
    with pytest.raises(CodecSpecError, match=re.escape(message)):
        make_codec(chain)


@pytest.mark.parametrize("chain,canonical", [
    ("topk:0.02", "topk:chunk=4096,k=82,ef=1+fp32"),
    ("topk:k=41,chunk=2048", "topk:chunk=2048,k=41,ef=1+fp32"),
    ("topk:41", "topk:chunk=4096,k=41,ef=1+fp32"),
    ("topk:1.0", "topk:chunk=4096,k=4096,ef=1+fp32"),
    ("int8:block=128", "int8:block=128"),
    ("topk:tile=64,k=64,ef=0.95", "topk:chunk=4096,k=64,ef=0.95,tile=64+fp32"),
    ("int8:64", "int8:block=64"),
    ("int4", "int4:block=128"),
    ("zstd:9", "fp32+zstd:level=9"),
    (" DCT + topk:0.5,chunk=64,ef=0.9 + 2bit + zstd ",
     "dct:chunk=64+topk:chunk=64,k=32,ef=0.9+2bit:block=128+zstd:level=3"),
])
def test_chain_options_parse_to_canonical(chain, canonical):
    codec = make_codec(chain)
    assert codec.chain == canonical
    assert make_codec(canonical).chain == canonical


@pytest.mark.parametrize("chain,message", [("int8:128,block=64", "given twice"), ("fp32:3", "takes no options")])
def test_positional_option_errors(chain, message):
    with pytest.raises(CodecSpecError, match=message):
        make_codec(chain)


# ---- encode / decode validation ---------------------------------------------------------------
def test_decode_rejects_another_codec_and_wrong_numel():
    x = _randn(300, seed=13)
    codec = make_codec("int8")
    payload = codec.encode(x)
    with pytest.raises(CorruptPayload, match="codec mismatch"):
        make_codec("int4").decode(payload)
    with pytest.raises(CorruptPayload, match="codec mismatch"):
        make_codec("int8:block=128").decode(payload)
    with pytest.raises(CorruptPayload, match="shape mismatch"):
        codec.decode(payload, expect_numel=301)
    with pytest.raises(CorruptPayload, match="shape mismatch"):
        codec.decode_accumulate_(payload, torch.zeros(299))
    assert codec.decode(payload, expect_numel=300).shape == (300,)
    with pytest.raises(CorruptPayload, match="above the limit"):
        make_codec("int8", max_numel=299).decode(payload)


@pytest.mark.parametrize("chain", ["fp32", "int8", "topk:0.5+2bit+zstd", "dct+fp16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encode_of_nan_or_inf_raises_value_error(chain, bad):
    codec = make_codec(chain)
    x = _randn(200, seed=14)
    x[17] = bad
    with pytest.raises(ValueError) as info:
        codec.encode(x, key="k")
    assert not isinstance(info.value, CorruptPayload)
    assert codec.residuals == {} and codec.stats.tensors == 0


def test_encode_rejects_unsupported_dtype_and_too_many_values():
    with pytest.raises(ValueError, match="dtype"):
        make_codec("fp32").encode(torch.arange(10))
    with pytest.raises(ValueError, match="limit"):
        make_codec("fp32", max_numel=10).encode(torch.zeros(11))


@pytest.mark.parametrize("chain", ["int8", "topk:0.25+2bit", "dct:chunk=16+fp16"])
def test_decode_accumulate_adds_weighted_decode(chain):
    codec = make_codec(chain)
    payload = codec.encode(_randn(10, 30, seed=15))
    base = _randn(300, seed=16)
    out = base.clone()
    codec.decode_accumulate_(payload, out, 0.25)
    assert torch.allclose(out, base + 0.25 * codec.decode(payload).reshape(-1), atol=1e-6)


# ---- hostile payloads -------------------------------------------------------------------------
FUZZ_CHAINS = ["fp32", "bf16", "fp16+zstd", "int8:block=64", "int4:block=32", "fp4", "2bit:block=16+zstd",
               "topk:k=5,chunk=32", "topk:k=3,chunk=16+int4:block=16", "topk:k=4,chunk=64+fp4+zstd",
               "dct:chunk=16+topk:0.25,chunk=32+int8:block=32", "dct:chunk=8+bf16", "stat2:block=16+zstd",
               "topk:k=4,chunk=32+stat2:block=8", "topk:k=4,tile=8+int4:block=16"]


def _decodes(codec, data: bytes) -> bool:
    """True when ``data`` decodes (to a finite tensor of its header's shape and dtype), False on CorruptPayload."""
    try:
        out = codec.decode(data)
    except CorruptPayload:
        return False
    header = wire.parse_header(data, codec.max_numel)
    assert out.shape == header.shape and out.dtype == header.dtype
    assert bool(torch.isfinite(out).all())
    return True


def _flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
    return bytes(b)


def _zstd_frame_declaring(size: int, body: bytes = bytes(8)) -> bytes:
    """A zstd frame whose header claims ``size`` content bytes, then one raw block holding ``body``."""
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, size) + struct.pack("<I", len(body) << 3 | 1)[:3] + body


@pytest.mark.parametrize("chain", FUZZ_CHAINS)
def test_fuzzed_payloads_raise_corrupt_payload_or_decode_finite(chain):
    rng = random.Random(chain)
    encoder, codec = make_codec(chain), make_codec(chain, max_numel=4096)
    zc = zstandard.ZstdCompressor() if "zstd" in chain else None

    def body(raw: bytes) -> bytes:
        return zc.compress(raw) if zc else raw

    decoded = {"repacked": 0, "rejected": 0}
    for i in range(250):
        shape = rng.choice([(rng.randint(50, 300),), (rng.randint(2, 12), rng.randint(5, 25))])
        x = torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 10.0 ** rng.uniform(-20, 20)
        valid = encoder.encode(x, key=i % 3)
        header = wire.parse_header(valid, codec.max_numel)
        payload = bytes(valid[header.offset:])
        raw = zstandard.ZstdDecompressor().decompress(payload) if zc else payload
        # damaged in transit: the checksum must catch every one
        for bad in (_flip(rng, valid), valid[:rng.randrange(len(valid))], valid + rng.randbytes(rng.randint(1, 9)),
                    rng.randbytes(rng.randint(0, 200)), wire.MAGIC + bytes([1]) + rng.randbytes(rng.randint(0, 80))):
            assert not _decodes(codec, bad)
        # well-formed frames (valid checksum) around bad contents: CorruptPayload or a finite tensor
        numel = rng.choice([0, 1, 7, 64, 300, 4096, 4097, 2**33])
        dims = rng.choice([(numel,), (1, numel), (numel, 3)]) if numel <= 4096 else (numel,)
        fake_len = codec.payload_bytes(numel) if numel <= 4096 and rng.random() < 0.7 else rng.randint(0, 400)
        dtype = rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16])
        for bad in (wire.pack(_flip(rng, payload), header.dtype, header.shape, header.chain),
                    wire.pack(body(_flip(rng, raw)), header.dtype, header.shape, header.chain),
                    wire.pack(body(rng.randbytes(len(raw))), header.dtype, header.shape, header.chain),
                    wire.pack(body(rng.randbytes(fake_len)), dtype, dims, header.chain)):
            decoded["repacked" if _decodes(codec, bad) else "rejected"] += 1
        if zc:
            need = len(raw)
            for frame in (_zstd_frame_declaring(rng.choice([need + 1, 2**40, 2**63 - 1]), raw[:8]),
                          zstandard.ZstdCompressor(write_content_size=False).compress(raw + b"\0"),
                          payload[:rng.randrange(len(payload))]):
                assert not _decodes(codec, wire.pack(frame, header.dtype, header.shape, header.chain))
    assert decoded["repacked"] > 50 and decoded["rejected"] > 50  # both the deep checks and decoding were reached


def test_zstd_bomb_is_rejected_without_inflating():
    codec = make_codec("fp32+zstd")
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(50_000_000))
    with pytest.raises(CorruptPayload, match="zstd"):
        codec.decode(wire.pack(bomb, torch.float32, (10,), codec.chain))
    with pytest.raises(CorruptPayload, match="declares"):
        codec.decode(wire.pack(_zstd_frame_declaring(2**62), torch.float32, (10,), codec.chain))


def _zstd_rle_frame(size: int) -> bytes:
    """A valid zstd frame of ``size`` zero bytes: 4 bytes per 128 KiB RLE block (a 256 MiB frame is 8 KiB)."""
    frame = [struct.pack("<IBQ", 0xFD2FB528, 0xE0, size)]  # single segment, 8-byte content size
    while size:
        n = min(size, 1 << 17)
        size -= n
        frame.append(struct.pack("<I", n << 3 | 1 << 1 | (size == 0))[:3] + b"\0")  # RLE block: n times byte 0
    return b"".join(frame)


def test_zstd_bomb_declaring_many_values_is_refused_before_inflating():
    codec = make_codec("fp32+zstd")
    frame = _zstd_rle_frame(4 << 26)  # 2^26 fp32 zeros: 256 MiB
    assert zstandard.frame_content_size(frame) == 4 << 26 and len(frame) < 10_000
    bomb = wire.pack(frame, torch.float32, (1 << 26,), codec.chain)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptPayload, match="zstd bomb"):
            codec.decode(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20  # the frame was never inflated (zstandard's output is a traced bytes object)
    # a caller that knows the size vouches for it; a wrong size is still refused before inflating
    with pytest.raises(CorruptPayload, match="shape mismatch"):
        codec.decode(bomb, expect_numel=1 << 20)
    with pytest.raises(CorruptPayload, match="shape mismatch"):
        codec.decode_accumulate_(bomb, torch.zeros(10))


def test_zstd_bomb_bound_is_on_the_sections_the_chain_needs():
    # top-k: 2^22 declared values need only their selected values and indices: 2,048 x (fp32 + 12-bit index)
    codec = make_codec("topk:k=2,chunk=4096+zstd")
    need = codec.payload_bytes(1 << 22)
    assert need == 4 * 2048 + 2048 * 12 // 8 < ZSTD_FREE_BYTES
    x = torch.zeros(1 << 22)
    x[::4096] = torch.arange(1.0, 1025.0)
    payload = codec.encode(x)
    assert 4 * x.numel() > 500 * len(payload)
    assert torch.equal(codec.decode(payload), x)  # a dense size 500x the payload's: decodes
    # a chain needing more than ZSTD_FREE_BYTES: the bound is ZSTD_MAX_RATIO x the compressed bytes present
    codec = make_codec("int8+zstd")
    numel = 1 << 21
    need = codec.payload_bytes(numel)
    frame = _zstd_rle_frame(need)
    for extra, ok in ((zstd_min_bytes(need) - len(frame), True), (zstd_min_bytes(need) - len(frame) - 1, False)):
        body = frame + struct.pack("<II", 0x184D2A50, extra - 8) + bytes(extra - 8)
        payload = wire.pack(body, torch.float32, (numel,), codec.chain)
        if ok:
            assert torch.equal(codec.decode(payload), torch.zeros(numel))
        else:
            with pytest.raises(CorruptPayload, match=f"more than {ZSTD_MAX_RATIO}x"):
                codec.decode(payload)
            assert torch.equal(codec.decode(payload, expect_numel=numel), torch.zeros(numel))


@pytest.mark.parametrize("chain,numel", [("fp32+zstd", 1 << 19), ("int8:block=64+zstd", 1 << 21),
                                         ("topk:0.5+int8+zstd", 1 << 20), ("dct:chunk=16+fp16+zstd:1", 1 << 20)])
def test_a_payload_beyond_the_bomb_bound_decodes_only_with_its_size(chain, numel):
    """Nothing is padded: what compresses better than the bound (zeros, ones) needs expect_numel; data that does
    not (noise) decodes without it; the transports always pass the size."""
    codec = make_codec(chain)
    need = codec.payload_bytes(numel)
    assert need > ZSTD_FREE_BYTES
    for kind, x in (("zeros", torch.zeros(numel)), ("ones", torch.ones(numel)), ("randn", _randn(numel, seed=21))):
        payload = codec.encode(x, key="k")
        header = wire.parse_header(payload, codec.max_numel)
        body = payload[header.offset:]
        raw = zstandard.ZstdDecompressor().decompress(body)
        level = codec.spec.zstd_level
        zc = threaded_zstd(level) if need > ZSTD_THREADS_ABOVE else zstandard.ZstdCompressor(level=level)
        assert len(raw) == need and zc.compress(raw) == body
        sized = codec.decode(payload, expect_numel=numel)
        assert bool(torch.isfinite(sized).all())
        if len(body) >= zstd_min_bytes(need):
            assert kind == "randn" or chain.startswith("topk") or chain.startswith("dct")
            assert torch.equal(codec.decode(payload), sized)
        else:
            assert kind != "randn"
            with pytest.raises(CorruptPayload, match="pass expect_numel="):
                codec.decode(payload)
        out = torch.zeros(numel)
        codec.decode_accumulate_(payload, out)  # the size comes from out
        assert torch.equal(out.view(sized.shape), sized.float())


def _topk_payload(codec, shape: tuple[int, ...], indices: list[int], values: torch.Tensor) -> bytes:
    packed = pack_bits(torch.tensor(indices), bits_for(codec.spec.topk_chunk))
    return wire.pack(values.numpy().tobytes() + packed.numpy().tobytes(), torch.float32, shape, codec.chain)


@pytest.mark.parametrize("chain,numel,indices,ok", [
    ("topk:k=4,chunk=16", 40, [0, 3, 7, 15, 1, 2, 3, 4, 0, 1, 5, 7], True),
    ("topk:k=4,chunk=16", 40, [0, 3, 7, 15, 1, 2, 3, 4, 0, 1, 5, 8], False),  # 8 is past the 8-value last chunk
    ("topk:k=4,chunk=16", 40, [0, 3, 3, 15, 1, 2, 3, 4, 0, 1, 5, 7], False),  # repeated
    ("topk:k=4,chunk=16", 40, [0, 3, 7, 15, 4, 3, 2, 1, 0, 1, 5, 7], False),  # decreasing
    ("topk:k=4,chunk=16", 40, [0, 3, 7, 15, 1, 2, 3, 4, 7, 1, 2, 3], False),  # decreasing in the last chunk
    ("topk:k=2,chunk=4096", 5000, [5, 4095, 3, 903], True),  # 12-bit indices
    ("topk:k=2,chunk=4096", 5000, [5, 4095, 3, 904], False),
    ("topk:k=2,chunk=4096", 5000, [4095, 5, 3, 900], False),
])
def test_topk_index_validation(chain, numel, indices, ok):
    codec = make_codec(chain)
    values = torch.arange(1, len(indices) + 1, dtype=torch.float32)
    data = _topk_payload(codec, (numel,), indices, values)
    if not ok:
        with pytest.raises(CorruptPayload, match="indices"):
            codec.decode(data)
        return
    k, chunk = codec.spec.topk_k, codec.spec.topk_chunk
    flat = torch.tensor(indices) + torch.arange(len(indices)) // k * chunk
    assert torch.equal(codec.decode(data), torch.zeros(numel).index_put_((flat,), values))


def test_tiles_keep_the_largest_of_each_tile_and_refuse_indices_outside_it():
    """Tensors of (6, 8), (6,) and (5,): tiles of 3 x 4 (k = 4 x 12 / 16 = 3), chunks of 3 and 1 (one kept each);
    the values go class by class (tiles of one length and k), tile by tile, indices row-major inside a tile."""
    codec = make_codec("topk:k=4,tile=4+fp32")
    shapes = [(6, 8), (6,), (5,)]
    x = torch.randn(59, generator=torch.Generator().manual_seed(3))
    got = codec.decode(codec.encode(x, shapes=shapes), shapes=shapes)
    m, want = x[:48].view(6, 8), torch.zeros(59)
    for r0 in (0, 3):
        for c0 in (0, 4):
            tile = m[r0:r0 + 3, c0:c0 + 4]
            for i in tile.reshape(-1).abs().topk(3).indices.tolist():
                want[(r0 + i // 4) * 8 + c0 + i % 4] = tile.reshape(-1)[i]
    for a, length in [(48, 3), (51, 3), *((54 + j, 1) for j in range(5))]:
        i = int(x[a:a + length].abs().argmax())
        want[a + i] = x[a + i]
    assert torch.equal(got, want)
    t = codec.tiling(shapes, 59)
    assert t.count == 4 * 3 + 2 + 5 and t.index_bits == 4
    # one tile's index at 12 (a tile holds 12 values), then a repeated index: refused before anything is written
    good = [0, 1, 2] * 4 + [0, 1] + [0] * 5
    for bad in ([12, 1, 2] + good[3:], [0, 0, 2] + good[3:], good[:12] + [3, 0] + good[14:]):
        data = wire.pack(torch.ones(19).numpy().tobytes() + pack_bits(torch.tensor(bad), 4).numpy().tobytes(),
                         torch.float32, (59,), codec.chain)
        with pytest.raises(CorruptPayload, match="indices"):
            codec.decode(data, shapes=shapes)
    # shapes the payload was not made for: refused by its size
    with pytest.raises(CorruptPayload):
        codec.decode(codec.encode(x, shapes=shapes))


@pytest.mark.parametrize("shapes", [[(8, 16), (16,), (2, 4, 8)], [(6, 9), (10,)]])
def test_tiles_decode_each_tiles_largest_in_place(shapes):
    """Tile widths all powers of two (a shift finds a value's row in its tile) or not (a division does): each
    tile of the decoded vector holds that tile's largest values where they were, and nothing else."""
    from diloco.compress.tiles import kept, tile_of

    codec = make_codec("topk:k=6,tile=4+fp32")
    n = sum(math.prod(s) for s in shapes)
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    got = codec.decode(codec.encode(x, shapes=shapes), shapes=shapes)
    assert codec.tiling(shapes, n).pow2_widths == (shapes[0] == (8, 16))
    at = 0
    for shape in shapes:
        size = math.prod(shape)
        rows, cols, s1, s2 = tile_of(shape, 4)
        xt, gt = (v[at:at + size].view(rows // s1, s1, cols // s2, s2).permute(0, 2, 1, 3).reshape(-1, s1 * s2)
                  for v in (x, got))
        keep = torch.zeros_like(xt, dtype=torch.bool).scatter_(1, xt.abs().topk(kept(6, s1 * s2, 16)).indices, True)
        assert torch.equal(gt, torch.where(keep, xt, 0.0)), shape
        at += size


def test_topk_payload_with_nan_values_is_rejected():
    codec = make_codec("topk:k=4,chunk=16")
    values = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    with pytest.raises(CorruptPayload, match="NaN"):
        codec.decode(_topk_payload(codec, (16,), [0, 1, 2, 3], values))


@pytest.mark.parametrize("chain,payload,dtype", [
    ("fp32", struct.pack("<f", 1e10), torch.float16),
    ("int8", struct.pack("<f", 1e30) + bytes([127]), torch.float16),
    ("fp32", struct.pack("<f", 3.4e38), torch.bfloat16),
], ids=["fp32-fp16", "int8-fp16", "fp32-bf16"])
def test_decode_to_half_precision_never_returns_inf(chain, payload, dtype):
    codec = make_codec(chain)
    _decodes(codec, wire.pack(payload, dtype, (1,), codec.chain))  # asserts finite values unless CorruptPayload


def test_decode_checks_the_payload_length_before_allocating():
    script = textwrap.dedent("""
        import resource, struct, torch
        from diloco.compress import CorruptPayload, make_codec, wire
        vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
        codec = make_codec("fp32")
        try:
            codec.decode(wire.pack(b"", torch.float32, (1 << 30,), codec.chain))
        except CorruptPayload:
            print("CorruptPayload")
        codec = make_codec("fp32+zstd")  # 2^28 values (1 GiB) from 32 KiB of zstd RLE blocks
        frame = struct.pack("<IBQ", 0xFD2FB528, 0xE0, 1 << 30) + (struct.pack("<I", 1 << 20 | 2)[:3] + bytes(1)) * 8191
        frame += struct.pack("<I", 1 << 20 | 3)[:3] + bytes(1)
        try:
            codec.decode(wire.pack(frame, torch.float32, (1 << 28,), codec.chain))
        except CorruptPayload:
            print("CorruptPayload")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), cwd=ROOT,
                          timeout=120)
    assert proc.stdout.split() == ["CorruptPayload"] * 2, proc.stderr[-2000:]


@pytest.mark.parametrize("chain,value", [("fp4", 1e37), ("int8", 2e38), ("dct:chunk=16", 3e38)])
def test_encode_of_finite_values_decodes_or_raises_value_error(chain, value):
    codec = make_codec(chain)
    x = torch.full((64,), value)
    try:
        payload = codec.encode(x)
    except ValueError:
        return
    assert _decodes(codec, payload)


# ---- one buffer: header, prefix, reuse, checksum ----------------------------------------------------
def test_header_is_aligned_and_checksummed_with_xxh3_of_the_header_and_the_piece_digests():
    import xxhash

    data = wire.pack(b"\x01\x02\x03", torch.float32, (3, 1), "fp32")
    header = wire.parse_header(data, 100)
    assert header.offset % wire.ALIGN == 0 and header.offset == wire.header_size(2, "fp32")
    tail = header.offset - 16
    (crc,) = struct.unpack_from("<Q", data, tail + 8)
    assert crc == xxhash.xxh3_64_intdigest(bytes(data[:tail + 8]) + xxhash.xxh3_64_digest(b"\x01\x02\x03"))
    padded = bytearray(data)
    padded[wire._FIXED.size + 16 + len("fp32")] = 1  # a padding byte that is not zero
    with pytest.raises(CorruptPayload, match="padding|checksum"):
        wire.parse_header(padded, 100)


def test_checksum_is_the_same_however_the_payload_is_fed(monkeypatch):
    """Pieces of HASH_PIECE bytes, each hashed alone (several at once on threads): feeding the payload in any
    split gives the checksum of the definition, and a change in any piece changes it."""
    import xxhash

    monkeypatch.setattr(wire, "HASH_PIECE", 64)
    data = random.Random(0).randbytes(64 * 9 + 17)
    want = xxhash.xxh3_64_intdigest(b"head" + b"".join(xxhash.xxh3_64_digest(data[a:a + 64])
                                                       for a in range(0, len(data), 64)))
    assert wire.checksum(memoryview(b"head"), memoryview(data)) == want
    for cuts in ([5, 64, 200, 201, 600], [64 * 4], [1] * 70, [63, 66, 64 * 5]):
        h = wire.Checksum(b"head")
        at = 0
        for c in cuts + [len(data)]:
            h.update(memoryview(data)[at:max(at, min(c + at, len(data)))])
            at = max(at, min(c + at, len(data)))
        assert at == len(data) and h.intdigest() == want
    changed = bytearray(data)
    changed[64 * 5 + 3] ^= 1
    assert wire.checksum(memoryview(b"head"), memoryview(changed)) != want
    assert wire.checksum(memoryview(b"head"), memoryview(b"")) == xxhash.xxh3_64_intdigest(b"head")


@pytest.mark.parametrize("chain", CHAINS)
def test_prefix_is_written_in_front_of_the_same_payload(chain):
    x = _randn(3000, seed=5)
    plain, with_prefix = make_codec(chain), make_codec(chain)
    a = plain.encode(x, key="k")
    b = with_prefix.encode(x, key="k", prefix=b"12345678")
    assert bytes(b[:8]) == b"12345678" and bytes(b[8:]) == bytes(a)
    assert plain.stats.wire_bytes == with_prefix.stats.wire_bytes == len(a)


@pytest.mark.parametrize("chain", ["fp32", "int8", "bf16+zstd"])
def test_an_output_buffer_is_reused_only_once_nothing_holds_it(chain, monkeypatch):
    import diloco.compress.codec as codec_module

    monkeypatch.setattr(codec_module, "POOL_MIN", 64)
    codec = make_codec(chain)
    x, y = _randn(5000, seed=1), _randn(5000, seed=2)
    first = codec.encode(x)
    kept = bytes(first)
    view = memoryview(first)
    second = codec.encode(y)  # ``first`` is held (and viewed): it must not be written again
    assert second is not first and bytes(first) == kept
    assert torch.equal(codec.decode(first), codec.decode(make_codec(chain).encode(x)))
    del view
    ident = id(first)
    del first
    third = codec.encode(x)
    assert bytes(third) == kept  # the released buffer (possibly reused) holds the new payload whole
    assert id(third) == ident or len(codec._buffers._bufs) <= codec_module.POOL_KEEP
    assert bytes(second) == bytes(make_codec(chain).encode(y))


@pytest.mark.parametrize("chain", ["fp32", "bf16", "int8", "int4:block=32", "fp4", "topk:0.1+int8", "dct+fp16+zstd"])
def test_decode_into_writes_what_decode_returns(chain):
    codec = make_codec(chain)
    x = _randn(4099, seed=3)
    payload = codec.encode(x)
    out = torch.full((4099,), float("nan"))
    codec.decode_into_(payload, out)
    assert torch.equal(out, codec.decode(payload))
    # with a weight: what zeros + decode_accumulate_ give, in one pass
    codec.decode_into_(payload, out, 0.3)
    acc = torch.zeros(4099)
    codec.decode_accumulate_(payload, acc, 0.3)
    assert torch.allclose(out, acc, rtol=1e-6, atol=0) and not torch.equal(out, codec.decode(payload))


@pytest.mark.parametrize("chain", ["fp32", "bf16", "int8", "fp4"])
def test_an_accumulation_that_overflows_is_refused(chain):
    codec = make_codec(chain)
    payload = codec.encode(_randn(1000, seed=4) * 1e30)
    out = torch.zeros(1000)
    codec.decode_accumulate_(payload, out, 1.0)  # large but finite
    with pytest.raises(CorruptPayload, match="overflow"):
        codec.decode_accumulate_(payload, out, 1e10)


def test_large_zstd_sections_use_the_multithreaded_compressor(monkeypatch):
    import diloco.compress.zstd as zstd_module

    monkeypatch.setattr(zstd_module, "ZSTD_THREADS_ABOVE", 1000)
    codec = make_codec("int8+zstd")
    x = _randn(20000, seed=6)
    payload = codec.encode(x)
    assert codec.zstd.threads is not None
    body = memoryview(payload)[wire.parse_header(payload, codec.max_numel).offset:]
    assert zstandard.frame_content_size(body) == codec.payload_bytes(20000)  # the size is declared
    assert torch.equal(codec.decode(payload), make_codec("int8").decode(make_codec("int8").encode(x)))


def test_a_dct_payload_whose_sum_overflows_is_refused_not_added_as_inf():
    """Two finite float32 values can sum past float32's range. The other value formats check each piece as they
    add it; the DCT path added and returned infinities without a word."""
    from diloco.compress import make_codec
    from diloco.compress.wire import CorruptPayload

    codec = make_codec("dct:chunk=4+fp32")
    payload = codec.encode(torch.tensor([3e38, 0.0, 0.0, 0.0]))
    out = torch.full((4,), 3e38)
    with pytest.raises(CorruptPayload, match="overflow"):
        codec.decode_accumulate_(payload, out, 1.0)
    fine = torch.zeros(4)
    codec.decode_accumulate_(payload, fine, 1.0)
    assert torch.isfinite(fine).all() and fine[0] == pytest.approx(3e38, rel=1e-5)


def test_a_header_with_a_dimension_past_the_limit_is_corrupt_even_with_no_elements():
    """A shape (0, 2**63) has no elements, so its element count passed; its view then raised a TypeError, not the
    CorruptPayload every bad input raises."""
    import struct

    from diloco.compress import make_codec, wire
    from diloco.compress.wire import CorruptPayload

    codec = make_codec("fp32")
    payload = bytearray(codec.encode(torch.empty((0, 5))))
    at = payload.find(struct.pack("<Q", 5))
    payload[at:at + 8] = struct.pack("<Q", 2 ** 63)
    tail = len(payload) - wire._TAIL.size  # an empty payload: its header ends the message
    length, _ = wire._TAIL.unpack_from(payload, tail)
    wire._TAIL.pack_into(payload, tail, length, wire.checksum(memoryview(payload)[:tail + 8], memoryview(b"")))
    with pytest.raises(CorruptPayload, match="a dimension above the limit"):
        codec.decode(payload)



@pytest.mark.parametrize("chain", ["fp32", "int8", "topk:0.02+2bit+zstd"])
def test_host_codecs_run_each_op_on_one_thread_and_give_the_count_back(chain):
    """On the CPU every op of an encode and a decode runs on one torch thread (a bucket's hundreds of small ops
    each opened a parallel region, and on a loaded machine each waited at its barrier); the caller's thread count
    is put back after the call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Threads(TorchDispatchMode):
        seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Threads.seen.add(torch.get_num_threads())
            return func(*args, **(kwargs or {}))

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(300_000)
        codec = make_codec(chain)
        out = torch.zeros_like(x)
        with Threads():
            payload = codec.encode(x, key="k")
            codec.decode_accumulate_(payload, out, 0.5)
            codec.decode(payload, expect_numel=x.numel())
        assert Threads.seen == {1}, Threads.seen
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
