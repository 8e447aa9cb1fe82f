"""What a run reports: MFU's FLOP count and peak, the progress line's tok/s, byte units."""

from __future__ import annotations

import json
import types

import pytest
import torch

from benchmarks import train_throughput
from launch.metrics.log import Metrics, format_seconds, human_bytes
from launch.metrics.mfu import MFU_RULE, Peak, matmul_precision, mfu_basis, peak_flops, peak_of
from launch.models.transformer import ModelArgs, Transformer, count_params, flops_per_token

H100 = "NVIDIA H100 80GB HBM3"


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256, max_seq_len=64))


@pytest.mark.parametrize("name, precision, label, tflops", [
    (H100, "bf16", "H100", 989),
    (H100, "fp32", "H100", 66.9),
    (H100, "tf32", "H100", 494.7),
    ("NVIDIA H100 PCIe", "bf16", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "bf16", "H100 NVL", 835.5),
    ("NVIDIA H200", "bf16", "H200", 989),
    ("NVIDIA GH200 480GB", "bf16", "GH200", 989),
    ("NVIDIA A100-SXM4-80GB", "bf16", "A100", 312),
    ("NVIDIA A100 80GB PCIe", "fp32", "A100", 19.5),
    ("NVIDIA L4", "bf16", "L4", 121),
    ("NVIDIA L40S", "bf16", "L40S", 362),
    ("NVIDIA A10", "bf16", "A10", 125),
    ("NVIDIA GeForce RTX 4090", "bf16", "RTX 4090", 165.2),
])
def test_datasheet_peaks_by_device_name_and_precision(name, precision, label, tflops):
    assert peak_of(name, precision) == Peak(label, precision, tflops * 1e12)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GeForce RTX 3090 Ti", "Tesla T4", "Some Future GPU"])
def test_unlisted_devices_have_no_peak(name):
    assert peak_of(name, "bf16") is None  # near misses are not taken for their neighbours


def test_no_peak_and_no_mfu_on_a_cpu():
    cpu = torch.device("cpu")
    assert peak_flops(cpu) is None  # no start-up matmul to measure a "peak" with
    mfu = mfu_basis(_model(), 64, cpu, matmul_precision(cpu, bf16=False))
    assert mfu.peak is None and mfu.of(1e6) is None
    assert mfu.describe() == "mfu: not reported: no datasheet peak for cpu"


def test_mfu_counts_6n_plus_attention_against_the_named_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    model = _model()
    cuda = torch.device("cuda")
    mfu = mfu_basis(model, 64, cuda, matmul_precision(cuda, bf16=True))
    assert mfu.flops_per_token == flops_per_token(model, 64)
    weights = count_params(model, non_embedding=True) + 256 * 64  # the output projection multiplies
    assert mfu.weights == weights and mfu.attention_flops == 12 * 2 * 64 * 64
    assert mfu.flops_per_token == 6 * weights + mfu.attention_flops
    assert mfu.of(1e6) == pytest.approx(mfu.flops_per_token * 1e6 / 989e12)
    line = mfu.describe()
    assert line.startswith("mfu: 6N+attention FLOPs per token (6 x ")
    assert line.endswith(" against H100 dense bf16 989 TFLOP/s"), line
    assert str(mfu_basis(model, 64, cuda, "fp32").peak) == "H100 dense fp32 66.9 TFLOP/s"


