"""DeMo: transform, top-k, error feedback, mean over senders, any shape, the published algorithm, kernels, loop."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from conftest import FAST, KERNEL_DEVICES, TINY, simulate_and_torchrun
from demo_optim import DeMo
from demo_optim import kernels as K
from demo_optim.transform import from_chunks, plan_for, to_chunks
from diloco.sim import InProcessGroup, run_workers
from launch.checkpoint import latest_checkpoint
from launch.config import load_config
from launch.simulate import simulate_once

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
        sums, counts = opt._aggregate(transport.all_gather_bytes(payload), plans, chain)
        return (sums[0] / counts[0].clamp(min=1)), counts[0], opt.last_contributors

    for agg, counts, contributors in run_workers(InProcessGroup(3), body):
        assert torch.allclose(agg, torch.tensor([[0.0, 3.0, 0.0, 0.0]]), atol=1e-6)
        assert counts[0, 1] == 2 and contributors == 2


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


# ---- in the loop -------------------------------------------------------------------------------
SMALL = ["run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none", "sim.step_time=0.01"]


def test_algo_demo_in_the_simulator(tmp_path):
    common = ["sim.workers=2", "run.max_steps=8", "run.checkpoint_every=8"]
    cfg, _ = load_config([TINY], [*FAST, *SMALL, f"run.dir={tmp_path / 'demo'}", *common, "algo.name=demo"])
    demo = simulate_once(cfg)
    cfg, _ = load_config([TINY], [*FAST, *SMALL, f"run.dir={tmp_path / 'ddp'}", *common, "algo.name=ddp"])
    ddp = simulate_once(cfg)
    assert demo["bytes_sent"] * 30 < ddp["bytes_sent"]
    assert demo["val_loss"] < 5.0
    state = latest_checkpoint(tmp_path / "demo" / "checkpoints")[1]
    w0, w1 = (w["model"] for w in state["workers"])
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    d0 = state["workers"][0]["algo"]["optimizer"]["state"][0]["delta"]
    d1 = state["workers"][1]["algo"]["optimizer"]["state"][0]["delta"]
    assert not torch.equal(d0, d1), "each worker keeps its own momentum"


def test_demo_refuses_a_codec():
    from launch.config import ConfigError

    with pytest.raises(ConfigError, match="DeMo sends its own"):
        load_config([TINY], ["algo.name=demo", "compress.codec=int8"])


def test_simulator_equals_real_gloo_processes(tmp_path):
    args = ["--config", TINY, "--max-steps", "6", "--seed", "3",
            *[a for s in [*FAST, *SMALL, "algo.name=demo", "run.checkpoint_every=6"] for a in ("--set", s)]]
    a, b, sa, sb = simulate_and_torchrun(tmp_path, args, 2)
    assert max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"]) < 1e-5
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0
