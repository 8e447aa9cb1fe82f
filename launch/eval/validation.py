"""The validation a run is scored on: windows spread evenly over the whole validation split, the same whatever
the run's layout.

A :class:`ValidationSet` is ``ceil(eval.tokens / seq_len)`` windows of the split (``seq_len + 1`` tokens each,
as training cuts them), the i-th at window ``floor((i + 1/2) * N / n)`` of the split's ``N``: deterministic, and
blind to ``run.batch_size``, gradient accumulation, the processes of a worker, the transport and the simulator.
A split with fewer windows than asked is scored whole.

:func:`score` sums each window's negative log-likelihood. The processes of a worker each score every P-th
window, all in forward passes of ``rows`` windows, and one sum over the processes joins them, so the result
depends only on the windows. Under ``run.shard: fsdp`` a forward pass is a collective: every process runs the
same number of them (the last padded with a window it already scored, whose result is dropped).

The loss is the mean over target tokens; its standard error is that of the mean over windows (every window has
``seq_len`` targets). Bits per byte divide the summed loss by the targets' bytes of text; its error is the ratio
estimator's (the delta method). Two models scored on the same windows compare by :func:`paired_gap`, whose
error is that of the per-window differences: far smaller than either error alone, since a window hard for one
model is hard for the other.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from launch.data.tokens import Windows, check_ids

LN2 = math.log(2.0)


@dataclass(frozen=True)
class ValidationSet:
    """Which windows of a split are scored (``picks``, ascending) and the split they come from."""

    windows: Windows
    picks: np.ndarray
    asked: int  # the tokens asked for (eval.tokens)

    @classmethod
    def spread(cls, windows: Windows, tokens: int) -> "ValidationSet":
        if tokens <= 0:
            raise ValueError(f"eval.tokens: {tokens}, expected a positive count of tokens")
        total = windows.n
        n = min(total, -(-tokens // windows.seq_len))
        picks = ((np.arange(n, dtype=np.float64) + 0.5) * total / n).astype(np.int64) if n else np.zeros(0, np.int64)
        return cls(windows, picks, tokens)

    @property
    def seq_len(self) -> int:
        return self.windows.seq_len

    @property
    def count(self) -> int:
        return len(self.picks)

    @property
    def tokens(self) -> int:
        """The target tokens scored."""
        return self.count * self.seq_len

    @property
    def whole(self) -> bool:
        """The whole split is scored (it has no more windows than asked)."""
        return self.count == self.windows.n

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """The windows at ``positions`` (indices into ``picks``), as ``[k, seq_len + 1]`` int64 rows."""
        return np.stack([self.windows.get(int(self.picks[p])) for p in positions])

    def check_ids(self, vocab_size: int, description: str) -> None:
        """Refuse ids outside ``[0, vocab_size)`` in the scored windows, in one line naming the data."""
        for p in self.picks:
            check_ids(self.windows.get(int(p)), vocab_size, description, "validation")

    def target_bytes(self, token_bytes: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """Bytes of text each window's targets stand for (None without a tokenizer's byte lengths)."""
        if token_bytes is None:
            return None
        out = np.empty(self.count, dtype=np.float64)
        top = len(token_bytes) - 1
        for i, p in enumerate(self.picks):
            out[i] = float(token_bytes[np.minimum(self.windows.get(int(p))[1:], top)].sum())
        return out

    def describe(self) -> str:
        where = "the whole validation split" if self.whole else f"spread over the split's {self.windows.n:,}"
        return f"{self.tokens:,} tokens in {self.count:,} windows of {self.seq_len} ({where})"

    def note(self) -> Optional[str]:
        """One line where the split is smaller than ``eval.tokens`` asks (None otherwise)."""
        if self.whole and self.tokens < self.asked:
            return (f"eval.tokens={self.asked:,}: the validation split has {self.tokens:,} tokens in windows of "
                    f"{self.seq_len}; it is scored whole")
        return None


@dataclass
class Score:
    """A model's validation: the loss in nats per token and bits per byte, each with its standard error, and
    what each window summed (for paired comparisons)."""

    loss: float
    loss_se: float
    bpb: Optional[float]
    bpb_se: Optional[float]
    seq_len: int
    nll: np.ndarray  # summed negative log-likelihood of each window's targets (nats)
    bytes: Optional[np.ndarray]  # bytes of text of each window's targets

    @property
    def tokens(self) -> int:
        """The target tokens scored."""
        return len(self.nll) * self.seq_len

    @classmethod
    def of(cls, nll: np.ndarray, seq_len: int, window_bytes: Optional[np.ndarray]) -> "Score":
        n = len(nll)
        per_token = nll / seq_len
        loss = float(per_token.mean())
        loss_se = float(per_token.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        bpb = bpb_se = None
        if window_bytes is not None and window_bytes.sum() > 0:
            bits = nll / LN2
            bpb = float(bits.sum() / window_bytes.sum())
            # the ratio estimator's error: deviations of bits from bpb x bytes, over the mean bytes of a window
            z = bits - bpb * window_bytes
            bpb_se = float(z.std(ddof=1) / math.sqrt(n) / window_bytes.mean()) if n > 1 else float("nan")
        return cls(loss, loss_se, bpb, bpb_se, seq_len, nll, window_bytes)

    def record(self) -> dict[str, Any]:
        """The fields a metrics line and summary.json carry."""
        return {"val_loss": self.loss, "val_loss_se": self.loss_se, "val_bpb": self.bpb, "val_bpb_se": self.bpb_se,
                "val_tokens": self.tokens}

    def windows_record(self, vset: "ValidationSet") -> dict[str, Any]:
        """Which windows were scored and what each summed, for :func:`run_gap` (``val_windows.json``)."""
        return {"seq_len": self.seq_len, "split_windows": vset.windows.n, "picks": [int(p) for p in vset.picks],
                "nll": [float(v) for v in self.nll],
                "bytes": None if self.bytes is None else [float(v) for v in self.bytes]}


def row_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed negative log-likelihood of ``targets`` ``[B, T]`` under ``logits`` ``[B, T, V]``, in fp32."""
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return nll.view(targets.shape).sum(dim=1)


