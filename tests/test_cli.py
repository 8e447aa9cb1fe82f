"""The ``loco`` command: help texts, user errors (one line, status 2, no traceback), small commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli.commands import EXAMPLES, build_parser, main
from conftest import child_env

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
COMMANDS = ["train", "simulate", "join", "sample", "plot", "status", "plan"]


def run_module(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "100"
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def help_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.strip()
    return out


def undocumented_options(text: str) -> list[str]:
    """Entries of the option/argument sections of an argparse help text that have no explanation."""
    lines = text.splitlines()
    missing = []
    in_section = False
    for i, line in enumerate(lines):
        if re.match(r"^\S.*:$", line):  # "options:", "configuration:", "positional arguments:", "examples:"
            in_section = not line.startswith(("examples", "quick start", "usage"))
            continue
        if not in_section or not re.match(r"^  \S", line):
            continue
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2 and parts[1].strip():
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        indent = len(nxt) - len(nxt.lstrip())
        if nxt.strip() and indent > 2 and not nxt.strip().startswith("-"):
            continue
        missing.append(line.strip())
    return missing


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


# ---------------------------------------------------------------------------------------------
# help
# ---------------------------------------------------------------------------------------------

def test_top_level_help_subprocess():
    proc = run_module("--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("usage: loco")
    for cmd in COMMANDS:
        assert re.search(rf"^\s+{cmd}\s+\S", out, re.M), f"{cmd} is not listed with an explanation"
    assert "quick start:" in out and "loco train --config configs/tiny.yaml" in out
    assert undocumented_options(out) in ([], ["COMMAND"])  # COMMAND is explained by the command list under it
    assert proc.stderr == ""


def test_top_level_help_in_process(capsys):
    out = help_of(capsys)
    for cmd in COMMANDS:
        assert cmd in out
    assert "-h, --help" in out


def test_no_command_prints_help_and_returns_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "usage: loco" in out and "train" in out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help(capsys, cmd):
    out = help_of(capsys, cmd)
    assert out.startswith(f"usage: loco {cmd}")
    assert undocumented_options(out) == []
    assert "\nexamples:\n" in out
    examples = out.split("\nexamples:\n", 1)[1]
    assert f"loco {cmd}" in examples or f"-m launch.cli {cmd}" in examples
    assert EXAMPLES[cmd].split("\n", 1)[1].splitlines()[0].strip() in examples


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_argument_has_help(cmd):
    """The same check on the parser itself, independent of how argparse wraps the text."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for choice in sub._choices_actions:
        assert choice.help, f"command {choice.dest} has no help"
    p = sub.choices[cmd]
    for action in p._actions:
        assert action.help and len(action.help) > 5, f"loco {cmd} {action.option_strings or action.dest}: no help"


@pytest.mark.parametrize("cmd", ["train", "simulate", "join"])
def test_training_commands_share_config_flags(capsys, cmd):
    out = help_of(capsys, cmd)
    for flag in ("--config FILE", "--set KEY=VALUE", "--run-dir DIR", "--max-steps N", "--max-time DURATION",
                 "--seed N", "--resume", "--help-config"):
        assert flag in out, f"{flag} missing from loco {cmd} --help"


def test_help_config_lists_keys(capsys):
    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert "optim:" in out and "run:" in out and "model:" in out
    optim = out.split("optim:\n", 1)[1].split("\nalgo:", 1)[0]
    for key in ("lr", "betas", "eps", "weight_decay", "warmup_steps", "schedule", "grad_clip"):
        assert re.search(rf"^  {key}: ", optim, re.M), f"optim.{key} not listed"
    assert "Peak learning rate of the inner optimizer" in optim
    assert "  lr: 0.0004" in optim
    assert "  max_time: None" in out


def test_help_config_shows_the_resolved_value_beside_the_default(capsys):
    assert main(["train", "--help-config", "--config", "tiny", "--set", "optim.lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  lr: 0.0004 +\(this config: 0.001\)$", out, re.M)
    assert re.search(r"^  betas: \(0.9, 0.95\)$", out, re.M)  # equal to the default: nothing beside it


def test_help_config_does_not_need_a_valid_config(capsys):
    # a broken override still lists every key with its default, and says in one line it was not applied
    assert main(["simulate", "--help-config", "--set", "optim.lr=fast"]) == 0
    out, err = capsys.readouterr()
    assert "optim:" in out and "this config" not in out
    assert err.count("\n") == 1 and "could not be applied: --set optim.lr=fast" in err


def test_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["fly"])
    assert info.value.code == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# user errors
