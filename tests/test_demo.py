"""DeMo: transform, top-k, error feedback, mean over senders, any shape, the published algorithm, kernels, loop."""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import replace

import pytest
import torch

from conftest import FAST, KERNEL_DEVICES, TINY, HostReads
from demo_optim import DeMo
from demo_optim import kernels as K
from demo_optim.kernels import dispatch, fused
from diloco.comm import Capabilities
from diloco.compress import from_chunks, plan_for, to_chunks
from diloco.compress.flat import end_to_end
from diloco.compress.kernels import topk
from diloco.sim import InProcessGroup, run_workers
from launch.store.checkpoint import latest_checkpoint
from launch.config import load_config
from launch.simulate.runner import simulate_once

SHAPES = [(), (1,), (7,), (131,), (64,), (131, 70), (64, 64), (128, 192), (3, 5, 64), (2, 3, 17, 33)]


@pytest.mark.parametrize("rule", ["auto", "divisor", "pad"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dct_chunks_round_trip(shape, rule):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    plan = plan_for(x.shape, 64, 32, rule)
    c = to_chunks(x, plan)
    assert c.shape == (plan.num_chunks, plan.chunk_size)
    assert torch.allclose(from_chunks(c, plan), x, atol=1e-5)
    assert math.isclose(float(c.norm()), float(x.norm()), rel_tol=1e-5)  # orthonormal


def test_chunk_rules_for_a_prime():
    assert plan_for((131,), 64, 32, "divisor").s2 == 1  # the published rule degrades to chunks of 1...
    auto = plan_for((131,), 64, 32, "auto")  # ...auto pads to whole chunks instead
    assert (auto.s2, auto.cols_padded, auto.k) == (64, 192, 32)
    assert plan_for((4096, 896), 64, 32, "auto") == plan_for((4096, 896), 64, 32, "divisor")
    assert plan_for((100,), 64, 32, "auto").s2 == 50  # a divisor at least half the chunk is kept


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_topk_of_the_whole_chunk_is_lossless_and_sent_plus_left_is_delta(shape):
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(shape, generator=g)
    full = plan_for(delta.shape, 64, 10**6)
    d = delta.clone()
    K.encode_ref(d, full)
    assert d.abs().max() < 1e-5  # everything was sent
    plan = plan_for(delta.shape, 64, 3)
    d = delta.clone()
    idx, vals = K.encode_ref(d, plan)
    sent = torch.zeros(plan.num_chunks, plan.chunk_size).scatter_(1, idx.long().view(plan.num_chunks, -1),
                                                                  vals.view(plan.num_chunks, -1))
    assert torch.allclose(d + from_chunks(sent, plan), delta, atol=1e-5)  # delta_after + sent == delta_before
    assert (idx.view(plan.num_chunks, -1).diff(dim=1) > 0).all()  # ascending within a chunk


def _run(world: int, shapes, grads_of, steps: int, **kw):
    """Each simulated worker runs DeMo on copies of the same initial parameters; returns their final params."""
    init = [torch.randn(s, generator=torch.Generator().manual_seed(10 + i)) for i, s in enumerate(shapes)]

    def body(rank, transport):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = DeMo(params, transport=transport, **kw)
        for t in range(steps):
            for j, p in enumerate(params):
                p.grad = grads_of(rank, t, j, p.shape)
            opt.step()
        return [p.detach().clone() for p in params], opt

    return init, run_workers(InProcessGroup(world), body)


def _randn_grads(rank, t, j, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * rank + 10 * t + j))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_any_shape_trains_and_workers_stay_identical(shape):
    _, results = _run(3, [shape], _randn_grads, 3, lr=0.01, compression_topk=4)
    (p0,), _ = results[0]
    for (p,), _ in results[1:]:
        assert torch.equal(p, p0)
    assert torch.isfinite(p0).all()


def test_aggregate_is_the_mean_over_the_workers_that_sent_it():
    """One coefficient: worker 0 sends 2.0, worker 1 sends 4.0, worker 2 sends nothing -> 3.0 (not 2.0)."""
    d = plan_for((4,), 4, 1)
    basis = from_chunks(torch.eye(4)[1:2], d)  # the vector whose DCT is e_1

    def body(rank, transport):
        opt = DeMo([torch.nn.Parameter(torch.zeros(4))], lr=1.0, compression_topk=1, compression_chunk=4,
                   compression_decay=0.0, transport=transport)
        p = opt.param_groups[0]["params"][0]
        p.grad = basis * (2.0 if rank == 0 else 4.0) if rank < 2 else torch.full((4,), float("nan"))
        entries = opt._entries()
        plans = [e[2] for e in entries]
        chain = opt._chain(plans)
        payload = opt._encode(entries, chain) if rank < 2 else None
        from diloco.compress import wire
        payload = payload or wire.pack(b"", torch.float32, (0,), chain)
        sums, counts = opt.aggregation.sum_wire(transport.all_gather_bytes(payload),
                                                opt._layout(plans, chain, torch.device("cpu")))
        return (sums[0] / counts[0].clamp(min=1)), counts[0], opt.last_contributors

    for agg, counts, contributors in run_workers(InProcessGroup(3), body):
        assert torch.allclose(agg, torch.tensor([[0.0, 3.0, 0.0, 0.0]]), atol=1e-6)
        assert counts[0, 1] == 2 and contributors == 2
        assert counts.dtype == torch.uint8  # a byte a coefficient for fewer than 256 payloads, not fp32's four


def test_one_sender_of_two_gives_two():
    d = plan_for((4,), 4, 1)
    basis = from_chunks(torch.eye(4)[2:3], d)

    def grads(rank, t, j, shape):
        return basis * 2.0 if rank == 0 else torch.full(shape, float("inf"))

    def body(rank, transport):
        opt = DeMo([torch.nn.Parameter(torch.zeros(4))], lr=1.0, compression_topk=1, compression_chunk=4,
                   compression_decay=0.0, transport=transport)
        p = opt.param_groups[0]["params"][0]
        p.grad = grads(rank, 0, 0, (4,))
        opt.step()
        return p.detach().clone(), opt.skipped_steps

    (p0, s0), (p1, s1) = run_workers(InProcessGroup(2), body)
    assert torch.equal(p0, p1), "the worker that sat out applies the same update"
    assert torch.equal(p0, -torch.sign(basis * 2.0)) and (s0, s1) == (0, 1)


# ---- the published algorithm, written independently here ------------------------------------------
def _dct(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None, :]
    m = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2 / n)
    m[0] *= math.sqrt(0.5)
    return m.float()