def score(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], vset: ValidationSet, rows: int,
          device: torch.device, share: tuple[int, int] = (0, 1),
          combine: Optional[Callable[[torch.Tensor], None]] = None,
          window_bytes: Optional[np.ndarray] = None) -> Score:
    """Score ``vset``. ``forward(x, y)`` gives each row's summed negative log-likelihood ``[k]``; ``share``:
    (this process's index, the processes that score together), whose sums ``combine`` adds up in place (every
    process calls it). The sums stay on ``device`` until the end: one read for the whole evaluation."""
    me, procs = share
    mine = np.arange(me, vset.count, procs)
    most = -(-vset.count // procs)  # the windows of the process with the most
    passes = -(-most // rows) if most else 0
    sums = torch.zeros(vset.count, dtype=torch.float64, device=device)
    my_sums = sums[me::procs]  # a view: this process's windows, in order
    for k in range(passes):
        part = mine[k * rows:(k + 1) * rows]
        real = len(part)
        if real == 0:  # fsdp: this process still runs the pass the others run; its result is dropped
            part = mine[:1] if len(mine) else np.zeros(1, np.int64)
        # one block on the host, cut into inputs and targets: the forward moves it to the device once
        block = torch.from_numpy(vset.rows(part))
        nll = forward(block[:, :-1], block[:, 1:])
        if real:
            my_sums[k * rows:k * rows + real] = nll[:real].to(torch.float64)
    if combine is not None and procs > 1:
        combine(sums)
    return Score.of(sums.cpu().numpy(), vset.seq_len, window_bytes)


@dataclass
class Gap:
    """``a - b`` in loss over the same windows, with the standard error of the per-window differences."""

    gap: float
    se: float

    @property
    def level(self) -> bool:
        """Within two standard errors: neither is better."""
        return not abs(self.gap) > 2 * self.se

    def describe(self, unit: str = "") -> str:
        word = "level" if self.level else ("lower" if self.gap < 0 else "higher")
        return f"{self.gap:+.4f}{unit} ± {self.se:.4f} ({word})"


def paired_gap(a: np.ndarray, b: np.ndarray, seq_len: int) -> Optional[Gap]:
    """The loss gap between two models' per-window sums over the same windows (None: not the same windows)."""
    if len(a) != len(b) or len(a) < 2:
        return None
    d = (np.asarray(a) - np.asarray(b)) / seq_len
    return Gap(float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))))


def scoring_rows(cfg: Any) -> int:
    """Windows a forward pass scores: ``eval.batch_size``, else the run's micro-batch (what fits in training)."""
    return cfg.eval.batch_size or max(1, cfg.run.batch_size // cfg.run.grad_accum)


class RunValidation:
    """A run's validation: its set (``eval.tokens`` of the split's windows), scored by a worker's processes
    together (``inner``: the transport among them, None for a worker of one process)."""

    def __init__(self, cfg: Any, windows: Windows, tokenizer: Any, device: torch.device, inner: Any = None,
                 vocab_size: Optional[int] = None, description: str = "the data") -> None:
        self.set = ValidationSet.spread(windows, cfg.eval.tokens)
        if vocab_size is not None:
            self.set.check_ids(vocab_size, description)
        self.rows = scoring_rows(cfg)
        self.device, self.inner, self.tokenizer = device, inner, tokenizer
        self._bytes: Optional[np.ndarray] = None
        self._bytes_read = False

    def window_bytes(self) -> Optional[np.ndarray]:
        """Each window's bytes of text (None for token ids without a tokenizer); read once."""
        if not self._bytes_read:
            lengths = self.tokenizer.token_bytes() if self.tokenizer is not None else None
            self._bytes, self._bytes_read = self.set.target_bytes(lengths), True
        return self._bytes

    def score(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Score:
        inner = self.inner
        share = (inner.rank, inner.world_size) if inner is not None else (0, 1)
        return score(forward, self.set, self.rows, self.device, share,
                     inner.all_reduce_sum_ if inner is not None else None, self.window_bytes())


def read_windows(run_dir: Any) -> Optional[dict[str, Any]]:
    """A run folder's ``val_windows.json`` (None where it has none or it cannot be read)."""
    path = Path(run_dir) / "val_windows.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_gap(a_dir: Any, b_dir: Any) -> Optional[Gap]:
    """The final validation loss of run ``a`` against run ``b``, paired over their windows (None: they were not
    scored on the same windows, or a run has no record of them)."""
    a, b = read_windows(a_dir), read_windows(b_dir)
    if a is None or b is None or any(a.get(k) != b.get(k) for k in ("seq_len", "split_windows", "picks")):
        return None
    return paired_gap(np.asarray(a["nll"]), np.asarray(b["nll"]), int(a["seq_len"]))


__all__ = ["Gap", "RunValidation", "Score", "ValidationSet", "paired_gap", "read_windows", "row_nll", "run_gap",
           "score", "scoring_rows"]
