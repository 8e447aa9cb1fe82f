"""The compressed all-reduce (in-process and over gloo) and codecs inside DiLoCo, Streaming DiLoCo and DDP."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch

from conftest import FAST, TINY, free_port, run_cli, simulate_and_torchrun
from diloco.comm.base import TransportError, shard_bounds
from diloco.comm.local import LocalTransport
from diloco.compress import make_codec
from diloco.compress import collective
from diloco.compress.flat import Scratch
from diloco.sim import InProcessGroup, run_workers
from launch.store.checkpoint import latest_checkpoint
from launch.config import load_config
from launch.simulate.runner import simulate_once

SMALL = ["run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none", "sim.step_time=0.01"]
SIZES = [1, 2, 5000, 3001]  # a one-element tensor has empty shards on most workers


def inputs(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(n, generator=g) * (r + 1) for n in SIZES] for r in range(world)]


def reduce_in_process(chain: str, weights: list[float], rounds: int = 1, bucket_bytes: int = 32 << 20,
                      gather: bool = False):
    xs = inputs(len(weights))

    def body(rank, transport):
        transport.bucket_bytes = bucket_bytes
        codec = make_codec(chain)
        for _ in range(rounds):
            ts = [t.clone() for t in xs[rank]]
            total = collective.weighted_mean(transport, ts, weights[rank], codec, key="k", gather=gather)
        return ts, total, transport.stats.bytes_sent

    return xs, run_workers(InProcessGroup(len(weights)), body)


def weighted_mean(xs, weights):
    return [sum(w * x[i] for w, x in zip(weights, xs)) / sum(weights) for i in range(len(SIZES))]


def rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).norm() ** 2) for x, y in zip(a, b))
    return (num / sum(float(y.norm() ** 2) for y in b)) ** 0.5


@pytest.mark.parametrize("chain, bound", [("fp32", 1e-6), ("bf16+zstd", 1e-2), ("int8", 2e-2), ("fp4:block=64", 0.3),
                                          ("topk:0.5+int8", 0.8), ("dct+topk:0.5+fp32+zstd", 0.8)])
def test_weighted_mean_is_the_same_on_every_worker(chain, bound):
    weights = [1.0, 2.0, 0.5]
    xs, results = reduce_in_process(chain, weights)
    expected = weighted_mean(xs, weights)
    first = results[0][0]
    for ts, total, _ in results:
        assert all(torch.equal(a, b) for a, b in zip(ts, first)), "every worker decodes the same bytes"
        assert total == pytest.approx(3.5)
    assert rel_err(first, expected) < bound


def test_bytes_on_the_wire_shrink_with_the_codec():
    weights = [1.0, 1.0, 1.0]
    dense = reduce_in_process("fp32", weights)[1][0][2]
    fp32_bytes = 4 * sum(SIZES)
    # about 2 (W-1)/W of the payload, plus headers
    assert 2 * 2 / 3 * fp32_bytes <= dense <= 2 * 2 / 3 * fp32_bytes * 1.05
    int8 = reduce_in_process("int8", weights)[1][0][2]
    assert int8 < 0.3 * dense
    sparse = reduce_in_process("topk:0.02+2bit+zstd", weights)[1][0][2]
    assert sparse < 0.05 * dense


def test_error_feedback_sends_what_an_earlier_round_dropped():
    """Reducing the same inputs again: the dropped mass arrives later, so the running mean approaches the truth."""
    weights = [1.0, 1.0]
    xs = inputs(2)
    expected = weighted_mean(xs, weights)

    def body(rank, transport, chain):
        codec = make_codec(chain)
        acc = [torch.zeros_like(t) for t in xs[rank]]
        errs = []
        for r in range(1, 31):
            ts = [t.clone() for t in xs[rank]]
            collective.weighted_mean(transport, ts, 1.0, codec, key="k")
            for a, t in zip(acc, ts):
                a.add_(t)
            errs.append(rel_err([a / r for a in acc], expected))
        return errs

    errs = run_workers(InProcessGroup(2), lambda r, t: body(r, t, "topk:0.05+fp32"))[0]
    assert errs[0] > 0.7 and errs[-1] < 0.45 * errs[0], errs[::5]
    without = run_workers(InProcessGroup(2), lambda r, t: body(r, t, "topk:0.05,ef=0+fp32"))[0]
    assert without[-1] > 0.95 * without[0], without[::5]


@pytest.mark.parametrize("gather", [False, True], ids=["sharded", "gathered"])
def test_a_payload_sent_with_weight_zero_leaves_the_error_feedback_as_it_was(gather):
    """A worker that sits a round out (weight 0: a non-finite pseudo-gradient, a joiner with no steps) sends a
    payload every worker discards. Its error feedback must not be spent on it: before, the residual's largest
    values were sent with weight 0 and cut from the residual, lost without a word."""
    xs = inputs(2)

    def body(rank, transport):
        codec = make_codec("topk:0.05+2bit")
        ts = [t.clone() for t in xs[rank]]
        collective.weighted_mean(transport, ts, 1.0, codec, key="k", gather=gather)  # builds the residuals
        before = {k: r.clone() for k, r in codec.residuals.items()}
        ts = [torch.zeros_like(t) for t in xs[rank]] if rank == 1 else [t.clone() for t in xs[rank]]
        total = collective.weighted_mean(transport, ts, 0.0 if rank == 1 else 1.0, codec, key="k",
                                         gather=gather)
        return before, {k: r.clone() for k, r in codec.residuals.items()}, total

    (b0, a0, t0), (b1, a1, t1) = run_workers(InProcessGroup(2), body)
    assert t0 == t1 == 1.0
    mine = [k for k in b1 if "mean" not in str(k)]  # what worker 1 sends of its own
    assert mine and all(torch.equal(b1[k], a1[k]) for k in mine), "the residual was spent on a weight-0 payload"
    assert any(not torch.equal(b0[k], a0[k]) for k in b0)  # the worker that sent with weight 1 used its own


def test_all_weights_zero_gives_zeros_and_total_zero():
    _, results = reduce_in_process("int8", [0.0, 0.0])
    for ts, total, _ in results:
        assert total == 0.0 and all(not t.any() for t in ts)


def test_a_worker_with_another_codec_is_named():
    def body(rank, transport):
        codec = make_codec("int8" if rank == 0 else "int4")
        collective.weighted_mean(transport, [torch.ones(1000)], 1.0, codec)

    with pytest.raises(TransportError, match=r"rank [01]: worker [01] sent a corrupt payload for shard [01]: codec mismatch"):
        run_workers(InProcessGroup(2), body)


def test_bad_weight_is_refused():
    def body(rank, transport):
        collective.weighted_mean(transport, [torch.ones(3)], float("nan"), make_codec("int8"))

    with pytest.raises(ValueError, match="weight"):
        run_workers(InProcessGroup(1), body)


def test_shard_bounds_cover_the_buffer_at_aligned_cuts():
    for n, w, align in [(0, 3, 4), (1, 3, 1), (10, 3, 4), (4096 * 5 + 7, 4, 4096), (100, 1, 64)]:
        b = shard_bounds(n, w, align)
        assert len(b) == w and b[0][0] == 0 and b[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert all(a % align == 0 for a, _ in b if a < n)


WORKER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_compressed import inputs
    from diloco.comm.base import TransportError
    from diloco.comm.torch_dist import TorchDistTransport
    from diloco.compress import make_codec
    from diloco.compress.collective import all_reduce_, weighted_mean, weighted_mean_async
    t = TorchDistTransport("gloo", timeout=60, settings={settings!r})
    t.bucket_bytes = {bucket_bytes}
    run, calls = t._run, []
    def counted(what, *a, **kw):
        calls.append(what)
        return run(what, *a, **kw)
    t._run = counted
    assert t.caps.overlaps_exchange  # the buckets' exchanges overlap: started collectives left in flight
    codec = make_codec({chain!r})
    weights = {weights!r}
    for r in range(2):  # the second round in the exchange thread (as Streaming DiLoCo's), on its own groups
        ts = [x.clone() for x in inputs(t.world_size)[t.rank]]
        if r == 0:
            total = weighted_mean(t, ts, weights[t.rank], codec, key="k")
        else:
            total = weighted_mean_async(t, ts, weights[t.rank], codec, key="k").wait()
    sent = t.stats.bytes_sent
    sizes_exchanged, payload_calls = sum("(sizes)" in c for c in calls), sum("(payload)" in c for c in calls)
    # the gathered mean (SparseLoCo's) over the same buckets, overlapped too
    gts = [x.clone() for x in inputs(t.world_size)[t.rank]]
    gtotal = weighted_mean(t, gts, weights[t.rank], make_codec({chain!r}), key="k", gather=True)
    for _ in range(2):  # the dense mean, twice: the second reuses the kept concatenation buffer
        dense = [x.clone() for x in inputs(t.world_size)[t.rank]]
        all_reduce_(t, dense)
    # the last worker with another codec: every worker names a sender, with later buckets still in flight (where
    # the settings were not agreed: sizes are exchanged)
    error = None
    if not t.caps.settings_agreed:
        try:
            weighted_mean(t, inputs(t.world_size)[t.rank], 1.0,
                          make_codec("int4" if t.rank == 2 else {chain!r}))
        except TransportError as e:
            error = str(e)
    torch.save({{"ts": ts, "total": total, "bytes": sent, "gts": gts, "gtotal": gtotal, "dense": dense, "error": error,
                "sizes_exchanged": sizes_exchanged, "payload_calls": payload_calls}}, f"{out}/rank{{t.rank}}.pt")
    t.close()
""")


