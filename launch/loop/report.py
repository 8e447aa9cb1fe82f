"""What a run says about itself: the metrics line every ``log.every`` steps, the final line, and
``summary.json``'s contents."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch

from diloco import Algorithm
from diloco.comm import Transport
from launch.config import Config
from launch.metrics.log import Metrics
from launch.metrics.mfu import Mfu
from launch.loop.memory import process_bytes
from launch.loop.runtime import threads_note
from launch.loop.schedule import Progress, RunClock
from launch.models.hf.causal_lm import folder_sha256, init_from_step
from launch.models.transformer import count_params


class Window:
    """The train loss summed since the last metrics line, its steps, and when the line's interval began. The
    sum stays on the device (read back at a metrics line only: no host sync per step), and a run stopped
    between two lines continues the average of its next one where it was (:meth:`state`)."""

    def __init__(self) -> None:
        self.loss: Any = 0.0
        self.steps = 0
        self.began = time.perf_counter()

    def add(self, step_loss: torch.Tensor) -> None:
        self.loss = self.loss + step_loss
        self.steps += 1

    def take(self, inner: Optional[Transport] = None) -> tuple[float, int, float]:
        """(mean loss, steps, seconds) of the interval; the sums start over (the clock at :meth:`restart`).
        ``inner``: the processes of a worker, each of which saw its share of the batch: the worker's loss is their
        mean (a collective every one of them reaches at the same metrics lines)."""
        loss = self.loss
        if inner is not None and inner.world_size > 1:
            loss = torch.as_tensor(loss, dtype=torch.float64).reshape(1).clone()  # where the sum lies
            inner.all_reduce_sum_(loss)
            loss = loss / inner.world_size
        taken = (float(loss) / self.steps, self.steps, max(time.perf_counter() - self.began, 1e-9))
        self.loss, self.steps = 0.0, 0
        return taken

    def restart(self) -> None:
        self.began = time.perf_counter()

    def state(self) -> dict[str, Any]:
        return {"loss": float(self.loss), "steps": self.steps}

    def load(self, state: dict[str, Any]) -> None:
        self.loss, self.steps = float(state.get("loss", 0.0)), int(state.get("steps", 0))


class Reporter:
    """Turns the run's state into its metrics records and its summary."""

    def __init__(self, cfg: Config, algo: Algorithm, transport: Transport, progress: Progress, clock: RunClock,
                 metrics: Metrics, mfu: Mfu) -> None:
        self.cfg, self.algo, self.transport = cfg, algo, transport
        self.progress, self.clock, self.metrics, self.mfu = progress, clock, metrics, mfu
        self.peak = mfu.peak.flops if mfu.peak is not None else None
        self.skipped_reported = algo.skipped_steps  # non-finite steps already reported (see _say_skipped)

    def line(self, window: Window, lr: float, info: dict[str, Any]) -> dict[str, Any]:
        """The metrics record of the steps in ``window`` (whose sums start over)."""
        self._say_skipped(info)
        loss, steps, seconds = window.take(self.transport.inner)
        tps_local = steps * self.progress.tokens_per_step / seconds
        mfu = self.mfu.flops_per_token * tps_local / self.peak if self.peak else None
        norm = info.get("grad_norm")
        return {"step": self.progress.step, "tokens": self.progress.tokens_seen(), "loss": loss, "lr": lr,
                "tokens_per_s": tps_local * self.progress.world, "mfu": mfu,
                "grad_norm": float(norm) if norm is not None else None, **self.algo.figures(), **self._traffic()}

    def final_line(self, val: Any, lr: float) -> dict[str, Any]:
        """The last line of metrics.jsonl: the final validation (a :class:`launch.eval.validation.Score`; no
        train loss)."""
        return {"step": self.progress.step, "tokens": self.progress.tokens_seen(), **val.record(), "lr": lr,
                **self._traffic()}

    def _traffic(self) -> dict[str, Any]:
        stats = self.transport.stats
        return {"bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "wall_s": self.clock.wall_s(),
                **self.transport.metrics()}

    def _say_skipped(self, info: dict[str, Any]) -> None:
        """Say (at a log step, where reading the device's count costs nothing extra) if steps were skipped."""
        skipped = self.algo.skipped_steps
        new, self.skipped_reported = skipped - self.skipped_reported, skipped
        if new > 0:
            norm = info.get("grad_norm")
            last = f"; last norm {float(norm):.4g}" if norm is not None else ""
            what = "this step's update was" if new == 1 else f"{new} steps' updates were"
            self.metrics.info(f"non-finite gradients{last}: {what} skipped; lower optim.lr or set optim.grad_clip",
                              self.progress.step)

    def summary(self, val: Any, run_dir: Any) -> dict[str, Any]:
        """``summary.json``: the run's totals and every worker's own (a collective: every worker calls it)."""
        p, stats = self.progress, self.transport.stats
        trained = self.transport.my_steps_trained()  # under churn: not the steps of the run while it was away
        steps = p.step - p.followed if trained is None else trained  # a joiner's own, not the run's before it
        tokens = p.my_tokens() if trained is None else trained * p.tokens_per_step
        mine = {"worker": self.transport.rank, "tokens": tokens, "bytes_sent": stats.bytes_sent,
                "bytes_received": stats.bytes_received, "val_loss": val.loss, "steps": steps}
        workers = self.transport.all_gather_object(mine)
        tokens = sum(w["tokens"] for w in workers)
        if self.transport.steps_trained() is not None:  # also what workers away at the end trained
            tokens = p.tokens_seen()
        summary = {
            **val.record(), "steps": p.step, "tokens": tokens,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received, "wall_s": self.clock.wall_s(),
            "peak_bytes_per_exchange": stats.peak_bytes, "algorithm": self.cfg.algo.name, "workers": workers,
            "num_workers": p.world, "codec": self.cfg.compress.codec, **self._codec_summary(),
            "skipped_steps": self.algo.skipped_steps, "run_dir": str(run_dir),
            **self.transport.summary(),
        }
        if summary.get("virtual_wall_s"):
            summary["tokens_per_virtual_s"] = summary["tokens"] / summary["virtual_wall_s"]
        return summary

    def _codec_summary(self) -> dict[str, Any]:
        codec = self.algo.codec
        if codec is None or not codec.stats.wire_bytes:
            return {}
        return {"codec_chain": codec.chain, "compression_ratio": codec.stats.ratio}


