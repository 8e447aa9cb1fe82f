"""End to end: the run folder layout, learning on the embedded corpus, --max-time, wandb offline, plots, sampling."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest
import yaml

from conftest import FAST, ROOT, TINY, HostReads, child_env, loco, run_cli
from launch.config import config_from_dict
from launch.loop.trainer import train

REQUIRED = {"step", "tokens", "loss", "lr", "tokens_per_s", "bytes_sent", "bytes_received", "wall_s"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    res = run_cli(["train", "--config", TINY, "--max-steps", "80", "--run-dir", str(run_dir),
                   *[a for s in FAST for a in ("--set", s)], "--set", "run.eval_every=40", "--set", "log.plot=true",
                   "--set", "run.batch_size=8"])
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir, res


def test_run_folder_layout(trained):
    run_dir, res = trained
    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    assert cfg.run.max_steps == 80 and cfg.data.seq_len == 128  # resolved: files, --set and flags applied
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("loss") is not None]
    assert train_rows and all(REQUIRED <= r.keys() for r in train_rows)
    assert [r["step"] for r in train_rows] == list(range(10, 81, 10))
    assert [r["step"] for r in rows if r.get("val_loss") is not None] == [40, 80]
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("val_loss", "tokens", "bytes_sent", "wall_s", "workers"):
        assert key in summary
    assert summary["tokens"] == 80 * 8 * 128 and summary["workers"][0]["tokens"] == summary["tokens"]
    assert (run_dir / "checkpoints" / "step_00000080.pt").is_file()
    png = (run_dir / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "[worker 0 | step 40/80]" in res.stderr  # plain progress lines carry context


def test_progress_ends_with_one_line_per_step_and_no_mfu_on_a_cpu(trained):
    _, res = trained
    assert res.stderr.count("step 80/80") == 1, res.stderr[-2000:]  # the last progress line, not the done line too
    assert "[worker 0] done at step 80: val_loss " in res.stderr
    assert "mfu" not in res.stderr  # a CPU has no datasheet peak: no MFU figure, and no line about it
    rows = [json.loads(l) for l in (trained[0] / "metrics.jsonl").read_text().splitlines()]
    assert all(r.get("mfu") is None for r in rows)  # the key stays, empty


def test_loss_falls_well_below_uniform(trained):
    run_dir, _ = trained
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] < math.log(256) - 2.0  # 5.55 nats for a uniform byte model
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss": null' not in l]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0


def test_sample_from_checkpoint(trained, capsys):
    from launch.cli import main

    run_dir, _ = trained
    res = loco(["sample", "--checkpoint", str(run_dir), "--prompt", "def ", "--max-new-tokens", "40",
                "--temperature", "0"], capsys)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("def ") and len(res.stdout) > 10
    again = loco(["sample", "--checkpoint", str(run_dir / "checkpoints" / "step_00000080.pt"), "--prompt", "def ",
                  "--max-new-tokens", "40", "--temperature", "0"], capsys)
    assert again.stdout == res.stdout  # greedy decoding is deterministic
    capsys.readouterr()
    rc = main(["sample", "--run-dir", str(run_dir), "--prompt", "def ", "--max-new-tokens", "40", "--temperature",
               "0", "--device", "cpu"])  # the flag train and --resume take for the folder
    assert rc == 0 and capsys.readouterr().out == res.stdout


def test_plot_command_compares_runs(trained, tmp_path):
    run_dir, _ = trained
    out = tmp_path / "cmp.png"
    res = loco(["plot", str(run_dir), str(run_dir), "--out", str(out)])
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_published_state_is_the_live_tensors_copied_to_host_once(tiny_cfg):
    """``Algorithm.shared_state`` hands out the live tensors, and ``Trainer.shared_state_later`` (what a
    ``loco join`` peer publishes every round) copies each of them to host memory once. A clone in
    ``shared_state`` was a second copy, on the GPU: 4 GB more for a 1B model at every publish and checkpoint."""
    import io

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from launch.loop.trainer import Trainer

    class Made(TorchDispatchMode):
        """The bytes of the storages that operations made (views of existing tensors are not counted)."""

        def __init__(self, existing: set[int]) -> None:
            super().__init__()
            self.existing, self.made = existing, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.existing:
                    self.made[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return out

    trainer = Trainer(tiny_cfg("algo.name=diloco", "algo.inner_steps=2"))
    try:
        algo = trainer.algo
        state = algo.shared_state()
        assert [t.data_ptr() for t in state["global_params"]] == [g.data_ptr() for g in algo.global_params]
        live = [*algo.global_params, *algo.params]
        with Made({t.untyped_storage().data_ptr() for t in live}) as seen:
            later = trainer.shared_state_later(epoch=3)
        assert sum(seen.made.values()) == sum(g.numel() * g.element_size() for g in algo.global_params)
        with torch.no_grad():
            for g in algo.global_params:  # training goes on: the published copy stays as it was
                g.add_(1.0)
        got = torch.load(io.BytesIO(later()), weights_only=True)
        assert got["epoch"] == 3
        assert all(torch.equal(a + 1.0, b) for a, b in zip(got["global_params"], algo.global_params))
    finally:
        trainer.transport.close()


# DDP's inner optimizer is Muon with AdamW: both kinds of moments are checked in one optimizer
@pytest.mark.parametrize("algo", ["ddp+muon", "diloco", "streaming", "sparseloco", "demo"])
def test_a_broken_shared_state_is_refused_whole_and_this_one_stays_as_it_was(algo, tiny_cfg):
    """What a ``loco join`` peer (or a simulated worker coming back) takes from another is checked whole before
    any of it is taken: a state with a NaN, a tensor of another shape, a round that is not a number, an
    optimizer moment of another shape (DDP's AdamW, an outer Nesterov momentum) is refused with one line naming
    its source and what is wrong, and every tensor of this worker's state stays as it was. Before, a NaN or a
    moment of another shape was taken, and a round that was not a number failed after the parameters and the
    optimizers' state were taken."""
    import io

    import torch

    from launch.errors import RunError
    from launch.loop.trainer import Trainer

    algo, _, optim = algo.partition("+")
    extra = ["algo.inner_steps=2"] if algo != "ddp" and algo != "demo" else []
    if algo == "streaming":
        extra.append("algo.fragments=2")
    if optim:
        extra.append(f"optim.name={optim}")
    cfg = tiny_cfg(f"algo.name={algo}", "run.max_steps=4", "run.eval_every=0", "run.checkpoint_every=0", *extra)
    mine, theirs = Trainer(cfg), Trainer(tiny_cfg(f"algo.name={algo}", "run.max_steps=4", "run.eval_every=0",
                                                  "run.checkpoint_every=0", "run.seed=7", *extra))
    try:
        for tr in (mine, theirs):  # moments and outer momenta exist after a few steps and rounds
            tr.fit()

        def tensors(tr):
            flat = []

            def walk(x):
                if isinstance(x, torch.Tensor):
                    flat.append(x.detach().clone())
                elif isinstance(x, dict):
                    for k in sorted(x, key=str):
                        walk(x[k])
                elif isinstance(x, (list, tuple)):
                    for v in x:
                        walk(v)
            walk(tr.algo.shared_state())
            return flat

        before, counts = tensors(mine), (mine.algo.round, mine.algo.global_tokens)
        good = torch.load(io.BytesIO(theirs.shared_state_blob()), weights_only=True)
        key = "params" if "params" in good else "global_params"

        def blob(change):
            state = torch.load(io.BytesIO(theirs.shared_state_blob()), weights_only=True)
            change(state)
            buf = io.BytesIO()
            torch.save(state, buf)
            return buf.getvalue()

        def nan_last(s):
            s[key][-1][0] = float("nan")

        def reshaped(s):
            s[key][-1] = s[key][-1].reshape(-1)[:5].clone()

        def bad_round(s):
            s["round"] = "three"

        broken = {"holds NaN or infinite": blob(nan_last), "shape (5,)": blob(reshaped), "'round' is 'three'":
                  blob(bad_round), "does not load": b"not a state", "not a run's state": _saved_list()}
        def sparse(s):
            s[key][0] = s[key][0].to_sparse()
        broken["is not a dense floating-point tensor"] = blob(sparse)
        if optim == "muon":  # AdamW's parameters come first, then Muon's matrices, each with its momentum
            last = len(good["optimizer"]["state"]) - 1

            def no_momentum(s):
                del s["optimizer"]["state"][last]["momentum_buffer"]
            broken[f"parameter {last} has no 'momentum_buffer'"] = blob(no_momentum)

            def muon_moment(s):
                s["optimizer"]["state"][last - 1]["momentum_buffer"] = torch.zeros(2, 3)
            broken[f"'momentum_buffer' of parameter {last - 1} is (2, 3)"] = blob(muon_moment)

        if algo == "ddp":  # AdamW's moments: parameter 0 is the embedding, 1 a norm's weight
            def moment(s):
                entry = s["optimizer"]["state"][1]
                entry["exp_avg"] = entry["exp_avg"].reshape(-1)[:7].clone()
            broken["'exp_avg' of parameter"] = blob(moment)

            def scalar_moment(s):  # one value: it loaded, and the next step failed to broadcast it
                s["optimizer"]["state"][0]["exp_avg"] = torch.zeros(())
            broken["'exp_avg' of parameter 0 is ()"] = blob(scalar_moment)

            def no_moment(s):
                del s["optimizer"]["state"][1]["exp_avg_sq"]
            broken["parameter 1 has no 'exp_avg_sq'"] = blob(no_moment)
        if algo in ("diloco", "streaming"):
            def momentum(s):
                opt = s["outer_optimizers"][-1]
                i = max(opt["state"])
                opt["state"][i]["momentum_buffer"] = torch.zeros(3)
            broken["'momentum_buffer' of parameter"] = blob(momentum)

            def one_value(s):
                opt = s["outer_optimizers"][0]
                opt["state"][min(opt["state"])]["momentum_buffer"] = torch.zeros(1)
            broken["'momentum_buffer' of parameter 0 is (1,)"] = blob(one_value)

            def nan_momentum(s):  # checked with the global parameters, which come first in the state
                opt = s["outer_optimizers"][-1]
                opt["state"][max(opt["state"])]["momentum_buffer"][0] = float("inf")
            broken["['momentum_buffer'] holds NaN or infinite"] = blob(nan_momentum)
        for what, b in broken.items():
            with pytest.raises(RunError) as e:
                mine.load_shared_blob(b, "peer QmBroken")
            assert "peer QmBroken" in str(e.value) and what in str(e.value), (what, str(e.value))
            after = tensors(mine)
            assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after)), what
        assert (mine.algo.round, mine.algo.global_tokens) == counts
        # a sound state is taken whole
        mine.load_shared_blob(theirs.shared_state_blob(), "peer QmGood")
        assert all(torch.equal(a, b) for a, b in zip(tensors(mine), tensors(theirs)))
        assert torch.equal(torch.cat([p.detach().flatten() for p in mine.algo.global_parameters()]),
                           torch.cat([g.flatten() for g in good[key]]))
    finally:
        mine.transport.close()
        theirs.transport.close()


