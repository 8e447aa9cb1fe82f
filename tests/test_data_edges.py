"""Edges of the data commands: a killed prepare takes its workers with it, an --out inside --path is refused,
a BPE run says how far its encoding at start is and counts tokens, the BPE recipe runs end to end, and Ctrl-C
while loco starts is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}


def _sigint_as_at_a_terminal() -> None:
    """In the child: SIGINT at its default, which a suite started as a shell's background job hands over ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            out.add(int(entry.name))
    return out


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def _until(check, seconds: float):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if value := check():
            return value
        time.sleep(0.02)
    return check()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_prepare_takes_its_pool_workers_with_it(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    line = "def worker(pool): return pool.queue.get() # a line of text for the pool\n"
    for i in range(400):
        (text / f"doc{i:04d}.txt").write_text(line * 200)  # 400 documents, 5.6 MB: a few seconds in small units
    proc = subprocess.Popen([sys.executable, "-m", "launch", "data", "prepare", "--source", "text", "--path",
                             str(text), "--tokenizer", "bytes", "--out", str(tmp_path / "shards"), "--shard-mb",
                             "0.02", "--workers", "2"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        workers = _until(lambda: c if len(c := _children(proc.pid)) >= 2 else None, 60)
        assert workers and proc.poll() is None, "the pool never came up while prepare ran"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _until(lambda: not _alive(workers), 5)
        assert not _alive(workers), f"workers {sorted(_alive(workers))} outlived their killed parent"
    finally:
        proc.kill()
        for pid in _alive(workers):
            os.kill(pid, signal.SIGKILL)


def test_an_out_inside_path_is_refused_in_one_line(tmp_path, capsys):
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("some text\n" * 20)
    for out in (text / "shards", text):
        assert main(["data", "prepare", "--source", "text", "--path", str(text), "--tokenizer", "bytes",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"--out {out} is inside --path {text}" in err
    assert not (text / "shards").exists() and sorted(p.name for p in text.iterdir()) == ["a.txt"]


def test_ctrl_c_while_loco_imports_is_one_line_and_elsewhere_a_keyboard_interrupt(tmp_path):
    # the handler is in place once the entry point is imported, before any command imports torch
    probe = ("import signal, sys; import launch.cli; "
             "print(signal.getsignal(signal.SIGINT) is launch.cli._interrupted, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60,
                         preexec_fn=_sigint_as_at_a_terminal)
    assert out.stdout.split() == ["True", "False"], out.stderr
    # a Ctrl-C that lands inside an import (as inside torch's): one line, the shell's 130, no traceback
    (tmp_path / "heavy.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
                                       "for _ in range(10 ** 8):\n    pass\n")
    run = [sys.executable, "-c", f"import sys; sys.argv[1:] = ['train']; import launch.cli; "
                                 f"sys.path.insert(0, {str(tmp_path)!r}); import heavy"]
    out = subprocess.run(run, env=_env(), capture_output=True, text=True, timeout=60,
                         preexec_fn=_sigint_as_at_a_terminal)
    assert (out.returncode, out.stderr) == (130, "loco train: stopped by the user (Ctrl-C)\n")
    # anywhere else it is still a KeyboardInterrupt, which each command handles as before
    caught = ("import os, signal, launch.cli\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
              "    for _ in range(10 ** 8):\n        pass\nexcept KeyboardInterrupt:\n    print('caught')\n")
    out = subprocess.run([sys.executable, "-c", caught], env=_env(), capture_output=True, text=True, timeout=60,
                         preexec_fn=_sigint_as_at_a_terminal)
    assert out.stdout == "caught\n", out.stderr


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    from launch.data.tokenizer import train_bpe
    from test_tokens import _write_corpus

    root = tmp_path_factory.mktemp("bpe")
    train_bpe(_write_corpus(root / "text", 40), 320, root / "tok.json", say=lambda m: None)
    return str(root / "tok.json")


def test_encoding_a_large_text_at_start_shows_progress_and_counts_tokens(bpe, monkeypatch, capsys):
    from launch.config.schema import DataConfig
    from launch.data import batches
    from launch.data.python_corpus import load_python
    from launch.data.ticker import Ticker

    monkeypatch.setattr(batches, "LARGE_TEXT", 0)  # every text is large here
    monkeypatch.setattr(batches, "ENCODE_BYTES", 20_000, raising=False)  # a look at the progress line every 20 kB
    monkeypatch.setattr(Ticker, "due", lambda self: 1.0)  # and a line due at every look
    raw = load_python(DataConfig().val_fraction, 6)
    size = raw.train_tokens + raw.val_tokens  # bytes
    data = batches.load_data(DataConfig(source="python", max_docs=6, tokenizer=bpe, seq_len=32))
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"encoding {size / 1e6:,.0f} MB of text with ")
    assert len([line for line in err if line.startswith("encoding: ")]) >= 2
    assert err[-1].startswith(f"encoded {size / 1e6:,.0f} MB of text into {data.train_tokens:,} train / "
                              f"{data.val_tokens:,} val tokens")
    # the start line's counts are tokens, and no byte count in the description is called tokens
    assert 0 < data.train_tokens + data.val_tokens < size and f"{size:,} tokens" not in data.description


def test_the_readme_bpe_recipe_runs_on_small_data(monkeypatch, tmp_path, capsys):
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```bash\nloco tokenizer train --data python"):]
    recipe = [line.split()[1:] for line in block[len("```bash\n"):block.index("```", 3)].splitlines()]
    assert [r[:2] for r in recipe] == [["tokenizer", "train"], ["data", "prepare"], ["train", "--config"]]
    tiny = [["--max-docs", "40", "--vocab-size", "300"], ["--max-docs", "40", "--workers", "1"],
            ["--max-steps", "2", "--run-dir", "run", *[a for kv in ("model.size=tiny", "data.seq_len=32",
             "run.batch_size=4", "eval.tokens=256", "log.plot=false", "log.progress=plain", "run.threads=1",
             "run.device=cpu") for a in ("--set", kv)]]]
    monkeypatch.chdir(tmp_path)  # the recipe's paths are relative to where loco runs
    recipe[2][recipe[2].index("--config") + 1] = str(ROOT / recipe[2][recipe[2].index("--config") + 1])
    for args, small in zip(recipe, tiny):
        assert main(args + small) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert "token shards data/python-8k" in out.out + out.err and "encoding" not in out.err
