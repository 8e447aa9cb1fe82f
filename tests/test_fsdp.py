"""``run.shard: fsdp``: a node's processes shard its worker with FSDP2 (gloo processes on loopback)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import torch

from conftest import FAST, TINY, loco, max_diff
from conftest import torchrun_nodes as nodes
from diloco.algorithm import algorithm_class
from launch.metrics.log import read_metrics
from launch.store.checkpoint import latest_checkpoint, load_checkpoint, payload_bytes, slices_folder
from launch.loop.checkpointer import Checkpointer

RUN = ["run.batch_size=2", "run.eval_every=0", "sim.baseline=none", "log.every=2", "run.checkpoint_every=3",
       "algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2", "algo.overlap_steps=2"]


def sets(*overrides: str) -> list[str]:
    return [a for s in [*FAST, *overrides] for a in ("--set", s)]


def test_two_sharded_nodes_equal_two_simulated_workers_and_resume_exactly(tmp_path, capfd):
    """Two nodes of two processes, each node one Streaming DiLoCo worker sharded with FSDP2, end within 1e-5 of
    ``loco simulate --workers 2`` with each worker's batch; each process holds half of a worker's state; the
    checkpoint exports as any other; a run resumed from its middle checkpoint ends where the unbroken one did, to
    the bit; and another layout resumes it too (the simulator), as a sharded run resumes the simulator's."""
    from diloco.comm.slices import read_slices

    common = ["--config", TINY, "--max-steps", "6", "--seed", "11"]
    sim = loco(["simulate", *common, *sets(*RUN, "run.batch_size=4"), "--workers", "2",
                "--run-dir", str(tmp_path / "sim")], capfd)
    assert sim.returncode == 0, sim.stderr[-3000:]
    # the blocks recomputed in the backward too (model.activation_checkpointing): the same gradients
    train = ["train", *common, *sets(*RUN, "run.shard=fsdp", "model.activation_checkpointing=true")]
    ran = nodes([[*train, "--run-dir", str(tmp_path / "fsdp")]] * 2, per_node=2)
    for node in ran:
        assert node.returncode == 0, node.stderr[-3000:]
    assert "each of a worker's 2 processes holds its slices (run.shard: fsdp): parameters 1.7 MiB, gradients 1.7 MiB, " \
           "optimizer 3.4 MiB, algorithm 4.2 MiB: 11.0 MiB" in ran[0].stderr, ran[0].stderr[-3000:]
    a = latest_checkpoint(tmp_path / "sim" / "checkpoints")[1]
    path, b = latest_checkpoint(tmp_path / "fsdp" / "checkpoints")
    assert b["slices"] == {"nodes": 2, "per_node": 2} and "workers" not in b
    assert max_diff(a["model"], b["model"]) < 1e-5
    # the same validation, scored by a node's two processes (each forward pass a collective) or one worker
    val_sim, val_fsdp = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("sim", "fsdp"))
    assert abs(val_fsdp["val_loss"] / val_sim["val_loss"] - 1) < 1e-4
    # the printed training loss is the worker's, over both processes' rows, as the simulated worker's
    train_sim, train_fsdp = ([r["loss"] for r in read_metrics(tmp_path / d) if r.get("loss") is not None]
                             for d in ("sim", "fsdp"))
    assert len(train_sim) == len(train_fsdp) > 0
    assert max(abs(a - b) for a, b in zip(train_sim, train_fsdp)) < 1e-4, (train_sim, train_fsdp)

    # each process's own state (its slices of the model, of AdamW's moments and of the global copy and outer
    # momentum) is half of what a whole worker holds, plus 5%
    whole = payload_bytes({k: a["workers"][0][k] for k in ("model", "algo")})
    for process in range(4):
        mine = read_slices(slices_folder(path), process)
        assert payload_bytes({k: mine[k] for k in ("model", "algo")}) <= whole / 2 * 1.05

    # the checkpoint's file holds the whole model: loco export reads it as any other
    exported = loco(["export", "--run-dir", str(tmp_path / "fsdp"), "--out", str(tmp_path / "hf")], capfd)
    assert exported.returncode == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), exported.stderr[-3000:]

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "fsdp", broken)
    (broken / "checkpoints" / "step_00000006.pt").unlink()
    to_sim = tmp_path / "to-sim"
    shutil.copytree(broken, to_sim)
    assert load_checkpoint(broken / "checkpoints" / "step_00000003.pt")["step"] == 3
    for node in nodes([[*train, "--run-dir", str(broken), "--resume"]] * 2, per_node=2):
        assert node.returncode == 0, node.stderr[-3000:]
    c = latest_checkpoint(broken / "checkpoints")[1]
    assert c["step"] == 6 and max_diff(b["model"], c["model"]) == 0.0
    for process in range(4):
        x = read_slices(slices_folder(path), process)
        y = read_slices(slices_folder(broken / "checkpoints" / "step_00000006.pt"), process)
        assert max_diff(dict(enumerate(x["algo"]["global_params"])), dict(enumerate(y["algo"]["global_params"]))) == 0

    # another layout takes them too. A worker's processes' slices, joined, are the state the simulated worker held
    # at that step: its model, AdamW's moments, the global copy, the outer momenta and the exchange in flight
    sim_at_3 = load_checkpoint(tmp_path / "sim" / "checkpoints" / "step_00000003.pt")
    for w in sim_at_3["workers"]:
        joined = Checkpointer.whole_worker(to_sim / "checkpoints" / "step_00000003.pt", b["slices"],
                                        w["data"]["worker_index"], algorithm_class("streaming"))
        assert joined["algo"]["pending"], "no exchange was in flight at the checkpoint"
        assert same_state(joined["algo"], w["algo"]) < 1e-5
        assert max_diff(joined["model"], w["model"]) < 1e-5
    # so the simulator resumes a sharded run, and a sharded run resumes the simulator's (each worker's state cut
    # into its processes' slices), each ending where the unbroken runs did
    resumed = loco(["simulate", "--run-dir", str(to_sim), "--resume", "--workers", "2",
                    *sets(*RUN, "run.batch_size=4", "run.shard=none")], capfd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert max_diff(a["model"], latest_checkpoint(to_sim / "checkpoints")[1]["model"]) < 1e-5
    assert abs(json.loads((to_sim / "summary.json").read_text())["val_loss"] / val_sim["val_loss"] - 1) < 1e-4
    from_sim = tmp_path / "from-sim"
    shutil.copytree(tmp_path / "sim", from_sim)
    (from_sim / "checkpoints" / "step_00000006.pt").unlink()
    for node in nodes([[*train, "--run-dir", str(from_sim), "--resume"]] * 2, per_node=2):
        assert node.returncode == 0, node.stderr[-3000:]
    assert max_diff(a["model"], latest_checkpoint(from_sim / "checkpoints")[1]["model"]) < 1e-5


def leaves(tree: Any, at: str = "") -> dict[str, Any]:
    """Every value of a nested state (dicts, lists) by its path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{at}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, f"{at}/{i}").items()}
    return {at: tree}


def same_state(a: Any, b: Any) -> float:
    """The largest difference between the tensors of two nested states of the same paths; every other value
    equal."""
    x, y = leaves(a), leaves(b)
    assert x.keys() == y.keys(), sorted(x.keys() ^ y.keys())
    tensors = {k for k, v in x.items() if isinstance(v, torch.Tensor)}
    assert {k: v for k, v in x.items() if k not in tensors} == {k: v for k, v in y.items() if k not in tensors}
    return max_diff({k: x[k] for k in tensors}, {k: y[k] for k in tensors})


@pytest.mark.parametrize("overrides, key, words", [
    (["optim.name=muon"], "optim.name", "muon orthogonalizes whole matrices"),
    (["algo.name=demo"], "run.shard", "DeMo takes its DCT chunks of whole tensors"),
    (["transport.mesh=flat"], "transport.mesh", "needs the node mesh"),
])
def test_settings_sharding_cannot_run_with_are_named(overrides, key, words):
    from launch.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"{key}: .*{words}"):
        load_config([TINY], ["run.shard=fsdp", *overrides])


def test_plan_prints_what_a_sharded_process_holds(capfd):
    """``loco plan --shard G``: each algorithm's bytes a process, from the parameter count alone (a 7B model over
    8 processes: 3.3 GiB of fp32 parameters each)."""
    res = loco(["plan", "--model", "7e9", "--workers", "2", "--bandwidth", "1Gbit", "--latency", "20ms",
                "--shard", "8"], capfd)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "sharded over 8 processes (run.shard: fsdp)" in res.stdout
    assert "diloco      parameters 3.3 GiB, gradients 3.3 GiB, optimizer 6.5 GiB, algorithm 6.5 GiB: 19.6 GiB" in res.stdout
    assert "ddp         parameters 3.3 GiB, gradients 3.3 GiB, optimizer 6.5 GiB, algorithm 0 B: 13.0 GiB" in res.stdout


def test_sharding_outside_torchrun_or_over_too_few_units_says_why(capfd):
    from diloco.comm import TransportError
    from diloco.comm.fsdp import shard_model, shard_units
    from launch.models.transformer import ModelArgs, Transformer

    res = loco(["train", "--config", TINY, "--max-steps", "1", *sets("run.shard=fsdp")], capfd)
    assert res.returncode != 0 and "run.shard=fsdp shards a worker among the processes of a node started by " \
                                    "torchrun" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    shape = dict(dim=16, n_layers=2, n_heads=2, vocab_size=32, max_seq_len=8)
    untied = Transformer(ModelArgs(**shape, tie_embeddings=False))
    assert shard_units(untied) == [*untied.layers, untied.output]  # the blocks and the head; the embedding: the root
    with pytest.raises(TransportError, match="the model has 2 unit"):  # a head tied to the embedding stays there
        shard_model(Transformer(ModelArgs(**shape, tie_embeddings=True)), None, 4, False)


def test_sparseloco_error_feedback_moves_between_layouts(tmp_path, capfd):
    """SparseLoCo's error feedback (its codec's residuals, one per bucket of a process's slices) joins and cuts with
    the rest: from a checkpoint of two nodes of two sharded processes, two nodes of one sharded process each and
    ``loco simulate`` go on to where the unbroken sharded run ended, within 1e-5. Every value is sent, in bf16
    (rounded one by one, so the error feedback holds the rounding): the top-k's chunks and the value blocks, which
    a process's slices cut otherwise, change nothing, and the sharded run equals the unsharded ones."""
    common = ["--config", TINY, "--max-steps", "2", "--seed", "5"]
    run = sets("run.batch_size=2", "run.eval_every=0", "sim.baseline=none", "run.checkpoint_every=1",
               "algo.name=sparseloco", "algo.inner_steps=1", "algo.topk_density=1.0", "algo.value_format=bf16",
               "run.shard=fsdp")
    first = tmp_path / "2x2"
    for node in nodes([["train", *common, *run, "--run-dir", str(first)]] * 2, per_node=2):
        assert node.returncode == 0, node.stderr[-3000:]
    unbroken = latest_checkpoint(first / "checkpoints")[1]
    (first / "checkpoints" / "step_00000002.pt").unlink()
    at_1 = Checkpointer.whole_worker(first / "checkpoints" / "step_00000001.pt", {"nodes": 2, "per_node": 2}, 0,
                               algorithm_class("sparseloco"))
    (residual,) = at_1["algo"]["codec"]["residuals"].values()  # tiny's pieces make one bucket
    assert residual.numel() == sum(g.numel() for g in at_1["algo"]["global_params"]) and residual.abs().max() > 0
    shutil.copytree(first, tmp_path / "sim")
    for node in nodes([["train", *common, *run, *sets("run.batch_size=4"), "--run-dir", str(first), "--resume"]] * 2,
                      per_node=1):
        assert node.returncode == 0, node.stderr[-3000:]
    sim = loco(["simulate", *common, *run, *sets("run.shard=none", "run.batch_size=4"), "--workers", "2",
                "--run-dir", str(tmp_path / "sim"), "--resume"], capfd)
    assert sim.returncode == 0, sim.stderr[-3000:]
    a, b = (latest_checkpoint(d / "checkpoints")[1] for d in (first, tmp_path / "sim"))
    assert a["step"] == b["step"] == 2
    assert max_diff(a["model"], b["model"]) < 1e-5 and max_diff(unbroken["model"], b["model"]) < 1e-5


