"""DiLoCo and Streaming DiLoCo: the three identities, fragments, weighting, resume, and simulator == gloo."""

from __future__ import annotations


import pytest
import torch

from conftest import FAST, TINY, max_diff
from diloco.outer import DiLoCo
from diloco.streaming import StreamingDiLoCo, layer_fragments
from launch.store.checkpoint import latest_checkpoint
from launch.config import load_config
from launch.models.transformer import SIZES, Transformer
from launch.simulate.runner import simulate_once
from launch.loop.trainer import train

SMALL = ["run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none", "sim.step_time=0.01"]


def cfg_of(tmp_path, name, *overrides):
    cfg, _ = load_config([TINY], [*FAST, *SMALL, f"run.dir={tmp_path / name}", *overrides])
    return cfg


def final_model(summary) -> dict[str, torch.Tensor]:
    _, state = latest_checkpoint(f"{summary['run_dir']}/checkpoints")
    return state["model"]


def test_identity_h1_plain_outer_sgd_equals_ddp(tmp_path):
    """(a) H=1, outer SGD lr 1 without momentum, M workers == DDP with M workers (inner SGD: averaging is linear).

    Equal up to fp32 rounding only: DDP steps by lr * mean(g), DiLoCo by mean(theta - (theta - lr * g_i)), and
    each path rounds a few times per step at |theta| <= ~1 (one ulp is 1.2e-7). Six steps at inner lr 0.1 (a
    lr of 0.5 amplifies those roundings 50-fold, which made the check depend on the machine) stay within
    ~4e-6; the bound 2e-5 leaves a margin of 4, while an outer step 5% off lands far beyond it (30 to 400 times
    on the machines tried: the corpus is this interpreter's standard library, so the data differ).
    """
    common = ["optim.name=sgd", "optim.lr=0.1", "optim.grad_clip=0", "optim.warmup_steps=0", "run.max_steps=6",
              "sim.workers=3"]
    ddp = simulate_once(cfg_of(tmp_path, "ddp", *common, "algo.name=ddp"))
    dil = simulate_once(cfg_of(tmp_path, "diloco", *common, "algo.name=diloco", "algo.inner_steps=1",
                               "algo.outer_lr=1", "algo.outer_momentum=0"))
    off = simulate_once(cfg_of(tmp_path, "off", *common, "algo.name=diloco", "algo.inner_steps=1",
                               "algo.outer_lr=0.95", "algo.outer_momentum=0"))
    diff = max_diff(final_model(ddp), final_model(dil))
    assert diff < 2e-5, diff
    assert max_diff(final_model(ddp), final_model(off)) > 10 * 2e-5  # the check sees a 5% error
    # the same dense exchange every step, plus the 4-byte weight riding in the same bucket
    assert 0 < dil["bytes_sent"] - ddp["bytes_sent"] <= 6 * 8


def test_identity_one_worker_equals_plain_training(tmp_path):
    """(b) M=1 with outer SGD lr 1, no momentum == plain inner-optimizer (AdamW) training."""
    plain = train(cfg_of(tmp_path, "plain", "run.max_steps=10"))
    dil = simulate_once(cfg_of(tmp_path, "diloco", "run.max_steps=10", "sim.workers=1", "algo.name=diloco",
                               "algo.inner_steps=4", "algo.outer_lr=1", "algo.outer_momentum=0"))
    assert max_diff(final_model(plain), final_model(dil)) < 1e-5
    assert dil["bytes_sent"] == 0


def test_identity_streaming_p1_equals_diloco(tmp_path):
    """(c) Streaming DiLoCo with P=1, tau=0, alpha=0 == DiLoCo (default outer Nesterov, AdamW inside)."""
    common = ["run.max_steps=10", "sim.workers=2", "algo.inner_steps=3"]
    dil = simulate_once(cfg_of(tmp_path, "diloco", *common, "algo.name=diloco"))
    st = simulate_once(cfg_of(tmp_path, "stream", *common, "algo.name=streaming", "algo.fragments=1"))
    assert max_diff(final_model(dil), final_model(st)) < 1e-6
    assert st["bytes_sent"] == dil["bytes_sent"]


def test_streaming_keep_merge_with_one_worker_equals_plain_training(tmp_path):
    """M=1, outer SGD lr 1 without momentum: the new global is what was sent, and the keep merge adds back the
    steps made while the exchange was in flight, so training is plain AdamW (the published mix is not)."""
    plain = train(cfg_of(tmp_path, "plain", "run.max_steps=10"))
    common = ["run.max_steps=10", "sim.workers=1", "algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2",
              "algo.overlap_steps=2", "algo.outer_lr=1", "algo.outer_momentum=0"]
    keep = simulate_once(cfg_of(tmp_path, "keep", *common, "algo.overlap_merge=keep"))
    mix = simulate_once(cfg_of(tmp_path, "mix", *common, "algo.mix_alpha=0.5"))
    assert max_diff(final_model(plain), final_model(keep)) < 1e-5
    assert max_diff(final_model(plain), final_model(mix)) > 1e-4


