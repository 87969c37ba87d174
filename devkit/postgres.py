"""A throwaway PostgreSQL 15 server on a free loopback port, for Airflow's metadata DB.

Used by the end-to-end tests (``tests/e2e``) and the real-triggerer benchmark
(``bench/triggerer_bench.py``)::

    with PostgresServer() as pg:
        with AirflowEnv(dags_folder, sql_alchemy_conn=pg.url) as env:
            ...

What it does: ``initdb`` into a new temporary directory, run ``postgres`` listening on 127.0.0.1
only (TCP, trust authentication for 127.0.0.1/32 and nothing else; the Unix socket lives in the
private temporary directory), create one database, and hand out
``postgresql+psycopg2://postgres@127.0.0.1:PORT/<database>``. :meth:`PostgresServer.stop` shuts the
server down (fast shutdown, then SIGKILL of whatever is left) and deletes the directory.

PostgreSQL refuses to run as root: when this process is root, ``initdb`` and ``postgres`` run as
the ``postgres`` OS user (``subprocess`` ``user=``/``group=``: the server stays our own child, so
stopping it never needs a broad ``pkill``), and the directory is owned by that user. Otherwise they
run as the current user.

The binaries are found in ``$PG_BIN`` if set, else the newest ``/usr/lib/postgresql/<major>/bin``
(Debian's layout; 15 on this project's machines), else on ``PATH``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Final

from devkit.ports import free_port

DB_OS_USER: Final = "postgres"
SUPERUSER: Final = "postgres"
DEFAULT_DATABASE: Final = "airflow"
# Durability off: for tests, where a crash of the throwaway server loses nothing of value. A
# benchmark of the metadata DB keeps PostgreSQL's defaults (fsync and synchronous_commit on), as a
# real deployment does; pass ``settings={}`` for that.
FAST_SETTINGS: Final[Mapping[str, str]] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


class PostgresError(RuntimeError):
    """The throwaway PostgreSQL server could not be started; the message carries its log tail."""


def pg_bin_dir() -> Path:
    """Directory of ``initdb`` / ``postgres`` / ``pg_isready`` / ``createdb``."""
    configured = os.environ.get("PG_BIN")
    if configured:
        return Path(configured)
    debian = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "postgres").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if debian:
        return debian[-1]
    found = shutil.which("postgres") or shutil.which("initdb")
    if found:
        return Path(found).parent
    raise PostgresError(
        "PostgreSQL server binaries not found: install the Debian package postgresql-15 "
        "(or set PG_BIN to the directory holding initdb and postgres)"
    )


@dataclass
class PostgresServer:
    """
    One PostgreSQL server process and its data directory (context manager).

    :param database: database created after start (the URL points at it).
    :param settings: ``postgresql.conf`` options passed as ``-c name=value`` (see ``FAST_SETTINGS``).
    :param startup_timeout: seconds to wait for the server to accept connections.
    :param port: TCP port on 127.0.0.1 (a free one by default).
    """

    database: str = DEFAULT_DATABASE
    settings: Mapping[str, str] = field(default_factory=dict)
    startup_timeout: float = 60.0
    port: int = 0

    base_dir: Path | None = field(default=None, init=False)
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    # -- addresses --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """SQLAlchemy URL of :attr:`database` (psycopg2 driver, as Airflow's sync engine needs)."""
        return f"postgresql+psycopg2://{SUPERUSER}@127.0.0.1:{self.port}/{self.database}"

    @property
    def async_url(self) -> str:
        """The same database for Airflow's async engine (asyncpg)."""
        return f"postgresql+asyncpg://{SUPERUSER}@127.0.0.1:{self.port}/{self.database}"

    @property
    def data_dir(self) -> Path:
        return self._base / "data"

    @property
    def log_path(self) -> Path:
        return self._base / "postgres.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def _base(self) -> Path:
        if self.base_dir is None:
            raise PostgresError("the PostgreSQL server has not been started")
        return self.base_dir

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """initdb, start the server, wait until it accepts connections, create the database."""
        if self.process is not None:
            raise PostgresError(f"already running (pid {self.pid})")
        bin_dir = pg_bin_dir()
        self.base_dir = Path(tempfile.mkdtemp(prefix="pg-devkit-"))
        try:
            self._chown(self.base_dir)
            if not self.port:
                self.port = free_port()
            self._run([str(bin_dir / "initdb"), *self._initdb_args()], what="initdb", timeout=120)
            # Trust exactly the loopback TCP address and the private socket; everything else is
            # rejected (initdb's own file would also trust ::1 and replication connections).
            (self.data_dir / "pg_hba.conf").write_text(
                "# devkit.postgres: throwaway server, loopback only\n"
                "local all all trust\n"
                "host  all all 127.0.0.1/32 trust\n"
            )
            self._spawn(bin_dir)
            self._wait_ready(bin_dir)
            self._run(
                [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, self.database],
                what=f"createdb {self.database}",
                timeout=60,
            )
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Fast shutdown (SIGINT to the postmaster), SIGKILL after ``timeout``; delete the directory."""
        proc, self.process = self.process, None
        try:
            if proc is not None and proc.poll() is None:
                # SIGINT = "fast" shutdown: roll back open transactions, checkpoint-free, exit.
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    # The postmaster leads its own process group (start_new_session): its backends
                    # and auxiliary processes go with it, and nothing else is in that group.
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            if proc is not None:
                # Backends exit on their own once the postmaster is gone; make sure none lingers.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)
                self.base_dir = None

    def log_tail(self, lines: int = 40) -> str:
        if self.base_dir is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    # -- internals --------------------------------------------------------------------------------
    def _initdb_args(self) -> list[str]:
        return [
            "-D",
            str(self.data_dir),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            # The directory is thrown away; syncing it to disk only costs time.
            "--no-sync",
        ]

    def _server_args(self) -> list[str]:
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            # The socket goes into the private directory: /var/run/postgresql may not exist, and
            # two throwaway servers must never share a socket path.
            "unix_socket_directories": str(self._base),
            "logging_collector": "off",
            **self.settings,
        }
        args = ["-D", str(self.data_dir)]
        for name, value in options.items():
            args += ["-c", f"{name}={value}"]
        return args

    @staticmethod
    def _db_user() -> pwd.struct_passwd | None:
        """The OS user to drop to: ``postgres`` when this process is root, else None (stay as is)."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(DB_OS_USER)
        except KeyError as exc:
            raise PostgresError(
                f"PostgreSQL refuses to run as root and there is no {DB_OS_USER!r} OS user to run it as"
            ) from exc

    def _chown(self, path: Path) -> None:
        """As root, hand ``path`` to the ``postgres`` user: initdb writes into it, the server owns it."""
        user = self._db_user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        return env

    def _run(self, argv: list[str], *, what: str, timeout: float) -> None:
        user = self._db_user()
        try:
            result = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=self._base,
                env=self._env(),
                stdin=subprocess.DEVNULL,
                user=user.pw_uid if user is not None else None,
                group=user.pw_gid if user is not None else None,
                extra_groups=[] if user is not None else None,
            )
        except subprocess.TimeoutExpired as exc:
            raise PostgresError(f"{what} did not finish in {timeout:.0f}s\n{self.log_tail()}") from exc
        if result.returncode != 0:
            raise PostgresError(
                f"{what} failed with exit code {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
                f"\n{self.log_tail()}"
            )

    def _spawn(self, bin_dir: Path) -> None:
        user = self._db_user()
        log = self.log_path.open("wb")
        try:
            self.process = subprocess.Popen(
                [str(bin_dir / "postgres"), *self._server_args()],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._base,
                env=self._env(),
                start_new_session=True,
                user=user.pw_uid if user is not None else None,
                group=user.pw_gid if user is not None else None,
                extra_groups=[] if user is not None else None,
            )
        finally:
            log.close()

    def _wait_ready(self, bin_dir: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout
        argv = [str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, "-q"]
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise PostgresError(f"postgres exited with code {self.process.returncode}:\n{self.log_tail()}")
            if subprocess.run(argv, check=False, env=self._env(), stdin=subprocess.DEVNULL).returncode == 0:
                return
            if time.monotonic() >= deadline:
                raise PostgresError(
                    f"postgres did not accept connections on 127.0.0.1:{self.port} within "
                    f"{self.startup_timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(0.1)