def _div(n: int, chunk: int) -> int:
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def _encode(x: torch.Tensor, chunk: int):
    if x.dim() == 1:
        s = _div(x.numel(), chunk)
        return x.reshape(-1, s) @ _dct(s).T
    r, c = x.shape
    s1, s2 = _div(r, chunk), _div(c, chunk)
    b = x.reshape(r // s1, s1, c // s2, s2).permute(0, 2, 1, 3)
    return torch.einsum("hi,yxij,wj->yxhw", _dct(s1), b, _dct(s2))


def _decode(coeffs: torch.Tensor, shape) -> torch.Tensor:
    if len(shape) == 1:
        return (coeffs @ _dct(coeffs.shape[-1])).reshape(shape)
    y, x, s1, s2 = coeffs.shape
    b = torch.einsum("hi,yxhw,wj->yxij", _dct(s1), coeffs, _dct(s2))
    return b.permute(0, 2, 1, 3).reshape(shape)


def reference_demo(init, grads_of, world, steps, lr, decay, topk, chunk, wd):
    params = [[p.clone() for p in init] for _ in range(world)]
    deltas = [[torch.zeros_like(p) for p in init] for _ in range(world)]
    for t in range(steps):
        for j, shape in enumerate(p.shape for p in init):
            idxs, vals = [], []
            for w in range(world):
                params[w][j].mul_(1 - lr * wd)
                deltas[w][j] = decay * deltas[w][j] + lr * grads_of(w, t, j, shape)
                c = _encode(deltas[w][j], chunk)
                flat = c.reshape(*c.shape[:-2], -1) if len(shape) == 2 else c
                k = min(topk, flat.shape[-1])
                idx = torch.topk(flat.abs(), k, dim=-1, sorted=False).indices
                val = torch.gather(flat, -1, idx)
                sent = torch.zeros_like(flat).scatter(-1, idx, val)
                deltas[w][j] = deltas[w][j] - _decode(sent.reshape(c.shape), shape)
                idxs.append(idx)
                vals.append(val)
            agg = torch.zeros_like(flat).scatter_reduce(-1, torch.cat(idxs, -1), torch.cat(vals, -1), "mean",
                                                        include_self=False)
            update = _decode(agg.reshape(c.shape), shape)
            for w in range(world):
                params[w][j] = params[w][j] - lr * torch.sign(update)
    return params


@pytest.mark.parametrize("world", [1, 3])
def test_equals_the_published_algorithm(world):
    shapes = [(128, 64), (64, 192), (64,), (128,)]
    kw = dict(lr=0.01, compression_decay=0.999, compression_topk=32, compression_chunk=64, weight_decay=0.1)
    init, results = _run(world, shapes, _randn_grads, 4, **kw)
    ref = reference_demo(init, _randn_grads, world, 4, 0.01, 0.999, 32, 64, 0.1)
    for w, (params, _) in enumerate(results):
        for a, b in zip(params, ref[w]):
            assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())
        assert not torch.allclose(params[0], init[0])


def test_packed_payload_is_at_least_30x_smaller_than_fp32_gradients():
    params = [torch.nn.Parameter(torch.zeros(896, 896)), torch.nn.Parameter(torch.zeros(896))]
    opt = DeMo(params, lr=0.01)
    fp32 = 4 * sum(p.numel() for p in params)
    assert fp32 / opt.bytes_per_step() >= 30
    # 12-bit indices: 196 chunks x 32 x (4 + 1.5) bytes for the matrix
    assert opt.bytes_per_step() < 196 * 32 * 5.5 + 14 * 32 * (4 + 0.75) + 200
    signs = DeMo(params, lr=0.01, sign_values=True)
    assert signs.bytes_per_step() < 0.45 * opt.bytes_per_step()


def test_sign_values_train_and_keep_workers_equal():
    _, results = _run(2, [(64, 64), (64,)], _randn_grads, 3, lr=0.01, sign_values=True)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(compression_topk=0), "compression_topk"), (dict(compression_chunk=0), "compression_chunk"),
    (dict(compression_decay=1.0), "compression_decay"), (dict(compression_decay=-0.1), "compression_decay"),
    (dict(lr=-1.0), "lr"), (dict(chunk_rule="odd"), "chunk_rule"), (dict(nonfinite="ignore"), "nonfinite")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeMo([torch.nn.Parameter(torch.zeros(3))], **{"lr": 0.01, **kwargs})


def test_nonfinite_raise():
    p = torch.nn.Parameter(torch.zeros(8))
    opt = DeMo([p], lr=0.01, nonfinite="raise")
    p.grad = torch.full((8,), float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()


def test_a_payload_that_fails_validation_is_left_out_and_logged(caplog):
    def body(rank, transport):
        p = torch.nn.Parameter(torch.zeros(64))
        opt = DeMo([p], lr=0.01, transport=transport, sign_values=rank == 2)  # worker 2 speaks another format
        p.grad = torch.ones(64)
        opt.step()
        return opt.rejected_payloads, opt.last_contributors

    with caplog.at_level(logging.WARNING, logger="demo_optim"):
        results = run_workers(InProcessGroup(3), body)
    assert results[0] == (1, 2) and results[1] == (1, 2) and results[2] == (2, 1)
    assert "left worker 2's payload out of the mean: settings or model differ" in caplog.text


# ---- kernels (the Triton interpreter on CPU, compiled on a GPU) ----------------------------------------
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (2, 64, 128), (100, 48), (40, 70)], ids=str)
def test_kernels_match_the_reference(shape, device):
    plan = plan_for(shape, 64, 32, "pad" if shape[-1] != 70 else "auto")
    if not K.kernel_fits(plan):
        plan = plan_for(shape, 32, 16, "pad")
    assert K.kernel_fits(plan)
    g = torch.Generator().manual_seed(3)
    d1 = torch.randn(shape, generator=g)
    d2 = d1.clone()
    i1, v1 = K.encode_ref(d1, plan)
    d2 = d2.to(device)
    i2, v2 = (t.cpu() for t in K.encode_triton(d2, plan))
    d2 = d2.cpu()
    assert torch.equal(i1, i2)
    assert torch.allclose(v1, v2, atol=1e-5) and torch.allclose(d1, d2, atol=1e-5)
    agg = torch.randn(plan.num_chunks, plan.chunk_size, generator=g)
    p1 = torch.randn(shape, generator=g)
    p2 = p1.clone().to(device)
    K.decode_sign_ref(agg, p1, 0.01, plan)
    K.decode_sign_triton(agg.to(device), p2, 0.01, plan)
    assert torch.equal(p1, p2.cpu())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("in_one_buffer, stack_bytes", [(True, None), (False, None), (False, 0)],
                         ids=["one-buffer", "separate", "separate-large"])
