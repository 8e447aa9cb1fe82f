"""SparseLoCo: equal to an independent implementation of the published steps, sparse on the wire, sim == gloo."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import FAST, ROOT, TINY, simulate_and_torchrun
from diloco import SparseLoCo
from diloco.sim import InProcessGroup, run_workers
from launch.config import ConfigError, load_config

H, ROUNDS, CHUNK, DENSITY, BETA, ALPHA, LR = 3, 4, 16, 0.25, 0.9, 0.8, 0.1
K, SIDE = round(DENSITY * CHUNK), 4  # tiles of 4 x 4


def _model() -> torch.nn.Module:
    """Sides that are multiples of the tile (8 x 16), and others (6, 5: tiles of 3 and 1)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 5))  # 225 values


def _batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(6, 16, generator=g), torch.randn(6, 5, generator=g)


def _loss(model, worker, step):
    x, y = _batch(worker, step)
    return ((model(x) - y) ** 2).mean()


# ---- the published algorithm, written out independently ----------------------------------------
def _chunks(chunking: str) -> list[list[int]]:
    """Each chunk's flat positions, in the order chunks are sent and, inside one, in index order. ``tensor``: each
    parameter (rows x cols) in tiles whose sides are the largest divisors of its sides up to SIDE, tiles in
    row-major order and each read row by row, sent class by class (the parameters whose tiles have the same
    length and k, in order); ``flat``: CHUNK consecutive values of the flat vector."""
    shapes = [tuple(p.shape) for p in _model().parameters()]
    total = sum(math.prod(s) for s in shapes)
    if chunking == "flat":
        return [list(range(a, min(a + CHUNK, total))) for a in range(0, total, CHUNK)]
    classes, offset = {}, 0  # (tile length, kept): its tiles; classes in the order of their first tensor
    for shape in shapes:
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        s1, s2 = (max(d for d in range(1, SIDE + 1) if n % d == 0) for n in (rows, cols))
        tiles = classes.setdefault((s1 * s2, _kept(s1 * s2)), [])
        for r0 in range(0, rows, s1):
            for c0 in range(0, cols, s2):
                tiles.append([offset + r * cols + c for r in range(r0, r0 + s1) for c in range(c0, c0 + s2)])
        offset += rows * cols
    return [tile for tiles in classes.values() for tile in tiles]


def _kept(length: int) -> int:
    """A tile of ``length`` values keeps K length / CHUNK of them, rounded half up, at least one."""
    return max(1, math.floor(K * length / CHUNK + 0.5))


def _topk_per_chunk(e: torch.Tensor, chunking: str) -> list[int]:
    """The positions of the largest |e| of each chunk (a tile keeps :func:`_kept` of them; a flat chunk K, a
    shorter last one min(K, its length)), in the order they are sent."""
    sent = []
    for chunk in _chunks(chunking):
        keep = min(K, len(chunk)) if chunking == "flat" else _kept(len(chunk))
        best = sorted(range(len(chunk)), key=lambda i: (-abs(float(e[chunk[i]])), i))[:keep]
        sent += [chunk[i] for i in sorted(best)]
    return sent


def _two_bit(e: torch.Tensor, sent: list[int], block: int = 128) -> torch.Tensor:
    """Four levels (q - 1.5) * s per block of the sent values, s = absmax / 1.5, q = clamp(floor(v / s) + 2, 0, 3)."""
    idx = torch.tensor(sent)  # the order values are sent in
    values = e[idx]
    out = torch.zeros_like(e)
    for b in range(0, values.numel(), block):
        v = values[b:b + block]
        s = float(v.abs().max()) / 1.5
        q = torch.clamp(torch.floor(v / s) + 2.0, 0.0, 3.0) if s > 0 else torch.full_like(v, 1.5)
        out[idx[b:b + block]] = (q - 1.5) * s
    return out


def _stat2(e: torch.Tensor, sent: list[int]) -> torch.Tensor:
    """The published statistical 2 bits over the sent values (one block: fewer than 1,024): four bins of width
    1.5 s from m - 3 s (the outer two open-ended), each value decoded to the mean of its bin's values."""
    idx = torch.tensor(sent)
    v = e[idx].double()
    m, s = float(v.mean()), float(v.std(unbiased=False))
    codes = [min(3, max(0, math.floor((float(x) - (m - 3 * s)) / (1.5 * s)))) for x in v]
    means = {c: sum(float(x) for x, k in zip(v, codes) if k == c) / codes.count(c) for c in set(codes)}
    out = torch.zeros_like(e)
    out[idx] = torch.tensor([means[c] for c in codes], dtype=e.dtype)
    return out