def test_a_downloaded_state_loads_without_a_copy_of_its_bytes(tiny_cfg):
    """A downloaded state is a ``bytearray``; ``io.BytesIO`` copied it whole before ``torch.load`` read it, a
    third copy of the state in host memory at a join (8.8 GB more for a 1B DiLoCo state). It is read in place
    (``BufferReader``): what Python allocates during the load is far below the state's size, the state taken
    is the same, and the buffer is the caller's again afterwards."""
    import tracemalloc

    import torch

    from launch.loop.trainer import Trainer

    base = tiny_cfg("algo.name=diloco", "algo.inner_steps=2", "run.eval_every=0", "run.checkpoint_every=0")
    mine, theirs = Trainer(base), Trainer(tiny_cfg("algo.name=diloco", "algo.inner_steps=2", "run.seed=5"))
    try:
        blob = bytearray(theirs.shared_state_blob(epoch=4))
        tracemalloc.start()
        try:
            mine.load_shared_blob(blob, "peer QmTheirs")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < len(blob) // 4, (peak, len(blob))
        assert all(torch.equal(a, b) for a, b in zip(mine.algo.global_params, theirs.algo.global_params))
        blob.extend(b"more")  # no view of it left behind
    finally:
        mine.transport.close()
        theirs.transport.close()