def run_sources(tokenizer: Any, init_from: Optional[str]) -> dict[str, Any]:
    """What a run started from, for summary.json: its tokenizer, and the weights of ``model.init_from``."""
    out: dict[str, Any] = {"tokenizer": None if tokenizer is None else {
        "name": tokenizer.name, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}}
    if init_from:
        out["init_from"] = {"path": init_from, "sha256": folder_sha256(Path(init_from))}
    return out


def start_lines(t: Any) -> list[str]:
    """The lines a run starts with (on its leader), from its :class:`launch.loop.trainer.Trainer` ``t``: the data,
    model, device and algorithm; the validation set; the device's peak (a CPU has no datasheet peak: no MFU, and no
    line about it); what a sharded process holds; the folder its weights came from (``model.init_from``) or the
    checkpoint it resumed from."""
    cfg, data, vset = t.cfg, t.data, t.validation.set
    train = "streamed" if data.stream is not None else f"{data.train_tokens:,}"
    lines = [f"{data.description}: {train} train / {data.val_tokens:,} val tokens; model "
             f"{count_params(t.model) / 1e6:.2f}M params on {t.device}{threads_note(t.threads)}; algorithm "
             f"{cfg.algo.name} x {t.world} worker(s); run folder {t.run_dir}",
             f"validation: {vset.describe()}", *([vset.note()] if vset.note() else [])]
    if t.device.type != "cpu":
        lines.append(t.mfu.describe())
    if t.sharded:
        lines.append(f"each of a worker's {t.inner.world_size} processes holds its slices (run.shard: fsdp): "
                     f"{process_bytes(cfg, count_params(t.model), t.inner.world_size).describe()}")
    if cfg.model.init_from and not t.resumed_from:
        step = init_from_step(cfg.model.init_from)
        lines.append(f"weights from model.init_from {cfg.model.init_from}"
                     + (f" (step {step} of the run it was exported from)" if step is not None else ""))
    if t.resumed_from:
        changes = f"; settings changed since it was saved: {t.resume_changes}" if t.resume_changes else ""
        lines.append(f"resumed from {t.resumed_from}{changes}")
    return lines
