"""The Algorithm interface: finite-gradient guard, clipping, state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from diloco import DDP
from diloco.comm import LocalTransport


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
