"""The run's validation: windows spread over the whole split, scored the same whatever the layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from launch.data.tokens import Windows
from launch.eval.validation import Score, ValidationSet, paired_gap, score
from launch.models.transformer import ModelArgs, Transformer

SEQ = 16


def _split(windows: int, seed: int = 0) -> Windows:
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(1, 256, size=n * SEQ + 1) for n in (windows // 3, windows - windows // 3)]
    return Windows(arrays, SEQ)


def test_the_windows_are_spread_over_the_whole_split_and_fixed_by_the_tokens_alone():
    split = _split(300)
    vset = ValidationSet.spread(split, 40 * SEQ)
    assert vset.count == 40 and vset.tokens == 40 * SEQ and not vset.whole and vset.note() is None
    assert np.all(np.diff(vset.picks) > 0) and vset.picks[0] < 300 / 40 and vset.picks[-1] > 300 - 300 / 40
    assert np.array_equal(ValidationSet.spread(split, 40 * SEQ - 5).picks, vset.picks)  # whole windows, rounded up
    # a split smaller than asked: scored whole, and said
    small = ValidationSet.spread(split, 10_000 * SEQ)
    assert small.whole and small.count == 300 and np.array_equal(small.picks, np.arange(300))
    assert "scored whole" in small.note() and "4,800 tokens" in small.note()
    with pytest.raises(ValueError, match="eval.tokens"):
        ValidationSet.spread(split, 0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=256, max_seq_len=SEQ))
    return m.eval()


def _forward(model, calls=None):
    def forward(x, y):
        if calls is not None:
            calls.append(len(x))
        logits = model(x)
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        return nll.view(y.shape).sum(1)
    return torch.no_grad()(forward)


def test_a_score_does_not_depend_on_the_batch_or_how_many_processes_share_it(model):
    vset = ValidationSet.spread(_split(120), 37 * SEQ)
    bytes_ = vset.target_bytes(np.ones(256, dtype=np.int64))
    base = score(_forward(model), vset, 37, torch.device("cpu"), window_bytes=bytes_)
    assert base.tokens == 37 * SEQ and math.isfinite(base.loss_se) and base.bpb == pytest.approx(base.loss / math.log(2))
    for rows in (1, 4, 8):
        for procs in (2, 3, 5):
            # each process scores its share; the sums are joined as the transport's all-reduce would
            calls = [[] for _ in range(procs)]
            parts = []
            for me in range(procs):
                def keep(sums, me=me):
                    parts.append(sums.clone())
                score(_forward(model, calls[me]), vset, rows, torch.device("cpu"), (me, procs), keep, bytes_)
            joined = Score.of(sum(parts).numpy(), SEQ, bytes_)
            assert abs(joined.loss - base.loss) <= 1e-6 * base.loss, (rows, procs)
            assert joined.loss_se == pytest.approx(base.loss_se, rel=1e-5)
            # every process runs the same forward passes (under fsdp each is a collective)
            assert len({len(c) for c in calls}) == 1, (rows, procs, calls)


def test_errors_and_paired_gaps():
    nll = np.array([30.0, 34.0, 26.0, 38.0])
    s = Score.of(nll, 10, np.array([12.0, 14.0, 10.0, 16.0]))
    assert s.loss == pytest.approx(3.2) and s.loss_se == pytest.approx(np.std(nll / 10, ddof=1) / 2)
    # a constant ratio of bits to bytes: no spread, no error
    assert s.bpb_se == pytest.approx(np.std(nll / math.log(2) - s.bpb * np.array([12, 14, 10, 16.0]), ddof=1)
                                     / 2 / 13)
    same = paired_gap(nll, nll + 0.0, 10)
    assert same.gap == 0 and same.level
    # windows hard for one model are hard for the other: the paired error is far below either alone
    better = paired_gap(nll - 1.0 + np.array([0.1, -0.1, 0.05, -0.05]), nll, 10)
    assert better.gap == pytest.approx(-0.1) and better.se < s.loss_se / 10 and not better.level
    assert "lower" in better.describe() and paired_gap(nll, nll[:3], 10) is None
