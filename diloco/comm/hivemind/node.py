"""This peer on the network: its DHT process (with the p2pd it starts), the libp2p replica this process talks
through, its ids and run key, the event loop every phase runs on, and the fault hook every phase awaits.

The DHT runs in a process of its own, which starts its own p2pd; this process talks to the swarm through a
replica of that daemon's libp2p client, on an event loop of its own thread (:meth:`Node.call` runs a coroutine
there from the training thread). Whatever way a peer ends (closed, its start failed, its daemon killed), its
DHT process is reaped and the unix sockets its daemon made are removed.
"""

from __future__ import annotations

import asyncio
import glob
import itertools
import os
import re
import signal
import socket
import tempfile
import threading
from typing import Any, Awaitable, Callable, Optional, Sequence

from diloco.comm.base import TransportError, die_with_parent
from diloco.comm.hivemind.auth import make_authorizer
from diloco.comm.hivemind.framing import log

_TAGS = itertools.count()


def _dht_class():
    from hivemind.dht import DHT

    class PeerDHT(DHT):
        def run(self) -> None:
            die_with_parent()
            # signals are for the peer's main process, which saves, leaves the swarm and then stops this one
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            super().run()

    return PeerDHT


def _socket_tag() -> str:
    """Give the p2pd this peer starts socket names of its own, so that they can be found and removed later.

    hivemind names the unix sockets of a daemon and its clients ``<prefix>p2pd-<random>.sock`` and
    ``<prefix>p2pclient-<random>.sock``; the DHT process, forked next, inherits the prefix set here.
    """
    from hivemind.p2p import P2P

    tag = f"hivemind-loco{os.getpid()}x{next(_TAGS)}-"
    P2P._UNIX_SOCKET_PREFIX = f"/unix{tempfile.gettempdir()}/{tag}"
    return os.path.join(tempfile.gettempdir(), tag)


def _remove_sockets(prefix: str) -> None:
    for path in glob.glob(glob.escape(prefix) + "*.sock"):
        try:
            os.remove(path)
        except OSError:
            pass


def _tcp_endpoint(maddr: str) -> Optional[tuple[str, int]]:
    parts = str(maddr).split("/")
    try:
        host = next(parts[i + 1] for i, p in enumerate(parts) if p in ("ip4", "ip6", "dns", "dns4", "dns6"))
        port = int(next(parts[i + 1] for i, p in enumerate(parts) if p == "tcp"))
    except (StopIteration, IndexError, ValueError):
        return None
    return host, port


