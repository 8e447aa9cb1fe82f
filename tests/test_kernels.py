"""Triton kernels against their torch references (in the interpreter on CPU, compiled on a GPU: conftest's
KERNEL_DEVICES); reference properties. References always run on the CPU, from the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import KERNEL_DEVICES
from diloco.compress.kernels import quant as q
from diloco.compress.kernels import topk as tk

FORMATS = list(q.FORMATS)


def _quant_inputs(block: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(block)

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g)

    zeros = randn(4 * block)
    zeros[block:2 * block] = 0.0  # a whole block of zeros
    zeros[::7] = 0.0
    zeros[1::11] = -0.0
    ties = torch.tensor([1.5, -1.5, 0.0, 0.75, -0.75, 1.5, 3.0, -3.0]).repeat(block)[: 2 * block + 3]
    extreme = randn(3 * block + 1)
    extreme[:4] = torch.tensor([1e30, -1e30, 1e-30, -1e-30])
    extreme[block:2 * block] *= 1e-30  # a block of only tiny values
    extreme[2 * block:3 * block] *= 1e30  # a block of only huge values
    return {
        "empty": randn(0),
        "one": randn(1),
        "partial": randn(3 * block + 5),
        "exact": randn(4 * block),
        "programs": randn(2 * 2048 + 3),  # several kernel programs, the last one partial
        "zeros": zeros,
        "ties": ties,
        "extreme": extreme,
        "denormal": randn(block + 1) * 1e-40,
    }



@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("block", [4, 64, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_kernel_matches_reference(fmt, block, device):
    for name, x in _quant_inputs(block).items():
        packed, scales = (t.cpu() for t in q.quantize_triton(x.to(device), block, fmt))
        ref_packed, ref_scales = q.quantize_ref(x, block, fmt)
        assert packed.dtype == torch.uint8 and packed.numel() == q.packed_bytes(x.numel(), fmt), name
        assert scales.numel() == q.num_blocks(x.numel(), block), name
        assert torch.equal(packed, ref_packed), name
        assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)), name  # bit for bit


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("block", [4, 64, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_matches_reference(fmt, block, device):
    g = torch.Generator().manual_seed(7)
    for name, x in _quant_inputs(block).items():
        n = x.numel()
        packed, scales = q.quantize_ref(x, block, fmt)
        # also every code the quantizer never writes (int8 -128, int4 code 0, fp4 negative zero)
        noise = torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=g)
        for codes in (packed, noise):
            got = q.dequantize_triton(codes.to(device), scales.to(device), n, block, fmt).cpu()
            assert torch.equal(got, q.dequantize_ref(codes, scales, n, block, fmt)), name
            base = torch.randn(n, generator=g)
            acc = q.dequantize_triton(codes.to(device), scales.to(device), n, block, fmt, out=base.clone().to(device),
                                      weight=0.37, accumulate=True).cpu()
            ref = q.dequantize_ref(codes, scales, n, block, fmt, out=base.clone(), weight=0.37, accumulate=True)
            assert torch.allclose(acc, ref, rtol=1e-6, atol=1e-6), name
            # written, not added, with the weight: both give weight x value, rounded once
            full = torch.full((n,), float("nan"))
            got = q.dequantize_triton(codes.to(device), scales.to(device), n, block, fmt, out=full.clone().to(device),
                                      weight=0.37).cpu()
            ref = q.dequantize_ref(codes, scales, n, block, fmt, out=full.clone(), weight=0.37)
            assert torch.equal(got, ref), name
            assert torch.equal(ref, q.dequantize_ref(codes, scales, n, block, fmt) * 0.37), name


def _defined_value(fmt: str, code: int) -> float:
    """The unscaled value of one code, from the module docstring's definition (plain Python)."""
    if fmt == "int8":
        return float(code - 256 if code >= 128 else code)
    if fmt == "int4":
        return float(code - 8)
    if fmt == "2bit":
        return code - 1.5
    e, negative = code & 7, code >= 8  # fp4
    mag = 2.0 ** (e - 7) if e else 0.0
    return -mag if negative else mag


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_byte_decodes_to_its_defined_values(fmt):
    _, bits, per = q.FORMATS[fmt]
    codes = torch.arange(256, dtype=torch.uint8)
    for scale in (1.0, 0.3, 7e-30):  # one block of 256 bytes, then the same bytes in blocks of 4 values
        got = q.dequantize_ref(codes, torch.tensor([scale]), 256 * per, 256 * per, fmt)
        want = [_defined_value(fmt, (b >> (i * bits)) & ((1 << bits) - 1)) for b in range(256) for i in range(per)]
        want = torch.tensor(want, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (fmt, scale)
        blocks = q.dequantize_ref(codes, torch.full((256 * per // 4,), scale), 256 * per, 4, fmt)
        assert torch.equal(blocks, got)


def _topk_inputs(chunk: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(chunk)

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g)

    zeros = randn(2 * chunk + 3)
    zeros[:chunk] = 0.0  # an all-zero chunk: k of the (tied) zeros still go
    zeros[chunk + 1::3] = -0.0
    extreme = randn(chunk + 7)
    extreme[:4] = torch.tensor([1e30, -1e30, 1e-30, -1e-30])
    extreme[chunk:] *= 1e-30
    nonfinite = randn(2 * chunk + 3)  # more NaN than k in a chunk, Inf of both signs, NaN in the short last one
    nonfinite[1:chunk:2] = math.nan
    nonfinite[2:chunk:4] = math.inf
    nonfinite[chunk + 1] = -math.inf
    nonfinite[-1] = math.nan
    return {
        "nonfinite": nonfinite,
        "empty": randn(0),
        "one": randn(1),
        "partial": randn(2 * chunk + 5),
        "exact": randn(2 * chunk),
        "zeros": zeros,
        "ties": torch.tensor([1.0, -1.0, 0.5, 1.0, -0.5, 2.0, -2.0, 1.0]).repeat(chunk // 4)[: chunk + 6],
        "extreme": extreme,
        "denormal": randn(chunk + 1) * 1e-40,
    }


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("chunk,k", [(16, 1), (16, 5), (16, 16), (256, 13)])
@pytest.mark.parametrize("residual,decay", [(False, 1.0), (True, 1.0), (True, 0.9)], ids=["plain", "ef", "ef-decay"])
def test_topk_kernel_matches_reference(chunk, k, residual, decay, device):
    g = torch.Generator().manual_seed(3)
    for name, x in _topk_inputs(chunk).items():
        r = torch.randn(x.numel(), generator=g) if residual else None
        r_kernel, r_ref = (r.clone().to(device), r.clone()) if residual else (None, None)
        idx, values = (t.cpu() for t in tk.topk_chunks_triton(x.to(device), chunk, k, r_kernel, decay))
        ref_idx, ref_values = tk.topk_chunks_ref(x, chunk, k, r_ref, decay)
        assert idx.dtype == torch.int32 and idx.numel() == tk.selected_count(x.numel(), chunk, k), name
        assert torch.equal(idx, ref_idx), name
        if name == "nonfinite":  # a GPU writes its own NaN bit pattern: compared as values, NaN equal to NaN
            torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
            if residual:
                torch.testing.assert_close(r_kernel.cpu(), r_ref, rtol=0, atol=0, equal_nan=True)
            continue
        assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32)), name
        if residual:
            assert torch.equal(r_kernel.cpu(), r_ref), name


# ---- reference properties --------------------------------------------------------------------
def test_int8_relative_error_below_one_percent():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    packed, scales = q.quantize_ref(x, 256, "int8")
    y = q.dequantize_ref(packed, scales, x.numel(), 256, "int8")
    assert (y - x).norm() / x.norm() < 0.01
    assert (y - x).abs().max() <= scales.max() / 2 * (1 + 1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_block_quantizes_to_zeros(fmt):
    x = torch.randn(3 * 64, generator=torch.Generator().manual_seed(4))
    x[64:128] = 0.0
    packed, scales = q.quantize_ref(x, 64, fmt)
    y = q.dequantize_ref(packed, scales, x.numel(), 64, fmt)
    assert scales[1] == 0
    assert torch.equal(y[64:128], torch.zeros(64))
    assert bool((y[:64] != 0).any())


def test_fp4_levels_are_powers_of_two_of_the_scale_and_nearest():
    x = torch.randn(4 * 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 4 * 128)
    packed, scales = q.quantize_ref(x, 128, "fp4")
    y = q.dequantize_ref(packed, scales, x.numel(), 128, "fp4")
    scale = scales.repeat_interleave(128)
    levels = torch.cat([torch.zeros(1), 2.0 ** torch.arange(-6.0, 1.0)])  # 0 and 2^(e-7), e = 1..7
    ratio = y.abs() / scale
    assert bool(torch.isin(ratio, levels).all())
    assert bool(((y == 0) | (y.sign() == x.sign())).all())
    nearest = (x.abs()[:, None] - scale[:, None] * levels).abs().min(dim=1).values
    assert torch.allclose((y - x).abs(), nearest, rtol=1e-6, atol=0)


def test_topk_keeps_the_k_largest_magnitudes():
    chunk, k = 64, 9
    g = torch.Generator().manual_seed(5)
    n = 5 * chunk + 20
    x = torch.randperm(n, generator=g).float() * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    idx, values = tk.topk_chunks_ref(x, chunk, k)
    for c in range(6):
        part = x[c * chunk:(c + 1) * chunk]
        got = idx[c * k:(c + 1) * k]
        want = torch.topk(part.abs(), min(k, part.numel())).indices.sort().values
        assert torch.equal(got.long(), want)
        assert torch.equal(values[c * k:(c + 1) * k], part[want])


def test_topk_ties_go_to_the_lowest_index():
    idx, values = tk.topk_chunks_ref(torch.tensor([1.0, -2.0, 2.0, -2.0, 2.0, 0.0, 0.0, 0.0]), 4, 2)
    assert idx.tolist() == [1, 2, 0, 1]
    assert values.tolist() == [-2.0, 2.0, 2.0, 0.0]


def test_topk_cpu_shortcut_selects_exactly_what_the_bit_patterns_select():
    """On the CPU the reference ranks the magnitudes themselves (in large chunks, only those of the groups with
    the largest maxima) and checks each chunk for a tie at its k-th largest: chunks with ties, NaN, Inf, signed
    zeros, the largest values crowded into one group and a short last chunk must still come out as the
    bit-pattern rule picks them (the rule the kernel and every other device use)."""
    g = torch.Generator().manual_seed(7)
    prefiltered = 0
    for trial in range(1200):
        chunk = (4, 16, 64, 256, 1024, 4096, 3000, 2051)[trial % 8]  # DeMo's chunks: any s1 * s2
        n = int(torch.randint(1, 5 * chunk, (1,), generator=g))
        top = chunk if trial // 8 % 2 else max(1, chunk // 64)  # small k: the prefilter's case
        kk = int(torch.randint(1, top + 1, (1,), generator=g))
        x = torch.randn(n, generator=g)
        kind = trial // 16 % 6
        if kind == 1:
            x[torch.rand(n, generator=g) < 0.5] = 0.0
        elif kind == 2:
            x = torch.randint(-3, 4, (n,), generator=g).float()
        elif kind == 3:
            x[torch.rand(n, generator=g) < 0.1] = float("nan")
            x[torch.rand(n, generator=g) < 0.1] = float("-inf")
        elif kind == 4:
            x[torch.rand(n, generator=g) < 0.3] = -0.0
        elif kind == 5:  # one prefilter group (a stride of chunk / GROUP apart) of every chunk holds the largest
            stride = max(1, chunk // tk.GROUP)
            start = int(torch.randint(0, stride, (1,), generator=g))
            x[start::stride] *= 100.0
        prefiltered += chunk % tk.GROUP == 0 and 4 * (kk + 1) <= chunk // tk.GROUP and n >= chunk
        chunks = -(-n // chunk)
        want = tk._top_by_bits(x, chunks, chunk, kk)
        assert torch.equal(tk._top_indices(x, chunks, chunk, kk), want), (trial, n, chunk, kk, kind)
    assert prefiltered > 200


@pytest.mark.parametrize("n, chunk, k", [(640, 64, 9), (650, 64, 9), (70, 64, 20), (40, 64, 64)])
def test_topk_selection_with_many_ties_matches_a_plain_ranking(n, chunk, k):
    """Few distinct magnitudes (more tied at the k-th than a chunk keeps), zeros, and a short last chunk: each
    chunk keeps its first min(k, L) entries ranked by (-|x|, index)."""
    g = torch.Generator().manual_seed(n + k)
    for x in (torch.randint(-2, 3, (n,), generator=g).float(), torch.zeros(n), torch.randn(n, generator=g)):
        idx, values = tk.topk_chunks_ref(x, chunk, k)
        want = []
        for a in range(0, n, chunk):
            part = x[a:a + chunk].tolist()
            ranked = sorted(range(len(part)), key=lambda i: (-abs(part[i]), i))[:min(k, len(part))]
            want += sorted(ranked)
        assert idx.tolist() == want
        starts = [a for a in range(0, n, chunk) for _ in range(min(k, len(x[a:a + chunk])))]
        assert torch.equal(values, x[torch.tensor(starts) + idx.long()])


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_topk_error_feedback_conserves_mass(decay):
    g = torch.Generator().manual_seed(2)
    chunk, k, n = 32, 3, 100
    residual = torch.zeros(n)
    total_in, total_sent = torch.zeros(n), torch.zeros(n)
    for _ in range(6):
        before = residual.clone()
        x = torch.randn(n, generator=g)
        idx, values = tk.topk_chunks_ref(x, chunk, k, residual, decay)
        flat = idx.long() + torch.arange(idx.numel()) // k * chunk
        sent = torch.zeros(n).index_put_((flat,), values)
        assert torch.equal(residual[flat], torch.zeros(flat.numel()))
        assert torch.allclose(residual + sent, x + decay * before, atol=1e-6)
        total_in = decay * total_in + x
        total_sent = decay * total_sent + sent
    assert torch.allclose(total_sent + residual, total_in, atol=1e-5)


def _quantize_formula(x: torch.Tensor, block: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The formats' definitions, written out over the whole vector at once (the reference works piece by piece)."""
    _, bits, per = q.FORMATS[fmt]
    n = x.numel()
    nb = q.num_blocks(n, block)
    xp = torch.cat([x, x.new_zeros(nb * block - n)]).view(nb, block)
    amax = xp.abs().amax(dim=1)
    if fmt in ("int8", "int4"):
        qmax = 127.0 if fmt == "int8" else 7.0
        scale = amax / qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        c = torch.floor(xp / safe + 0.5).clamp_(-qmax, qmax).to(torch.int32)
        codes = c & 0xFF if fmt == "int8" else c + 8
    elif fmt == "fp4":
        scale = amax
        e = sum((xp.abs() >= scale[:, None] * t).to(torch.int32) for t in q._FP4_T)
        codes = torch.where((xp < 0) & (e > 0), e + 8, e)
    else:
        scale = amax / 1.5
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
        codes = (torch.floor(xp / safe) + 2.0).clamp_(0.0, 3.0).to(torch.int32)
    codes = codes.reshape(-1, per) << torch.arange(0, bits * per, bits, dtype=torch.int32)
    return codes.sum(dim=1).to(torch.uint8)[:q.packed_bytes(n, fmt)], scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_pieces_match_the_formula_and_write_into_given_buffers(fmt):
    block = 64
    n = 3 * q._PIECE + 5 * block + 17  # several pieces, and a partial last block
    x = torch.randn(n, generator=torch.Generator().manual_seed(11)) * 3.0
    x[::97] = 0.0
    want_packed, want_scales = _quantize_formula(x, block, fmt)
    buf = torch.zeros(4 * q.num_blocks(n, block) + q.packed_bytes(n, fmt) + 8, dtype=torch.uint8)
    scales = buf[8:8 + 4 * q.num_blocks(n, block)].view(torch.float32)
    packed = buf[8 + scales.numel() * 4:]
    got_packed, got_scales = q.quantize_ref(x, block, fmt, packed=packed, scales=scales)
    assert got_packed.data_ptr() == packed.data_ptr() and got_scales.data_ptr() == scales.data_ptr()
    assert torch.equal(packed, want_packed)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    assert not buf[:8].any()  # nothing written outside the given views
    values = q.dequantize_ref(packed, scales, n, block, fmt)
    amax = torch.cat([x.abs(), x.new_zeros(-n % block)]).view(-1, block).amax(dim=1).repeat_interleave(block)[:n]
    assert values.shape == (n,) and bool((values.abs() <= amax * 1.0001).all())
    assert float((values - x).norm() / x.norm()) < {"int8": 0.01, "int4": 0.2, "fp4": 0.3, "2bit": 0.8}[fmt]
    acc = torch.ones(n)
    q.dequantize_ref(packed, scales, n, block, fmt, out=acc, weight=0.5, accumulate=True)
    assert torch.allclose(acc, 1.0 + 0.5 * values)