def test_a_model_vocabulary_smaller_than_the_data_is_refused_in_one_line(tiny_cfg):
    """A byte-level corpus has 256 tokens; a model of 100 would look a token past its embedding up (an IndexError
    on the CPU, a device assert that ends the CUDA context on a GPU)."""
    from launch.errors import RunError
    from launch.loop.trainer import Trainer

    with pytest.raises(RunError, match="model.vocab_size=100 is smaller than the data's vocabulary of 256 tokens"):
        Trainer(tiny_cfg("model.vocab_size=100"))


def test_a_new_run_in_the_folder_of_one_without_checkpoints_starts_its_own_curve(tiny_cfg, tmp_path, capfd):
    """A run that left no checkpoint (``checkpoint_every=0``, a crash before the first) run again in its folder:
    its metrics and wandb id are moved aside, as ``--restart`` does, instead of the new steps being appended to
    the old curve (and the old wandb run continued)."""
    run_dir = tmp_path / "again"
    cfg = lambda: tiny_cfg("run.max_steps=3", "run.eval_every=0", "run.checkpoint_every=0",  # noqa: E731
                           "run.checkpoint_final=false", "log.every=1", run_dir=run_dir)
    train(cfg())
    (run_dir / ".wandb_id").write_text("earlier\n")
    first = (run_dir / "metrics.jsonl").read_text()
    train(cfg())
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == sorted(set(steps)) and steps[-1] == 3, steps  # one curve, not two
    moved = list(run_dir.glob("discarded-*"))
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").read_text() == first
    assert (moved[0] / ".wandb_id").read_text() == "earlier\n" and not (run_dir / ".wandb_id").exists()
    assert "an earlier run's metrics (no checkpoints): moved" in capfd.readouterr().err


