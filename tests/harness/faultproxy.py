"""A TCP fault proxy for the tests: put it between ingest and a server, then break the network.

No fault server (toxiproxy) installs on these machines, so the faults production
networks produce are made here, in test code, on loopback only:

=================  ==============================================================================
``blackhole()``    accept, then forward nothing in either direction and send no RST: a NAT or
                   firewall that dropped the flow, a peer that crashed with the socket half open.
                   Connections already open stay silent for good (their state is "lost");
                   new ones are accepted and stay silent too, until :meth:`heal`.
``reset()``        close every open connection now with an RST (``SO_LINGER`` 0).
``reset_after(n)`` let ``n`` more bytes through towards the server, then reset that connection
                   (a reset in the middle of a COPY).
``latency(ms)``    delay every chunk by ``ms`` per direction (``up``: towards the server).
``bandwidth(bps)`` at most ``bps`` bytes per second per direction and connection.
``refuse()``       new connections are reset as soon as they are accepted.
``heal()``         back to a clean pass-through for new connections (and for connections that
                   were only slowed); blackholed connections stay dead.
=================  ==============================================================================

Faults switch at run time from the test's thread. Every connection is a pair of
pump threads (one per direction) that re-read the proxy's state between chunks,
so a switch takes effect within :data:`POLL_S`. ``stats()`` counts what went
through, so a test can wait until traffic flowed before it breaks something.

Use as a context manager (``with FaultProxy(host, port) as proxy: ... proxy.port``);
``close()`` resets every connection and stops the listener.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

#: How often a pump re-reads the fault state while it has nothing to move (seconds).
POLL_S = 0.05
_CHUNK = 64 * 1024


@dataclass
class Faults:
    """The proxy's switchable state (read by every pump; changed under the proxy's lock)."""

    blackhole: bool = False
    refuse: bool = False
    latency_s: dict[str, float] = field(default_factory=lambda: {"up": 0.0, "down": 0.0})
    bandwidth_bps: dict[str, float | None] = field(default_factory=lambda: {"up": None, "down": None})
    #: bytes still allowed towards the server before a reset, per connection id (None: no limit)
    reset_after_bytes: int | None = None


def _rst(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Link:
    """One proxied connection: the client's socket, the server's, and their two pumps."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket | None,
                 silent: bool) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        #: blackholed: forwards nothing, ever (set when the proxy was blackholed during its life)
        self.silent = silent
        #: bytes left towards the server before a reset (None: no limit)
        self.budget_up: int | None = None
        self.closed = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.server is None:  # silent from birth: hold the client, forward nothing
            threading.Thread(target=self._hold, daemon=True, name="faultproxy-hold").start()
            return
        for name, src, dst in (("up", self.client, self.server), ("down", self.server, self.client)):
            threading.Thread(target=self._pump, args=(name, src, dst), daemon=True,
                             name=f"faultproxy-{name}").start()

    def reset(self) -> None:
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        _rst(self.client)
        if self.server is not None:
            _rst(self.server)
        self.proxy._forget(self)

    def _finish(self) -> None:
        """Orderly close (one side closed): FIN both ways."""
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        for sock in (self.client, self.server):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self.proxy._forget(self)

    def _hold(self) -> None:
        # Read nothing, answer nothing: the client's bytes sit in the kernel's buffers.
        while not self.closed.wait(POLL_S):
            pass

    def _pump(self, direction: str, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.closed.is_set():
                if self.silent or self.proxy.faults.blackhole:
                    self.silent = True  # a dropped flow never comes back
                    self.closed.wait(POLL_S)
                    continue
                readable, _, _ = select.select([src], [], [], POLL_S)
                if not readable:
                    continue
                if self.silent or self.proxy.faults.blackhole:
                    continue
                data = src.recv(_CHUNK)
                if not data:
                    self._finish()
                    return
                data, then_reset = self._through_budget(direction, data)
                faults = self.proxy.faults
                delay = faults.latency_s[direction]
                if delay:
                    time.sleep(delay)
                if data:
                    dst.sendall(data)
                    self.proxy._count(direction, len(data))
                if then_reset:
                    self.proxy._note_reset_after()
                    self.reset()
                    return
                bps = faults.bandwidth_bps[direction]
                if bps:
                    time.sleep(len(data) / bps)
        except OSError:
            self.reset()

    def _through_budget(self, direction: str, data: bytes) -> tuple[bytes, bool]:
        """Apply a pending ``reset_after``: the bytes that may pass, and whether to reset after them."""
        if direction != "up":
            return data, False
        with self._lock:
            if self.budget_up is None:
                return data, False
            allowed = data[: self.budget_up]
            self.budget_up -= len(allowed)
            return allowed, self.budget_up <= 0


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``, with switchable faults.

    Threads: one acceptor, two pumps per connection (daemon threads). Thread-safe controls.
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.faults = Faults()
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._bytes = {"up": 0, "down": 0}
        self._accepted = 0
        self._resets_after = 0
        self._listener = socket.create_server(("127.0.0.1", listen_port), reuse_port=False)
        self._listener.settimeout(POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="faultproxy-accept")
        self._acceptor.start()

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- faults -----------------------------------------------------------------------------
    def blackhole(self) -> None:
        """Forward nothing, on open and new connections alike, and send no RST (see the module docstring)."""
        with self._lock:
            self.faults.blackhole = True

    def reset(self) -> int:
        """Reset every open connection now; returns how many."""
        links = self._snapshot()
        for link in links:
            link.reset()
        return len(links)

    def reset_after(self, n_bytes: int) -> None:
        """Each connection open now, and each new one, resets after ``n_bytes`` more towards the server."""
        with self._lock:
            self.faults.reset_after_bytes = n_bytes
            for link in self._links:
                with link._lock:
                    link.budget_up = n_bytes

    def latency(self, ms: float, direction: str = "both") -> None:
        """Delay each chunk by ``ms`` milliseconds in ``direction`` (``up``, ``down`` or ``both``)."""
        with self._lock:
            for d in self._directions(direction):
                self.faults.latency_s[d] = ms / 1000.0

    def bandwidth(self, bytes_per_s: float | None, direction: str = "both") -> None:
        """At most ``bytes_per_s`` per connection in ``direction`` (None: unlimited)."""
        with self._lock:
            for d in self._directions(direction):
                self.faults.bandwidth_bps[d] = bytes_per_s

    def refuse(self) -> None:
        """Reset new connections as soon as they are accepted."""
        with self._lock:
            self.faults.refuse = True

    def heal(self) -> None:
        """A clean pass-through again for new connections; blackholed ones stay dead (never forward)."""
        with self._lock:
            blackholed = self.faults.blackhole
            self.faults = Faults()
            if blackholed:
                for link in self._links:
                    link.silent = True
                    with link._lock:
                        link.budget_up = None
            else:
                for link in self._links:
                    with link._lock:
                        link.budget_up = None

    # -- observation ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Bytes forwarded per direction, connections accepted and open, resets done by ``reset_after``."""
        with self._lock:
            return {"up": self._bytes["up"], "down": self._bytes["down"], "accepted": self._accepted,
                    "open": len(self._links), "resets_after": self._resets_after}

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for link in self._snapshot():
            link.reset()
        self._acceptor.join(2)

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _directions(direction: str) -> tuple[str, ...]:
        if direction == "both":
            return ("up", "down")
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be up, down or both, not {direction!r}")
        return (direction,)

    def _snapshot(self) -> list[_Link]:
        with self._lock:
            return list(self._links)

    def _forget(self, link: _Link) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._links.remove(link)

    def _count(self, direction: str, n: int) -> None:
        with self._lock:
            self._bytes[direction] += n

    def _note_reset_after(self) -> None:
        with self._lock:
            self._resets_after += 1

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._accepted += 1
                faults = self.faults
            if faults.refuse:
                _rst(client)
                continue
            server = None
            if not faults.blackhole:
                try:
                    server = socket.create_connection(self.upstream, timeout=5)
                    server.settimeout(None)
                except OSError:
                    _rst(client)
                    continue
            link = _Link(self, client, server, silent=faults.blackhole)
            link.budget_up = faults.reset_after_bytes
            with self._lock:
                self._links.append(link)
            link.start()


@contextlib.contextmanager
def proxied_broker() -> Iterator[tuple[FaultProxy, str]]:
    """A Tansu broker of its own that clients reach only through a :class:`FaultProxy`.

    The broker advertises the proxy's address, so every connection (bootstrap, group coordinator,
    partition leader) crosses the proxy. Yields ``(proxy, bootstrap)``; stops both afterwards.
    """
    from harness.services import kafka_check, start_tansu

    proxy = FaultProxy("127.0.0.1", 9)  # the upstream port is the broker's, known once it started
    try:
        svc = start_tansu(advertised_port=proxy.port)
        try:
            proxy.upstream = ("127.0.0.1", int(svc.handle))  # type: ignore[arg-type]
            kafka_check(proxy.address, timeout_s=10)
            yield proxy, proxy.address
        finally:
            from harness.kafka import close_producers

            close_producers(proxy.address)
            svc.stop()
    finally:
        proxy.close()
