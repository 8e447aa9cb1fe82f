"""Checks that need a CUDA GPU (``pytest -m gpu``): bf16 autocast with exact resume, NCCL with one process, a node
with more processes than GPUs, the simulator with ``--offload``. The kernels on CUDA against their references are
the ``cuda`` cases of tests/test_kernels.py and tests/test_demo.py. Without CUDA all of these are skipped with a
reason (conftest); the device choice they rely on is checked on the CPU at the end of this file."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import FAST, TINY, free_port, run_cli
from launch.store.checkpoint import latest_checkpoint, list_checkpoints
from launch.config import load_config
from launch.metrics.log import read_metrics
from launch.simulate.runner import simulate_once
from launch.errors import RunError
from launch.loop.runtime import check_gpu_share
from launch.loop.trainer import Hooks, train

# FAST names the CPU; a later override wins
ON_GPU = [*FAST, "run.device=cuda", "run.eval_every=0", "run.batch_size=4"]
COMPARED = ("step", "tokens", "loss", "lr", "grad_norm")


def gpu_cfg(run_dir, *overrides: str):
    cfg, _ = load_config([TINY], [*ON_GPU, f"run.dir={run_dir}", *overrides])
    return cfg


def sets(*overrides: str) -> list[str]:
    return [a for s in [*ON_GPU, *overrides] for a in ("--set", s)]


@pytest.mark.gpu
def test_bf16_autocast_on_cuda_resumes_exactly(tmp_path):
    extra = ["run.precision=bf16", "run.max_steps=30", "run.checkpoint_every=10", "log.every=1"]
    reference = train(gpu_cfg(tmp_path / "reference", *extra))

    def interrupt(step, record):
        if step == 15:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(gpu_cfg(tmp_path / "broken", *extra), hooks=Hooks(on_step=interrupt))
    assert list_checkpoints(tmp_path / "broken" / "checkpoints")[0].name == "step_00000015.pt"
    resumed = train(gpu_cfg(tmp_path / "broken", *extra, "run.resume=true"))
    assert resumed["steps"] == 30
    curve = [{k: r.get(k) for k in COMPARED} for r in read_metrics(tmp_path / "broken")]
    want = [{k: r.get(k) for k in COMPARED} for r in read_metrics(tmp_path / "reference")]
    assert curve == want
    _, state = latest_checkpoint(tmp_path / "broken" / "checkpoints")
    assert all(t.device.type == "cpu" for t in state["model"].values())  # checkpoints load anywhere


@pytest.mark.gpu
def test_nccl_with_one_process_equals_one_simulated_worker_on_cuda(tmp_path):
    args = ["--config", TINY, "--max-steps", "8", "--seed", "3",
            *sets("algo.name=diloco", "algo.inner_steps=4", "run.checkpoint_every=8", "sim.baseline=none",
                  "run.deterministic=true")]  # two processes: each would otherwise autotune its own kernels
    sim = run_cli(["simulate", *args, "--workers", "1", "--run-dir", str(tmp_path / "sim")])
    assert sim.returncode == 0, sim.stderr[-3000:]
    real = run_cli(["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    "-m", "launch.cli", "train", *args, "--set", "transport.dist_backend=nccl",
                    "--run-dir", str(tmp_path / "real")], module="torch.distributed.run")
    assert real.returncode == 0, real.stderr[-3000:]
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("sim", "real")]
    assert all(math.isfinite(s["val_loss"]) for s in summaries)
    a, b = (latest_checkpoint(tmp_path / n / "checkpoints")[1]["model"] for n in ("sim", "real"))
    worst = max((float((a[k] - b[k]).abs().max()), k) for k in a)
    assert worst[0] < 1e-5, (worst, [s["val_loss"] for s in summaries])


@pytest.mark.gpu
def test_more_processes_than_gpus_stop_before_any_work(tmp_path):
    procs = torch.cuda.device_count() + 1
    res = run_cli(["--nproc-per-node", str(procs), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   "-m", "launch.cli", "train", "--config", TINY, "--max-steps", "5",
                   *[a for s in FAST[:-1] for a in ("--set", s)], "--run-dir", str(tmp_path / "run")],
                  module="torch.distributed.run", timeout=120)
    assert res.returncode != 0
    # every rank stops with loco's one line (torchrun then adds its own report of the failed ranks)
    assert f"loco train: error: this node starts {procs} processes but has {procs - 1} GPU(s)" in res.stderr
    assert "Duplicate GPU" not in res.stderr and "NCCL error" not in res.stderr
    assert "Traceback" not in "\n".join(line for line in res.stderr.splitlines() if "loco" in line)
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["fp32", "int8", "topk:0.1+int8"])
def test_simulator_offload_on_cuda_changes_nothing(tmp_path, codec, monkeypatch):
    """Parking idle workers in pinned host memory moves bits, not values: equal to the run without it (int8: a
    worker brought back lays its parameters end to end again, see DiLoCo._move; top-k: its error-feedback
    residuals are parked and brought back too, Algorithm.to). With ``algo.offload_outer`` the
    outer step itself runs on the CPU, whose arithmetic differs from the GPU's in the last bits, so that run is
    only close (fp32; int8 may round such a difference to another step of its grid). Small buckets: a worker
    parked at an exchange's first bucket runs the others on the GPU with the pseudo-gradients it began with."""
    from diloco.sim.transport import InProcessTransport

    monkeypatch.setattr(InProcessTransport, "bucket_bytes", 64 << 10)
    common = ["run.max_steps=6", "sim.workers=3", "algo.name=diloco", "algo.inner_steps=3", "sim.baseline=none",
              "run.checkpoint_every=6", f"compress.codec={codec}"]
    runs = {}
    for name, extra in (("plain", []), ("offload", ["sim.offload=true"]),
                        ("outer", ["sim.offload=true", "algo.offload_outer=true"])):
        runs[name] = simulate_once(gpu_cfg(tmp_path / name, *common, *extra))
    assert runs["plain"]["bytes_sent"] == runs["offload"]["bytes_sent"] == runs["outer"]["bytes_sent"]
    states = {n: latest_checkpoint(tmp_path / n / "checkpoints")[1] for n in runs}
    for w in range(3):
        a, b, c = (states[n]["workers"][w] for n in ("plain", "offload", "outer"))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        if codec == "fp32":
            assert all(torch.allclose(a["model"][k].float(), c["model"][k].float(), atol=1e-5) for k in a["model"])
    assert runs["plain"]["val_loss"] == runs["offload"]["val_loss"]
    if codec == "fp32":
        assert abs(runs["plain"]["val_loss"] - runs["outer"]["val_loss"]) < 1e-3


