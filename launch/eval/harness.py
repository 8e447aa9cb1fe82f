"""Downstream tasks through lm-eval-harness (the ``eval`` extra): a loco model and tokenizer served to lm-eval.

``LocoLM`` answers lm-eval's three requests for any module mapping ids [B, T] to logits [B, T, V] within a context
of ``max_len`` tokens, with a loco :class:`~launch.data.tokenizer.Tokenizer`; :func:`run_tasks` runs named tasks
on it in this process and returns plain numbers. lm-eval is imported only when tasks run: loco works without it.

It scores as lm-eval's own ``hf`` model scores a loco export, so the two agree:

- a text's ids are its encoding alone (no BOS); where lm-eval asks for a prefix token (an empty context, the first
  rolling window) it gets ``eos``, after which loco's documents begin;
- a (context, continuation) pair longer than the context keeps its last ``max_len + 1`` ids (the last is only
  predicted), and a generation's context its last ``max_len - max_gen_toks``; each such request is counted;
- rolling log-likelihoods use lm-eval's own disjoint windows of ``max_len`` ids;
- generation is greedy and ends at ``eos``, an ``until`` string or ``max_gen_toks`` ids.

On purpose it differs: log-softmax is taken in fp32 whatever the model's dtype, and a task that asks to sample
is refused (loco's models are scored greedily).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from launch.errors import RunError

INSTALL = "pip install 'loco[eval]'"
MAX_GEN_TOKS = 256  # lm-eval's own default where a task names no limit
GEN_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")  # lm-eval's order
# generation steps between two looks at the text for stop strings: each look reads the ids back to the host, and
# the steps past a stop cost compute but change no answer (greedy decoding, the text cut at the first stop)
STOP_CHECK_EVERY = 8
# resamples for the stderr of metrics without a closed form (lm-eval's default, 100,000, takes minutes)
BOOTSTRAP_ITERS = 1000


def _lm_eval() -> Any:
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401  (TemplateLM, below)
        import lm_eval.utils  # noqa: F401  (the rolling windows)
    except ImportError as e:
        what = "is not installed" if e.name in (None, "lm_eval") else f"cannot be imported ({e})"
        raise RunError(f"downstream tasks need lm-eval, which {what}: {INSTALL}") from None
    return lm_eval


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class _Serving:
    """What :class:`LocoLM` does; lm-eval's ``TemplateLM`` is mixed in when lm-eval is imported."""

    def _setup(self, model: nn.Module, tokenizer: Any, max_len: int, device: Any, batch_size: int) -> None:
        if int(max_len) < 2:
            raise RunError(f"max_len {max_len}: a model scores tasks with a context of at least 2 tokens")
        self.model, self.tok, self.max_len = model, tokenizer, int(max_len)
        self._device = torch.device(device) if device is not None else _device_of(model)
        self.batch_size = max(1, int(batch_size))
        self.truncated = 0  # requests cut on the left to fit the context
        self.requests = 0  # requests answered, of the three kinds
        model.eval()

    @property
    def eot_token_id(self) -> int:
        return int(self.tok.eos)

    @property
    def prefix_token_id(self) -> int:
        return int(self.tok.eos)  # a document starts after eos in loco's data

    @property
    def max_length(self) -> int:
        return self.max_len

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string).tolist()

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)

    def loglikelihood(self, requests: list, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        self.requests += len(requests)
        return super().loglikelihood(requests, disable_tqdm=True)  # type: ignore[misc]

    # -- scoring ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = True,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) for each
        (strings, context ids, continuation ids), in batches of requests of similar length."""
        limit = self.max_len
        rows: list[tuple[list[int], list[int]]] = []
        wholes = []
        for _, context, continuation in requests:
            if len(continuation) > limit:
                raise RunError(f"a continuation of {len(continuation)} tokens is longer than the model's context "
                               f"({limit} tokens)")
            whole = [*context, *continuation]
            if len(whole) > limit + 1:
                self.truncated += 1
            rows.append((whole[-(limit + 1):-1], list(continuation)))
            wholes.append(whole)
        # longest first, as lm-eval's models order them: a batch is padded to its first request
        order = sorted((i for i in range(len(rows)) if rows[i][1]), key=lambda i: (-len(wholes[i]), wholes[i]))
        sums, greedy = [], []
        for start in range(0, len(order), self.batch_size):
            s, g = self._score_batch([rows[i] for i in order[start:start + self.batch_size]])
            sums.append(s)
            greedy.append(g)
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)  # an empty continuation has probability 1
        if order:
            for i, s, g in zip(order, torch.cat(sums).tolist(), torch.cat(greedy).tolist()):
                out[i] = (float(s), bool(g))
        return out

    def _score_batch(self, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, on the device: the continuation's summed log-probability, and whether each of its ids is the
        argmax. Inputs are padded on the right, which a causal model's earlier positions never see."""
        n, width = len(rows), max(len(inp) for inp, _ in rows)
        span = max(len(cont) for _, cont in rows)
        ids = np.full((n, width), self.eot_token_id, dtype=np.int64)
        where = np.zeros((n, span), dtype=np.int64)  # the position whose logits predict each continuation id
        target = np.zeros((n, span), dtype=np.int64)
        mask = np.zeros((n, span), dtype=bool)
        for r, (inp, cont) in enumerate(rows):
            ids[r, :len(inp)] = inp
            where[r, :len(cont)] = np.arange(len(inp) - len(cont), len(inp))
            target[r, :len(cont)] = cont
            mask[r, :len(cont)] = True
        ids_t, where_t, target_t, mask_t = (torch.from_numpy(a).to(self._device) for a in (ids, where, target, mask))
        logits = self.model(ids_t)
        picked = logits[torch.arange(n, device=self._device)[:, None], where_t].float()  # [n, span, V]
        logp = F.log_softmax(picked, dim=-1).gather(-1, target_t[..., None]).squeeze(-1)
        sums = torch.where(mask_t, logp, torch.zeros_like(logp)).sum(dim=1)
        greedy = ((picked.argmax(dim=-1) == target_t) | ~mask_t).all(dim=1)
        return sums, greedy

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = True) -> list[float]:
        """Each text's whole log-likelihood from ``eos``, over lm-eval's disjoint windows of ``max_len`` ids."""
        utils = _lm_eval().utils
        self.requests += len(requests)
        windows, owner = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            for pair in utils.get_rolling_token_windows(token_list=self.tok_encode(text),
                                                        prefix_token=self.prefix_token_id,
                                                        max_seq_len=self.max_len, context_len=1):
                context, continuation = utils.make_disjoint_window(pair)
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        return totals

    # -- generation ---------------------------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = True) -> list[str]:
        """Greedy continuations, batched among requests of the same generation settings, longest context first."""
        self.requests += len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for members in groups.values():
            until, max_new = self._generation_settings(requests[members[0]].args[1])
            ids = {i: self.tok_encode(requests[i].args[0]) for i in members}
            members.sort(key=lambda i: (-len(ids[i]), requests[i].args[0]))
            keep = self.max_len - max_new
            for i in members:
                if len(ids[i]) > keep:
                    self.truncated += 1
                ids[i] = ids[i][-keep:] or [self.eot_token_id]
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                for i, text in zip(batch, self._greedy([ids[i] for i in batch], max_new, until)):
                    out[i] = text
        return out

    def _generation_settings(self, kwargs: Any) -> tuple[list[str], int]:
        kwargs = dict(kwargs or {})
        if kwargs.get("do_sample"):
            raise RunError("a task asks to sample (do_sample: true); loco scores its models by greedy decoding: "
                           "set do_sample: false in the task's generation_kwargs")
        until = kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]  # "" would stop at once
        max_new = next((int(kwargs[k]) for k in GEN_TOKEN_KEYS if kwargs.get(k) is not None), MAX_GEN_TOKS)
        if not 0 < max_new < self.max_len:
            raise RunError(f"a task asks to generate up to {max_new} tokens and the model's context is {self.max_len}"
                           f": set max_gen_toks in its generation_kwargs between 1 and {self.max_len - 1}")
        return until, max_new

    @torch.no_grad()
    def _greedy(self, contexts: list[list[int]], max_new: int, until: list[str]) -> list[str]:
        """Up to ``max_new`` greedy ids after each context, all rows a step at a time (each row's next id read at
        its own length: rows are padded on the right), the text cut at eos and at the first stop string. The ids
        are read back only every ``STOP_CHECK_EVERY`` steps, to see whether every row has stopped."""
        eos, n = self.eot_token_id, len(contexts)
        lengths = [len(c) for c in contexts]
        longest = max(lengths)
        buf = np.full((n, longest + max_new), eos, dtype=np.int64)
        for r, c in enumerate(contexts):
            buf[r, :len(c)] = c
        ids = torch.from_numpy(buf).to(self._device)
        rows = torch.arange(n, device=self._device)
        ends = torch.tensor(lengths, device=self._device)
        texts = [""] * n
        for step in range(max_new):
            logits = self.model(ids[:, :longest + step])
            ids[rows, ends + step] = logits[rows, ends + step - 1].argmax(dim=-1)
            if (step + 1) % STOP_CHECK_EVERY and step + 1 < max_new:
                continue
            done = True
            for r, row in enumerate(ids.tolist()):
                texts[r], stopped = self._cut(row[lengths[r]:lengths[r] + step + 1], until)
                done = done and stopped
            if done:
                break
        return texts

    def _cut(self, generated: list[int], until: list[str]) -> tuple[str, bool]:
        """The text of ``generated`` up to eos and before the first stop string; whether either was met."""
        stopped = self.eot_token_id in generated
        if stopped:
            generated = generated[:generated.index(self.eot_token_id)]
        text = self.tok_decode(generated)
        for stop in until:
            if stop in text:
                text, stopped = text.split(stop, 1)[0], True
        return text, stopped