def test_residuals_lie_in_buckets_of_their_pieces():
    """A codec's residuals, one per bucket of an exchange's pieces laid end to end, as one tensor per piece and
    back; a residual kept by shares of a bucket (the node mesh) is refused in one line."""
    from diloco.reshard import KEPT_BY_SHARES, bucketed, exchanges, unbucketed

    shapes = exchanges([[torch.Size([3, 4]), torch.Size([5])], [torch.Size([2, 2])]])
    # at most 12 values a bucket: [3, 4] alone, then [5] and [2, 2] together where they follow each other
    kept = {("fragment0", 0): torch.arange(12.0), ("fragment0", 1): torch.arange(5.0), ("all", 1): torch.ones(9)}
    pieces = unbucketed(kept, shapes, bucket_bytes=48)  # by fragment; None: the exchange of all at once
    assert pieces[0][0].shape == (3, 4) and pieces[1] == [None]
    assert pieces[None][0] is None and torch.equal(pieces[None][2], torch.ones(2, 2))
    again = bucketed(pieces, shapes, bucket_bytes=48, process=1)
    assert again.keys() == {(k, 1) for k in kept} and all(torch.equal(again[(k, 1)], v) for k, v in kept.items())
    joined = bucketed(pieces, shapes, bucket_bytes=1 << 20)  # one bucket an exchange: the others' pieces are zeros
    assert torch.equal(joined[("all", 0)], torch.cat([torch.zeros(12), torch.ones(9)]))
    with pytest.raises(ValueError, match="cannot be carried to another layout"):
        unbucketed({(("fragment0", 0), 1): torch.zeros(6)}, shapes, bucket_bytes=48)
    assert "resume laid out as it was written" in KEPT_BY_SHARES
