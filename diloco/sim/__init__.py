"""Simulate N workers on one device: in-process transport, heterogeneous speeds, network-time model."""

from diloco.sim.group import InProcessGroup, run_workers
from diloco.sim.network import NetworkModel
from diloco.sim.speeds import parse_speeds, resolve_speeds, sample_speeds
from diloco.sim.transport import InProcessTransport
from diloco.sim.units import parse_bandwidth

__all__ = ["InProcessGroup", "InProcessTransport", "NetworkModel", "parse_bandwidth", "parse_speeds",
           "resolve_speeds", "run_workers", "sample_speeds"]