@functools.lru_cache(maxsize=None)
def _adapter_class() -> type:
    template = _lm_eval().api.model.TemplateLM

    class LocoLM(_Serving, template):  # type: ignore[valid-type, misc]
        """A loco model and tokenizer as an lm-eval model: ``LocoLM(model, tokenizer, max_len, device=None,
        batch_size=16)``; ``device`` defaults to the model's own. ``truncated`` and ``requests`` count what it
        answered."""

        def __init__(self, model: nn.Module, tokenizer: Any, max_len: int, device: Any = None,
                     batch_size: int = 16) -> None:
            template.__init__(self)
            self._setup(model, tokenizer, max_len, device, batch_size)

    LocoLM.__module__, LocoLM.__qualname__ = __name__, "LocoLM"
    return LocoLM


def __getattr__(name: str) -> Any:
    if name == "LocoLM":  # built on first use: its base class is lm-eval's
        return _adapter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- tasks ------------------------------------------------------------------------------------------------------


def task_manager(include_path: Optional[str]) -> Any:
    """lm-eval's task index, with the task YAMLs under ``include_path`` besides its own; built once per path
    (indexing lm-eval's thousands of YAMLs takes seconds)."""
    _lm_eval()
    return _manager(_folder(include_path), True)


def _folder(include_path: Optional[str]) -> Optional[str]:
    if include_path is None:
        return None
    path = Path(include_path).expanduser().resolve()
    if not path.exists():
        raise RunError(f"--include-path {include_path}: no such folder (the folder of a task's YAML files)")
    return str(path)