@pytest.mark.gpu
def test_a_published_state_is_copied_to_pinned_memory_without_waiting_and_read_as_it_was(tmp_path):
    """``Trainer.shared_state_later`` on a GPU (what a ``loco join`` peer publishes every round) copies the state
    into pinned host memory without the training thread waiting for it; training goes on at once and changes the
    live tensors, and the bytes made later are still the state as published."""
    import io

    from launch.loop.trainer import Trainer

    trainer = Trainer(gpu_cfg(tmp_path, "algo.name=diloco", "algo.inner_steps=2"))
    try:
        algo = trainer.algo
        with torch.no_grad():
            for g in algo.global_params:
                g.normal_()
        expected = [g.detach().cpu() for g in algo.global_params]
        later = trainer.shared_state_later(epoch=7)
        with torch.no_grad():  # training goes on: queued on the stream after the copies
            for g in algo.global_params:
                g.mul_(3.0).add_(1.0)
        got = torch.load(io.BytesIO(later()), weights_only=True)
        assert got["epoch"] == 7
        assert all(torch.equal(a, b) for a, b in zip(expected, got["global_params"]))
    finally:
        trainer.transport.close()


@pytest.mark.gpu
def test_a_residual_parked_on_the_host_visits_the_gpu_for_one_encode_and_goes_back():
    """A simulated worker parked inside an exchange (``sim.offload``) encodes each bucket on the GPU with its
    residual, which Algorithm.to left in pinned host memory (``Codec.residuals.home``): the residual comes over for the
    encode and goes back, so N parked workers' residuals do not gather on the GPU bucket by bucket. The payload
    and the residual equal those of a codec whose residual never left the GPU."""
    from diloco.compress.codec import make_codec

    stay, parked = make_codec("topk:0.1+int8"), make_codec("topk:0.1+int8")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(100_000, device="cuda", generator=g)
    for codec in (stay, parked):
        codec.encode(x, key="k")
    parked.residuals.home = torch.device("cpu")  # as Algorithm.to(cpu) parks it
    parked.residuals["k"] = parked.residuals["k"].cpu().pin_memory()
    y = torch.randn(100_000, device="cuda", generator=g)
    assert bytes(stay.encode(y, key="k")) == bytes(parked.encode(y, key="k"))
    assert parked.residuals["k"].device.type == "cpu" and parked.residuals["k"].is_pinned()
    assert torch.equal(stay.residuals["k"].cpu(), parked.residuals["k"])


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_simulated_ddp_with_offload_on_cuda_changes_nothing(tmp_path, codec, monkeypatch):
    """DDP's workers are parked at the first bucket of every step's exchange and brought back at its end; the
    gradients stay on the GPU meanwhile (the exchange holds them, off the parameters), so every bucket is reduced
    there, as without offload: the same weights to the bit."""
    from diloco.sim.transport import InProcessTransport

    monkeypatch.setattr(InProcessTransport, "bucket_bytes", 64 << 10)
    common = ["run.max_steps=4", "sim.workers=3", "algo.name=ddp", "sim.baseline=none", "run.checkpoint_every=4",
              f"compress.codec={codec}"]
    runs = {name: simulate_once(gpu_cfg(tmp_path / name, *common, *extra))
            for name, extra in (("plain", []), ("offload", ["sim.offload=true"]))}
    states = {n: latest_checkpoint(tmp_path / n / "checkpoints")[1] for n in runs}
    a, b = states["plain"]["model"], states["offload"]["model"]  # one replica: rank 0 saves it
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert runs["plain"]["val_loss"] == runs["offload"]["val_loss"]