def _reference(workers: int, aggregate: str, values: str = "2bit", chunking: str = "tensor") -> torch.Tensor:
    theta = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    e = [torch.zeros_like(theta) for _ in range(workers)]
    for r in range(ROUNDS):
        sent, where = [], []
        for w in range(workers):
            local = _model()
            torch.nn.utils.vector_to_parameters(theta.clone(), local.parameters())
            opt = torch.optim.SGD(local.parameters(), lr=LR)
            for h in range(H):
                _loss(local, w, r * H + h).backward()
                opt.step()
                opt.zero_grad()
            delta = theta - torch.nn.utils.parameters_to_vector(local.parameters()).detach()
            e[w] = e[w] * BETA + delta
            sent_at = _topk_per_chunk(e[w], chunking)
            mask = torch.zeros(e[w].numel(), dtype=torch.bool)
            mask[sent_at] = True
            s = _two_bit(e[w], sent_at) if values == "2bit" else _stat2(e[w], sent_at)
            e[w] = e[w] - s
            sent.append(s)
            where.append(mask)
        total = torch.stack(sent).sum(dim=0)
        if aggregate == "senders":  # as the published scatter_reduce mean: over the workers that sent a position
            mean = total / torch.stack(where).sum(dim=0).clamp(min=1)
        else:
            mean = total / workers
        theta = theta - ALPHA * mean
    return theta


def _loco(workers: int, aggregate: str = "senders", values: str = "2bit",
          chunking: str = "tensor") -> list[torch.Tensor]:
    def body(rank, transport):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        algo = SparseLoCo(model, opt, transport, inner_steps=H, topk_density=DENSITY, chunk=CHUNK, ef_decay=BETA,
                          outer_lr=ALPHA, aggregate=aggregate, value_format=values, chunking=chunking)
        for step in range(ROUNDS * H):
            _loss(model, rank, step).backward()
            info = algo.step()
            algo.zero_grad()
        assert info.get("synced") and algo.round == ROUNDS
        local = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
        return (torch.cat([g.reshape(-1) for g in algo.global_params]), local, algo.transport.stats.bytes_sent,
                algo.figures())

    return run_workers(InProcessGroup(workers), body)


@pytest.mark.parametrize("workers, aggregate, values, chunking", [
    (1, "senders", "2bit", "tensor"), (3, "senders", "2bit", "tensor"), (3, "all", "2bit", "tensor"),
    (3, "senders", "stat2", "tensor"), (3, "senders", "2bit", "flat")])
def test_sparseloco_equals_the_published_steps(workers, aggregate, values, chunking):
    want = _reference(workers, aggregate, values, chunking)
    for theta, local, _, figures in _loco(workers, aggregate, values, chunking):
        assert torch.allclose(theta, want, atol=1e-6, rtol=1e-5), float((theta - want).abs().max())
        assert torch.equal(theta, local)  # every worker starts the next round from the global model
        assert 0 < figures["sent_share"] <= 1
        if aggregate == "senders":  # 1 <= senders of a sent position <= workers (one exactly: a lone worker)
            assert 1 <= figures["senders_per_position"] <= workers
            assert (figures["senders_per_position"] == 1) == (workers == 1)
    if workers == 3 and values == "2bit":  # the two means differ where top-k sets do not overlap
        assert not torch.allclose(want, _reference(3, "all" if aggregate == "senders" else "senders"))
    if values == "stat2":  # and the two value formats differ
        assert not torch.allclose(want, _reference(3, aggregate))
    if chunking == "flat":  # and the two chunkings
        assert not torch.allclose(want, _reference(3, aggregate))


def test_the_exchange_stays_sparse_on_the_wire():
    """Each worker sends its own sparse payload to the others, never a densified sum."""
    _, _, sent, _ = _loco(3)[0]
    values = len(_topk_per_chunk(torch.ones(225), "tensor"))  # K L / CHUNK of each tile of L values
    assert values == 8 * 4 + 2 + 4 * 3 + 2 + 10 + 5
    payload_bound = 8 + 200 + math.ceil(values * 4 / 8) + 4 + math.ceil(values * 2 / 8)  # weight, header, 4-bit indices, a scale, 2-bit codes
    assert 0 < sent <= ROUNDS * 2 * payload_bound  # to 2 other workers per round
    assert sent < ROUNDS * 2 * 225 * 4 / 4  # far below a quarter of the dense fp32 bytes