def test_matmul_precision_follows_autocast_and_tf32(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert matmul_precision(cpu, True) == "bf16" and matmul_precision(cpu, False) == "fp32"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert matmul_precision(cuda, False) == "tf32" and matmul_precision(cpu, False) == "fp32"


def test_benchmark_caption_and_column_use_the_same_count_and_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    mfu = mfu_basis(_model(), 64, torch.device("cuda"), "bf16")
    gpu = {"model": "tiny", "params": 1000, "batch_size": 2, "seq_len": 64, "steps": 3, "tokens_per_s": [1e6] * 3,
           "ms_per_step": [1.0] * 3, "peak_bytes": 2 ** 30, "baseline_bytes": 0, "peak_kind": "x", "device": "cuda",
           "device_name": H100, "torch": "2", "threads": 1, "precision": "bf16 autocast",
           "peak": str(mfu.peak), "mfu_device": mfu.device, "mfu": [mfu.of(1e6)] * 3}
    args = types.SimpleNamespace(data="random", warmup=1, repeats=3)
    text = train_throughput.render([gpu], args, "now", (0.0, 0.0))
    assert f"- MFU: {MFU_RULE} against H100 dense bf16 989 TFLOP/s" in text
    assert text.splitlines()[-1].endswith(f" {100 * mfu.of(1e6):.1f}% |")
    assert "MFU (median)" in text

    cpu = {**gpu, "device": "cpu", "device_name": "x86", "peak": None, "mfu_device": "cpu", "mfu": None}
    text = train_throughput.render([cpu], args, "now", (0.0, 0.0))
    assert "- MFU: not reported: no datasheet peak for cpu" in text and "MFU (median)" not in text
    assert text.splitlines()[-1].endswith("1.0 GiB [+1.0 GiB] |")


def test_human_bytes_names_binary_units():
    assert [human_bytes(n) for n in (512, 1536, 10.7 * 2 ** 20, 2 * 2 ** 30, 3 * 2 ** 40)] == \
        ["512 B", "1.5 KiB", "10.7 MiB", "2.0 GiB", "3.0 TiB"]


def _metrics(tmp_path) -> Metrics:
    log_cfg = types.SimpleNamespace(progress="plain", wandb=False)
    return Metrics(tmp_path, log_cfg, active=True, total_steps=100)


def test_progress_line_shows_a_moving_median_of_tok_s(tmp_path, capsys):
    m = _metrics(tmp_path)
    rates = [1000, 1100, 17000, 900, 300, 1050]
    for i, tps in enumerate(rates):
        m.log({"step": 10 * (i + 1), "loss": 3.0, "lr": 1e-3, "tokens_per_s": tps, "mfu": tps / 1e5})
    m.close()
    lines = capsys.readouterr().err.splitlines()
    shown = [l.split(" | ")[3] for l in lines]  # after "[worker 0 | step N/100] loss" and lr
    assert shown == ["1.0k tok/s", "1.1k tok/s", "1.1k tok/s", "1.1k tok/s", "1.0k tok/s", "1.0k tok/s"]
    assert lines[2].endswith("mfu 1.1%")  # the mfu of the same median, not 17%
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_per_s"] for r in rows] == rates  # the file keeps each interval's own figure


def test_a_record_can_be_written_without_a_progress_line(tmp_path, capsys):
    m = _metrics(tmp_path)
    m.log({"step": 5, "val_loss": 2.5}, show=False)
    m.close()
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 5, "val_loss": 2.5}


def test_plain_progress_lines_say_how_long_is_left(tmp_path, capsys):
    """At the pace of the last lines: a slow machine says how long it still needs (a bar shows its own)."""
    m = _metrics(tmp_path)
    for step, wall in ((10, 5.0), (20, 6.0), (30, 7.0), (40, 14.0)):
        m.log({"step": step, "loss": 3.0, "lr": 1e-3, "wall_s": wall})
    m.close()
    lines = capsys.readouterr().err.splitlines()
    assert "eta" not in lines[0]  # one line: no pace yet
    assert [l.split(" | ")[-1] for l in lines[1:]] == ["eta 8s", "eta 7s", "eta 18s"]  # 60 steps at 0.3 s
    assert format_seconds(59.6) == "1m00s" and format_seconds(3725) == "1h02m"


def test_gpu_sh_reports_a_junit_result_and_keeps_an_earlier_calls_stage_times(tmp_path):
    """benchmarks/gpu.sh's helpers: a pytest result becomes a report whose failures decide the exit code, and a
    run in two calls leaves one record of its stages, but only over a record of the same device."""
    from benchmarks.gpu_tools import record, tests_report

    junit = tmp_path / "r.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok" time="1.5"/>'
                     '<testcase classname="tests.test_a" name="test_bad" time="2"><failure message="assert 1 | 2">'
                     'x</failure></testcase><testcase classname="tests.test_b" name="test_skip" time="0">'
                     '<skipped message="needs a GPU"/></testcase></testsuite></testsuites>')
    out = tmp_path / "report.md"
    assert tests_report(out, junit, "T", "pytest", "cpu", base="- produced by X") == 1
    text = out.read_text()
    assert "| passed | 1 |" in text and "| failure | 1 |" in text and "| needs a GPU | 1 |" in text
    assert "`test_a.py::test_bad` | failure | assert 1 \\| 2 |" in text  # a cell's bar is escaped
    assert tests_report(out, tmp_path / "missing.xml", "T", "pytest", "cpu", base="- produced by X") == 1

    rec = tmp_path / "gpu_sh.md"
    rec.write_text("- produced by `bash benchmarks/gpu.sh` on another card; x\n| old | 9 | full |\n")
    base = "- produced by `bash benchmarks/gpu.sh` on cardA"
    record(rec, ["gpu-tests=100"], ["gpu-tests=pytest -m gpu"], "110", "cpu", False, base)
    assert "| old |" not in rec.read_text()  # another card's stages are not carried on
    record(rec, ["suite=200", "demo=30"], ["suite=pytest"], "240", "cpu", False, base)
    text = rec.read_text()
    assert all(f"| {s} | {n} |" in text for s, n in (("gpu-tests", 100), ("suite", 200), ("demo", 30)))
    assert "`pytest -m gpu` (gpu-tests)" in text and "`pytest` (suite)" in text
