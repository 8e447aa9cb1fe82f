"""A network lab for tests: hosts in Linux network namespaces, made and removed by the test itself.

The lab is one switch (a bridge in a namespace of its own) on the "internet", 10.77.0.0/24. A host is a
namespace with a program's view of one machine:

- ``public(name)``: a host with an address on the internet, reachable by everyone;
- ``behind_nat(name)``: a host on a private network (192.168.k.0/24) behind a router of its own that
  masquerades its connections (iptables MASQUERADE): it reaches the internet, nobody reaches it;
- ``far(name, delay_s, rate_bps)``: a public host whose link to the switch is a delay line, a program that
  carries every packet between two TUN devices after the link's one-way delay and at its rate, dropping what
  a router's buffer would not hold. This kernel has no netem, so latency is made here.

``cut(name)`` takes a host's link to the switch down (its TCP connections stall, as on a partition: nothing
is reset) and ``heal(name)`` brings it back. ``run(name, argv)`` starts a program in a host, as
``ip netns exec`` does.

Run as a script, this file is the delay line (``python netlab.py wire ...``), started by :meth:`Lab.far`.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from typing import Optional, Sequence

SWITCH = "10.77.0"
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
    return out


def _in(ns: str, *argv: str) -> None:
    out = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"in {ns}: {' '.join(argv)}: {out.stderr.strip()}")


def unavailable(nat: bool = False) -> Optional[str]:
    """Why no lab can be built on this machine (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    if nat and shutil.which("iptables") is None:
        return "iptables is not installed (Debian's iptables package; .ci/run installs it as root)"
    name = f"lcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Lab:
    """Namespaces named ``<tag><host>``; everything is removed on :meth:`close` (and at exit of a `with`)."""

    def __init__(self) -> None:
        self.tag = f"lc{os.getpid() % 100000}"
        self.hosts: dict[str, str] = {}      # host -> its address on the switch (or behind its NAT)
        self.ports: dict[str, str] = {}      # host -> its switch port (in the switch namespace)
        self.routers: list[str] = []         # namespaces that are not hosts: NAT routers, far gateways
        self.routes: list[tuple[str, str]] = []  # (subnet, via) every host on the switch must know
        self.on_switch: list[str] = []       # namespaces with an address on the switch
        self.wires: list[subprocess.Popen] = []
        self.procs: list[subprocess.Popen] = []
        self._n = 0
        self.switch = self.tag + "sw"
        self._netns("add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)

    # ---- building ---------------------------------------------------------------------------------
    def _netns(self, verb: str, name: str) -> None:
        _ip("netns", verb, name, check=verb == "add")
        if verb == "add":
            _ip("link", "set", "lo", "up", ns=name)

    def _plug(self, ns: str, addr: str) -> str:
        """A veth from ``ns`` (eth0, ``addr``/24) to a port of the switch; the port's name."""
        self._n += 1
        port = f"p{self._n}"
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
        _ip("link", "set", port, "master", "br0", "up", ns=self.switch)
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        for subnet, via in self.routes:
            _ip("route", "add", subnet, "via", via, ns=ns)
        self.on_switch.append(ns)
        return port

    def ns(self, host: str) -> str:
        return self.tag + host

    def public(self, host: str) -> str:
        """A host on the internet; its address."""
        ns, addr = self.ns(host), f"{SWITCH}.{len(self.hosts) + 1}"
        self._netns("add", ns)
        self.ports[host] = self._plug(ns, addr)
        self.hosts[host] = addr
        return addr

    def behind_nat(self, host: str) -> str:
        """A host behind a masquerading router of its own; its private address."""
        k = len(self.routers) + 1
        router, ns = self.ns(f"r{k}"), self.ns(host)
        self._netns("add", router)
        self.routers.append(router)
        self.ports[host] = self._plug(router, f"{SWITCH}.{100 + k}")
        self._netns("add", ns)
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", "lan0", "netns", router)
        _ip("addr", "add", f"192.168.{k}.1/24", "dev", "lan0", ns=router)
        _ip("link", "set", "lan0", "up", ns=router)
        addr = f"192.168.{k}.2"
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("route", "add", "default", "via", f"192.168.{k}.1", ns=ns)
        _in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _in(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        # a home router: what it did not ask for is dropped, not refused
        _in(router, "iptables", "-A", "FORWARD", "-i", "eth0", "-m", "state", "!", "--state",
            "ESTABLISHED,RELATED", "-j", "DROP")
        self.hosts[host] = addr
        return addr

    def far(self, host: str, delay_s: float, rate_bps: float, buffer_s: float = 1.0) -> str:
        """A public host at the end of a delay line of ``delay_s`` each way and ``rate_bps`` each way."""
        k = len(self.routers) + 1
        gw, ns = self.ns(f"g{k}"), self.ns(host)
        self._netns("add", gw)
        self.routers.append(gw)
        via = f"{SWITCH}.{150 + k}"
        self.ports[host] = self._plug(gw, via)
        subnet, addr = f"10.78.{k}.0/24", f"10.78.{k}.2"
        self._netns("add", ns)
        for where, dev in ((gw, "line"), (ns, "eth0")):
            _ip("tuntap", "add", "dev", dev, "mode", "tun", ns=where)
            _ip("link", "set", dev, "up", ns=where)
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        _ip("route", "add", "default", "dev", "eth0", ns=ns)
        _ip("route", "add", subnet, "dev", "line", ns=gw)
        _in(gw, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for other in self.on_switch[:-1]:
            _ip("route", "add", subnet, "via", via, ns=other)
        self.routes.append((subnet, via))
        wire = subprocess.Popen(["ip", "netns", "exec", gw, sys.executable, os.path.abspath(__file__), "wire", "line",
                                 ns, "eth0", str(delay_s), str(rate_bps), str(buffer_s)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.wires.append(wire)
        self.hosts[host] = addr
        return addr

    def shape(self, host: str, rate_bps: float) -> None:
        """Limit a host on the switch to ``rate_bps`` each way (token buckets on both ends of its cable)."""
        burst = max(int(rate_bps / 8 / 250), 64 << 10)  # 4 ms of the rate
        for ns, dev in ((self.ns(host), "eth0"), (self.switch, self.ports[host])):
            _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit", "burst",
                str(burst), "latency", "20ms")

    # ---- faults -----------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Partition: the host's link to the switch goes dark (packets are dropped, connections stall)."""
        _ip("link", "set", self.ports[host], "down", ns=self.switch)

    def heal(self, host: str) -> None:
        _ip("link", "set", self.ports[host], "up", ns=self.switch)

    # ---- programs ---------------------------------------------------------------------------------
    def run(self, host: str, argv: Sequence[str], **popen) -> subprocess.Popen:
        """Start ``argv`` in ``host`` (its own process group: the lab kills the group when it closes)."""
        popen.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], **popen)
        self.procs.append(p)
        return p

    def connects(self, host: str, addr: str, port: int, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from ``host`` to ``addr:port`` is accepted within ``timeout``."""
        code = (f"import socket\ns = socket.socket()\ns.settimeout({timeout})\n"
                f"try:\n    s.connect(({addr!r}, {port}))\nexcept OSError:\n    raise SystemExit(1)")
        return subprocess.run(["ip", "netns", "exec", self.ns(host), sys.executable, "-c", code],
                              capture_output=True, timeout=timeout + 30).returncode == 0

    def listen(self, host: str, port: int) -> subprocess.Popen:
        """A program in ``host`` that accepts TCP connections on ``port`` (all addresses) until the lab closes."""
        code = (f"import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                f"s.bind(('0.0.0.0', {port}))\ns.listen()\nprint('up', flush=True)\n"
                f"while True:\n    s.accept()[0].close()")
        p = self.run(host, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "up"
        return p

    def close(self) -> None:
        for p in self.procs + self.wires:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        for ns in [self.ns(h) for h in self.hosts] + self.routers + [self.switch]:
            self._netns("del", ns)

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the delay line (runs as its own process in the gateway's namespace) -------------------------------
def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _enter(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns into {ns}")
    os.close(fd)


def wire(here_dev: str, far_ns: str, far_dev: str, delay_s: float, rate_bps: float, buffer_s: float) -> None:
    """Carry packets between ``here_dev`` (this namespace) and ``far_dev`` (in ``far_ns``): each direction is
    a link of ``rate_bps`` whose packets arrive ``delay_s`` after they are sent; a packet that would wait more
    than ``buffer_s`` for the link is dropped, as a router's full queue drops it."""
    near = _tun(here_dev)
    _enter(far_ns)
    far = _tun(far_dev)
    other = {near: far, far: near}
    free = {near: 0.0, far: 0.0}     # when each direction's link has sent all it holds
    queue: list[tuple[float, int, int, bytes]] = []
    seq = 0
    while True:
        now = time.monotonic()
        wait = max(0.0, queue[0][0] - now) if queue else 1.0
        ready, _, _ = select.select([near, far], [], [], wait)
        now = time.monotonic()
        for fd in ready:
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                start = max(now, free[fd])
                if start - now > buffer_s:
                    continue
                free[fd] = start + len(pkt) * 8 / rate_bps
                seq += 1
                heapq.heappush(queue, (free[fd] + delay_s, seq, other[fd], pkt))
        while queue and queue[0][0] <= now:
            _, _, out, pkt = heapq.heappop(queue)
            try:
                os.write(out, pkt)
            except OSError:
                pass


if __name__ == "__main__" and len(sys.argv) == 8 and sys.argv[1] == "wire":
    a = sys.argv[2:]
    wire(a[0], a[1], a[2], float(a[3]), float(a[4]), float(a[5]))