# ---- the device choice, on any machine ------------------------------------------------------------
def test_a_node_with_fewer_gpus_than_processes_is_named_with_the_ways_out():
    check_gpu_share(2, 2)
    with pytest.raises(RunError) as err:
        check_gpu_share(4, 1)
    msg = str(err.value)
    assert "this node starts 4 processes but has 1 GPU(s)" in msg
    for way in ("--nproc-per-node 1", "loco simulate --workers 4", "run.device=cpu", "transport.dist_backend=gloo"):
        assert way in msg


@pytest.mark.gpu
@pytest.mark.parametrize("chain", ["fp32", "bf16", "fp16", "int8", "int4", "topk:0.02+2bit+zstd", "fp32+zstd"])
def test_codecs_on_cuda_decode_all_of_a_payload_larger_than_a_piece_as_the_cpu_does(chain):
    """On a GPU the payload goes to the device once and is checked in one piece: every value must arrive,
    the same as the CPU's piece-by-piece path gives, and a bad value refuses the whole payload before any add."""
    from diloco.compress import CorruptPayload, make_codec, wire
    from diloco.compress.checked import PIECE

    n = 3 * PIECE + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    payload = bytes(make_codec(chain).encode(x.cuda()))
    assert payload == bytes(make_codec(chain).encode(x))  # the same bytes from either device
    codec = make_codec(chain)
    want = codec.decode(payload, expect_numel=n)
    assert torch.equal(codec.decode(payload, expect_numel=n, device="cuda").cpu(), want)
    acc = torch.ones(n, device="cuda")
    codec.decode_accumulate_(payload, acc, 0.5)
    ref = torch.ones(n)
    codec.decode_accumulate_(payload, ref, 0.5)
    assert torch.equal(acc.cpu(), ref)
    if chain in ("fp32", "bf16", "fp16"):  # a NaN in the last value: refused, nothing added
        body = bytearray(payload[wire.parse_header(payload, n).offset:])
        size = len(body) // n
        body[-size:] = torch.tensor([math.nan], dtype={2: torch.bfloat16 if chain == "bf16" else torch.float16,
                                                        4: torch.float32}[size]).view(torch.uint8).numpy().tobytes()
        bad = wire.pack(body, torch.float32, (n,), codec.chain)
        before = acc.clone()
        with pytest.raises(CorruptPayload, match="NaN or Inf"):
            codec.decode_accumulate_(bad, acc, 0.5)
        assert torch.equal(acc, before)


@pytest.mark.gpu
def test_tiles_on_cuda_send_the_cpus_bytes_and_keep_its_residuals():
    """SparseLoCo's tiles on a GPU: the Triton top-k on power-of-two tiles, the reference on the others (50 x 64,
    1-wide), the residual kept in tile order; two rounds of error feedback give the CPU's bytes and state."""
    from diloco.compress import make_codec

    shapes = [(192, 320), (320,), (100, 64), (37,)]
    n = sum(math.prod(s) for s in shapes)
    cpu, gpu = (make_codec("topk:k=64,tile=64,ef=0.95+2bit") for _ in range(2))
    for r in range(2):
        x = torch.randn(n, generator=torch.Generator().manual_seed(r))
        payload = bytes(cpu.encode(x, key="b", shapes=shapes))
        assert bytes(gpu.encode(x.cuda(), key="b", shapes=shapes)) == payload
    assert torch.equal(gpu.state_dict()["residuals"]["b"].cpu(), cpu.state_dict()["residuals"]["b"])
    acc, ref = torch.ones(n, device="cuda"), torch.ones(n)
    gpu.decode_accumulate_(payload, acc, 0.5, shapes=shapes)
    cpu.decode_accumulate_(payload, ref, 0.5, shapes=shapes)
    assert torch.equal(acc.cpu(), ref)
