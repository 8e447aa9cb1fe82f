"""The Algorithm interface: finite-gradient guard, clipping, state round trip."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from conftest import HostReads
from diloco import DDP
from diloco.comm import LocalTransport
from diloco.muon import MuonAdamW


def _setup(clip=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, DDP(model, opt, LocalTransport(), grad_clip=clip)


def test_non_finite_gradients_skip_the_step():
    model, algo = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(5, 4)).sum().backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    info = algo.step()
    assert info["skipped"] and not math.isfinite(info["grad_norm"])
    assert algo.skipped_steps == 1 and algo.steps == 1  # counted for round schedules, nothing applied
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p), "a NaN gradient reached the parameters"
        assert p.grad is None


def test_clipping_bounds_the_update():
    model, algo = _setup(clip=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    (model(torch.randn(5, 4)) * 100).sum().backward()
    info = algo.step()
    assert info["grad_norm"] > 0.01
    moved = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(model.parameters(), before)))
    assert moved == pytest.approx(0.1 * 0.01, rel=1e-3)  # lr * clipped norm


def test_state_dict_round_trip_and_name_check():
    model, algo = _setup()
    model(torch.randn(5, 4)).sum().backward()
    algo.step()
    state = algo.state_dict()
    _, other = _setup()
    other.load_state_dict(state)
    assert other.steps == 1
    state["name"] = "diloco"
    with pytest.raises(ValueError, match="diloco"):
        other.load_state_dict(state)


def _optimizer_pair(clip: float, name: str = "adamw"):
    """The same model and optimizer (AdamW, SGD with momentum, or Muon with AdamW) twice: fused (checks on the device) and the
    plain loop (checks on the host)."""
    out = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        kernel = dict(fused=fused, foreach=None if fused else False)
        if name == "muon":  # the weights with Muon, the biases with AdamW
            weights = [p for p in model.parameters() if p.dim() == 2]
            opt = MuonAdamW(weights, [{"params": [p for p in model.parameters() if p.dim() == 1]}], lr=0.05,
                            weight_decay=0.1, adamw=dict(lr=0.05, **kernel))
        elif name == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, **kernel)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **kernel)
        out.append((model, DDP(model, opt, LocalTransport(), grad_clip=clip)))
    return out


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_a_fused_step_reads_nothing_back_and_matches_the_host_checks(clip, name):
    (fast, fast_algo), (slow, slow_algo) = _optimizer_pair(clip, name)
    assert fast_algo._checks_on_device() and not slow_algo._checks_on_device()
    for step in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)) * 10
        for model, algo in ((fast, fast_algo), (slow, slow_algo)):
            model(x).sum().backward()
            if step == 2:  # a non-finite gradient: both skip the update and count it
                next(model.parameters()).grad[0, 0] = float("inf")
            with HostReads() as reads:
                info = algo.step()
            algo.zero_grad()
            if algo is fast_algo:
                assert reads.count == 0, "the fused step read a value back to the host"
                assert isinstance(info["skipped"], torch.Tensor) and bool(info["skipped"]) == (step == 2)
            else:
                assert reads.count > 0
        for a, b in zip(fast.parameters(), slow.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fast_algo.skipped_steps == slow_algo.skipped_steps == 1
    assert fast_algo.steps == slow_algo.steps == 4
    if name != "sgd":  # AdamW's own step count skips the skipped step too (bias correction stays aligned)
        assert float(fast_algo.optimizer.state[list(fast.parameters())[-1]]["step"]) == 3
    state = fast_algo.state_dict()
    assert state["skipped_steps"] == 1


@pytest.mark.parametrize("saved_fused", [False, True], ids=["unfused-into-fused", "fused-into-unfused"])
def test_a_state_saved_with_the_other_adamw_kernel_resumes_with_this_ones(saved_fused):
    """A checkpoint keeps its param groups' kernel flags: a CPU run's (an unfused AdamW until the fused kernel was
    the CPU's too) resumed where the step is fused turned the next step into an unfused one driven by the fused
    step's device checks, which it refuses. Each side keeps its own kernel, and the run goes on as if unbroken."""
    (fast, fast_algo), (slow, slow_algo) = _optimizer_pair(0.05)
    saver, loader = (fast_algo, slow_algo) if saved_fused else (slow_algo, fast_algo)
    saver_model, loader_model = (fast, slow) if saved_fused else (slow, fast)
    for step in range(3):
        saver_model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        saver.step()
        saver.zero_grad()
    blob = io.BytesIO()
    torch.save({"algo": saver.state_dict(), "model": saver_model.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    loader_model.load_state_dict(saved["model"])
    loader.load_state_dict(saved["algo"])
    assert [g["fused"] for g in loader.optimizer.param_groups] == [not saved_fused]
    assert loader._checks_on_device() == (not saved_fused)
    for step in range(3, 5):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for model, algo in ((saver_model, saver), (loader_model, loader)):
            model(x).sum().backward()
            algo.step()
            algo.zero_grad()
    for a, b in zip(saver_model.parameters(), loader_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(loader.optimizer.state[next(loader_model.parameters())]["step"]) == 5
    # a DDP worker that joins takes the others' optimizer state the same way (loco join, a simulated comeback)
    _, joiner = _optimizer_pair(0.05)[1 if saved_fused else 0]  # the loader's kernel
    joiner.load_shared_state(saver.shared_state())
    assert [g["fused"] for g in joiner.optimizer.param_groups] == [not saved_fused]
    assert float(joiner.optimizer.state[joiner.params[0]]["step"]) == 5


@pytest.mark.parametrize("bad", [None, "inf", "nan"])
def test_ddp_with_a_codec_checks_its_gradients_in_one_read_whatever_the_number_of_parameters(bad):
    """A worker with non-finite gradients sends nothing (weight 0); the test for it reads back once, not once per
    parameter (a host sync each on a GPU)."""
    from diloco.compress import make_codec

    def step(layers):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)  # its step reads nothing back
        algo = DDP(model, opt, LocalTransport(), codec=make_codec("int8"))
        model(torch.randn(3, 8)).sum().backward()
        if bad:
            list(model.parameters())[-2].grad[1, 2] = float(bad)
        with HostReads() as reads:
            info = algo.step()
        assert bool(info["skipped"]) == (bad is not None)
        return reads.count

    assert step(2) == step(8)



def test_a_round_of_fixed_steps_never_reads_the_clock():
    """sync.mode=steps ends a round on its step count alone: the clock (on a node of a torchrun mesh, a broadcast
    among the node's processes and a read back) is not read at every step; sync.mode=time reads it."""
    from diloco.sync import SyncPolicy

    def clock(*_):
        raise AssertionError("the clock was read")

    steps = SyncPolicy("steps", inner_steps=3)
    steps.start_round(clock)
    assert [steps.round_done(k, clock) for k in (1, 2, 3)] == [False, False, True]
    times = iter([10.0, 10.4, 11.2])
    timed = SyncPolicy("time", time_budget_s=1.0)
    timed.start_round(lambda: next(times))
    assert [timed.round_done(k, lambda start: next(times) - start) for k in (1, 2)] == [False, True]


def test_a_simulated_time_budgeted_round_is_not_stretched_by_a_moving_step_time():
    """The simulator prices a step at the median of the measured step times, which moves as the run goes on. A
    round's elapsed time prices the steps since its start at one price: with ``now() - start``, every step of the
    run before the round was re-priced too, and 2,000 steps at a median 0.5% higher made a 0.5 s round read 1.5 s."""
    from diloco.sim.clock import VirtualTime
    from diloco.sim.group import InProcessGroup
    from diloco.sim.transport import InProcessTransport
    from diloco.sync import SyncPolicy

    g = InProcessGroup(1)
    t = InProcessTransport(g, 0)
    price = [0.1]
    g.step_time_s = lambda: price[0]
    g.clock[0] = VirtualTime(3.0, 2000.0)
    policy = SyncPolicy("time", time_budget_s=1.0)
    policy.start_round(t.mark)
    g.clock[0] = g.clock[0].plus(steps=5)  # five steps of 0.1 s: half the budget
    price[0] = 0.1005
    assert t.seconds_since(policy.round_start) == pytest.approx(5 * 0.1005)
    assert not policy.round_done(5, t.seconds_since)
    g.clock[0] = g.clock[0].plus(steps=5)
    assert policy.round_done(10, t.seconds_since)


@pytest.mark.parametrize("batch_numel", [None, 32 * 32])  # as it comes, or one 32 x 32 matrix per batch
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_muon_with_adamw_steps_as_torchs_muon_and_adamw(device, batch_numel, monkeypatch):
    """MuonAdamW is torch.optim.Muon on the matrices and torch's AdamW on the rest, given the same gradients:
    within bf16's rounding of each orthogonalized update (about 3% of its largest value), which torch's Muon
    computes in bf16 one matrix at a time and MuonAdamW in batches of one shape (in fp32 on a CPU)."""
    from diloco import muon

    if batch_numel:
        monkeypatch.setattr(muon, "BATCH_NUMEL", batch_numel)
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
                               torch.nn.Linear(32, 8)).to(device)  # two matrices of one shape: one batch
    ref = copy.deepcopy(ours)
    split = lambda m: ([p for p in m.parameters() if p.dim() == 2], [p for p in m.parameters() if p.dim() == 1])
    (mats, vecs), (ref_mats, ref_vecs) = split(ours), split(ref)
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    opt = MuonAdamW(mats, [{"params": vecs}], lr=0.02, weight_decay=0.1, adamw=adamw)
    torch_muon = torch.optim.Muon(ref_mats, lr=0.02, weight_decay=0.1)
    torch_adamw = torch.optim.AdamW(ref_vecs, **adamw)
    start = [p.detach().clone() for p in ours.parameters()]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for p, q in zip(ours.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g).to(device)
            q.grad = p.grad.clone()
        opt.step()
        torch_muon.step()
        torch_adamw.step()
    for a, b, s in zip(ours.parameters(), ref.parameters(), start):
        # each of 3 steps moves a matrix by lr x sqrt(max(1, rows / cols)) x its update
        torch.testing.assert_close(a, b, rtol=0, atol=3 * 0.02 * 2 ** 0.5 * 0.02)
        assert not torch.equal(a, s)