def test_same_shaped_parameters_take_one_launch_and_match_one_by_one(device, in_one_buffer, stack_bytes,
                                                                     monkeypatch):
    """encode_many/decode_sign_many stack a run of same-shaped parameters into one launch (in place when they
    lie back to back in one buffer, else through a copy written back; decode: above STACK_BYTES of them, a launch
    each rather than a copy): the same result as one at a time."""
    if stack_bytes is not None:
        monkeypatch.setattr(dispatch, "STACK_BYTES", stack_bytes)
    shapes = [(64, 128), (64, 128), (64, 128), (32, 64), (32, 64), (64, 64)]
    plans = [plan_for(s, 64, 16, "divisor") for s in shapes]
    g = torch.Generator().manual_seed(5)
    src = [torch.randn(s, generator=g) for s in shapes]
    if in_one_buffer:
        buf = torch.stack(src[:3]).to(device)
        run = [buf[0], buf[1], buf[2]]
        assert K.stacked_view(run) is not None
    else:
        run = [t.clone().to(device) for t in src[:3]]
        assert K.stacked_view(run) is None
    many = run + [t.clone().to(device) for t in src[3:]]
    one = [t.clone().to(device) for t in src]
    i_many, v_many = K.encode_many(many, plans, triton=True)
    pieces = [K.encode_triton(d, p) for d, p in zip(one, plans)]
    assert torch.equal(i_many.cpu(), torch.cat([i for i, _ in pieces]).cpu())
    assert torch.equal(v_many.cpu(), torch.cat([v for _, v in pieces]).cpu())
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(many, one)), "the residuals were not written back"
    agg = torch.randn(sum(p.num_chunks * p.chunk_size for p in plans), generator=g).to(device)
    lrs = [0.01, 0.01, 0.01, 0.02, 0.03, 0.01]  # a new lr starts a new run
    K.decode_sign_many(agg, many, lrs, plans, triton=True)
    at = 0
    for p, lr, plan in zip(one, lrs, plans):
        n = plan.num_chunks * plan.chunk_size
        K.decode_sign_triton(agg[at:at + n].view(plan.num_chunks, plan.chunk_size), p, lr, plan)
        at += n
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(many, one))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("triton, in_one_buffer", [(False, True), (False, False), (True, True),
                                                   ("per-parameter", False)],
                         ids=["reference-one-buffer", "reference-separate", "kernel-one-buffer",
                              "kernel-each-separate"])
def test_momentum_kept_as_coefficients_sends_what_the_momentum_in_the_parameters_shape_sends(device, triton,
                                                                                             in_one_buffer,
                                                                                             monkeypatch):
    """step_encode_many keeps an unpadded parameter's momentum as its DCT coefficients and zeroes what it sent.
    Over several steps it sends what the published update sends (decay, add lr * grad, DCT, top-k, subtract
    the inverse DCT of what was sent, in the parameter's shape), and the coefficients stay the DCT of that
    momentum; a padded parameter keeps the parameter-shaped momentum. With a missing gradient, two groups'
    settings, and the coefficients in one buffer or apart; the kernel stacks a run's gradients, or (above
    STACK_BYTES of them) launches once per parameter."""
    if triton == "per-parameter":
        monkeypatch.setattr(dispatch, "STACK_BYTES", 0)
        triton = True
    shapes = [(64, 128), (64, 128), (128, 64), (32, 64), (100,), (40, 70)]
    plans = [plan_for(s, 32, 16, "pad" if s == (40, 70) else "auto") for s in shapes]
    assert [p.padded for p in plans] == [False] * 5 + [True]
    decays, lrs = [0.9] * 3 + [0.5] * 3, [0.01] * 3 + [0.03] * 3
    g = torch.Generator().manual_seed(11)
    deltas = [torch.zeros(s, device=device) for s in shapes]
    sizes = [p.num_chunks * p.chunk_size for p in plans[:5]]
    if in_one_buffer:
        coeffs = [c.view(p.num_chunks, p.chunk_size) for c, p in
                  zip(torch.zeros(sum(sizes), device=device).split(sizes), plans)]
    else:
        coeffs = [torch.zeros(p.num_chunks, p.chunk_size, device=device) for p in plans[:5]]
    assert (end_to_end(coeffs) is not None) == in_one_buffer
    moms = [*coeffs, torch.zeros(shapes[5], device=device)]
    for step in range(3):
        grads = [torch.randn(s, generator=g).to(device) for s in shapes]
        if step == 1:
            grads[3] = None
        for d, grad, decay, lr in zip(deltas, grads, decays, lrs):  # the published update, one by one
            d.mul_(decay)
            if grad is not None:
                d.add_(grad, alpha=lr)
        want_i, want_v = K.encode_many(deltas, plans, triton=False)
        got_i, got_v = K.step_encode_many(grads, moms, plans, decays, lrs, triton=triton)
        assert torch.equal(got_i.cpu(), want_i.cpu()), step
        assert torch.allclose(got_v, want_v, rtol=1e-5, atol=1e-7), step
        for m, d, plan in zip(moms, deltas, plans):
            want = d if plan.padded else to_chunks(d, plan)
            assert torch.allclose(m.cpu(), want.cpu(), rtol=1e-4, atol=1e-6), (step, plan.shape)
    assert all(float(m.abs().max()) > 0 for m in moms)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("triton", [False, True], ids=["reference", "kernel"])
