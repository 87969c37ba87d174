"""
A real ``redis-server`` on a free loopback port, in a temporary directory (Debian's package
``redis-server``: ``bash scripts/system-packages.sh`` installs it), or the server ``REDIS_URL``
points at (``redis://[user:password@]host:port[/db]``; nothing is started then).

:func:`start_redis` fails loudly (never returns a half-started server). :class:`RedisServer` can
stop and start the same server again on the same port and data directory, with its append-only
file and RDB snapshot kept (the restart tests).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from devkit.brokers import BrokerStartError
from devkit.ports import free_port, wait_for_port
from devkit.processes import stop_process_group

REDIS_URL_ENV = "REDIS_URL"


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise BrokerStartError(
            "redis-server is not installed: bash scripts/system-packages.sh (Debian's redis-server), "
            f"or point {REDIS_URL_ENV} at a running Redis"
        )
    return binary


@dataclass
class RedisServer:
    """One redis-server process (or an external server named by ``REDIS_URL``: ``process`` None)."""

    host: str
    port: int
    db: int = 0
    username: str | None = None
    password: str | None = None
    data_dir: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    external: bool = False
    appendfsync: str = "everysec"
    _log: Path | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = ""
        if self.password:
            auth = f"{self.username or ''}:{self.password}@"
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"

    def connection(self) -> dict[str, Any]:
        """The upstream ``redis`` Airflow connection (as AIRFLOW_CONN_* JSON) for this server."""
        conn: dict[str, Any] = {"conn_type": "redis", "host": self.host, "port": self.port, "extra": {"db": self.db}}
        if self.username:
            conn["login"] = self.username
        if self.password:
            conn["password"] = self.password
        return conn

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``redis.Redis`` / ``redis.asyncio.Redis`` for an independent client."""
        return {
            "host": self.host,
            "port": self.port,
            "db": self.db,
            "username": self.username,
            "password": self.password,
        }

    # -- the process ---------------------------------------------------------------------------
    def start(self, *, timeout: float = 30.0) -> None:
        """Start (or start again) the server on its port and data directory."""
        if self.external:
            return
        assert self.data_dir is not None
        self._log = self.data_dir / "redis.log"
        argv = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "60 1",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self._log),
        ]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            wait_for_port(self.port, timeout=timeout)
        except TimeoutError as exc:
            tail = self.log_tail()
            self.stop()
            raise BrokerStartError(f"redis-server did not start on port {self.port}: {exc}\n{tail}") from exc
        if self.process.poll() is not None:
            raise BrokerStartError(f"redis-server exited with {self.process.returncode}\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM: Redis writes its append-only file and snapshot first); data kept."""
        process, self.process = self.process, None
        if process is not None:
            stop_process_group(process, timeout=20)

    def kill(self) -> None:
        """SIGKILL: what the append-only file has not synced is lost (``appendfsync``)."""
        process, self.process = self.process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)

    def close(self) -> None:
        """Stop the server and remove its data directory."""
        self.stop()
        if self.data_dir is not None and not self.external:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_from_url(url: str) -> RedisServer:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise BrokerStartError(f"{REDIS_URL_ENV} must be a redis:// URL, got scheme {parts.scheme!r}")
    path = parts.path.strip("/")
    return RedisServer(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 6379,
        db=int(path) if path.isdigit() else 0,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        external=True,
    )


def start_redis(*, own: bool = False, appendfsync: str = "everysec", timeout: float = 30.0) -> RedisServer:
    """
    The Redis for a test: the one ``REDIS_URL`` names (unless ``own``: a test that restarts or
    kills the server needs one of its own), else a new ``redis-server`` on a free loopback port
    with append-only persistence in a temporary directory. ``close()`` stops it and removes the
    directory (an external server is left as it is).
    """
    configured = os.environ.get(REDIS_URL_ENV)
    if configured and not own:
        return server_from_url(configured)
    server = RedisServer(
        host="127.0.0.1",
        port=free_port(),
        data_dir=Path(tempfile.mkdtemp(prefix="redis-server-")),
        appendfsync=appendfsync,
    )
    try:
        server.start(timeout=timeout)
    except BaseException:
        server.close()
        raise
    return server