# ---------------------------------------------------------------------------------------------

def test_bad_override_subprocess_one_line_no_traceback(tmp_path):
    proc = run_module("train", "--config", TINY, "--set", "optim.lr=fast", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("loco train: error: --set optim.lr=fast: optim.lr: ")
    assert "expected a number" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started


def test_unknown_key_subprocess(tmp_path):
    proc = run_module("train", "--set", "optim.lrr=1")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "unknown key 'optim.lrr'" in lines[0] and "did you mean 'lr'" in lines[0]


def test_missing_config_file_in_process(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"
    assert main(["train", "--config", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"loco train: error: {missing}: config file not found"


@pytest.mark.parametrize("cmd", ["train", "simulate"])
def test_resume_of_a_folder_without_a_run_names_it(capsys, tmp_path, cmd):
    """A mistyped --run-dir with --resume must not start a new run with the default settings."""
    missing, empty = tmp_path / "runs" / "mien", tmp_path / "empty"
    empty.mkdir()
    for folder, why in ((missing, "does not exist"), (empty, "has no config.yaml")):
        for flag in ("--resume", "--restart"):
            assert main([cmd, "--run-dir", str(folder), flag]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"loco {cmd}: error: {folder}: no run to continue there" in err, err
            assert why in err and f"without {flag}" in err
    assert not missing.exists() and list(empty.iterdir()) == [], "nothing may be written"


@pytest.mark.parametrize("cmd", ["train", "simulate"])
def test_a_model_too_large_for_memory_is_one_line(capsys, tmp_path, cmd):
    """Not an allocator traceback: the parameter count, the bytes it needs and what the device has."""
    run = tmp_path / "run"
    assert main([cmd, "--config", TINY, "--set", "model.dim=100000000", "--set", "run.device=cpu",
                 "--run-dir", str(run), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "parameters and needs at least" in lines[0] and "cpu has" in lines[0] and "model.dim" in lines[0]
    assert not list(run.glob("checkpoints/*.pt"))


WITHOUT = """import sys
for name in {hidden!r}:
    sys.modules[name] = None  # as on a machine where the package is not installed
from launch.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("hidden, argv, extra, feature", [
    ("hivemind", ["join", "--config", TINY], "swarm", "loco join"),
    ("wandb", ["train", "--config", TINY, "--max-steps", "1", "--set", "log.wandb=true"], "wandb", "log.wandb=true"),
])
def test_a_missing_extra_is_one_line_naming_the_pip_install(tmp_path, hidden, argv, extra, feature):
    """`pip install loco` holds train and simulate; swarm, wandb and hf are extras, each named when missing."""
    code = WITHOUT.format(hidden=[hidden], argv=[*argv, "--run-dir", str(tmp_path / "run")])
    env = child_env(OMP_NUM_THREADS="1", WANDB_MODE="offline")  # the caller's PYTHONPATH kept: where packages may lie
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"loco {argv[0]}: error: {feature} needs the {hidden} package")
    assert lines[0].endswith(f'pip install "loco[{extra}]"')


def test_train_and_simulate_import_no_extra(tmp_path):
    """The core commands run with hivemind, wandb, datasets and Triton all absent."""
    code = WITHOUT.format(hidden=["hivemind", "wandb", "datasets", "triton"],
                          argv=["simulate", "--config", TINY, "--max-steps", "2", "--workers", "2", "--baseline",
                                "none", "--set", "algo.name=diloco", "--set", "algo.inner_steps=1",
                                "--set", "compress.codec=int8", "--set", "run.device=cpu",
                                "--run-dir", str(tmp_path / "run")])
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()


def test_resume_and_restart_exclude_each_other(capsys, tmp_path):
    assert main(["train", "--run-dir", str(tmp_path), "--resume", "--restart"]) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_bad_max_time_flag_names_the_flag(capsys):
    assert main(["train", "--max-time", "soon"]) == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1
    assert "--max-time: run.max_time: 'soon' is not a duration" in lines[0]


def test_bad_max_steps_type_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--max-steps", "many"])
    assert info.value.code == 2
    assert "--max-steps" in capsys.readouterr().err


def test_bad_yaml_file_in_process(capsys, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("run:\n  batch_size: 10\n  grad_accum: 3\n")
    assert main(["train", "--config", str(path)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1
    assert lines[0] == f"loco train: error: {path}: run.grad_accum: 3 does not divide run.batch_size=10"


@pytest.mark.parametrize("argv, expected", [
    (["join", "--config", TINY, "--set", "algo.name=streaming"], "loco join runs algo.name=diloco"),
    (["join", "--config", TINY, "--run", "a.b"], "--run: run name 'a.b'"),
    (["join", "--config", TINY, "--run-key-file", "/nonexistent/key"], "--run-key-file /nonexistent/key: no such file"),
    (["join", "--config", TINY, "--norm-clip", "-1"], "--norm-clip -1: a factor of at least 0"),
    (["join", "--config", TINY, "--weight-clip", "0.5"], "--weight-clip 0.5: a factor of at least 1"),
    (["status"], "loco status needs --peers MULTIADDR"),
])
def test_swarm_commands_name_bad_input(capsys, argv, expected):
    assert main(argv) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"loco {argv[0]}: error: {expected}"), lines


@pytest.mark.parametrize("cmd", ["simulate", "join"])
def test_commands_check_the_config_first(capsys, cmd):
    assert main([cmd, "--set", "optim.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and "expected a number" in err


def test_plot_without_metrics_names_the_folder(capsys, tmp_path):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    out = tmp_path / "x.png"
    assert main(["plot", str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1
    assert lines[0].startswith("loco plot: error: ")
    assert str(empty) in lines[0] and "metrics.jsonl" in lines[0]
    assert not out.exists()


def test_plot_writes_png(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "tokens": 100 * s, "loss": 5.0 - 0.1 * s, "bytes_sent": 0} for s in range(1, 6)]
    rows.append({"step": 5, "tokens": 500, "val_loss": 4.6, "bytes_sent": 0})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "los'  # a torn last line is skipped
    (run / "metrics.jsonl").write_text(text)
    out = tmp_path / "plots" / "loss.png"
    assert main(["plot", str(run), "--out", str(out), "--title", "t"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_missing_checkpoint(capsys, tmp_path):
    missing = tmp_path / "nope.pt"
    assert main(["sample", "--checkpoint", str(missing)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(missing) in lines[0] and lines[0].startswith("loco sample: error: ")


def test_sample_folder_without_checkpoint(capsys, tmp_path):
    assert main(["sample", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: no valid checkpoint found" in err


def test_sample_corrupt_checkpoint(capsys, tmp_path):
    bad = tmp_path / "step_00000001.pt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["sample", "--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(bad) in err and "unreadable" in err


def test_sample_requires_checkpoint_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sample"])
    assert info.value.code == 2
    assert "--checkpoint" in capsys.readouterr().err


def _save_tiny_checkpoint(folder: Path, with_args: bool = True, tokenizer: bool = True) -> None:
    import torch

    from launch.store.checkpoint import save_checkpoint
    from launch.models.transformer import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=256, max_seq_len=64)
    model = Transformer(args)
    save_checkpoint(folder / "checkpoints", 1, {"model": model.state_dict(),
                                                  "model_args": vars(args) if with_args else None,
                                                  "tokenizer": "bytes" if tokenizer else None})


def test_sample_from_run_folder(capsys, tmp_path):
    _save_tiny_checkpoint(tmp_path)
    argv = ["sample", "--checkpoint", str(tmp_path), "--prompt", "def ", "--max-new-tokens", "8",
            "--temperature", "0", "--device", "cpu"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert first.startswith("def ")
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # greedy: same text again


def test_sample_custom_model_checkpoint(capsys, tmp_path):
    _save_tiny_checkpoint(tmp_path, with_args=False)
    assert main(["sample", "--checkpoint", str(tmp_path), "--device", "cpu"]) == 2
    assert "custom model" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--prompt", "def f"], "trained on token ids (data.source=shards), so --prompt is ids separated by spaces"),
    (["--prompt", "3 999"], "--prompt: token id 999 is outside this model's vocabulary of 256"),
    (["--prompt", "3", "--device", "gpu"], "device 'gpu' is not one: auto, cpu, cuda or cuda:N"),
])
def test_sample_names_a_prompt_or_device_it_cannot_take(capsys, tmp_path, argv, expected):
    """A text prompt for a model trained on token ids, an id past the vocabulary, a device torch does not know:
    one line each. They were a ValueError, an IndexError (a device assert on CUDA) and a RuntimeError."""
    _save_tiny_checkpoint(tmp_path, tokenizer=False)
    assert main(["sample", "--checkpoint", str(tmp_path), "--max-new-tokens", "2", *argv]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("loco sample: error: ") and expected in lines[0], lines


def test_a_config_that_is_not_text_or_a_run_folder_that_cannot_be_made_is_one_line(capsys, tmp_path):
    binary = tmp_path / "step_00000001.pt"
    binary.write_bytes(b"PK\x03\x04\xff\xfe\x00\x81 not yaml")
    assert main(["train", "--config", str(binary)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{binary}: not a YAML text file (not UTF-8)" in lines[0], lines
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["train", "--config", TINY, "--run-dir", str(blocker / "run"), "--set", "data.max_docs=20"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{blocker / 'run'}: the run folder cannot be made" in lines[0], lines


def test_help_checker_flags_an_option_without_explanation():
    import argparse

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--documented", help="does things")
    p.add_argument("--bare")
    p.add_argument("--a-very-long-option-name-that-wraps", metavar="SOMETHING_LONG", help="explained below")
    assert undocumented_options(p.format_help()) == ["--bare BARE"]


@pytest.mark.parametrize("flag, value, expected", [
    ("--top-k", "-3", "--top-k -3: a count of at least 0"),
    ("--temperature", "-1", "--temperature -1: at least 0"),
    ("--max-new-tokens", "-2", "--max-new-tokens -2: a count of at least 0"),
])
def test_sample_flags_out_of_range_are_one_line(capsys, tmp_path, flag, value, expected):
    """Refused before the checkpoint loads (a negative top-k was torch's own RuntimeError)."""
    _save_tiny_checkpoint(tmp_path)
    assert main(["sample", "--checkpoint", str(tmp_path), "--device", "cpu", flag, value]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("loco sample: error: ") and expected in lines[0], lines


@pytest.mark.parametrize("content, expected", [
    (b"", "unreadable (an empty file)"),
    (bytes(range(256)) * 8, "unreadable (not a torch checkpoint (no zip archive), 2,048 bytes)"),
])
def test_empty_or_random_checkpoint_is_one_line_without_torchs_text(capsys, tmp_path, content, expected):
    bad = tmp_path / "step_00000003.pt"
    bad.write_bytes(content)
    assert main(["sample", "--checkpoint", str(bad)]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{bad}: {expected}" in lines[0], lines
    assert "mmap" not in lines[0] and "_use_new_zipfile_serialization" not in lines[0]


def test_plot_of_metrics_that_are_not_utf8_draws_the_lines_that_read(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "tokens": 100 * s, "loss": 5.0 - 0.1 * s, "bytes_sent": 0} for s in range(1, 6)]
    good = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (run / "metrics.jsonl").write_bytes(good[:60] + b"\xff\xfe\x80garbage\n" + good)
    out = tmp_path / "loss.png"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "tiny", "--workers", "4", "--links", "configs/links-home-uplink.csv", "--bandwidth", "1Gbit"],
    ["plan", "--model", "tiny", "--workers", "4", "--links", "configs/links-home-uplink.csv", "--latency", "5ms"],
    ["simulate", "--links", "configs/links-home-uplink.csv", "--bandwidth", "1Gbit", "--max-steps", "1"],
])
def test_links_beside_bandwidth_or_latency_is_refused_alike(capsys, argv):
    """--links gives every link: simulate used to take it over --bandwidth and plan the other way, silently."""
    assert main(argv) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "--links configs/links-home-uplink.csv gives every worker's bandwidth" in lines[0], lines
    assert "would be unused" in lines[0]


def test_dry_run_says_what_would_run_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "run"
    assert main(["train", "--config", TINY, "--dry-run", "--run-dir", str(folder), "--set", "optim.lr=1e-3",
                 "--set", "data.max_docs=40", "--set", "run.shard=none"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dry run: nothing is trained or written")
    assert "  optim.lr = 0.001" in out and "model: 0.89M parameters, loco's Transformer (tiny)" in out
    assert "windows of 128" in out.split("validation: ")[1] and "2,048 tokens a step a worker" in out
    assert "a process holds: parameters 3.4 MiB" in out
    assert not folder.exists()