def test_a_refused_flag_leaves_every_momentum_as_it_was(device, triton):
    """step_encode_many with ``ok`` (decided on the device): where it is False, a step with NaN and Inf gradients
    leaves every momentum bit for bit as it was (coefficients of one buffer or apart, a padded parameter's, a
    vector's) and its indices still lie in their chunks; where it is True the step is the unguarded one."""
    shapes = [(64, 128), (64, 128), (32, 64), (100,), (40, 70)]
    plans = [plan_for(s, 32, 16, "pad" if s == (40, 70) else "auto") for s in shapes]
    assert [p.padded for p in plans] == [False] * 4 + [True]
    decays, lrs = [0.9] * 5, [0.01] * 3 + [0.03] * 2
    g = torch.Generator().manual_seed(4)

    def moms():  # the first two end to end in one buffer on the device, the others apart
        sizes = [p.num_chunks * p.chunk_size for p in plans[:2]]
        run = [c.view(p.num_chunks, p.chunk_size)
               for c, p in zip(torch.randn(sum(sizes), generator=g).to(device).split(sizes), plans)]
        alone = [torch.randn(p.num_chunks, p.chunk_size, generator=g).to(device) for p in plans[2:4]]
        return run + alone + [torch.randn(shapes[4], generator=g).to(device)]

    start = moms()
    assert end_to_end(start[:2]) is not None
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    bad = [x.clone() for x in grads]
    bad[0][3, 5], bad[2][0, 0], bad[3][7], bad[4][1, 1] = math.nan, math.inf, -math.inf, math.nan
    ms = [m.clone() for m in start]
    ms[:2] = list(end_to_end(start[:2]).clone().split([m.numel() for m in start[:2]]))
    ms[:2] = [m.view(p.num_chunks, p.chunk_size) for m, p in zip(ms[:2], plans)]
    refused = torch.tensor(False, device=device)
    idx, _ = K.step_encode_many(bad, ms, plans, decays, lrs, triton=triton, ok=refused)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(ms, start)), "a refused step changed a momentum"
    limits = torch.cat([torch.full((p.sent,), p.chunk_size) for p in plans])
    assert idx.shape == limits.shape and bool(((idx.cpu() >= 0) & (idx.cpu() < limits)).all())

    plain = [m.clone() for m in start]
    want_i, want_v = K.step_encode_many(grads, plain, plans, decays, lrs, triton=triton)
    got_i, got_v = K.step_encode_many(grads, ms, plans, decays, lrs, triton=triton,
                                      ok=torch.tensor(True, device=device))
    assert torch.equal(got_i.cpu(), want_i.cpu()) and torch.equal(got_v.cpu(), want_v.cpu())
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(ms, plain))


