"""Model FLOPs utilisation, counted one way for the trainer's log and ``benchmarks/train_throughput.py`` alike
(:func:`mfu_basis`): 6N+attention FLOPs per token against the device's datasheet peak at the run's precision.
CPUs and unlisted devices have no peak, and so no MFU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from launch.metrics.log import count_label

# Datasheet peaks of accelerators, in TFLOP/s without sparsity, by the precision the matmuls run in: bf16
# (autocast), tf32 (fp32 tensors under torch.set_float32_matmul_precision("high"), which allow_tf32 also sets)
# and fp32. The first pattern found in the device's name wins, so variants come before their family. A device
# that is not listed, or a CPU, has no peak: no MFU is reported for it rather than a guess.
_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"\bGH200\b", "GH200", {"bf16": 989, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH200 NVL\b", "H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60}),
    (r"\bH200\b", "H200", {"bf16": 989, "tf32": 494.7, "fp32": 66.9}),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", {"bf16": 756.5, "tf32": 378, "fp32": 51.2}),
    (r"\bH100 NVL\b", "H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60}),
    (r"\bH100\b", "H100", {"bf16": 989, "tf32": 494.7, "fp32": 66.9}),
    (r"\bB200\b", "B200", {"bf16": 2250}),
    (r"\bA100\b", "A100", {"bf16": 312, "tf32": 156, "fp32": 19.5}),
    (r"\bL40S\b", "L40S", {"bf16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", "L4", {"bf16": 121, "tf32": 60, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"\bRTX 4090\b", "RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"\bRTX 3090\b(?! Ti)", "RTX 3090", {"bf16": 71, "tf32": 35.6, "fp32": 35.6}),
    (r"\bMI300X\b", "MI300X", {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
)


@dataclass(frozen=True)
class Peak:
    """A datasheet peak: ``H100 dense bf16 989 TFLOP/s``."""

    device: str
    precision: str  # bf16 | tf32 | fp32
    flops: float  # FLOP/s

    def __str__(self) -> str:
        return f"{self.device} dense {self.precision} {self.flops / 1e12:g} TFLOP/s"


def matmul_precision(device: torch.device, bf16: bool) -> str:
    """The precision a run's matmuls use: bf16 under autocast; fp32 ones run as tf32 on CUDA where torch allows it."""
    if bf16:
        return "bf16"
    if device.type == "cuda":
        return {"high": "tf32", "medium": "bf16"}.get(torch.get_float32_matmul_precision(), "fp32")
    return "fp32"


def peak_of(name: str, precision: str = "bf16") -> Optional[Peak]:
    """The datasheet peak of the accelerator named ``name`` (``torch.cuda.get_device_name``) at ``precision``;
    None for a device or precision the table does not list."""
    for pattern, label, peaks in _PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            tflops = peaks.get(precision)
            return Peak(label, precision, tflops * 1e12) if tflops else None
    return None


def device_peak(device: torch.device, precision: str = "bf16") -> Optional[Peak]:
    """The peak of a CUDA (or ROCm) device from the table; None for CPUs and unlisted devices."""
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device), precision)


def peak_flops(device: torch.device, precision: str = "bf16") -> Optional[float]:
    """FLOP/s of :func:`device_peak`, or None."""
    peak = device_peak(device, precision)
    return peak.flops if peak is not None else None


def flop_label(x: float) -> str:
    """``7.9 MFLOP``, ``1.2 GFLOP``."""
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {prefix}FLOP"
    return f"{x:.3g} FLOP"


# the FLOP count MFU uses, in words (launch.models.transformer.flops_per_token computes it)
MFU_RULE = ("6N+attention FLOPs per token (N: the weights that multiply, the output projection included and the "
            "embedding lookup not; attention: 12 x layers x dim x seq_len, as in PaLM's appendix B)")


@dataclass(frozen=True)
class Mfu:
    """How model FLOPs utilisation is counted for one model on one device. The trainer's log and
    ``benchmarks/train_throughput.py`` both take it from :func:`mfu_basis`, so they count the same way.

    MFU = ``flops_per_token`` x tokens/s of one device / ``peak.flops``. Without a datasheet peak (CPUs, unlisted
    devices) there is no MFU: ``of`` returns None and nothing prints one.
    """

    flops_per_token: float
    weights: float  # N of 6N
    attention_flops: float  # per token
    seq_len: int
    peak: Optional[Peak]
    device: str  # what ran: "cpu", "NVIDIA H100 80GB HBM3"

    def of(self, tokens_per_s: Optional[float]) -> Optional[float]:
        if self.peak is None or not tokens_per_s:
            return None
        return self.flops_per_token * tokens_per_s / self.peak.flops

    def count(self) -> str:
        """This model's count: ``6N+attention FLOPs per token (6 x 1.05M weights + 2.36 MFLOP attention at
        seq_len 256 = 8.66 MFLOP)``."""
        six_n = f"6 x {count_label(self.weights)} weights"
        if not self.attention_flops:
            return f"6N FLOPs per token ({six_n} = {flop_label(self.flops_per_token)})"
        return (f"6N+attention FLOPs per token ({six_n} + {flop_label(self.attention_flops)} attention at seq_len "
                f"{self.seq_len} = {flop_label(self.flops_per_token)})")

    def describe(self) -> str:
        """One line for a log: which FLOP count against which peak, or why there is no MFU."""
        if self.peak is None:
            return f"mfu: not reported: no datasheet peak for {self.device}"
        return f"mfu: {self.count()} against {self.peak}"


def mfu_basis(model: torch.nn.Module, seq_len: int, device: torch.device, precision: str = "bf16") -> Mfu:
    """The one place MFU's FLOP count and peak come from (see :class:`Mfu`); ``precision`` as
    :func:`matmul_precision` gives it."""
    from launch.models.transformer import flops_per_token

    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module counts as the module it wraps
    total = flops_per_token(model, seq_len)
    six_n = flops_per_token(model, 0)  # no context: the attention term is zero
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return Mfu(flops_per_token=total, weights=six_n / 6, attention_flops=total - six_n, seq_len=seq_len,
               peak=device_peak(device, precision), device=name)
