"""DDP over gloo under torchrun equals one process with the combined batch; the gloo transport itself; replicas
stay equal under a time-keyed lr schedule."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import FAST, TINY, child_env, free_port, loco, run_cli
from launch.store.checkpoint import latest_checkpoint

STEPS = 6


def _final_params(run_dir):
    hit = latest_checkpoint(run_dir / "checkpoints")
    assert hit is not None, f"no checkpoint in {run_dir}"
    path, state = hit
    assert state["step"] == STEPS
    return state["model"]


def test_torchrun_ddp_matches_single_process_with_doubled_batch(tmp_path, capfd):
    common = ["train", "--config", TINY, "--max-steps", str(STEPS), "--seed", "3",
              *[a for s in FAST for a in ("--set", s)], "--set", "run.eval_every=0", "--set", "algo.name=ddp"]
    single = loco([*common, "--run-dir", str(tmp_path / "single"), "--set", "run.batch_size=8"], capfd)
    assert single.returncode == 0, single.stderr[-3000:]

    port = free_port()
    ddp = run_cli(["--nproc-per-node", "2", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "launch.cli", *common, "--run-dir", str(tmp_path / "ddp"), "--set", "run.batch_size=4"],
                  module="torch.distributed.run", timeout=240)
    assert ddp.returncode == 0, ddp.stderr[-3000:]

    a, b = _final_params(tmp_path / "single"), _final_params(tmp_path / "ddp")
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-4, f"DDP drifted from single-process training by {worst}"
    # and training really moved the parameters away from the seeded init (not a vacuous comparison)
    from launch.config import load_config
    from launch.models.transformer import Transformer, model_args_from_config

    cfg, _ = load_config([TINY])
    torch.manual_seed(3)
    init = Transformer(model_args_from_config(cfg.model, 256, 128)).state_dict()
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    assert moved > 100 * max(worst, 1e-7)
    import json

    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["num_workers"] == 2 and len(summary["workers"]) == 2
    assert summary["bytes_sent"] > 0, "DDP must count the bytes of its gradient all-reduce"
    assert summary["tokens"] == STEPS * 8 * 128
    solo = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert solo["bytes_sent"] == 0 and solo["tokens"] == summary["tokens"]


GLOO_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress.collective import all_reduce_
    t = TorchDistTransport("gloo", timeout=60)
    t.bucket_bytes = 64  # force several buckets
    r = t.rank
    a = torch.full((10,), float(r + 1)); b = torch.arange(7, dtype=torch.float64) * (r + 1); c = torch.ones(3, 2) * r
    all_reduce_(t, [a, b, c], op="mean")
    got = t.all_gather_bytes(b"x" * (r * 5))
    obj = t.broadcast_object({"from": r}, src=1)
    gathered = t.all_gather_object(r * 10)
    w = torch.full((4,), float(r)); t.broadcast_(w, src=1)
    print(json.dumps({"a": a.tolist(), "b": b.tolist(), "c": c.tolist(), "got": [len(g) for g in got],
                      "obj": obj, "gathered": gathered, "w": w.tolist(), "sent": t.stats.bytes_sent,
                      "recv": t.stats.bytes_received}))
    t.close()
""")


def test_gloo_transport_collectives(tmp_path):
    import json

    script = tmp_path / "gloo_check.py"
    script.write_text(GLOO_SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              start_new_session=True) for r in range(3)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, o in enumerate(outs):
        assert o["a"] == [2.0] * 10  # mean of 1, 2, 3
        assert o["b"] == [float(i * 2) for i in range(7)]
        assert o["c"] == [[1.0, 1.0]] * 3
        assert o["got"] == [0, 5, 10]
        assert o["obj"] == {"from": 1}
        assert o["gathered"] == [0, 10, 20]
        assert o["w"] == [1.0] * 4
        # ring all-reduce: 2 (W-1)/W of each bucket, each way, plus the gathered payload bytes
        dense = (10 * 4 + 7 * 8 + 6 * 4)
        assert o["sent"] >= 2 * 2 * dense // 3 + r * 5 * 2 - 3 * 3
        assert o["recv"] > 0


def test_a_time_keyed_lr_schedule_keeps_replicas_equal(tmp_path):
    """With run.max_time and no max_steps the lr decays with the clock. Replicas that must stay equal (DDP's, here
    two simulated workers whose clocks start apart) take rank 0's clock as agreed at the stop checks, not each its
    own: the same lr at every step, the same parameters at the end, and the run stops on the one budget."""
    from launch.config import load_config
    from launch.data.batches import load_data
    from launch.loop.trainer import Trainer
    from diloco.sim import InProcessGroup, run_workers

    cfg, _ = load_config([TINY], [*FAST, "algo.name=ddp", "run.max_steps=null", "run.max_time=2s", "log.every=2",
                                  "optim.warmup_steps=2", "run.eval_every=0", "run.checkpoint_every=0",
                                  f"run.dir={tmp_path / 'run'}"])
    data = load_data(cfg.data)

    def worker(rank, transport):
        trainer = Trainer(cfg, transport=transport, data=data)
        lrs, set_lr = [], trainer.schedule.apply
        trainer.schedule.apply = lambda: lrs.append(set_lr()) or lrs[-1]
        if rank == 1:
            time.sleep(0.3)  # this worker's clock starts later, so its own clock would run 0.3 s behind
        trainer.fit()
        return lrs, [p.detach().clone() for p in trainer.model.parameters()]

    (lrs0, params0), (lrs1, params1) = run_workers(InProcessGroup(2), worker)
    assert len(lrs0) == len(lrs1) > 4 and lrs0 == lrs1
    assert lrs0[-1] < lrs0[2], "the lr did not decay with the clock"
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_nccl_on_a_cpu_process_is_refused_naming_both_settings():
    from diloco.comm import TransportError
    from diloco.comm.torch_dist import TorchDistTransport

    with pytest.raises(TransportError) as e:
        TorchDistTransport(backend="nccl", device=torch.device("cpu"))
    assert "transport.dist_backend=nccl" in str(e.value) and "run.device" in str(e.value)
    assert not torch.distributed.is_initialized()