def test_streaming_ends_with_every_worker_on_the_global_model(tmp_path):
    """Training that ends while a fragment's exchange is in flight (sent at the last step) still applies it."""
    cfg = cfg_of(tmp_path, "s", "run.max_steps=8", "sim.workers=2", "algo.name=streaming", "algo.inner_steps=4",
                 "algo.fragments=2", "algo.overlap_steps=1", "algo.mix_alpha=0.5", "run.checkpoint_every=8")
    summary = simulate_once(cfg)
    _, state = latest_checkpoint(f"{summary['run_dir']}/checkpoints")
    w0, w1 = (s["model"] for s in state["workers"])
    assert max_diff(w0, w1) == 0.0 and max_diff(w0, state["model"]) == 0.0
    assert all(not s["algo"]["pending"] for s in state["workers"])


def test_diloco_moves_the_model_and_workers_agree_after_sync(tmp_path):
    cfg = cfg_of(tmp_path, "d", "run.max_steps=8", "sim.workers=2", "algo.name=diloco", "algo.inner_steps=4",
                 "run.checkpoint_every=8")
    summary = simulate_once(cfg)
    _, state = latest_checkpoint(f"{summary['run_dir']}/checkpoints")
    w0, w1 = (s["model"] for s in state["workers"])
    assert max_diff(w0, w1) == 0.0, "after a sync every worker holds the global parameters"
    assert max_diff(w0, state["model"]) == 0.0
    assert state["workers"][0]["algo"]["round"] == 2
    # the two workers trained on different data: their inner optimizer states differ
    m0 = state["workers"][0]["algo"]["optimizer"]["state"][0]["exp_avg"]
    m1 = state["workers"][1]["algo"]["optimizer"]["state"][0]["exp_avg"]
    assert not torch.equal(m0, m1)


def _piece_sizes(frags, params):
    return [sum(params[x].numel() if isinstance(x, int) else (x[2] - x[1]) * params[x[0]][0].numel() for x in f)
            for f in frags]


def test_layer_fragments_are_strided_and_cover_everything():
    model = Transformer(SIZES["tiny"])
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    layer_of = lambda i: int(names[i].split(".")[1]) if names[i].startswith("layers.") else None  # noqa: E731
    for num in (1, 2, 3, 4):
        frags = layer_fragments(model, num)
        # every element in exactly one fragment: whole parameters, or row ranges that tile a parameter
        rows = {i: [] for i in range(len(params))}
        for f in frags:
            for x in f:
                i, a, b = (x, 0, params[x].shape[0] if params[x].dim() else 1) if isinstance(x, int) else x
                rows[i].append((a, b))
        for i, spans in rows.items():
            spans.sort()
            n = params[i].shape[0] if params[i].dim() else 1
            assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for p, f in enumerate(frags):  # layer j in fragment j mod P, whole
            assert {layer_of(x) for x in f if isinstance(x, int)} - {None} == set(range(p, 4, num))
    # P=4 on tiny: one layer each, the embedding's 256 rows cut 64 per fragment, so the fragments are even
    frags = layer_fragments(model, 4)
    sizes = _piece_sizes(frags, params)
    assert sum(sizes) == sum(p.numel() for p in params)
    assert sum(sizes) / max(sizes) > 3.99, sizes
    assert sorted(x for f in frags for x in f if not isinstance(x, int)) == [(0, 0, 64), (0, 64, 128), (0, 128, 192),
                                                                               (0, 192, 256)]
    with pytest.raises(ValueError, match="more than the model's 4 layers"):
        layer_fragments(model, 5)


