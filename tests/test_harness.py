"""Downstream tasks through lm-eval (``launch.eval.harness``): a loco model scores as lm-eval's own ``hf`` model
scores its fp32 export, request by request and task by task; long requests are cut on the left and counted; bad
input is one line. The tasks are made here, offline: a multiple-choice, a rolling-perplexity and a generation task
over json files, passed through ``include_path``."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launch.errors import RunError
from launch.eval import harness

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # lm-eval's hf model needs it

MAX_LEN = 48
COLORS, ANIMALS = ["red", "blue", "green"], ["cat", "dog", "fox"]
VERBS, PLACES = ["sat", "ran", "slept"], ["mat", "tree", "river"]
WORDS = ["the", "on", *COLORS, *ANIMALS, *VERBS, *PLACES]
TASKS = ["loco_mc", "loco_ppl", "loco_gen"]
STEPS = 100  # of training: enough that greedy text follows the pattern


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _task(folder: Path, name: str, data: Path, body: str) -> None:
    (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                         f"    test: {data}\ntest_split: test\n{body}")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A BPE, a tiny Transformer trained a few steps on sentences of one pattern, its fp32 export, and the tasks."""
    from launch.data.tokenizer import train_bpe
    from launch.models.hf.export import export
    from launch.models.transformer import ModelArgs, Transformer
    from launch.store.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("harness")
    rng = random.Random(0)
    texts = [f"the {rng.choice(COLORS)} {rng.choice(ANIMALS)} {rng.choice(VERBS)} on the {rng.choice(PLACES)}."
             for _ in range(300)]  # a pattern a few steps learn: greedy text runs to "." and eos
    tok = train_bpe(texts, 300, root / "tok.json", say=lambda m: None)
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=tok.vocab_size, max_seq_len=MAX_LEN)
    model = Transformer(args)
    stream = torch.tensor([i for t in texts for i in [tok.eos, *tok.encode(t).tolist()]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        starts = torch.randint(0, len(stream) - MAX_LEN - 1, (8,))
        batch = torch.stack([stream[s:s + MAX_LEN + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    save_checkpoint(root / "run" / "checkpoints", STEPS, {"model": model.state_dict(), "model_args": vars(args),
                                                       "tokenizer": tok.state()})
    export(root / "run", root / "hf", dtype="fp32")

    tasks = root / "tasks"
    tasks.mkdir()
    items = [{"question": f"Q: {_sentence(rng, 60 if i == 0 else rng.randint(2, 8))}\nA:",  # item 0: too long
              "choices": [_sentence(rng, rng.randint(1, 3)) for _ in range(3)], "label": rng.randrange(3)}
             for i in range(12)]
    _task(tasks, "loco_mc", _jsonl(root / "mc.jsonl", items),
          'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
          "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    docs = [{"text": t} for t in texts[:5]] + [{"text": " ".join(texts[10:40])}]  # the last spans windows
    _task(tasks, "loco_ppl", _jsonl(root / "ppl.jsonl", docs),
          'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
          "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    prompts = [{"prompt": f"the {rng.choice(COLORS)}" + (f" {rng.choice(ANIMALS)}" if i % 2 else ""),
                "answer": " dog ran on the mat" if i % 2 == 0 else " ran on the mat"} for i in range(5)]
    prompts.append({"prompt": _sentence(rng, 50), "answer": " sat"})  # longer than the room left for generation
    _task(tasks, "loco_gen", _jsonl(root / "gen.jsonl", prompts),
          'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
          'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 10\n  do_sample: false\n'
          "metric_list:\n  - metric: exact_match\n")
    _task(tasks, "loco_missing", root / "nowhere.jsonl",
          'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
          "doc_to_target: label\nmetric_list:\n  - metric: acc\n")
    return {"root": root, "model": model, "tok": tok, "tasks": str(tasks), "texts": texts, "prompts": prompts,
            "items": items}


@pytest.fixture(scope="module")
def manager(world):
    """lm-eval's whole task index and the test's tasks: built once (seconds), and kept by the harness for every
    later call with the same folder (the unknown-name check below uses it too)."""
    return harness.task_manager(world["tasks"])


@pytest.fixture(scope="module")
def hf(world):
    """lm-eval's own hf model on the fp32 export."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(world["root"] / "hf"), device="cpu", dtype="float32", batch_size=4)


def _requests(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_both_sides_read_the_same_ids(world, hf):
    """HFLM adds no BOS to the export's tokenizer (it has no post-processor), and its prefix token is eos, as
    the adapter's: both score the very same ids."""
    tok = world["tok"]
    text = "the cat sat on a mat."
    assert hf.tok_encode(text) == tok.encode(text).tolist()
    assert hf.prefix_token_id == hf.eot_token_id == tok.eos
    assert hf.max_length == MAX_LEN


def test_each_request_scores_as_lm_eval_s_hf_model(world, hf):
    lm = harness.LocoLM(world["model"], world["tok"], MAX_LEN, batch_size=3)
    long_context = " ".join(world["texts"][:20])  # over MAX_LEN ids: cut on the left
    pairs = [("", " the cat"), ("the dog", " sat on a mat."), ("a big ", "tree"), (long_context, " red sky"),
             (long_context, " blue"), ("Q: the cat\nA:", " sat")]
    ours = lm.loglikelihood(_requests("loglikelihood", pairs))
    theirs = hf.loglikelihood(_requests("loglikelihood", pairs))
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert max(abs(a - b) for (a, _), (b, _) in zip(ours, theirs)) < 1e-4
    assert lm.truncated == 2 and lm.requests == len(pairs)

    # the cut keeps the last MAX_LEN + 1 ids of context and continuation, the last one only predicted
    tok, model = world["tok"], world["model"]
    context, continuation = tok.encode(long_context).tolist(), tok.encode(long_context + " blue").tolist()
    continuation = continuation[len(context):]
    kept = (context + continuation)[-(MAX_LEN + 1):]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([kept[:-1]])), dim=-1)[0]
    by_hand = sum(float(logp[MAX_LEN - len(continuation) + k, t]) for k, t in enumerate(continuation))
    assert abs(ours[4][0] - by_hand) < 1e-4

    texts = [world["texts"][0], " ".join(world["texts"][:30])]  # the second spans several windows
    assert len(tok.encode(texts[1])) > 2 * MAX_LEN
    ours = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]))
    theirs = hf.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]))
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    assert lm.truncated == 2  # windows are never cut

    # two groups of settings: stopped by ".", and by eos (no newline is ever generated) or the length
    dot, eos = {"until": ["."], "max_gen_toks": 10, "do_sample": False}, {"until": ["\n"], "max_gen_toks": 12}
    prompts = [(p["prompt"], dict(s)) for p in world["prompts"] for s in (dot, eos)]
    ours = lm.generate_until(_requests("generate_until", prompts + [("", dict(dot))]))
    theirs = hf.generate_until(_requests("generate_until", [(c, dict(s)) for c, s in prompts]))
    assert ours[:-1] == theirs and all(ours[:10])  # the patterned prompts all go on
    assert all("." not in t for t in ours[::2]) and any("." in t for t in ours[1::2])
    assert lm.truncated == 4  # the long prompt, twice: it keeps MAX_LEN - max_gen_toks ids


