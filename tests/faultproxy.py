"""
A loopback TCP fault proxy: put it in front of a broker's port and break the connection on demand.

The proxy listens on a free ``127.0.0.1`` port and forwards every connection to one upstream
loopback port. It runs its own asyncio loop in a daemon thread, so it keeps forwarding while the
test's loop is busy and outlives function-scoped event loops (a module fixture can own one).
Every control method is thread-safe and returns once the fault is in effect:

* :meth:`FaultProxy.drop`: reset every open connection now (RST both ways, mid-stream).
* :meth:`FaultProxy.stall`: forward no byte either way for ``seconds``; connections stay open
  and the bytes are delivered afterwards (nothing is lost, TCP flow control holds the rest).
* :meth:`FaultProxy.refuse`: for ``seconds``, accept each new connection and reset it at once
  (open connections keep working). ``math.inf`` refuses until :meth:`FaultProxy.heal`.
* :meth:`FaultProxy.heal`: end a stall and a refusal now.

:attr:`FaultProxy.accepted` counts every connection attempt that reached the proxy (refused ones
included), which is how a test measures a client's reconnect rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

_CHUNK = 64 * 1024
_CONTROL_TIMEOUT = 10.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with an RST (SO_LINGER 0) instead of an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    pumps: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for task in self.pumps:
            task.cancel()
        _reset(self.client)
        _reset(self.upstream)


class FaultProxy:
    """A TCP proxy ``127.0.0.1:<port>`` -> ``upstream_host:upstream_port`` (loopback only)."""

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        if not _is_loopback(upstream_host):
            raise ValueError(f"FaultProxy forwards to loopback only, not {upstream_host!r}")
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.host = "127.0.0.1"
        self.port = listen_port
        # Counters, written by the proxy thread only (reads from other threads see whole ints).
        self.accepted = 0
        self.refused = 0
        self.dropped = 0
        self.upstream_failures = 0
        self.bytes_forwarded = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._flowing: asyncio.Event | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._refuse_until = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def start(self) -> FaultProxy:
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loop, started), name="fault-proxy", daemon=True)
        self._thread.start()
        if not started.wait(_CONTROL_TIMEOUT) or self._server is None:
            raise RuntimeError("FaultProxy did not start")
        return self

    def _run(self, loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = loop.run_until_complete(
            asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CONTROL_TIMEOUT)
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        pumps = [task for connection in self._connections for task in connection.pumps]
        self._drop_all()
        await asyncio.gather(*pumps, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("FaultProxy is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CONTROL_TIMEOUT)

    # -- faults ----------------------------------------------------------------------------------
    def drop(self) -> int:
        """Reset every open connection now; return how many were reset."""

        async def drop() -> int:
            return self._drop_all()

        return self._call(drop())

    def stall(self, seconds: float) -> None:
        """Stop forwarding bytes both ways for ``seconds`` (connections kept, bytes delivered later)."""

        async def stall() -> None:
            assert self._flowing is not None and self._loop is not None
            self._cancel_stall_timer()
            self._flowing.clear()
            if math.isfinite(seconds):
                self._stall_timer = self._loop.call_later(seconds, self._flowing.set)

        self._call(stall())

    def refuse(self, seconds: float) -> None:
        """For ``seconds``, reset every new connection as soon as it is accepted (open ones keep working)."""

        async def refuse() -> None:
            assert self._loop is not None
            self._refuse_until = self._loop.time() + seconds

        self._call(refuse())

    def heal(self) -> None:
        """End a stall and a refusal now."""

        async def heal() -> None:
            assert self._flowing is not None
            self._cancel_stall_timer()
            self._flowing.set()
            self._refuse_until = 0.0

        self._call(heal())

    @property
    def stalled(self) -> bool:
        return self._flowing is not None and not self._flowing.is_set()

    # -- proxy thread ------------------------------------------------------------------------------
    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _drop_all(self) -> int:
        connections = list(self._connections)
        self._connections.clear()
        for connection in connections:
            connection.reset()
        self.dropped += len(connections)
        return len(connections)

    def _refusing(self) -> bool:
        return self._loop is not None and self._loop.time() < self._refuse_until

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._refusing():
            self.refused += 1
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            self.upstream_failures += 1
            _reset(writer)
            return
        if self._refusing():  # a refusal began while connecting upstream
            self.refused += 1
            _reset(up_writer)
            _reset(writer)
            return
        connection = _Connection(writer, up_writer)
        self._connections.add(connection)
        connection.pumps = [
            asyncio.create_task(self._pump(reader, up_writer, connection)),
            asyncio.create_task(self._pump(up_reader, writer, connection)),
        ]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection: _Connection) -> None:
        flowing = self._flowing
        assert flowing is not None
        try:
            while True:
                await flowing.wait()
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await flowing.wait()  # a stall that began during the read holds this chunk too
                writer.write(data)
                await writer.drain()
                self.bytes_forwarded += len(data)
            # Orderly end of one direction: pass the FIN on, keep the other direction going.
            if writer.can_write_eof():
                writer.write_eof()
        except asyncio.CancelledError:
            raise
        except OSError:
            # One side reset: reset the other (a reset mid-stream stays a reset).
            if connection in self._connections:
                self._connections.discard(connection)
                connection.reset()
            return
        if all(task.done() or task is asyncio.current_task() for task in connection.pumps):
            self._connections.discard(connection)
            connection.client.close()
            connection.upstream.close()