def test_with_time_budgeted_rounds_the_lr_follows_the_runs_agreed_tokens_not_the_workers_own_steps(tiny_cfg):
    """With ``sync.mode=time`` a fast worker makes more steps than a slow one, and the run stops on the tokens
    they agreed on. The lr schedule follows the same: those tokens as steps of every worker plus this worker's
    steps since the last sync. A worker at a quarter of the speed decayed only a third of the way by the run's
    end; a fast one spent the last third at the floor."""
    from launch.loop.schedule import lr_factor
    from launch.loop.trainer import Trainer

    cfg = tiny_cfg("algo.name=diloco", "sync.mode=time", "sync.time_budget_s=1s", "run.max_steps=100",
                   "optim.warmup_steps=0", "optim.min_lr_ratio=0.1", "optim.lr=1e-3")
    trainer = Trainer(cfg)
    try:
        per_step = trainer.tokens_per_step * trainer.world

        def lr_at(own_step, agreed_steps, since_sync):
            trainer.progress.step, trainer.progress.synced_step = own_step, own_step - since_sync
            trainer.algo.global_tokens = agreed_steps * per_step
            return trainer.schedule.apply()

        slow, fast = lr_at(30, 80, 0), lr_at(140, 80, 0)  # both just synced at 80 steps' worth of agreed tokens
        assert slow == fast == pytest.approx(1e-3 * lr_factor(80, 0, 0.8, "cosine", 0.1))
        assert lr_at(30, 80, 5) == pytest.approx(1e-3 * lr_factor(85, 0, 0.85, "cosine", 0.1))
        assert lr_at(30, 100, 0) == pytest.approx(1e-4)  # the end of the run is the end of the schedule
    finally:
        trainer.transport.close()