@pytest.mark.parametrize("chain,agreed", [("int8", True), ("topk:0.1+2bit+zstd", False)])
def test_gloo_processes_equal_the_simulator(tmp_path, chain, agreed):
    """Three real processes over gloo get byte-for-byte the simulator's result (two rounds: error feedback too;
    the second one started in the background, as Streaming DiLoCo's; then one gathered round). Small buckets (one
    of two tensors concatenated, two of one tensor each) make the gloo workers overlap the buckets' exchanges,
    which the simulator runs one after the other. Where the processes agreed on their settings and the codec's
    sizes are fixed (int8), no payload waits for a size exchange."""
    weights = [1.0, 3.0, 0.5]
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(TINY.rsplit("/configs", 1)[0] + "/tests"), chain=chain,
                                    weights=weights, out=str(tmp_path), bucket_bytes=16 << 10,
                                    settings={"codec": chain} if agreed else None))
    proc = run_cli(["--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    str(script)], module="torch.distributed.run", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, sim = reduce_in_process(chain, weights, rounds=2, bucket_bytes=16 << 10)
    _, gathered = reduce_in_process(chain, weights, bucket_bytes=16 << 10, gather=True)
    for rank, (ts, total, sent) in enumerate(sim):
        real = torch.load(tmp_path / f"rank{rank}.pt")
        gts, gtotal, _ = gathered[rank]
        assert all(torch.equal(a, b) for a, b in zip(real["gts"], gts)) and real["gtotal"] == gtotal
        assert all(torch.equal(a, b) for a, b in zip(real["ts"], ts))
        assert real["total"] == total and real["bytes"] == sent
        mean = [sum(x[i] for x in inputs(3)) / 3 for i in range(len(SIZES))]
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(real["dense"], mean))
        # 3 buckets x 2 rounds x 2 collectives, each started and waited for
        assert real["payload_calls"] == 24
        if agreed:
            assert real["sizes_exchanged"] == 0
        else:  # one size exchange per payload collective
            assert real["sizes_exchanged"] == 12
            assert re.fullmatch(rf"rank {rank}: worker [012] sent a corrupt payload for shard {rank}: codec mismatch.*",
                                real["error"] or "", re.S), real["error"]


def test_the_concatenation_buffer_is_kept_only_where_asked():
    t = Scratch(keep=False)
    first = t.take(100, torch.device("cpu"))
    t.give(first)
    assert t.take(100, torch.device("cpu")).data_ptr() != first.data_ptr()  # keep_scratch is off here
    t.keep = True
    t.give(first)
    again = t.take(50, torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr()
    assert t.take(50, torch.device("cpu")).data_ptr() != first.data_ptr()  # taken: a second taker gets its own
    t.give(again)
    bigger = t.take(200, torch.device("cpu"))  # too small: a new one, kept in its place
    assert bigger.numel() == 200
    t.give(bigger)
    assert t.take(150, torch.device("cpu")).data_ptr() == bigger.data_ptr()
    t.give(bigger, "mean")  # slots are kept apart
    assert t.take(10, torch.device("cpu")).data_ptr() != bigger.data_ptr()
    assert t.take(10, torch.device("cpu"), "mean").data_ptr() == bigger.data_ptr()


def test_pieces_of_one_buffer_are_reduced_where_they_lie():
    """Tensors that lie end to end in one buffer (DiLoCo's pseudo-gradients with a codec) are encoded and decoded
    where they lie: no bucket is concatenated, and the result has the bits of separate tensors'."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Cats(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.cats = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.cats += str(func).startswith("aten.cat")
            return func(*args, **(kwargs or {}))

    xs = inputs(2)

    def run(chain: str, flat: bool):
        tensors = [list(torch.cat(x).split(SIZES)) if flat else [t.clone() for t in x] for x in xs]

        def body(rank, transport):
            transport.bucket_bytes = 16 << 10  # buckets [1, 2], [5000], [3001]: the first of two pieces
            codec = make_codec(chain)
            for _ in range(2):  # the second round carries the first's error feedback
                collective.weighted_mean(transport, tensors[rank], 1.0 + rank, codec, key="k")
            return [t.clone() for t in tensors[rank]]

        with Cats() as seen:
            out = run_workers(InProcessGroup(2), body)
        return out, seen.cats

    for chain in ["int8", "topk:0.5+int8"]:
        (apart, cats_apart), (flat, cats_flat) = run(chain, False), run(chain, True)
        assert cats_apart - cats_flat == 2 * 2, chain  # the one bucket of two pieces, per worker and round
        assert cats_flat == 0 or chain != "int8"  # (top-k concatenates what it selects)
        for a, b in zip(apart, flat):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), chain


def test_diloco_with_a_codec_lays_its_parameters_end_to_end():
    """With a codec DiLoCo's parameters, hence its pseudo-gradients, lie end to end in one buffer (the model
    computing the same); pseudo-gradients that are new tensors are made end to end too."""
    from diloco.compress.flat import end_to_end
    from diloco.outer import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    before = model(x)
    params = list(model.parameters())
    algo = DiLoCo(model, torch.optim.AdamW(params, lr=1e-2), LocalTransport(), codec=make_codec("int8"))
    assert algo.flat_params and end_to_end(params) is not None
    assert torch.equal(model(x), before) and all(p is q for p, q in zip(model.parameters(), params))
    for in_place in (False, True):
        model(x).square().mean().backward()
        algo.optimizer.step()
        expected = [g - p.detach() for g, p in zip(algo.global_params, params)]
        deltas, _, handle = algo.start_exchange(range(len(params)), 1.0, in_place=in_place)
        assert end_to_end(deltas) is not None
        assert (deltas[0].data_ptr() == params[0].data_ptr()) == in_place
        handle.wait()  # (one worker: the mean of one, through int8)
        assert rel_err(deltas, expected) < 1e-2
        algo.apply_exchange(range(len(params)), deltas, 1.0, mix_alpha=0.0)

    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    algo = DiLoCo(plain, torch.optim.AdamW(plain.parameters()), LocalTransport(), codec=make_codec("int8"))
    assert not algo.flat_params and end_to_end(list(plain.parameters())) is None  # bf16: left where it was


# ---- codecs inside the algorithms -----------------------------------------------------------------
def cfg_of(tmp_path, name, *overrides):
    cfg, _ = load_config([TINY], [*FAST, *SMALL, f"run.dir={tmp_path / name}", *overrides])
    return cfg


def final_state(summary):
    return latest_checkpoint(f"{summary['run_dir']}/checkpoints")[1]


DILOCO = ["sim.workers=2", "algo.name=diloco", "algo.inner_steps=4", "run.max_steps=12"]


def test_diloco_with_topk_sends_far_fewer_bytes_and_still_learns(tmp_path):
    dense = simulate_once(cfg_of(tmp_path, "dense", *DILOCO))
    sparse = simulate_once(cfg_of(tmp_path, "sparse", *DILOCO, "compress.codec=topk:0.02+2bit+zstd"))
    assert sparse["bytes_sent"] < dense["bytes_sent"] / 40
    assert sparse["compression_ratio"] > 60 and sparse["codec_chain"].startswith("topk:chunk=4096,k=82")
    assert sparse["val_loss"] < 5.0  # learned something (the untrained model is at ln(256) = 5.5)
    state = final_state(sparse)
    w0, w1 = (w["model"] for w in state["workers"])
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "workers end on the same global model"
    residuals = state["workers"][0]["algo"]["codec"]["residuals"]
    assert residuals and any(r.abs().sum() > 0 for r in residuals.values())


def test_codec_residuals_resume_exactly(tmp_path):
    extra = [*DILOCO[:-1], "compress.codec=topk:0.05+int8+zstd"]
    full = simulate_once(cfg_of(tmp_path, "full", *extra, "run.max_steps=16"))
    simulate_once(cfg_of(tmp_path, "part", *extra, "run.max_steps=8", "run.checkpoint_every=4"))
    resumed = simulate_once(cfg_of(tmp_path, "part", *extra, "run.max_steps=16", "run.resume=true"))
    a, b = final_state(full)["model"], final_state(resumed)["model"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert resumed["bytes_sent"] == full["bytes_sent"]


def test_streaming_overlap_with_a_codec(tmp_path):
    """Int8 fragments, overlapped: 4x fewer bytes, the same loss, no more time than dense (with zstd the sizes are
    exchanged first, two more latency-bound collectives a fragment, which the default 80 ms link makes dearer
    than the bytes it saves on tiny)."""
    s = simulate_once(cfg_of(tmp_path, "s", "sim.workers=2", "algo.name=streaming", "algo.fragments=2",
                             "algo.inner_steps=4", "algo.overlap_steps=1", "algo.mix_alpha=0.5", "run.max_steps=12",
                             "compress.codec=int8", "sim.bandwidth=100Mbit"))
    d = simulate_once(cfg_of(tmp_path, "d", "sim.workers=2", "algo.name=streaming", "algo.fragments=2",
                             "algo.inner_steps=4", "algo.overlap_steps=1", "algo.mix_alpha=0.5", "run.max_steps=12",
                             "sim.bandwidth=100Mbit"))
    assert s["bytes_sent"] < 0.3 * d["bytes_sent"]
    assert abs(s["val_loss"] - d["val_loss"]) < 0.05
    assert s["virtual_wall_s"] <= d["virtual_wall_s"]


def test_ddp_with_int8_gradients_tracks_dense_ddp(tmp_path):
    common = ["sim.workers=2", "algo.name=ddp", "run.max_steps=6"]
    dense = simulate_once(cfg_of(tmp_path, "dense", *common))
    int8 = simulate_once(cfg_of(tmp_path, "int8", *common, "compress.codec=int8"))
    a, b = final_state(dense)["model"], final_state(int8)["model"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 0.02
    assert int8["bytes_sent"] < 0.3 * dense["bytes_sent"]
    topk = simulate_once(cfg_of(tmp_path, "topk", *common, "compress.codec=topk:0.1+fp32"))
    workers = final_state(topk)["workers"]  # error feedback makes each worker's state its own
    assert len(workers) == 2 and workers[0]["algo"]["codec"]["residuals"]


def test_simulator_equals_real_gloo_processes_with_a_codec(tmp_path, capfd):
    args = ["--config", TINY, "--max-steps", "8", "--seed", "5",
            *[a for s in [*FAST, *SMALL, "algo.name=diloco", "algo.inner_steps=4",
                          "compress.codec=topk:0.05+2bit+zstd"] for a in ("--set", s)]]
    a, b, sa, sb = simulate_and_torchrun(tmp_path, args, 2, capfd)
    assert max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"]) < 1e-5
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0


def test_simulate_table_names_the_codec_and_the_baseline_stays_dense(tmp_path, capsys):
    from launch.simulate.runner import simulate

    cfg = cfg_of(tmp_path, "run", *DILOCO[:-1], "run.max_steps=4", "sim.baseline=ddp", "compress.codec=int8")
    simulate(cfg)
    table = capsys.readouterr().out
    assert "diloco x2 (H=4) int8" in table and "ddp x2 " in table
    rows = json.loads((tmp_path / "run" / "comparison.json").read_text())
    assert [s["codec"] for s in rows.values()] == ["int8", "fp32"]
