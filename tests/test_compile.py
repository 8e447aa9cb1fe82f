"""run.compile: a compiled model trains like the eager one, resumes exactly, shares its graphs between simulated
workers, and a compiler that fails leaves the run going uncompiled with one line.

Inductor compiles for the CPU here (it needs a C compiler, which CI has); every run uses the same model and
shapes, so after the first test the compiled graphs come from inductor's cache.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import ROOT, TINY, child_env, loco, run_cli
from launch.store.checkpoint import latest_checkpoint
from launch.metrics.log import read_metrics
from launch.loop.trainer import train

SMALL = ["data.max_docs=60", "log.plot=false", "log.progress=plain", "run.device=cpu", "run.threads=1",
         "run.batch_size=4", "data.seq_len=64", "run.eval_every=0", "eval.tokens=256", "log.every=1",
         "model.n_layers=2"]


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return latest_checkpoint(run_dir / "checkpoints")[1]["model"]


def test_compiled_equals_eager_and_resumes_exactly(tiny_cfg, tmp_path):
    eager = train(tiny_cfg(*SMALL, "run.max_steps=6", "run.compile=false", run_dir=tmp_path / "eager"))
    whole = train(tiny_cfg(*SMALL, "run.max_steps=6", "run.compile=true", run_dir=tmp_path / "whole"))
    a, b = _losses(tmp_path / "eager"), _losses(tmp_path / "whole")
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, rel=1e-4), (a, b)  # the same model to float tolerance (fused kernels round apart)
    assert whole["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)
    # checkpoints of a compiled model keep the module's own names, and resuming one is exact
    weights = _weights(tmp_path / "whole")
    assert not any("_orig_mod" in k for k in weights)
    train(tiny_cfg(*SMALL, "run.max_steps=3", "run.compile=true", run_dir=tmp_path / "split"))
    train(tiny_cfg(*SMALL, "run.max_steps=6", "run.compile=true", "run.resume=true", run_dir=tmp_path / "split"))
    assert _losses(tmp_path / "split") == _losses(tmp_path / "whole")
    resumed = _weights(tmp_path / "split")
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_a_backward_that_fails_to_compile_leaves_the_run_going_uncompiled(tiny_cfg, tmp_path, monkeypatch, capfd):
    """The backward graph compiles at the first backward, after the forward compiled: a compiler that fails there
    (an unsupported kernel on the user's GPU) gets the same one line, and the step runs again eagerly: the same
    losses as an eager run, nothing added twice to the gradients."""
    from torch._dynamo.backends.common import aot_autograd

    tried = []

    def backward_fails(gm, example_inputs):
        tried.append(len(example_inputs))
        raise RuntimeError("no kernel for this GPU")

    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: gm.forward, bw_compiler=backward_fails)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend=backend))
    torch._dynamo.reset()
    train(tiny_cfg(*SMALL, "run.max_steps=4", "run.grad_accum=2", "run.compile=true", run_dir=tmp_path / "broken"))
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "run.compile" in line]
    assert len(tried) == 1 and len(lines) == 1, err[-3000:]
    assert "torch.compile failed (RuntimeError: no kernel for this GPU" in lines[0] and \
        "continuing without compiling" in lines[0]
    monkeypatch.undo()
    train(tiny_cfg(*SMALL, "run.max_steps=4", "run.grad_accum=2", "run.compile=false", run_dir=tmp_path / "eager"))
    assert _losses(tmp_path / "broken") == _losses(tmp_path / "eager")
    assert all(torch.equal(a, b) for a, b in zip(_weights(tmp_path / "broken").values(),
                                                  _weights(tmp_path / "eager").values()))


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_simulated_workers_share_the_compiled_graphs(tmp_path, codec):
    """Three workers take turns on one compiled architecture: no worker switch compiles again (int8: each
    worker's parameters are views of one flat buffer of its own, see DiLoCo)."""
    from torch._dynamo.utils import counters

    from launch.config import load_config
    from launch.simulate.runner import simulate

    def graphs_for(workers: int) -> int:
        torch._dynamo.reset()
        counters.clear()
        cfg, _ = load_config([TINY], [*SMALL, "run.max_steps=4", "run.compile=true", "algo.name=diloco",
                                      "algo.inner_steps=2", "sim.baseline=none", f"sim.workers={workers}",
                                      f"compress.codec={codec}", f"run.dir={tmp_path / f'sim{workers}'}"])
        simulate(cfg)
        return int(counters["stats"]["unique_graphs"])

    one, three = graphs_for(1), graphs_for(3)
    assert one >= 1, "nothing was compiled"
    assert three == one, f"{three} graphs for 3 workers against {one} for one: the workers recompiled"


def test_a_failing_compiler_leaves_the_run_going_uncompiled(tmp_path, capfd):
    """No C compiler (and no cache to hide it): one line naming the failure, then the eager run, same losses."""
    env = child_env(CXX="/nonexistent/g++", CC="/nonexistent/gcc", TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                    TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    sets = [a for s in [*SMALL, "run.max_steps=3"] for a in ("--set", s)]
    broken = run_cli(["train", "--config", TINY, *sets, "--set", "run.compile=true", "--run-dir",
                      str(tmp_path / "broken")], env=env)
    assert broken.returncode == 0, broken.stderr[-3000:]
    lines = [line for line in broken.stderr.splitlines() if "run.compile" in line]
    assert len(lines) == 1 and "torch.compile failed" in lines[0] and "continuing without compiling" in lines[0], \
        broken.stderr[-3000:]
    assert "Traceback" not in broken.stderr
    eager = loco(["train", "--config", TINY, *sets, "--set", "run.compile=false", "--run-dir",
                  str(tmp_path / "eager")], capfd)
    assert eager.returncode == 0, eager.stderr[-3000:]
    assert _losses(tmp_path / "broken") == _losses(tmp_path / "eager")