def _answers(endpoint: tuple[str, int], timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            return True
    except OSError:
        return False


def join_failure(error: Exception, initial_peers: Sequence[str], keyed: bool) -> str:
    """One line on why this peer could not join: the bootstrap peers could not be reached, or they answered
    and refused it (another run key), or hivemind's own reason, without its advice about its arguments."""
    text = re.sub(r"\s*\(set ensure_bootstrap_success=False to ignore\)", "", str(error)).strip()
    if not initial_peers or "bootstrap" not in text:
        return text or type(error).__name__
    endpoints = {str(m): _tcp_endpoint(m) for m in initial_peers}
    answered = [m for m, ep in endpoints.items() if ep is not None and _answers(ep)]
    if not answered:
        where = ", ".join(f"{ep[0]}:{ep[1]}" if ep else m for m, ep in endpoints.items())
        return (f"no bootstrap peer could be reached ({where}: nothing answers there); check the address in "
                f"--peers and that the peer is running and reachable from this machine")
    if "none of the initial_peers responded" in text:
        key = ("this peer's run key is not the run's (the run has another one, or none)" if keyed
               else "the run has a run key and this peer has none")
        return (f"the bootstrap peer {answered[0]} answered but refused this peer: {key} (check --run-key or "
                f"--run-key-file)")
    return (f"something answers at {answered[0]} but the libp2p connection failed: is the /p2p/ id in the "
            f"address that peer's? ({text.splitlines()[-1] if text else type(error).__name__})")


class Node:
    """One peer's DHT process, libp2p replica and event loop (see the module's docstring).

    ``key``: the run key (empty: an open run); every MAC a phase makes or checks reads it here. ``on_phase``:
    an async ``(phase, data) -> data`` awaited at the start of each phase (:meth:`phase`); the fault tests stop
    or kill this peer's daemon there, or corrupt what it sends. ``p2p`` is set once the loop runs
    (:meth:`replicate`).
    """

    def __init__(self, run: str, key: bytes, initial_peers: Sequence[str], dht_options: dict[str, Any]) -> None:
        self.run, self.key = run, key
        self.on_phase: Optional[Callable[[str, Any], Awaitable[Any]]] = None
        self.p2p = None
        self._closed = False
        self._background: set[asyncio.Task] = set()  # tasks started by soon(), held until they end
        kwargs = dict(dht_options, initial_peers=list(initial_peers), start=False, ensure_bootstrap_success=True,
                      await_ready=True)
        if key:
            kwargs["authorizer"] = make_authorizer(key)
        self._sockets = _socket_tag()  # this peer's p2pd sockets, removed whatever way it ends
        self.dht = _dht_class()(**kwargs)
        try:
            self.dht.run_in_background(await_ready=True)
        except Exception as e:
            self._abandon_dht()
            raise TransportError(f"could not start or join the swarm {run!r}: "
                                 f"{join_failure(e, initial_peers, bool(key))}") from None
        self.peer_id = self.dht.peer_id  # a blocking round trip: read it before our loop starts
        self.me = self.peer_id.to_base58()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loco-hivemind", daemon=True)
        self._thread.start()

    @property
    def tag(self) -> str:
        """This peer's name in log lines: the end of its id."""
        return self.me[-8:]

    def call(self, coro, timeout: Optional[float] = None) -> Any:
        """Run ``coro`` on this peer's loop and wait for it (at most ``timeout`` s: then it is cancelled)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def soon(self, work: Callable[[], Awaitable[Any]]) -> None:
        """Run ``work()`` as a task of this peer's loop without waiting for it, from any thread."""
        self._loop.call_soon_threadsafe(self._hold, work)

    def _hold(self, work: Callable[[], Awaitable[Any]]) -> None:
        """Start ``work()`` as a task held until it ends: the loop itself keeps only a weak reference to a task,
        and a pending one that nothing else holds is collected mid-way ("Task was destroyed but it is
        pending!")."""
        task = self._loop.create_task(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def replicate(self) -> None:
        """On the loop: this process's libp2p client, a replica of the DHT process's."""
        self.p2p = await self.dht.replicate_p2p()

    async def phase(self, name: str, data: Any) -> Any:
        """The start of a phase of a round ("push": this peer's payload, "ack": its commit) or of serving a
        state stripe ("state"): ``on_phase`` may act there, and returns what is sent."""
        return data if self.on_phase is None else await self.on_phase(name, data)

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def daemon_alive(self) -> bool:
        """Whether this peer's p2pd accepts a connection on its control socket (named under ``_sockets``, see
        :func:`_socket_tag`): False once the daemon died (killed, crashed; its socket file stays behind), when
        nothing sent through it can arrive. With no socket file to probe it counts as alive."""
        paths = glob.glob(glob.escape(self._sockets) + "p2pd-*.sock")
        if not paths:
            return True
        for path in paths:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                return True
            except OSError:
                pass
            finally:
                probe.close()
        return False

    def close(self, leave: Optional[Callable[[], Awaitable[Any]]] = None) -> None:
        """Stop: ``leave()`` first (this peer's goodbye to the swarm, at most 3 s), then the P2P replica, the
        loop, and the DHT process (and its p2pd)."""
        if self._closed:
            return
        self._closed = True
        # a dead daemon (killed, crashed) can neither carry the leave nor stop the DHT process gracefully: both
        # would wait their timeouts (3 s each) for nothing
        daemon = self.daemon_alive()
        try:
            if self._thread.is_alive():
                try:
                    self.call(self._shutdown(leave if daemon else None), 10)
                except Exception as e:
                    log.warning("hivemind: leaving the swarm uncleanly: %s", e)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
        finally:
            if daemon:
                self.dht.shutdown()
            self._reap_dht(0.5 if daemon else 0.0)  # shutdown() waited its grace period: the rest ignores SIGTERM
            _remove_sockets(self._sockets)

    async def _shutdown(self, leave: Optional[Callable[[], Awaitable[Any]]]) -> None:
        if leave is not None:
            try:
                await asyncio.wait_for(leave(), 3)
            except Exception:
                pass
        await self.p2p.shutdown()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _reap_dht(self, wait: float) -> None:
        """Wait up to ``wait`` s for the DHT process to end, then kill it: hivemind's fallback is SIGTERM, which
        this process ignores (see _dht_class), and it holds nothing to save."""
        self.dht.join(wait)
        if self.dht.is_alive():
            os.kill(self.dht.pid, signal.SIGKILL)
            self.dht.join(5)

    def _abandon_dht(self) -> None:
        """After a failed start: stop the DHT process (and its p2pd) and remove the sockets they made."""
        self._reap_dht(self.dht.shutdown_timeout)
        _remove_sockets(self._sockets)