def test_settings_are_checked_where_the_user_sets_them():
    with pytest.raises(ConfigError, match="algo.chunk: chunk must be a power of two"):
        load_config([TINY], [*FAST, "algo.name=sparseloco", "algo.chunk=1000"])
    with pytest.raises(ConfigError, match="algo.chunk: the chunks of algo.chunking: tensor are square tiles"):
        load_config([TINY], [*FAST, "algo.name=sparseloco", "algo.chunk=2048"])
    assert load_config([TINY], [*FAST, "algo.name=sparseloco", "algo.chunk=2048", "algo.chunking=flat"])
    with pytest.raises(ConfigError, match="compress.codec: SparseLoCo sends its own top-k payload"):
        load_config([TINY], [*FAST, "algo.name=sparseloco", "compress.codec=int8"])
    with pytest.raises(ConfigError, match="algo.topk_density"):
        load_config([TINY], [*FAST, "algo.name=sparseloco", "algo.topk_density=0"])


def test_resume_continues_exactly(tmp_path):
    """The error-feedback buffers are part of the checkpoint: 8 steps + resume to 16 == 16 steps."""
    from launch.store.checkpoint import latest_checkpoint
    from launch.simulate.runner import simulate_once

    def cfg(name, *extra):
        c, _ = load_config([TINY], [*FAST, "run.batch_size=4", "run.eval_every=0", "sim.baseline=none",
                                    "sim.step_time=0.01", "sim.workers=2", "algo.name=sparseloco",
                                    "algo.inner_steps=4", "algo.chunk=256", f"run.dir={tmp_path / name}", *extra])
        return c

    full = simulate_once(cfg("full", "run.max_steps=16", "run.checkpoint_every=0"))
    simulate_once(cfg("part", "run.max_steps=8", "run.checkpoint_every=4"))
    resumed = simulate_once(cfg("part", "run.max_steps=16", "run.checkpoint_every=0", "run.resume=true"))
    a, b = (latest_checkpoint(f"{s['run_dir']}/checkpoints")[1]["model"] for s in (full, resumed))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert resumed["bytes_sent"] == full["bytes_sent"] > 0
    from launch.metrics.log import read_metrics  # the round's figures, on every metrics line, resumed alike

    lines = [[r for r in read_metrics(tmp_path / n) if "loss" in r] for n in ("full", "part")]
    assert all(1 <= r["senders_per_position"] <= 2 and 0 < r["sent_share"] <= 1 for r in lines[0][1:])
    assert [r["sent_share"] for r in lines[0]] == [r["sent_share"] for r in lines[1]]


def test_simulator_equals_torchrun(tmp_path, capfd):
    """A simulated 2-worker SparseLoCo run and 2 torchrun processes over gloo end with the same parameters."""
    sets = [*FAST, "run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0", "sim.baseline=none",
            "sim.step_time=0.01", "algo.name=sparseloco", "algo.inner_steps=4", "algo.chunk=256"]
    args = ["--config", TINY, "--max-steps", "8", "--seed", "5", *[a for s in sets for a in ("--set", s)]]
    a, b, sa, sb = simulate_and_torchrun(tmp_path, args, 2, capfd)
    diff = max(float((a["model"][k].float() - b["model"][k].float()).abs().max()) for k in a["model"])
    assert diff < 1e-5
    for wa, wb in zip(a["workers"], b["workers"]):  # the error-feedback buffers agree too
        ra, rb = wa["algo"]["codec"]["residuals"], wb["algo"]["codec"]["residuals"]
        assert ra.keys() == rb.keys() and all(torch.allclose(ra[k], rb[k], atol=1e-5) for k in ra)
    assert sa["bytes_sent"] == sb["bytes_sent"] > 0