def test_fragments_of_rows_are_checked_and_train_like_whole_ones():
    """Row pieces: bad covers fail clearly; P fragments of rows, all synced together, equal plain DiLoCo."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    params = list(lin.parameters())  # weight (4, 6), bias (4,)

    def make(fragments):
        model = torch.nn.Linear(6, 4)
        model.load_state_dict(lin.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, DiLoCo(model, opt, inner_steps=3, outer_lr=0.7, outer_momentum=0.9, fragments=fragments)

    for bad, match in ([[(0, 0, 2)], [1]], "cover every parameter"), ([[(0, 0, 3), (0, 2, 4), 1]], "cover every"), \
                      ([[(0, 0, 5), 1]], "do not fit"), ([[0, 1, 2]], "names parameter 2"):
        with pytest.raises(ValueError, match=match):
            make(bad)
    runs = []
    for fragments in (None, [[(0, 0, 1), (1, 2, 4)], [(0, 1, 4), (1, 0, 2)]]):
        model, algo = make(fragments)
        torch.manual_seed(1)
        for _ in range(7):
            x = torch.randn(5, 6)
            model(x).pow(2).mean().backward()
            algo.step()
            algo.zero_grad()
        algo.finalize()
        runs.append([g.clone() for g in algo.global_params])
    assert len(params) == 2 and all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*runs))


def test_streaming_lowers_peak_bytes_per_exchange(tmp_path):
    """P fragments on staggered schedules: each exchange carries 1/P of the model."""
    from diloco.sim import InProcessGroup

    sizes = {}
    original = InProcessGroup.rendezvous

    def spy(self, rank, value, combine, comm_s=None):
        if rank == 0 and isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.numel() > 1:
            sizes.setdefault(self.world, []).append(value.numel())
        return original(self, rank, value, combine, comm_s)

    InProcessGroup.rendezvous = spy
    try:
        simulate_once(cfg_of(tmp_path, "d", "run.max_steps=8", "sim.workers=2", "algo.name=diloco",
                             "algo.inner_steps=8"))
        peak_plain = max(sizes.pop(2))
        stream = simulate_once(cfg_of(tmp_path, "s", "run.max_steps=8", "sim.workers=2", "algo.name=streaming",
                                      "algo.inner_steps=8", "algo.fragments=4", "algo.overlap_steps=2",
                                      "algo.mix_alpha=0.5"))
        peak_stream = max(sizes.pop(2))
    finally:
        InProcessGroup.rendezvous = original
    assert peak_stream < peak_plain / 3.99, (peak_plain, peak_stream)  # the embedding is cut into even rows
    assert stream["val_loss"] < 5.0


def test_time_mode_heterogeneous_speeds(tmp_path):
    """Speeds (1, 0.25) with sync.mode=time: the slow worker does about a quarter of the steps and weight."""
    cfg = cfg_of(tmp_path, "t", "sim.workers=2", "sim.speeds=1,0.25", "algo.name=diloco", "sync.mode=time",
                 "sync.time_budget_s=0.2", "sim.step_time=0.01", "run.max_steps=40")
    summary = simulate_once(cfg)
    fast, slow = summary["workers"]
    assert fast["steps"] >= 40
    assert abs(slow["steps"] / fast["steps"] - 0.25) < 0.05
    assert abs(slow["tokens"] / (fast["tokens"] + slow["tokens"]) - 0.2) < 0.03  # 1 : 0.25 of the tokens
    # the token budget (40 steps x 4 x 128 x 2 workers) is met, counted over both workers
    assert summary["tokens"] >= 40 * 4 * 128 * 2
    assert summary["virtual_compute_s_per_worker"][1] == pytest.approx(summary["virtual_compute_s_per_worker"][0], rel=0.1)


def _linear_diloco(transport, **kwargs):
    """A seeded 3 -> 1 linear model under DiLoCo with inner SGD; the same start on every worker."""
    from diloco import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    return model, DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), transport,
                         **{"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, **kwargs})


def _linear_start() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, bias=False).weight.detach()


def test_weighted_average_leaves_out_a_worker_with_no_tokens():
    from diloco.sim import InProcessGroup, run_workers

    group = InProcessGroup(2)

    def body(rank, transport):
        model, algo = _linear_diloco(transport)
        with torch.no_grad():
            model.weight.add_(1.0 if rank == 0 else 100.0)  # worker 1 drifted far...
        algo.round_steps = 1 if rank == 0 else 0  # ...but trained no tokens this round
        algo.sync()
        return model.weight.detach().clone(), algo.global_tokens

    (w0, t0), (w1, t1) = run_workers(group, body)
    assert torch.equal(w0, w1)
    assert torch.allclose(w0, _linear_start() + 1.0)
    assert t0 == t1 == 1.0


def test_simulated_run_resumes_exactly(tmp_path):
    extra = ["sim.workers=2", "algo.name=diloco", "algo.inner_steps=4", "run.max_steps=16", "log.every=2"]
    full = simulate_once(cfg_of(tmp_path, "full", *extra))
    part = simulate_once(cfg_of(tmp_path, "part", *extra[:-2], "run.max_steps=8", "log.every=2",
                                "run.checkpoint_every=4"))
    assert part["steps"] == 8
    # continue the same run folder to 16 steps
    resumed = simulate_once(cfg_of(tmp_path, "part", *extra, "run.resume=true"))
    assert resumed["steps"] == 16
    assert max_diff(final_model(full), final_model(resumed)) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_streaming_resumed_with_exchanges_in_flight_equals_the_unbroken_run(tmp_path, device):
    """A Streaming checkpoint holds exchanges still in flight (their averaged deltas and what was sent); a
    checkpoint loads on the CPU, and on a GPU they must go back beside the global copy and the local parameters
    (StreamingDiLoCo._place) before they are applied. Resumed from the middle, the run ends as the unbroken
    one, to the bit."""
    import shutil

    extra = ["sim.workers=2", "algo.name=streaming", "algo.inner_steps=4", "algo.fragments=2",
             "algo.overlap_steps=2", "algo.overlap_merge=keep", "run.checkpoint_every=6", "run.max_steps=12",
             "sim.baseline=none", f"run.device={device}"]
    full = simulate_once(cfg_of(tmp_path, "full", *extra))
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "full", broken)
    for ckpt in (broken / "checkpoints").glob("step_*.pt"):
        if ckpt.name != "step_00000006.pt":
            ckpt.unlink()
    _, state = latest_checkpoint(broken / "checkpoints")
    assert state["step"] == 6 and all(w["algo"]["pending"] for w in state["workers"]), "nothing was in flight"
    resumed = simulate_once(cfg_of(tmp_path, "broken", *extra, "run.resume=true"))
    assert resumed["steps"] == 12
    want, got = final_model(full), final_model(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_resume_with_other_fragments_fails_clearly(tmp_path):
    """A Streaming run resumed with another P, or as plain DiLoCo, stops with the checkpoint and the key named."""
    from launch.errors import RunError

    extra = ["sim.workers=2", "algo.inner_steps=4", "run.max_steps=4", "run.checkpoint_every=4"]
    simulate_once(cfg_of(tmp_path, "s", *extra, "algo.name=streaming", "algo.fragments=2"))
    more = [*extra[:2], "run.max_steps=8", "run.resume=true"]
    with pytest.raises(RunError, match=r"step_00000004\.pt: cannot resume .* same algo\.fragments") as refused:
        simulate_once(cfg_of(tmp_path, "s", *more, "algo.name=streaming", "algo.fragments=4"))
    assert "Settings changed since it was saved: algo.fragments 2 -> 4; run.max_steps 4 -> 8" in str(refused.value)
    with pytest.raises(RunError, match="holds algorithm 'streaming', this run uses 'diloco'"):
        simulate_once(cfg_of(tmp_path, "s", *more, "algo.name=diloco"))
    assert simulate_once(cfg_of(tmp_path, "s", *more, "algo.name=streaming", "algo.fragments=2"))["steps"] == 8
    # a checkpoint written before fragments recorded their layout held whole parameters only
    model = Transformer(SIZES["tiny"])
    algo = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), fragments=4, inner_steps=8)
    state = algo.state_dict()
    del state["fragments"]
    with pytest.raises(ValueError, match="same algo.fragments"):
        algo.load_state_dict(state)


def test_a_diverged_worker_is_left_out_and_resynced():
    """No NaN is averaged into the model: a worker with non-finite parameters sends weight 0."""
    from diloco.sim import InProcessGroup, run_workers

    def body(rank, transport):
        model, algo = _linear_diloco(transport)
        with torch.no_grad():
            model.weight.add_(1.0 if rank == 0 else float("nan"))
        algo.round_steps = 1
        algo.sync()
        return model.weight.detach().clone(), algo.rejected_updates, algo.global_tokens

    (w0, r0, t0), (w1, r1, t1) = run_workers(InProcessGroup(2), body)
    assert torch.isfinite(w0).all() and torch.equal(w0, w1)
    assert torch.allclose(w0, _linear_start() + 1.0)
    assert (r0, r1) == (0, 1) and t0 == t1 == 1.0


@pytest.mark.parametrize("extra", [{"mix_alpha": 0.5}, {"overlap_steps": 1, "overlap_merge": "keep"},
                                   {"overlap_steps": 1, "mix_alpha": 0.5}], ids=["mix", "overlap-keep", "overlap-mix"])
def test_a_diverged_streaming_worker_takes_the_global_fragments_and_trains_on(extra):
    """A Streaming worker whose parameters turn NaN sends weight 0 and takes the new global values of each
    fragment as they are: mixed (``mix_alpha``) or with its progress kept (``overlap_merge=keep``), NaN stayed NaN
    for good, and every later exchange of the worker was refused."""
    from diloco import StreamingDiLoCo
    from diloco.sim import InProcessGroup, run_workers
    from launch.models.transformer import ModelArgs, Transformer

    def body(rank, transport):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16))
        algo = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), transport, fragments=2,
                               inner_steps=4, outer_lr=1.0, outer_momentum=0.0, **extra)
        g = torch.Generator().manual_seed(rank)
        for step in range(16):
            x = torch.randint(0, 64, (2, 9), generator=g)
            logits = model(x[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
            if rank == 1 and step == 2:
                with torch.no_grad():
                    model.layers[0].attn.wq.weight.fill_(float("nan"))
            algo.step()
            algo.zero_grad()
        algo.finalize()
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return finite, algo.rejected_updates, [g.detach().clone() for g in algo.global_params]

    (f0, r0, g0), (f1, r1, g1) = run_workers(InProcessGroup(2), body)
    assert f0 and f1, "the diverged worker stayed NaN"
    assert r0 == 0 and 1 <= r1 <= 2, (r0, r1)  # its first exchange of the NaN fragment, at most one more
    assert all(torch.equal(a, b) and bool(torch.isfinite(a).all()) for a, b in zip(g0, g1))


def test_streaming_finalize_is_not_repeated_when_resumed_from_the_final_checkpoint():
    """A finished Streaming run resumed from its final checkpoint (``--resume`` at its last step) finalizes once:
    the schedule alone still counts unsent steps there, so every fragment went out again with weight 0 and the
    run counted one round more (and an error-feedback codec would have spent its residuals on nothing)."""
    import copy

    from diloco import StreamingDiLoCo
    from launch.models.transformer import ModelArgs, Transformer

    def make():
        torch.manual_seed(0)
        model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16))
        return model, StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), fragments=2,
                                      inner_steps=4, outer_lr=0.7)

    model, algo = make()
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        x = torch.randint(0, 64, (2, 9), generator=g)
        torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
        algo.step()
        algo.zero_grad()
    algo.finalize()
    done = (algo.round, algo.global_tokens)
    algo.finalize()  # a second call at the same step changes nothing
    assert (algo.round, algo.global_tokens) == done
    state, weights = copy.deepcopy(algo.state_dict()), copy.deepcopy(model.state_dict())
    model2, again = make()
    model2.load_state_dict(weights)
    again.load_state_dict(state)
    again.finalize()
    assert (again.round, again.global_tokens) == done
    assert all(torch.equal(a, b) for a, b in zip(again.global_params, algo.global_params))


def test_skipped_steps_keep_the_round_schedule():
    """A worker that skips a non-finite step still reaches the sync with the others (no deadlock)."""
    from diloco.sim import InProcessGroup, run_workers

    def body(rank, transport):
        model, algo = _linear_diloco(transport, inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
        infos = []
        for step in range(4):
            model(torch.ones(2, 3)).sum().backward()
            if rank == 1 and step == 0:
                model.weight.grad.fill_(float("inf"))
            infos.append(algo.step())
            algo.zero_grad()
        return [bool(i.get("synced")) for i in infos], algo.skipped_steps

    (s0, k0), (s1, k1) = run_workers(InProcessGroup(2), body)
    assert s0 == s1 == [False, True, False, True]
    assert (k0, k1) == (0, 1)


@pytest.mark.parametrize("algo", [["algo.name=diloco"], ["algo.name=streaming", "algo.fragments=2"]],
                         ids=["diloco", "streaming"])
def test_workers_waiting_in_an_exchange_hold_no_gradients(tmp_path, algo):
    """The gradients are spent once the inner step is taken: a simulated worker waiting for the others in a round's
    exchange does not keep them (N workers wait at once: N gradients' worth of memory on one GPU)."""
    from diloco.sim import InProcessGroup, run_workers
    from launch.data.batches import load_data
    from launch.loop.trainer import Trainer

    cfg, _ = load_config([TINY], [*FAST, *algo, "algo.inner_steps=2", "run.max_steps=4", "run.eval_every=0",
                                  "run.checkpoint_every=0", "run.checkpoint_final=false",
                                  f"run.dir={tmp_path / 'run'}"])
    data = load_data(cfg.data)
    group = InProcessGroup(2)
    trainers, held = {}, []
    group.on_release = lambda rank: rank in trainers and trainers[rank].step > 0 and held.append(
        sum(p.grad is not None for p in trainers[rank].model.parameters()))

    def worker(rank, transport):
        trainers[rank] = trainer = Trainer(cfg, transport=transport, data=data)
        return trainer.fit()

    run_workers(group, worker)
    assert len(held) >= 2 and held == [0] * len(held), held