def test_results_are_read_back_per_call_not_per_request_or_token(world):
    """Scores stay on the device until every batch is done; generation reads its ids back every
    ``STOP_CHECK_EVERY`` steps, to look for stop strings."""
    from conftest import HostReads

    lm = harness.LocoLM(world["model"], world["tok"], MAX_LEN, batch_size=3)
    with HostReads() as reads:
        lm.loglikelihood(_requests("loglikelihood", [("the dog", f" sat on the {p}.") for p in PLACES * 3]))
    assert reads.count == 2  # the sums and the greedy flags, for 9 requests in 3 batches
    with HostReads() as reads:
        lm.generate_until(_requests("generate_until", [("the", {"until": ["\n"], "max_gen_toks": 20})] * 4))
    assert 2 <= reads.count <= 2 * -(-20 // harness.STOP_CHECK_EVERY)  # 2 batches


def test_tasks_score_as_lm_eval_s_hf_model_on_the_export(world, hf, manager):
    from lm_eval import simple_evaluate

    model = world["model"].train()
    torch.manual_seed(7)
    rng_before = torch.get_rng_state()
    ours = harness.run_tasks(model, world["tok"], MAX_LEN, "cpu", TASKS, world["tasks"], batch_size=4)
    assert model.training and torch.equal(torch.get_rng_state(), rng_before)  # the caller's state is kept
    model.eval()
    theirs = simple_evaluate(hf, tasks=TASKS, task_manager=manager, bootstrap_iters=harness.BOOTSTRAP_ITERS,
                             log_samples=False)["results"]
    assert set(ours["tasks"]) == set(TASKS)
    for task, metrics in ours["tasks"].items():
        want = {k.split(",")[0]: v for k, v in theirs[task].items() if k.endswith(",none") and v != "N/A"}
        assert metrics.keys() == want.keys(), task
        for name, value in metrics.items():
            assert type(value) is float
            assert abs(value - want[name]) <= 1e-4 * max(1.0, abs(want[name])), (task, name, value, want[name])
    assert {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr"} <= ours["tasks"]["loco_mc"].keys()
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= ours["tasks"]["loco_ppl"].keys()
    # the long question's three choices and the long prompt were cut
    assert ours["truncated"] == 4
    assert ours["requests"] == 3 * len(world["items"]) + 6 + len(world["prompts"])
    flat = harness.flat_scores(ours)
    assert flat["loco_mc/acc"] == ours["tasks"]["loco_mc"]["acc"] and "loco_ppl/bits_per_byte" in flat
    assert not [k for k in flat if "stderr" in k]


def test_a_byte_level_model_reads_text_from_eos():
    """Bytes: a text's rolling log-likelihood is that of its UTF-8 bytes after id 0, eos; an empty context is
    eos too."""
    from launch.data.tokenizer import ByteTokenizer
    from launch.models.transformer import ModelArgs, Transformer

    torch.manual_seed(1)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    lm = harness.LocoLM(model, ByteTokenizer(), 64)
    text = "héllo"
    ids = [0, *text.encode("utf-8")]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]])), dim=-1)[0]
    by_hand = sum(float(logp[k, t]) for k, t in enumerate(ids[1:]))
    (rolling,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    ((empty, _),) = lm.loglikelihood(_requests("loglikelihood", [("", text)]))
    assert abs(rolling - by_hand) < 1e-4 and abs(empty - by_hand) < 1e-4


def test_bad_input_is_one_line(world, manager, monkeypatch, tmp_path):
    model, tok, tasks = world["model"], world["tok"], world["tasks"]
    with pytest.raises(RunError, match="unknown task 'no_such_task'.*--include-path"):
        harness.run_tasks(model, tok, MAX_LEN, "cpu", ["loco_mc", "no_such_task"], tasks)
    with pytest.raises(RunError, match="nowhere.jsonl: no such file"):
        harness.run_tasks(model, tok, MAX_LEN, "cpu", ["loco_missing"], tasks)
    with pytest.raises(RunError, match="--include-path .*: no such folder"):
        harness.run_tasks(model, tok, MAX_LEN, "cpu", ["loco_mc"], str(tmp_path / "absent"))
    lm = harness.LocoLM(model, tok, MAX_LEN)
    for settings, words in (({"do_sample": True}, "greedy"), ({"max_gen_toks": MAX_LEN}, "between 1 and 47")):
        with pytest.raises(RunError, match=words):
            lm.generate_until(_requests("generate_until", [("the cat", settings)]))

    # without lm-eval: the module still imports, and running tasks says what to install
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    spec = importlib.util.spec_from_file_location("harness_alone", Path(harness.__file__))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for call in (lambda: harness.run_tasks(model, tok, MAX_LEN, "cpu", ["loco_mc"], tasks),
                 lambda: harness.task_manager(None)):
        with pytest.raises(RunError, match=r"lm-eval, which is not installed: pip install 'loco\[eval\]'"):
            call()


def test_a_run_scores_its_tasks_in_the_loop_and_loco_eval_on_its_checkpoint(world, manager, tmp_path, capsys):
    """``eval.tasks`` every ``eval.tasks_every`` steps and at the end, in metrics.jsonl and the plot; ``loco eval
    --tasks`` on the checkpoint gives the final line's scores; an unknown task stops the run before it trains."""
    from conftest import FAST, TINY
    from launch.cli import main
    from launch.config import load_config
    from launch.loop.trainer import Trainer, train

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i}.txt").write_text("\n".join(world["texts"][i * 15:(i + 1) * 15]))
    run = tmp_path / "run"
    sets = [*FAST, "data.source=text", f"data.path={corpus}", f"data.tokenizer={world['root'] / 'tok.json'}",
            "data.seq_len=32", "run.batch_size=4", "run.max_steps=4", "run.eval_every=0", "log.plot=true",
            "eval.tasks=loco_mc", f"eval.include_path={world['tasks']}", "eval.tasks_every=2"]
    train(load_config([TINY], [*sets, f"run.dir={run}"])[0])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r["tasks/loco_mc/acc"] for r in lines if "tasks/loco_mc/acc" in r}
    assert sorted(scored) == [2, 4] and all(0 <= v <= 1 for v in scored.values())
    assert (run / "loss.png").is_file()
    import matplotlib.pyplot as plt

    from launch.metrics.plots import runs_figure

    fig = runs_figure([run])
    assert [ax.get_title() for ax in fig.axes][-1] == "downstream tasks (lm-eval)"
    assert fig.axes[-1].get_legend().get_texts()[0].get_text() == "loco_mc/acc"
    plt.close(fig)
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--tasks", "loco_mc", "--include-path", world["tasks"],
                 "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tasks"]["tasks"]["loco_mc"]["acc"] == pytest.approx(scored[4], abs=1e-6)
    # only at the end, where the last step's line already holds the validation: a line of their own, and the summary
    end = tmp_path / "end"
    train(load_config([TINY], [*sets, "eval.tasks_every=0", "run.eval_every=2", f"run.dir={end}"])[0])
    lines = [json.loads(x) for x in (end / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "tasks/loco_mc/acc" in r] == [4]
    assert json.loads((end / "summary.json").read_text())["tasks/loco_mc/acc"] == pytest.approx(scored[4])
    with pytest.raises(RunError, match="loco_nope"):
        Trainer(load_config([TINY], [*sets, "eval.tasks=loco_nope", f"run.dir={tmp_path / 'other'}"])[0])