def _manager_for(names: list[str], include_path: Optional[str]) -> Any:
    """The index of ``include_path`` alone where every name is a task there (it takes milliseconds, and a task
    of its own needs nothing of lm-eval's), else :func:`task_manager`'s."""
    folder = _folder(include_path)
    if folder is not None:
        local = _manager(folder, False)
        if set(names) <= set(local.all_subtasks):
            return local
    return _manager(folder, True)


@functools.lru_cache(maxsize=None)
def _manager(include_path: Optional[str], defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    with _quiet():
        return TaskManager(include_path=include_path, include_defaults=defaults)


def run_tasks(model: nn.Module, tokenizer: Any, max_len: int, device: Any, tasks: Sequence[str],
              include_path: Optional[str] = None, batch_size: int = 16, limit: Optional[int] = None) -> dict:
    """Score ``model`` on lm-eval ``tasks`` (names, or the paths of task YAMLs) in this process.

    Returns ``{"tasks": {task: {metric: value, "<metric>_stderr": value}}, "truncated": n, "requests": m}`` with
    plain floats (a filter other than ``none`` stays in the name, as ``exact_match,strict-match``; a stderr lm-eval
    has none for is left out). The model is left in the mode it came in, and the caller's random state as it was.
    """
    _lm_eval()
    from lm_eval import evaluator

    names = list(tasks)
    if not names:
        raise RunError("no lm-eval task named: name one or more")
    manager = _manager_for(names, include_path)
    _check_names(manager, names, include_path)
    training = model.training
    lm = _adapter_class()(model, tokenizer, max_len, device, batch_size)
    try:
        with _quiet(), _kept_random_state(lm.device):
            out = evaluator.simple_evaluate(model=lm, tasks=names, batch_size=batch_size, limit=limit,
                                            bootstrap_iters=BOOTSTRAP_ITERS, log_samples=False,
                                            task_manager=manager)
    except FileNotFoundError as e:
        raise RunError(_missing_file(e, names)) from None
    finally:
        model.train(training)
    return {"tasks": _scores(out["results"]), "truncated": lm.truncated, "requests": lm.requests}


def check_tasks(tasks: Sequence[str], include_path: Optional[str] = None) -> None:
    """Each task name known (lm-eval's or the folder's), else one line: a run says so at its start, not at its
    first evaluation hours in."""
    _lm_eval()
    names = list(tasks)
    _check_names(_manager_for(names, include_path), names, include_path)


class RunTasks:
    """A run's lm-eval tasks (``eval.tasks``): every ``eval.tasks_every`` steps (0: only at the end) and at the end,
    on the worker of rank 0, all of its processes (under ``run.shard: fsdp`` a forward pass is a collective)."""

    def __init__(self, ecfg: Any, max_len: int, tokenizer: Any, device: torch.device, here: bool) -> None:
        self.names = [t.strip() for t in (ecfg.tasks or "").split(",") if t.strip()]
        self.every, self.include_path, self.limit = ecfg.tasks_every, ecfg.include_path, ecfg.tasks_limit
        self.max_len, self.tokenizer, self.device = max_len, tokenizer, device
        self.rows = ecfg.batch_size or 16
        self.here = here and bool(self.names)
        self.last_step: Optional[int] = None
        if self.names:
            if tokenizer is None:
                raise RunError("eval.tasks: this run reads token ids without a tokenizer, and lm-eval's tasks are "
                               "text; set data.tokenizer (or the shards' manifest names one)")
            check_tasks(self.names, self.include_path)

    def due(self, step: int) -> bool:
        return self.here and self.every > 0 and step % self.every == 0

    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        """The tasks' scores as metrics fields (``tasks/<task>/<metric>``); {} where this process runs none."""
        if not self.here:
            return {}
        result = run_tasks(model, self.tokenizer, self.max_len, self.device, self.names, self.include_path,
                           batch_size=self.rows, limit=self.limit)
        self.last_step = step
        return {f"tasks/{k}": v for k, v in flat_scores(result).items()}


def flat_scores(result: dict) -> dict[str, float]:
    """``task/metric`` -> value for a metrics line (stderrs left out)."""
    return {f"{task}/{metric}": value for task, metrics in result["tasks"].items()
            for metric, value in metrics.items() if "_stderr" not in metric}


def _scores(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's ``results`` (``"acc,none": 0.5``, names, aliases, sizes) as metric -> float per task."""
    out = {}
    for task, row in results.items():
        metrics = {}
        for key, value in row.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # "alias", "sample_len"; a stderr of "N/A"
            metric, kept = key.split(",", 1)
            metrics[metric if kept == "none" else key] = float(value)
        out[task] = metrics
    return out


def _check_names(manager: Any, names: list[str], include_path: Optional[str]) -> None:
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known and not Path(n).is_file()]
    if not unknown:
        return
    named = ", ".join(repr(n) for n in unknown)
    if include_path is None:
        raise RunError(f"unknown task {named}: lm-eval has no task of that name (a task of your own: "
                       f"--include-path FOLDER, the folder of its YAML)")
    raise RunError(f"unknown task {named}: neither lm-eval nor --include-path {include_path} has a task of that "
                   f"name (a YAML's task: key names it)")


def _missing_file(error: FileNotFoundError, names: list[str]) -> str:
    quoted = re.search(r"'([^']+)'", str(error))
    file = error.filename or (quoted.group(1) if quoted else str(error))
    return (f"{file}: no such file, and one of the tasks {', '.join(names)} reads it (its YAML's "
            f"dataset_kwargs.data_files; a relative path is taken from the working directory)")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's output kept off the terminal: its log below errors, its progress bars and prints (stdout,
    stderr) dropped, and its bootstrap in this process rather than a pool of forked ones."""
    logger = logging.getLogger("lm_eval")
    level, multiproc = logger.level, os.environ.get("DISABLE_MULTIPROC")
    logger.setLevel(logging.ERROR)
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
        if multiproc is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = multiproc


@contextlib.contextmanager
def _kept_random_state(device: torch.device) -> Iterator[None]:
    """lm-eval seeds python's, numpy's and torch's generators; the caller's (a training run's) are put back."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
