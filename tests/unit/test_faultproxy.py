"""tests/faultproxy.py against a tiny echo server: each fault does what it says, and only that."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faultproxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        with contextlib.suppress(OSError):
            while data := sock.recv(4096):
                sock.sendall(data)


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, name="echo", daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def proxy(echo_port: int) -> Iterator[FaultProxy]:
    with FaultProxy(echo_port) as running:
        yield running


def connect(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection((proxy.host, proxy.port), timeout=5)
    sock.settimeout(5)
    return sock


def echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    received = b""
    while len(received) < len(data):
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    return received


def closed_by_peer(sock: socket.socket, *, timeout: float = 2.0) -> bool:
    """True when the peer reset or closed the connection within ``timeout`` (no data read)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def refused_at_once(proxy: FaultProxy) -> bool:
    """A new connection is reset right away (during the handshake or at its first read)."""
    try:
        sock = connect(proxy)
    except (ConnectionResetError, ConnectionRefusedError):
        return True
    with sock:
        return closed_by_peer(sock)


def wait_for(predicate: object, timeout: float = 2.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_forwards_bytes_both_ways_on_loopback(proxy: FaultProxy) -> None:
    assert proxy.host == "127.0.0.1" and proxy.port > 0
    with connect(proxy) as sock:
        assert echo(sock, b"hello") == b"hello"
        assert echo(sock, b"x" * 200_000) == b"x" * 200_000
        assert proxy.open_connections == 1
    wait_for(lambda: proxy.open_connections == 0)
    assert proxy.accepted == 1 and proxy.refused == 0 and proxy.dropped == 0


def test_upstream_must_be_loopback() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        FaultProxy(9092, upstream_host="10.0.0.1")
    with pytest.raises(ValueError, match="loopback only"):
        FaultProxy(9092, upstream_host="example.com")


def test_drop_resets_every_open_connection_and_new_ones_work(proxy: FaultProxy) -> None:
    first, second = connect(proxy), connect(proxy)
    with first, second:
        assert echo(first, b"a") == b"a" and echo(second, b"b") == b"b"
        assert proxy.drop() == 2
        assert proxy.open_connections == 0
        assert closed_by_peer(first) and closed_by_peer(second)
        with pytest.raises(OSError):  # a reset, not an orderly close: writing fails too
            for _ in range(50):
                first.sendall(b"after the reset")
                time.sleep(0.01)
    with connect(proxy) as third:
        assert echo(third, b"c") == b"c"
    assert proxy.dropped == 2 and proxy.accepted == 3


def test_stall_holds_bytes_both_ways_then_delivers_them(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert echo(sock, b"before") == b"before"
        proxy.stall(0.8)
        started = time.monotonic()
        sock.sendall(b"held")
        sock.settimeout(0.4)
        with pytest.raises(TimeoutError):
            sock.recv(16)  # nothing forwarded while stalled
        sock.settimeout(5)
        assert sock.recv(16) == b"held"  # not lost: delivered once the stall ends
        assert time.monotonic() - started >= 0.7
        assert proxy.open_connections == 1 and proxy.accepted == 1  # same connection, kept


def test_stall_also_holds_new_connections_and_heal_ends_it(proxy: FaultProxy) -> None:
    proxy.stall(60)
    assert proxy.stalled
    with connect(proxy) as sock:  # accepted (kept), but nothing flows
        sock.sendall(b"x")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)
        started = time.monotonic()
        proxy.heal()
        sock.settimeout(5)
        assert sock.recv(1) == b"x"
        assert time.monotonic() - started < 1.0
    assert not proxy.stalled


def test_refuse_resets_new_connections_only_for_a_while(proxy: FaultProxy) -> None:
    with connect(proxy) as kept:
        assert echo(kept, b"k") == b"k"
        proxy.refuse(0.8)
        assert refused_at_once(proxy)  # accepted, then reset at once
        assert echo(kept, b"still") == b"still"  # open connections are not touched
        assert proxy.refused == 1
        time.sleep(0.9)
        with connect(proxy) as later:
            assert echo(later, b"back") == b"back"
    assert proxy.accepted == 3 and proxy.refused == 1


def test_refuse_until_healed_counts_every_attempt(proxy: FaultProxy) -> None:
    proxy.refuse(float("inf"))
    for _ in range(5):
        assert refused_at_once(proxy)
    assert proxy.accepted == 5 and proxy.refused == 5
    proxy.heal()
    with connect(proxy) as sock:
        assert echo(sock, b"ok") == b"ok"
    assert proxy.refused == 5


def test_unreachable_upstream_resets_the_client() -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        dead_port = int(placeholder.getsockname()[1])  # bound, never listening: connections refused
        with FaultProxy(dead_port) as proxy:
            assert refused_at_once(proxy)
            wait_for(lambda: proxy.upstream_failures == 1)
            assert proxy.open_connections == 0


def test_stop_closes_open_connections(echo_port: int) -> None:
    proxy = FaultProxy(echo_port).start()
    sock = connect(proxy)
    with sock:
        assert echo(sock, b"a") == b"a"
        proxy.stop()
        assert closed_by_peer(sock)
    with pytest.raises(RuntimeError):
        proxy.drop()