def test_alpha_left_empty_is_sparselocos_own_and_a_fine_decay_keeps_its_digits():
    """``algo.outer_lr`` left empty is each algorithm's own: SparseLoCo's alpha is 1 as published, DiLoCo's outer
    lr 0.7. It was DiLoCo's 0.7 for SparseLoCo on every preset that does not set it (small, 150m, 1b). A decay
    written into the chain keeps every digit it needs: 0.9999995 became 1 (no decay)."""
    from diloco.compress import make_codec
    from diloco.sparseloco import sparse_chain
    from launch.config import load_config

    from launch.config.algorithms import algorithm_class
    from launch.join.peer import schema_of

    small = [str(ROOT / "configs" / "small.yaml")]
    for name, alpha in (("sparseloco", 1.0), ("diloco", 0.7), ("streaming", 0.7)):
        cfg, _ = load_config(small, [f"algo.name={name}"])
        assert algorithm_class(name).outer_lr_of(cfg) == alpha, name
        assert algorithm_class(name)._settings(cfg)["outer_lr"] == alpha, name
    cfg, _ = load_config(small, ["algo.name=sparseloco", "algo.outer_lr=4"])
    assert algorithm_class("sparseloco").outer_lr_of(cfg) == 4.0
    # peers that leave it empty and peers that write the algorithm's own share a schema
    assert schema_of(load_config(small, ["algo.name=diloco"])[0]) == \
        schema_of(load_config(small, ["algo.name=diloco", "algo.outer_lr=0.7"])[0])
    assert make_codec(sparse_chain(0.02, 4096, 0.9999995, "2bit")).spec.ef_decay == 0.9999995
    assert sparse_chain(0.02, 4096, 0.95, "2bit") == "topk:chunk=4096,k=82,ef=0.95,tile=64+2bit"
    assert sparse_chain(0.02, 4096, 0.95, "2bit", "flat") == "topk:chunk=4096,k=82,ef=0.95+2bit"


@pytest.mark.parametrize("robust", [False, True])
def test_the_mean_over_senders_divides_each_position_by_the_weight_of_its_senders(robust):
    """Gathered (fixed ranks) and robust (peers): a position is the token-weighted mean of the workers whose top-k
    holds it; one nobody sent stays zero; a worker of weight 0 is no sender."""
    from dataclasses import replace

    from diloco.compress import make_codec
    from diloco.compress.collective import Senders, weighted_mean

    n, weights = 96, [1.0, 3.0, 0.0]
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(w)) for w in range(3)]

    def body(rank, transport):
        if robust:
            transport.caps = replace(transport.caps, fixed_ranks=False)
        codec, senders = make_codec("topk:chunk=32,k=4+fp32"), Senders()
        x = xs[rank].clone()
        weighted_mean(transport, [x], weights[rank], codec, key="x", gather=True, senders=senders)
        return x, senders.pairs, senders.per_position()

    masks = []
    for x in xs:
        mask = torch.zeros(n, dtype=torch.bool)
        for c in range(0, n, 32):
            mask[c + x[c:c + 32].abs().topk(4).indices] = True
        masks.append(mask)
    num = sum(w * x * m for w, x, m in zip(weights, xs, masks))
    den = sum(w * m.float() for w, m in zip(weights, masks))
    want = torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros(n))
    covered = int(((masks[0] | masks[1])).sum())
    for got, pairs, per in run_workers(InProcessGroup(3), body):
        assert torch.allclose(got, want, atol=1e-6), float((got - want).abs().max())
        assert pairs == 2 * 12 and per == pytest.approx(24 / covered)


def test_under_churn_the_robust_mean_over_senders_keeps_the_workers_on_one_model(tmp_path):
    """The simulator under churn averages through the robust mean: the mean over senders there too, each round's
    figures in rounds.jsonl, and the joiner ends on worker 0's model."""
    import json

    from launch.simulate.runner import simulate_once

    trace = tmp_path / "churn.csv"
    trace.write_text("round,worker,event\n1,1,leave\n2,1,join\n")
    cfg, _ = load_config([TINY], [*FAST, "run.batch_size=4", "run.eval_every=0", "run.checkpoint_every=0",
                                  "sim.baseline=none", "sim.step_time=1", "run.max_steps=12", "sim.workers=3",
                                  "algo.name=sparseloco", "algo.inner_steps=3", "algo.chunk=256",
                                  f"sim.churn={trace}", f"run.dir={tmp_path / 'run'}"])
    summary = simulate_once(cfg)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [len(r["members"]) for r in rounds] == [3, 2, 3, 3]  # worker 1 away for round 2
    assert all(1 <= r["senders_per_position"] <= len(r["members"]) for r in rounds)
    shares = [r["sent_share"] for r in rounds]
    assert 0 < shares[0] and shares == sorted(shares)  # positions once moved stay counted
    losses = {w["worker"]: w["val_loss"] for w in summary["workers"]}
    assert losses[0] == losses[1]