class _TooBigForThisDevice:
    """A kernel as Triton hands it back on a GPU whose programs get too little shared memory for the block (a
    consumer card and 128 x 128 blocks): its launch raises OutOfResources before anything runs."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches += 1
            raise fused.OutOfResources(147456, 101376, "shared memory")
        return launch


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_blocks_a_device_cannot_run_take_the_torch_path_with_one_warning(device, monkeypatch):
    """Where the device refuses a kernel for a block size, encode, the step's encode and decode fall back to the
    reference for it: the same results as the reference, one warning per kernel, no second try."""
    monkeypatch.setattr(fused, "REFUSED", set())
    stand_ins = {name: _TooBigForThisDevice() for name in ("_encode_kernel", "_step_encode_kernel",
                                                             "_decode_sign_kernel")}
    for name, kernel in stand_ins.items():
        monkeypatch.setattr(fused, name, kernel)
    shapes = [(64, 128), (64, 128), (32, 64)]
    plans = [plan_for(s, 32, 16, "divisor") for s in shapes]
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    agg = torch.randn(sum(p.num_chunks * p.chunk_size for p in plans), generator=g).to(device)
    results = {}
    for triton in (False, True, True):  # the reference, then the kernel path twice
        deltas = [x.clone() for x in grads]
        moms = [torch.zeros(p.num_chunks, p.chunk_size, device=device) for p in plans]
        params = [x.clone() for x in grads]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = (K.encode_many(deltas, plans, triton=triton),
                   K.step_encode_many(grads, moms, plans, [0.9] * 3, [0.01] * 3, triton=triton))
            K.decode_sign_many(agg, params, [0.01] * 3, plans, triton=triton)
        flat = [t.cpu() for pair in out for t in pair] + [t.cpu() for t in (*deltas, *moms, *params)]
        results.setdefault(triton, []).append((flat, [str(w.message) for w in caught]))
    (want, none), = results[False]
    (first, said), (again, quiet) = results[True]
    assert none == [] and quiet == []
    assert len(said) == 3 and all("take the slower torch path" in m and "32 x 32 blocks" in m for m in said), said
    for got in (first, again):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # every kernel was tried once on the one block size, then remembered as refused
    assert {(name, s1, s2) for name, _, s1, s2 in fused.REFUSED} == {("encode", 32, 32), ("step", 32, 32),
                                                                  ("decode", 32, 32)}
    assert [k.launches for k in stand_ins.values()] == [1, 1, 1]


def _demo_run(world: int, on_device: bool, device_gather: bool, nan_at: tuple[int, int], steps: int = 3,
              sign_values: bool = False, device: str = "cpu"):
    """``steps`` steps of DeMoAlgorithm on ``world`` simulated workers of the 2-layer tiny model, worker
    ``nan_at[0]`` with NaN gradients at step ``nan_at[1]``: per worker the parameters, the momenta, contributors
    per step and the skipped steps (algorithm, optimizer); and the host reads of the whole run (the workers are
    greenlets of one thread: one counter sees them all)."""
    from demo_optim.algorithm import DeMoAlgorithm

    def body(rank, transport):
        transport.caps = replace(transport.caps, device_gather=device_gather)
        model = _tiny(2).to(device)
        opt = DeMo(model.parameters(), lr=1e-3, weight_decay=0.1, transport=transport, sign_values=sign_values)
        algo = DeMoAlgorithm(model, opt, transport)
        algo.checks_on_device = on_device
        seen = []
        for step in range(steps):
            for i, p in enumerate(model.parameters()):
                x = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + 10 * step + i))
                p.grad = (x if (rank, step) != nan_at else torch.full(p.shape, math.nan)).to(device)
            info = algo.step()
            assert torch.is_tensor(info["grad_norm"]) == on_device  # read back only where the step needs it
            seen.append(info["contributors"])
        momenta = [t.cpu() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return ([p.detach().cpu() for p in model.parameters()], momenta, seen,
                (algo.skipped_steps, opt.skipped_steps))

    with HostReads() as counter:
        results = run_workers(InProcessGroup(world), body)
    return results, counter.count


ON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("device_gather", [True, False], ids=["device-payloads", "wire-payloads"])
@pytest.mark.parametrize("sign_values", [False, True], ids=["fp32-values", "sign-values"])
def test_a_step_decided_on_the_device_equals_one_decided_on_the_host(device_gather, sign_values, device, caplog):
    """DeMoAlgorithm tests its gradients on the device (checks_on_device, the default on accelerators): the
    optimizer gets ``found_inf``; a worker whose gradients are not finite leaves its parameters and momenta
    untouched and says so in its payload, and still applies the others' update. Parameters, momenta,
    contributors and skipped counts equal those of the host decision, bit for bit."""
    with caplog.at_level(logging.WARNING, logger="demo_optim"):
        decided, _ = _demo_run(3, True, device_gather, (1, 1), sign_values=sign_values, device=device)
    host, _ = _demo_run(3, False, device_gather, (1, 1), sign_values=sign_values, device=device)
    for (pd, md, cd, sd), (ph, mh, ch, sh) in zip(decided, host):
        assert cd == ch == [3, 2, 3] and sd == sh
        assert all(torch.equal(a, b) for a, b in zip(pd, ph))
        assert len(md) == len(mh) and all(torch.equal(a, b) for a, b in zip(md, mh))
    assert [s for *_, s in decided] == [(0, 0), (1, 1), (0, 0)]
    if not device_gather:  # the wire path learns it on the host with the payload's bytes, and says so there
        assert "DeMo worker 1: non-finite gradients, sending nothing this step" in caplog.text


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_demo_step_reads_back_once_per_simulated_step(device, monkeypatch):
    """Simulated workers whose payloads stay on the device, their gradients tested on the device: a simulated
    step of three workers reads back once, to accept or refuse the payloads (the first worker checks the list
    they all received, the others take its mean). Deciding on the host reads once more per worker and step."""
    monkeypatch.setattr(topk, "_top_indices", topk._top_by_bits)  # as on a GPU (see _step_cost)
    reads = {(on_device, steps): _demo_run(3, on_device, True, (-1, -1), steps=steps, device=device)[1]
             for on_device in (True, False) for steps in (1, 3)}
    assert reads[True, 3] - reads[True, 1] == 2, reads  # two more simulated steps: one read each
    assert reads[False, 3] - reads[False, 1] == 2 + 2 * 3, reads


def test_a_saved_momentum_of_either_kind_or_other_blocks_resumes():
    """DeMo keeps coefficient momenta with their block sides in its state. The same settings resume to the bit;
    a parameter-shaped momentum (the state of earlier versions) or coefficients of other block sides are
    converted on load, and the run goes on as if it had not stopped (to rounding); a state that fits no block
    of the parameter is refused on load, naming the parameter."""
    import copy

    shapes = [(64, 128), (128,), (40, 70)]
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]

    def make(start):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        return params, DeMo(params, lr=0.01, compression_topk=16, compression_chunk=64, chunk_rule="pad")

    def steps(params, opt, gs):
        for step_grads in gs:
            for p, x in zip(params, step_grads):
                p.grad = x.clone()
            opt.step()
        return [p.detach().clone() for p in params]

    pa, a = make(init)
    mid = steps(pa, a, grads[:2])
    saved = copy.deepcopy(a.state_dict())
    assert set(saved["state"][0]) == {"coeffs", "block"} and set(saved["state"][2]) == {"delta"}
    end = steps(pa, a, grads[2:])

    pb, b = make(mid)
    b.load_state_dict(copy.deepcopy(saved))
    assert all(torch.equal(x, y) for x, y in zip(steps(pb, b, grads[2:]), end))

    old = copy.deepcopy(saved)  # every momentum in the parameter's shape, as earlier versions saved it
    for i, st in old["state"].items():
        if "coeffs" in st:
            plan = plan_for(shapes[i], 64, 16, "pad")
            old["state"][i] = {"delta": from_chunks(st["coeffs"], plan)}
    pc, c = make(mid)
    c.load_state_dict(old)
    assert set(c.state_dict()["state"][0]) == {"coeffs", "block"}
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(steps(pc, c, grads[2:]), end))

    other = copy.deepcopy(saved)  # other block sides (the groups' settings come with the state): 32 x 32
    for group in other["param_groups"]:
        group["compression_chunk"] = 32
    pd, d = make(mid)
    d.load_state_dict(other)
    st = d.state_dict()["state"][0]
    assert st["block"] == (32, 32) and st["coeffs"].shape == (8, 1024)
    was = from_chunks(saved["state"][0]["coeffs"], plan_for(shapes[0], 64, 16, "pad"))
    assert torch.allclose(from_chunks(st["coeffs"], plan_for(shapes[0], 32, 16, "pad")), was, atol=1e-6)

    bad = copy.deepcopy(saved)
    bad["state"][0]["block"] = (48, 64)
    pe, e = make(mid)
    with pytest.raises(ValueError, match=r"parameter \(64, 128\)"):
        e.load_state_dict(bad)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("triton", [False, True], ids=["reference", "kernel"])
def test_signs_then_apply_equal_the_fused_decode(device, triton):
    """signs_many writes sign(IDCT(agg)) into parameter-shaped views of one buffer (what simulated workers
    share); adding -lr times it gives exactly what decode_sign_many's fused pass gives, fp32 and bf16 (bf16 not
    through the interpreter, whose fp32-to-bf16 conversion truncates where a GPU and torch round to nearest)."""
    shapes = [(64, 128), (64, 128), (32, 64), (100,), (40, 70)]
    plans = [plan_for(s, 64, 16, "auto") for s in shapes]
    g = torch.Generator().manual_seed(9)
    agg = torch.randn(sum(p.num_chunks * p.chunk_size for p in plans), generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" or not triton else (torch.float32,):
        params = [torch.randn(s, generator=g).to(device, dtype) for s in shapes]
        fused = [p.clone() for p in params]
        K.decode_sign_many(agg, fused, [0.01] * len(shapes), plans, triton=triton)
        flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtype, device=device)
        outs = list(flat.split([math.prod(s) for s in shapes]))
        outs = [o.view(s) for o, s in zip(outs, shapes)]
        K.signs_many(agg, outs, plans, triton=triton)
        assert set(flat.unique().tolist()) <= {-1.0, 0.0, 1.0}
        torch._foreach_add_(params, outs, alpha=-0.01)
        assert all(torch.equal(a, b) for a, b in zip(params, fused)), dtype


# ---- in the loop -------------------------------------------------------------------------------
SMALL = ["run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none", "sim.step_time=0.01"]


def test_algo_demo_in_the_simulator(tmp_path):
    common = ["sim.workers=2", "run.max_steps=8", "run.checkpoint_every=8"]
    cfg, _ = load_config([TINY], [*FAST, *SMALL, f"run.dir={tmp_path / 'demo'}", *common, "algo.name=demo"])
    demo = simulate_once(cfg)
    cfg, _ = load_config([TINY], [*FAST, *SMALL, f"run.dir={tmp_path / 'ddp'}", *common, "algo.name=ddp"])
    ddp = simulate_once(cfg)
    assert demo["bytes_sent"] * 30 < ddp["bytes_sent"]
    assert demo["peak_bytes_per_exchange"] * 8 == demo["bytes_sent"]  # one payload a step, the same size each
    assert demo["val_loss"] < 5.0
    state = latest_checkpoint(tmp_path / "demo" / "checkpoints")[1]
    w0, w1 = (w["model"] for w in state["workers"])
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    d0 = state["workers"][0]["algo"]["optimizer"]["state"][0]["coeffs"]  # the momentum, as DCT coefficients
    d1 = state["workers"][1]["algo"]["optimizer"]["state"][0]["coeffs"]
    assert not torch.equal(d0, d1), "each worker keeps its own momentum"


def test_demo_refuses_a_codec_and_muon():
    from launch.config import ConfigError

    with pytest.raises(ConfigError, match="DeMo sends its own"):
        load_config([TINY], ["algo.name=demo", "compress.codec=int8"])
    with pytest.raises(ConfigError, match="optim.name: DeMo is its own inner optimizer"):
        load_config([TINY], ["algo.name=demo", "optim.name=muon"])


# ---- the exchange's cost does not grow with the number of parameter tensors (issue 24) ---------------
def _tiny(n_layers: int) -> torch.nn.Module:
    from dataclasses import replace

    from launch.models.transformer import SIZES, Transformer
    torch.manual_seed(0)
    return Transformer(replace(SIZES["tiny"], n_layers=n_layers, max_seq_len=16))


def _aggregate_cost(n_layers: int, world: int, on_device: bool) -> tuple[int, int, int, int]:
    """(parameter tensors, ops, host syncs, payloads) of one worker's aggregation in one DeMo step: of the wire
    payloads (``Aggregation.sum_wire``), or of device payloads (``Aggregation.sum_device``)."""
    seen = {}

    def body(rank, transport):
        transport.caps = replace(transport.caps, device_gather=on_device)
        model = _tiny(n_layers)
        opt = DeMo(model.parameters(), lr=1e-3, transport=transport)
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + i))
        aggregate = opt.aggregation.sum_device if on_device else opt.aggregation.sum_wire

        def counted(payloads, *a, **kw):  # runs between two collectives: no other worker's ops interleave
            with HostReads() as counter:
                out = aggregate(payloads, *a, **kw)
            seen[rank] = (len(list(model.parameters())), counter.ops, counter.count, len(payloads))
            return out

        if on_device:
            opt.aggregation.sum_device = counted
        else:
            opt.aggregation.sum_wire = counted
        opt.step()
        return opt.last_contributors

    assert run_workers(InProcessGroup(world), body) == [world] * world
    assert len(seen) == 1, seen  # simulated workers share one aggregation of the payload list they all received
    return next(iter(seen.values()))


@pytest.mark.parametrize("bad_rank", [None, 1])
def test_simulated_workers_share_one_mean_and_end_as_if_each_computed_it(bad_rank, caplog):
    """The workers of an InProcessGroup get the very same payload list; DeMo validates and sums it once, and the
    others take that mean. Parameters, contributor counts and rejections equal those of workers that each
    computed their own (shared_results off)."""
    def run(shared: bool):
        calls = []

        def body(rank, transport):
            transport.caps = replace(transport.caps, shared_results=shared)
            model = _tiny(2)
            opt = DeMo(model.parameters(), lr=1e-3, transport=transport, sign_values=rank == bad_rank)
            def counted(aggregate):
                def wrapper(*a, **kw):
                    calls.append(rank)
                    return aggregate(*a, **kw)
                return wrapper

            opt.aggregation.sum_wire = counted(opt.aggregation.sum_wire)
            opt.aggregation.sum_device = counted(opt.aggregation.sum_device)
            for step in range(2):
                for i, p in enumerate(model.parameters()):
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + 10 * step + i))
                opt.step()
            return [p.detach().clone() for p in model.parameters()], opt.last_contributors, opt.rejected_payloads

        return run_workers(InProcessGroup(3), body), calls

    with caplog.at_level(logging.WARNING, logger="demo_optim"):
        shared, shared_calls = run(True)
        alone, alone_calls = run(False)
    assert len(alone_calls) == 6
    assert len(shared_calls) == (2 if bad_rank is None else 4), shared_calls  # the odd worker computes its own
    for (ps, cs, rs), (pa, ca, ra) in zip(shared, alone):
        assert (cs, rs) == (ca, ra)
        assert all(torch.equal(a, b) for a, b in zip(ps, pa))
    if bad_rank is not None:
        assert shared[0][2] == 2 and shared[2][2] == 2  # worker 1's payload left out by 0 and 2, at both steps


@pytest.mark.parametrize("sign_values", [False, True])
def test_device_payloads_give_the_same_steps_as_wire_payloads(sign_values):
    """Simulated workers move their payloads as device tensors (Capabilities.device_gather); the same run through
    wire payloads and host bytes gives the same parameters, contributors and skipped steps, bit for bit, also
    when a worker sits a step out."""
    def run(on_device: bool):
        def body(rank, transport):
            transport.caps = replace(transport.caps, device_gather=on_device)
            model = _tiny(2)
            opt = DeMo(model.parameters(), lr=1e-3, weight_decay=0.1, transport=transport, sign_values=sign_values)
            seen, sent = [], []
            for step in range(3):
                for i, p in enumerate(model.parameters()):
                    g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + 10 * step + i))
                    p.grad = g if (rank, step) != (1, 1) else torch.full(p.shape, math.nan)
                before = transport.stats.bytes_sent
                opt.step()
                seen.append(opt.last_contributors)
                sent.append(transport.stats.bytes_sent - before)
            assert len(set(sent)) == 1, sent  # a silent payload is as long as the others: sizes known beforehand
            return [p.detach().clone() for p in model.parameters()], seen, opt.skipped_steps

        return run_workers(InProcessGroup(3), body)

    device, wire_path = run(True), run(False)
    for (pd, cd, sd), (pw, cw, sw) in zip(device, wire_path):
        assert (cd, sd) == (cw, sw) and cd == [3, 2, 3]
        assert all(torch.equal(a, b) for a, b in zip(pd, pw))
    assert [s for _, _, s in device] == [0, 1, 0]


def test_forged_device_payloads_are_refused_and_logged(caplog):
    """A device payload with NaN values, disordered indices, an unknown flag, another fingerprint or another size
    is left out of the mean and logged with its rank; the honest one is kept; all of it in one host sync."""
    from diloco.comm.local import LocalTransport
    from diloco.compress import wire

    class Forging(LocalTransport):
        caps = Capabilities(device_gather=True)
        world_size = 6

        def _all_gather_tensor(self, t):
            head = wire.header_size(1, chain)
            nan, disordered, flag, other = (t.clone() for _ in range(4))
            nan[head:head + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # a float32 NaN
            disordered[head + layout.value_bytes:] = 0  # every index 0: not increasing within a chunk
            flag[0] = 7
            other[5] ^= 1
            return [t, nan, disordered, flag, other, t[:-1]]

    p = torch.nn.Parameter(torch.zeros(64, 64))
    opt = DeMo([p], lr=0.01, transport=Forging())
    p.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    plans = [plan for _, _, plan in opt._entries()]
    chain = opt._chain(plans)
    layout = opt._layout(plans, chain, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="demo_optim"):
        opt.step()
    assert opt.rejected_payloads == 5 and opt.last_contributors == 1
    for rank, why in [(1, "payload holds NaN or Inf"), (2, "indices of parameter (64, 64) out of range or not "
                      "increasing"), (3, "payload flag 7"), (4, "settings or model differ: the payload's fingerprint"),
                      (5, "settings or model differ")]:
        assert f"left worker {rank}'s payload out of the mean: {why}" in caplog.text


def _step_cost(n_layers: int, monkeypatch) -> tuple[int, int, int]:
    """(parameter tensors, ops, host syncs) of a whole DeMo step (the second) of one worker on its own. The
    top-k selects by the bit patterns, as it does on a GPU: the CPU's shortcut checks its ties with a host sync,
    which costs nothing there."""
    from diloco.compress.kernels import topk

    monkeypatch.setattr(topk, "_top_indices", topk._top_by_bits)
    model = _tiny(n_layers)
    opt = DeMo(model.parameters(), lr=1e-3, weight_decay=0.1)
    for t in range(2):
        for i, p in enumerate(model.parameters()):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * t + i))
        with HostReads() as counter:
            opt.step()
    return len(list(model.parameters())), counter.ops, counter.count


def test_aggregate_cost_is_flat_in_the_number_of_parameter_tensors(monkeypatch):
    params2, ops2, syncs2, payloads = _aggregate_cost(2, 3, on_device=False)
    params4, ops4, syncs4, _ = _aggregate_cost(4, 3, on_device=False)
    assert params4 >= params2 + 10  # the 4-layer model has many more parameter tensors
    assert ops4 - ops2 <= 4, (ops2, ops4)  # validation and accumulation: a fixed number of ops per payload
    # checked as rows of one tensor, one accept/reject decision for all of them, whether the payloads came as
    # wire bytes or stay on the device
    assert syncs2 == 1 and syncs4 == 1 and payloads == 3, (syncs2, syncs4)
    _, dops2, dsyncs2, _ = _aggregate_cost(2, 3, on_device=True)
    _, dops4, dsyncs4, _ = _aggregate_cost(4, 3, on_device=True)
    assert dops4 - dops2 <= 4, (dops2, dops4)
    assert dsyncs2 == 1 and dsyncs4 == 1, (dsyncs2, dsyncs4)
    # the whole step reads back three times: the gradient check, the payload on its way to the wire's bytes and the
    # payload's accept decision; what still runs per parameter tensor (encode's blocks in and out, decode's update)
    # is a few ops each (v1: ~140 ops and ~3 syncs per tensor)
    params2, ops2, syncs2 = _step_cost(2, monkeypatch)
    params4, ops4, syncs4 = _step_cost(4, monkeypatch)
    assert syncs2 == syncs4 == 3, (syncs2, syncs4)
    assert (ops4 - ops2) / (params4 - params2) <= 40, (ops2, ops4)


def test_forged_payloads_are_rejected_whatever_their_header_says(caplog):
    """Payloads with a valid header and checksum but NaN values, repeated, unordered or out-of-range indices are
    left out and logged; random corruption of the index section is rejected exactly when a per-parameter check
    of the indices (the one the v1 format ran) fails; the honest payload is always kept."""
    import random
    import struct

    from diloco.compress import bits_for, chunk_indices_ok, pack_bits, unpack_bits, wire

    shapes = [(64, 64), (100,), (7,), (3, 40), (64,)]  # index widths 12, 6, 3, 7, 6 (chunks of 4096, 50, 7, 120, 64)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = DeMo(params, lr=0.01, compression_topk=4)
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    entries = opt._entries()
    plans = [plan for _, _, plan in entries]
    chain = opt._chain(plans)
    honest = opt._encode(entries, chain)
    header = wire.parse_header(honest, 1 << 31)
    body = bytes(honest[header.offset:header.offset + header.length])
    layout = opt._layout(plans, chain, torch.device("cpu"))
    vb = layout.value_bytes
    assert len(body) == vb + layout.index_bytes

    def forge(b: bytes) -> bytes:
        return wire.pack(bytes(b), torch.float32, (header.numel,), chain)

    def indices(b: bytes) -> list[torch.Tensor]:  # every parameter's (chunks, k) indices, in wire order
        out, at = [], vb
        for width, count, nbytes in layout.stream_sizes:
            out.append(unpack_bits(torch.frombuffer(bytearray(b[at:at + nbytes]), dtype=torch.uint8), width, count))
            at += nbytes
        flat, rows = torch.cat(out), []
        for j in layout.order:
            rows.append(flat[:plans[j].sent].view(plans[j].num_chunks, plans[j].k))
            flat = flat[plans[j].sent:]
        return rows

    def with_indices(b: bytes, rows: list[torch.Tensor]) -> bytes:
        flat, out, at = torch.cat([r.reshape(-1) for r in rows]), [b[:vb]], 0
        for width, count, _ in layout.stream_sizes:
            out.append(pack_bits(flat[at:at + count], width).numpy().tobytes())
            at += count
        return b"".join(out)

    def valid(b: bytes) -> bool:  # the per-parameter check, independent of the vectorised one
        values = torch.frombuffer(bytearray(b[:vb]), dtype=torch.float32)
        return bool(torch.isfinite(values).all()) and all(
            chunk_indices_ok(r, plans[j].chunk_size) for j, r in zip(layout.order, indices(b)))

    def kept(payload: bytes) -> bool:
        before = opt.rejected_payloads
        opt.aggregation.sum_wire([honest, payload], layout)
        assert opt.last_contributors == 1 + (opt.rejected_payloads == before)
        return opt.rejected_payloads == before

    assert valid(body) and kept(honest)
    rows = indices(body)
    by_width = {bits_for(plans[j].chunk_size): n for n, j in enumerate(layout.order)}
    forged = {
        "nan value": body[:8] + struct.pack("<f", float("nan")) + body[12:],
        "inf value": body[:vb - 4] + struct.pack("<f", float("inf")) + body[vb:],
        "all indices zero": body[:vb] + bytes(layout.index_bytes),
    }
    for width, n in by_width.items():
        r = [x.clone() for x in rows]
        r[n][0, 1] = r[n][0, 0]  # a repeated index
        forged[f"repeat in the {width}-bit stream"] = with_indices(body, r)
        r = [x.clone() for x in rows]
        r[n][-1] = r[n][-1].flip(0)  # the last chunk's indices descending
        forged[f"descending in the {width}-bit stream"] = with_indices(body, r)
    r = [x.clone() for x in rows]
    n, j = next((n, j) for n, j in enumerate(layout.order) if plans[j].chunk_size < 1 << bits_for(plans[j].chunk_size))
    r[n][0] = torch.arange(plans[j].chunk_size, plans[j].chunk_size + plans[j].k)  # increasing, out of range
    forged["out of range"] = with_indices(body, r)
    with caplog.at_level(logging.WARNING, logger="demo_optim"):
        for name, b in forged.items():
            assert len(b) == len(body) and not valid(b), name
            assert not kept(forge(b)), name
    assert "payload holds NaN or Inf values" in caplog.text
    assert "out of range or not increasing" in caplog.text

    rng = random.Random(0)
    outcomes = set()
    for _ in range(300):  # random bytes in the index section: kept exactly when the indices are still valid
        b = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(vb, len(b))] = rng.randrange(256)
        outcomes.add(valid(bytes(b)))
        assert kept(forge(bytes(b))) == valid(bytes(b))
    assert outcomes == {True, False}


def test_the_counts_of_refused_payloads_and_skipped_steps_survive_a_resume():
    """A resumed DeMo run goes on counting the peer payloads it left out and the steps it sat out from where the
    checkpoint left them (the summary and the logs report both)."""
    from demo_optim.algorithm import DeMoAlgorithm

    def made():
        model = _tiny(2)
        return DeMoAlgorithm(model, DeMo(model.parameters(), lr=1e-3))

    saved = made()
    saved.optimizer.rejected_payloads, saved.skipped_steps = 3, 2
    resumed = made()
    resumed.load_state_dict(saved.state_dict())
    assert resumed.optimizer.rejected_payloads == 3 and resumed.skipped_steps == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_decay_decided_on_the_device_equals_the_hosts(dtype):
    """With ``found_inf`` the weight decay is applied on the device, by a factor that is 1 where the step is sat out:
    equal to the plain step where it goes, in fp32 and in bf16 parameters alike (a bf16 factor would round 0.9999
    to 1), and nothing changes where it is sat out."""
    def run(found_inf):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 64, generator=g).to(dtype)),
                  torch.nn.Parameter(torch.randn(64, generator=g).to(dtype))]
        opt = DeMo(params, lr=1e-3, weight_decay=0.1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        before = [p.detach().clone() for p in params]
        if found_inf is not None:
            opt.found_inf = torch.tensor(found_inf)
        opt.step()
        return before, [p.detach().clone() for p in params]

    _, plain = run(None)
    _, decided = run(0.0)
    before, sat_out = run(1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, decided))
    # sat out: the others' update still applies (here: none, one worker sent nothing), no weight decay
    assert all(torch.equal(a, b) for a, b in zip(before, sat_out))