def _saved_list() -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save([torch.zeros(2)], buf)
    return buf.getvalue()


def test_max_time_stops_evaluates_and_saves(tiny_cfg, tmp_path):
    cfg = tiny_cfg("run.max_steps=null", "run.max_time=2s", "run.checkpoint_every=0")
    summary = train(cfg)
    assert 2.0 <= summary["wall_s"] < 30
    assert summary["steps"] > 0 and math.isfinite(summary["val_loss"])
    assert (tmp_path / "run" / "checkpoints" / f"step_{summary['steps']:08d}.pt").is_file()


def test_wandb_offline_run_is_written(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(tiny_cfg("run.max_steps=10", "log.wandb=true", "log.every=5", "run.eval_every=0"))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "no offline wandb run was written"
    # wandb's service process writes the run log; under load it may flush a moment after finish() returns
    deadline = time.monotonic() + 20
    while (b"tokens_per_s" not in runs[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    data = runs[0].read_bytes()
    assert b"loss" in data and b"tokens_per_s" in data


_FAULTS = """
import resource, sys, torch
from launch.config import load_config
from launch.models.transformer import SIZES, Transformer
from launch.loop.trainer import Trainer
from demo_optim import DeMo

if sys.argv[1] == "trainer":  # a trainer in the process keeps freed memory from then on
    cfg, _ = load_config([sys.argv[2]], sys.argv[3:])
    Trainer(cfg)
torch.manual_seed(0)
model = Transformer(SIZES["tiny"])
opt = DeMo(model.parameters(), lr=1e-3)
x = torch.randint(0, 256, (4, 64))

def step():
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

for _ in range(3):
    step()
STEPS = 12  # the heap still grows now and then (one step in 8 or so faults a few hundred pages, even with a
# trainer): the mean is taken over enough steps that such a step does not decide it
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(STEPS):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // STEPS)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator settings (Linux)")
def test_a_trainer_process_reuses_freed_memory_instead_of_faulting_in_fresh_pages(tmp_path):
    """Every step re-creates temporaries of the same sizes; by default glibc hands many of them back to the OS
    and the next step faults in fresh pages (3,000 to 4,500 per DeMo step on tiny). A process that runs a Trainer
    keeps them (keep_freed_memory): next to no page faults per step (0 to about 180 measured), a tenth or less."""
    sets = [*FAST, f"run.dir={tmp_path / 'run'}", "algo.name=demo"]
    faults = {}
    for mode in ("plain", "trainer"):
        res = subprocess.run([sys.executable, "-c", _FAULTS, mode, TINY, *sets],
                             capture_output=True, text=True, timeout=120, env=child_env(), cwd=ROOT)
        assert res.returncode == 0, res.stderr[-3000:]
        faults[mode] = int(res.stdout.split()[-1])
    assert faults["trainer"] < 200 and faults["plain"] > max(1000, 10 * faults["trainer"]), faults


@pytest.mark.parametrize("algo", ["ddp", "diloco", "diloco+muon"])
def test_a_step_reads_nothing_back_to_the_host_outside_log_steps_and_rounds(algo, tiny_cfg, tmp_path):
    """On a GPU a read-back stalls the queue of kernels; the loop makes none inside a step. With the fused AdamW
    (the CPU's kernel as well as CUDA's), and with Muon beside it, a plain step reads nothing back; a log step reads the loss, the norm
    and the skipped count; a DiLoCo round a few numbers; neither grows with the model's parameter tensors."""
    from launch.loop.trainer import Trainer

    algo, _, optim = algo.partition("+")
    seen = {}
    for layers in (2, 4):
        cfg = tiny_cfg("run.max_steps=12", f"algo.name={algo}", "algo.inner_steps=4", "run.eval_every=0",
                       "run.checkpoint_every=0", "run.checkpoint_final=false", "log.every=6", "run.batch_size=2",
                       "data.seq_len=32", f"model.n_layers={layers}", f"optim.name={optim or 'adamw'}",
                       run_dir=tmp_path / f"run{layers}")
        trainer = Trainer(cfg)
        assert trainer.algo._checks_on_device()
        reads, per_step, last = HostReads(), [], [0]

        def end(synced, info):
            per_step.append((trainer.step, bool(synced), reads.count - last[0]))
            last[0] = reads.count

        trainer.hooks.on_step_end = end
        with reads:
            trainer.fit()
        seen[layers] = per_step
    assert seen[2] == seen[4], seen  # the same reads, whatever the number of parameter tensors
    for step, synced, count in seen[2]:
        if step % 6 and not synced:
            assert count == 0, (step, count)  # a plain step
        else:
            assert 0 < count <= 6, (step, synced, count)  # a log step (3 reads), a round (3), or both
    assert any(synced for _, synced, _ in seen[2]) == (algo != "ddp")


def test_a_worker_that_takes_the_runs_step_counts_only_the_tokens_it_trained(tiny_cfg):
    """A late ``loco join`` peer takes the run's step with its state (``follow_run``): its summary's tokens are the
    steps it trained, not the run's steps before it joined."""
    from launch.loop.trainer import Trainer

    cfg = tiny_cfg("run.max_steps=14", "run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0",
                   "run.checkpoint_final=false")
    trainer = Trainer(cfg)
    trainer.follow_run(10)  # as a peer does after taking another's state at step 10
    summary = trainer.fit()
    trainer.transport.close()
    per_step = 4 * cfg.data.seq_len
    assert summary["steps"] == 14
    assert summary["workers"][0]["tokens"] == 4 * per_step and summary["workers"][0]["steps"] == 4
    assert summary["tokens"] == 4 * per_step


def test_the_start_line_says_how_many_threads_auto_took_and_why(tmp_path):
    """run.threads: auto (the default) on a CPU, with torchrun's LOCAL_WORLD_SIZE saying 4096 processes share the
    node: one thread each, and the start line says so; a number given is taken as it is, without a note."""
    env = child_env(LOCAL_WORLD_SIZE="4096")
    env.pop("OMP_NUM_THREADS")
    args = ["train", "--config", TINY, "--max-steps", "2", *[a for s in FAST for a in ("--set", s)],
            "--set", "run.eval_every=0", "--set", "run.checkpoint_final=false"]
    res = run_cli([*args, "--set", "run.threads=auto", "--run-dir", str(tmp_path / "auto")], env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"params on cpu \(1 thread: \d+ core\(s\) shared by 4096 processes", res.stderr), res.stderr[-3000:]
    res = run_cli([*args, "--run-dir", str(tmp_path / "one")], env=env)  # FAST sets run.threads=1
    assert res.returncode == 0 and "params on cpu; algorithm" in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_a_stream_on_a_worker_of_several_processes_names_settings_the_config_takes(tmp_path, shard):
    from types import SimpleNamespace

    from launch.config import load_config
    from launch.errors import RunError
    from launch.loop.trainer import Trainer

    cfg, _ = load_config([TINY], [*FAST, f"run.dir={tmp_path}", f"run.shard={shard}"])
    node = SimpleNamespace(rank=0, world_size=1, is_leader=True, inner=SimpleNamespace(rank=0, world_size=2))
    with pytest.raises(RunError) as info:
        Trainer(cfg, transport=node, data=SimpleNamespace(stream=object()))
    msg = str(info.value)
    assert "\n" not in msg and "transport.mesh: flat" in msg and "mesh: off" not in msg
    assert ("run.shard: none" in msg) == (shard == "fsdp")
    assert ("--nproc-per-node 1" in msg) == (shard == "none")
