"""A throwaway, real Airflow 3.3 on a temporary ``AIRFLOW_HOME`` with a SQLite metadata DB
(or any SQLAlchemy URL: ``sql_alchemy_conn``, e.g. a :class:`devkit.postgres.PostgresServer`'s).

Used by the end-to-end tests and by ``python -m devkit.demo``::

    with AirflowEnv(dags_folder, connections={"kafka_default": {...}}) as env:
        env.wait_for_dags(["orders_eu_consumer"])
        env.unpause(["orders_eu_consumer"])
        env.wait_for_watchers(3)
        ...
        env.asset_events("orders_eu")

What it runs, each as its own subprocess in its own process group with its own log file under
``$AIRFLOW_HOME/process-logs/``: ``airflow db migrate`` once, then ``airflow dag-processor``,
``airflow triggerer``, ``airflow scheduler`` and ``airflow api-server``.

Choices (Airflow 3.3):

* **LocalExecutor on SQLite.** Airflow 3 has no SequentialExecutor; LocalExecutor works with
  SQLite (``airflow standalone`` uses the same pair). ``parallelism`` is kept small for 2 cores.
* **The api-server is not optional when tasks run**: Airflow 3 task processes talk to the
  Execution API (``[core] execution_api_server_url``) served by the api-server. The helpers below
  also read Dags, Dag runs and asset events through the public REST API (``/api/v2``).
* **SimpleAuthManager** (the 3.x default) with one ``admin`` user whose password is written to the
  passwords file before the api-server starts, so the login is known (``admin`` / ``admin`` unless
  ``admin_password`` says otherwise).
* **Asset watchers are registered by the Dag processor, and only for unpaused Dags**:
  :meth:`AirflowEnv.unpause` therefore also asks the Dag processor to re-parse the Dag files
  (``PUT /api/v2/parseDagFile/{file_token}``), and :meth:`AirflowEnv.wait_for_watchers` waits until
  the triggerer has picked the watchers' triggers up. The one thing the REST API does not expose
  (which triggerer runs which trigger) is read from the SQLite file in read-only mode (on
  PostgreSQL: a read-only psycopg2 session).
* ``[triggerer] triggerer_health_check_threshold`` is lowered to 10 s so a triggerer restarted
  after ``kill -9`` takes the dead one's triggers over quickly.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import httpx

from devkit.ports import free_port
from devkit.processes import stop_process_group

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
    from types import TracebackType

T = TypeVar("T")

COMPONENTS: Final = ("dag-processor", "triggerer", "scheduler", "api-server")
_HEALTH_KEYS: Final = {
    "scheduler": "scheduler",
    "triggerer": "triggerer",
    "dag-processor": "dag_processor",
}


class AirflowEnvError(RuntimeError):
    """The Airflow environment failed; the message carries the tail of every component's log."""


def venv_bin(name: str) -> str:
    """Path of an executable next to the running interpreter (the venv's ``airflow``)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise AirflowEnvError(f"cannot find the {name!r} executable next to {sys.executable} or on PATH")
    return found


def _config_env(section: str, option: str) -> str:
    # Airflow's own naming: a dotted section (``common.io``) is ``COMMON_IO``.
    return f"AIRFLOW__{section.replace('.', '_').upper()}__{option.upper()}"


def _config_value(value: object) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


def connection_env(conn_id: str, connection: Mapping[str, Any] | str) -> tuple[str, str]:
    """``AIRFLOW_CONN_<ID>`` for a connection given as a JSON-able dict or a URI string."""
    value = connection if isinstance(connection, str) else json.dumps(dict(connection))
    return f"AIRFLOW_CONN_{conn_id.upper()}", value


@dataclass
class AirflowComponent:
    """One long-running ``airflow <command>`` subprocess, in its own process group."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0

    def start(self) -> None:
        if self.alive:
            raise AirflowEnvError(f"{self.name} is already running (pid {self.pid})")
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== devkit: start #{self.starts} of {self.name}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.env["AIRFLOW_HOME"],
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def kill(self) -> None:
        """``kill -9`` the whole process group (the command and every child it forked)."""
        if self.process is None:
            return
        self.kills += 1
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        with self.log_path.open("ab") as log:
            log.write(f"\n===== devkit: kill -9 of {self.name} (kill #{self.kills})\n".encode())

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after ``timeout``."""
        proc = self.process
        if proc is None:
            return
        stop_process_group(proc, timeout)

    def log_text(self) -> str:
        if not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


@dataclass
class AirflowEnv:
    """
    A real Airflow (metadata DB + dag-processor + triggerer + scheduler + api-server).

    :param dags_folder: the Dags folder (it is also on ``sys.path`` of every component).
    :param connections: ``conn_id -> dict | URI`` exported as ``AIRFLOW_CONN_*``.
    :param triggerer: ``[triggerer]`` options, e.g. ``{"shared_stream_ack_timeout": 60}``.
    :param config: any other options, ``{"section": {"option": value}}`` (wins over the defaults).
    :param env: extra environment variables for every component (read by Dags and tasks).
    :param home: ``AIRFLOW_HOME``; a new temporary directory by default (deleted on exit unless
        ``keep_home``).
    :param api_server: start the api-server (needed for any task to run, and for the REST helpers).
    :param admin_password: password of the ``admin`` user of the SimpleAuthManager.
    :param parallelism: ``[core] parallelism`` (LocalExecutor worker slots).
    :param startup_timeout: seconds to wait for the components to report healthy.
    :param api_port: api-server port (a free one by default).
    :param python_path: directories put on ``PYTHONPATH`` of every component; default: the Dags
        folder. Airflow 3.3 puts the Dags folder on ``sys.path`` of the Dag processor and of task
        processes, but **not of the triggerer** (only ``$AIRFLOW_HOME/config`` and the plugins
        folder), and the triggerer is where ``filter_function="module.func"`` is imported.
    :param sql_alchemy_conn: metadata DB URL (``[database] sql_alchemy_conn``); default: a SQLite
        file in the home. Only SQLite and ``postgresql+psycopg2://`` are supported by the read-only
        helpers (:meth:`query_db`). The DB must be empty or migrated by the same Airflow version.
    """

    dags_folder: Path
    connections: Mapping[str, Mapping[str, Any] | str] = field(default_factory=dict)
    triggerer: Mapping[str, object] = field(default_factory=dict)
    config: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    home: Path | None = None
    keep_home: bool = False
    api_server: bool = True
    admin_password: str = "admin"
    parallelism: int = 4
    startup_timeout: float = 300.0
    api_port: int = 0
    python_path: tuple[Path, ...] | None = None
    sql_alchemy_conn: str | None = None

    components: dict[str, AirflowComponent] = field(default_factory=dict, init=False)
    _created_home: bool = field(default=False, init=False)
    _token: str | None = field(default=None, init=False)
    _client: httpx.Client | None = field(default=None, init=False)
    _process_env: dict[str, str] = field(default_factory=dict, init=False)

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> AirflowEnv:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def airflow_home(self) -> Path:
        if self.home is None:
            raise AirflowEnvError("the environment has not been started")
        return self.home

    @property
    def db_path(self) -> Path:
        return self.airflow_home / "airflow.db"

    @property
    def is_postgres(self) -> bool:
        return self.sql_alchemy_conn is not None and self.sql_alchemy_conn.startswith("postgresql")

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def process_env(self) -> dict[str, str]:
        """The environment every ``airflow`` subprocess gets (a copy)."""
        return dict(self._process_env)

    def build_env(self) -> dict[str, str]:
        home = self.airflow_home
        base = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_")) and key != "AIRFLOW_HOME"
        }
        from cryptography.fernet import Fernet

        settings: dict[tuple[str, str], object] = {
            ("database", "sql_alchemy_conn"): self.sql_alchemy_conn or f"sqlite:///{self.db_path}",
            ("core", "dags_folder"): str(self.dags_folder),
            ("core", "load_examples"): False,
            ("core", "executor"): "LocalExecutor",
            ("core", "parallelism"): self.parallelism,
            ("core", "fernet_key"): Fernet.generate_key().decode(),
            ("core", "execution_api_server_url"): f"{self.api_url}/execution/",
            ("core", "simple_auth_manager_users"): "admin:admin",
            ("core", "simple_auth_manager_passwords_file"): str(home / "simple_auth_manager_passwords.json"),
            ("core", "dags_are_paused_at_creation"): True,
            ("api", "base_url"): self.api_url,
            ("api", "host"): "127.0.0.1",
            ("api", "port"): self.api_port,
            ("api", "workers"): 1,
            ("api", "maximum_page_limit"): 100_000,
            ("api", "secret_key"): secrets.token_urlsafe(24),
            ("api_auth", "jwt_secret"): secrets.token_urlsafe(32),
            ("logging", "base_log_folder"): str(home / "logs"),
            ("logging", "worker_log_server_port"): free_port(),
            ("logging", "trigger_log_server_port"): free_port(),
            ("dag_processor", "refresh_interval"): 5,
            ("dag_processor", "min_file_process_interval"): 60,
            ("dag_processor", "parsing_processes"): 1,
            ("dag_processor", "print_stats_interval"): 300,
            ("scheduler", "scheduler_heartbeat_sec"): 2,
            ("scheduler", "task_instance_heartbeat_sec"): 5,
            ("triggerer", "job_heartbeat_sec"): 2,
            ("triggerer", "triggerer_health_check_threshold"): 10,
            # No shared_stream_cohort_grace_period: it stays at Airflow's default (0); the
            # producers wait for their cohort themselves (_core/cohort.py).
        }
        if self.is_postgres:
            # Airflow derives the async URL by swapping the driver for asyncpg; set it explicitly
            # so the sync (psycopg2) and async (asyncpg) engines can never disagree on the DB.
            assert self.sql_alchemy_conn is not None
            _scheme, rest = self.sql_alchemy_conn.split("://", 1)
            settings["database", "sql_alchemy_conn_async"] = f"postgresql+asyncpg://{rest}"
        for option, value in self.triggerer.items():
            settings["triggerer", option] = value
        for section, options in self.config.items():
            for option, value in options.items():
                settings[section, option] = value
        env = dict(base)
        env["AIRFLOW_HOME"] = str(home)
        env["PYTHONUNBUFFERED"] = "1"
        extra_path = [str(p) for p in (self.python_path if self.python_path is not None else (self.dags_folder,))]
        if base.get("PYTHONPATH"):
            extra_path.append(base["PYTHONPATH"])
        if extra_path:
            env["PYTHONPATH"] = os.pathsep.join(extra_path)
        env["NO_COLOR"] = "1"
        for (section, option), value in settings.items():
            env[_config_env(section, option)] = _config_value(value)
        for conn_id, connection in self.connections.items():
            key, value = connection_env(conn_id, connection)
            env[key] = value
        env.update(self.env)
        return env

    def start(self) -> None:
        """Create the home, migrate the DB, start every component and wait until they are healthy."""
        if self.home is None:
            self.home = Path(tempfile.mkdtemp(prefix="airflow-env-"))
            self._created_home = True
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.api_port:
            self.api_port = free_port()
        (self.home / "process-logs").mkdir(exist_ok=True)
        # The SimpleAuthManager only generates passwords for users missing from this file.
        (self.home / "simple_auth_manager_passwords.json").write_text(json.dumps({"admin": self.admin_password}))
        self._process_env = self.build_env()
        # Also stop the components if the caller never reaches stop() (an uncaught exception
        # outside a with-block, sys.exit): no orphaned scheduler keeps running.
        atexit.register(self.stop)
        self.migrate()
        names = [name for name in COMPONENTS if self.api_server or name != "api-server"]
        for name in names:
            self.components[name] = self._component(name)
            self.components[name].start()
        self.wait_healthy(timeout=self.startup_timeout)

    def _component(self, name: str) -> AirflowComponent:
        argv = [venv_bin("airflow"), name]
        if name in ("triggerer", "scheduler"):
            argv.append("--skip-serve-logs")
        if name == "api-server":
            argv += ["--host", "127.0.0.1", "--port", str(self.api_port), "--workers", "1"]
        return AirflowComponent(
            name=name,
            argv=argv,
            env=self._process_env,
            log_path=self.airflow_home / "process-logs" / f"{name}.log",
        )

    def add_triggerer(
        self, name: str, triggerer: Mapping[str, object] | None = None, *, args: Sequence[str] = ()
    ) -> AirflowComponent:
        """
        Start one more ``airflow triggerer`` on the same metadata DB (an HA deployment), with its
        own ``[triggerer]`` options on top of the environment's (e.g. another ``capacity``) and
        extra command-line ``args`` (e.g. ``["--queues", "q"]``).
        """
        if name in self.components:
            raise AirflowEnvError(f"a component named {name!r} exists already")
        env = dict(self._process_env)
        for option, value in (triggerer or {}).items():
            env[_config_env("triggerer", option)] = _config_value(value)
        component = AirflowComponent(
            name=name,
            argv=[venv_bin("airflow"), "triggerer", "--skip-serve-logs", *args],
            env=env,
            log_path=self.airflow_home / "process-logs" / f"{name}.log",
        )
        self.components[name] = component
        component.start()
        return component

    def migrate(self, timeout: float = 600.0) -> None:
        log_path = self.airflow_home / "process-logs" / "db-migrate.log"
        with log_path.open("wb") as log:
            try:
                result = subprocess.run(
                    [venv_bin("airflow"), "db", "migrate"],
                    env=self._process_env,
                    cwd=self.airflow_home,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise AirflowEnvError(f"airflow db migrate did not finish in {timeout}s") from exc
        if result.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise AirflowEnvError(f"airflow db migrate failed with exit code {result.returncode}:\n{tail}")

    def stop(self) -> None:
        """Stop every component (process groups), close the client, delete a temporary home."""
        atexit.unregister(self.stop)
        if self._client is not None:
            self._client.close()
            self._client = None
        # Scheduler first (no new task starts), triggerers last but one, api-server last.
        extra = [name for name in self.components if name not in COMPONENTS]
        for name in ("scheduler", "dag-processor", *extra, "triggerer", "api-server"):
            component = self.components.get(name)
            if component is not None:
                component.stop()
        if self._created_home and not self.keep_home and self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    # -- diagnostics ------------------------------------------------------------------------------
    def log_tails(self, lines: int = 30) -> str:
        parts = []
        for name, component in self.components.items():
            state = "running" if component.alive else f"exited with {component.returncode}"
            parts.append(f"----- {name} ({state}, log {component.log_path}) -----\n{component.log_tail(lines)}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        """Raise (with the log tail) if a component that should be running has exited."""
        for name, component in self.components.items():
            if component.process is not None and not component.alive and component.kills < component.starts:
                raise AirflowEnvError(
                    f"airflow {name} exited with code {component.returncode}; "
                    f"last lines of {component.log_path}:\n{component.log_tail(60)}"
                )

    def wait_until(self, predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 1.0) -> T:
        """Poll ``predicate`` until it returns something truthy; raise with every log tail on timeout."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            self.check_alive()
            try:
                result = predicate()
            except (httpx.HTTPError, sqlite3.Error, AirflowEnvError) as exc:  # query_db wraps psycopg2's
                last_error = exc
                result = None
            if result:
                return result
            if time.monotonic() >= deadline:
                detail = f" (last error: {last_error!r})" if last_error else ""
                raise AirflowEnvError(f"timed out after {timeout:.0f}s waiting for {what}{detail}\n{self.log_tails()}")
            time.sleep(interval)

    def wait_healthy(self, timeout: float) -> None:
        """Wait until the api-server answers and reports every component's heartbeat as healthy."""
        if "api-server" not in self.components:
            self.wait_until(self._db_jobs_running, timeout=timeout, what="component heartbeats")
            return

        def healthy() -> bool:
            response = httpx.get(f"{self.api_url}/api/v2/monitor/health", timeout=10)
            if response.status_code != 200:
                return False
            body = response.json()
            return (
                all(
                    body.get(key, {}).get("status") == "healthy"
                    for name, key in _HEALTH_KEYS.items()
                    if name in self.components
                )
                and body.get("metadatabase", {}).get("status") == "healthy"
            )

        self.wait_until(healthy, timeout=timeout, what="api-server /monitor/health to report every component healthy")

    def _db_jobs_running(self) -> bool:
        rows = self.query_db("SELECT DISTINCT job_type FROM job WHERE state = 'running'")
        kinds = {row[0] for row in rows}
        return {"SchedulerJob", "TriggererJob", "DagProcessorJob"} <= kinds

    # -- components -------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """``kill -9`` one component's whole process group (a crash: no cleanup runs)."""
        self.components[name].kill()

    def restart(self, name: str) -> None:
        component = self.components[name]
        if component.alive:
            component.stop()
        component.start()

    # -- REST API ---------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.api_url, timeout=60)
        return self._client

    def token(self) -> str:
        if self._token is None:
            response = self.client.post(
                "/auth/token", json={"username": "admin", "password": self.admin_password}, timeout=60
            )
            response.raise_for_status()
            self._token = str(response.json()["access_token"])
        return self._token

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the public REST API as ``admin``; return the decoded JSON (None for an empty body)."""
        extra_headers = dict(kwargs.pop("headers", {}) or {})
        response: httpx.Response | None = None
        for attempt in range(4):
            try:
                headers = {**extra_headers, "Authorization": f"Bearer {self.token()}"}
                response = self.client.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError:
                if attempt == 3:
                    raise
                time.sleep(1.0 + attempt)
                continue
            if response.status_code == 401:
                self._token = None
                continue
            if response.status_code < 500 or attempt == 3:
                break
            time.sleep(1.0 + attempt)  # a busy SQLite answers 500 now and then: retry
        assert response is not None
        if response.status_code >= 400:
            raise AirflowEnvError(f"{method} {path} -> {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None

    def _paged(self, path: str, key: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        page = 10_000
        while True:
            body = self.api("GET", path, params={**params, "limit": page, "offset": len(items)})
            batch = list(body[key])
            items += batch
            if len(batch) < page or len(items) >= int(body["total_entries"]):
                return items

    def import_errors(self) -> list[dict[str, Any]]:
        return self._paged("/api/v2/importErrors", "import_errors", {})

    def dag(self, dag_id: str) -> dict[str, Any] | None:
        try:
            return dict(self.api("GET", f"/api/v2/dags/{dag_id}"))
        except AirflowEnvError as exc:
            if "-> 404" in str(exc):
                return None
            raise

    def wait_for_dags(self, dag_ids: Iterable[str], timeout: float = 240.0) -> dict[str, dict[str, Any]]:
        """Wait until every Dag is parsed and serialized; fail fast on an import error."""
        wanted = list(dag_ids)

        def parsed() -> dict[str, dict[str, Any]] | None:
            errors = self.import_errors()
            if errors:
                text = "\n".join(f"{err.get('filename')}:\n{err.get('stack_trace')}" for err in errors)
                raise AirflowEnvError(f"Dag import errors:\n{text}")
            found = {dag_id: self.dag(dag_id) for dag_id in wanted}
            if all(found.values()):
                return {dag_id: dag for dag_id, dag in found.items() if dag is not None}
            return None

        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                result = parsed()
            except httpx.HTTPError:
                result = None
            if result:
                return result
            if time.monotonic() >= deadline:
                raise AirflowEnvError(f"Dags {wanted} were not parsed within {timeout:.0f}s\n{self.log_tails()}")
            time.sleep(1.0)

    def unpause(self, dag_ids: Iterable[str], *, reparse: bool = True) -> None:
        """
        Unpause Dags and (by default) ask the Dag processor to re-parse their files.

        Airflow registers an asset's watchers only while a Dag scheduled on the asset is unpaused,
        and it does so when it parses the Dag file, so the re-parse is what starts the watchers.
        """
        tokens: set[str] = set()
        for dag_id in dag_ids:
            dag = self.api("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": False})
            tokens.add(str(dag["file_token"]))
        if reparse:
            for token in tokens:
                self.api("PUT", f"/api/v2/parseDagFile/{token}")

    def pause(self, dag_ids: Iterable[str]) -> None:
        for dag_id in dag_ids:
            self.api("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": True})

    def asset_events(self, asset_name: str | None = None, *, after_id: int = 0) -> list[dict[str, Any]]:
        """
        Every asset event (optionally of one asset; ``after_id``: only those with a larger id, for a
        poll that reads what is new), oldest first: ``id``, ``name`` (the asset's), ``extra``
        (decoded JSON) and ``timestamp``.

        Read from the metadata DB (read-only) rather than ``GET /api/v2/assets/events``: in Airflow
        3.3.2 that endpoint answers 500 while an event is linked to a Dag run that has not started
        yet (``created_dagruns[].start_date`` is required but None), which is the normal state of a
        busy asset-triggered Dag.
        """
        sql = (
            "SELECT e.id, a.name, e.extra, e.timestamp FROM asset_event e JOIN asset a ON a.id = e.asset_id"
            " WHERE e.id > ?" + (" AND a.name = ?" if asset_name is not None else "") + " ORDER BY e.id"
        )
        rows = self.query_db(sql, (after_id, asset_name) if asset_name is not None else (after_id,))
        return [
            # SQLite returns the JSON column as text, psycopg2 decoded (a dict).
            {"id": int(i), "name": str(n), "extra": json.loads(x) if isinstance(x, str) else x, "timestamp": str(t)}
            for i, n, x, t in rows
        ]

    def asset_event_counts(self) -> dict[str, int]:
        """``asset name -> number of asset events`` (metadata DB, read-only)."""
        rows = self.query_db(
            "SELECT a.name, count(e.id) FROM asset a LEFT JOIN asset_event e ON e.asset_id = a.id GROUP BY a.name"
        )
        return {str(name): int(count) for name, count in rows}

    def assets(self) -> list[dict[str, Any]]:
        return self._paged("/api/v2/assets", "assets", {"only_active": True})

    def asset(self, name: str) -> dict[str, Any] | None:
        for asset in self.assets():
            if asset["name"] == name:
                return asset
        return None

    def dag_runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self._paged(f"/api/v2/dags/{dag_id}/dagRuns", "dag_runs", {"order_by": "id"})

    def dag_run_states(self, dag_id: str) -> dict[str, int]:
        states: dict[str, int] = {}
        for run in self.dag_runs(dag_id):
            states[str(run["state"])] = states.get(str(run["state"]), 0) + 1
        return states

    def queued_asset_events(self, dag_id: str) -> int:
        """How many assets have queued events (``AssetDagRunQueue`` rows) waiting for a run of ``dag_id``."""
        body = self.api("GET", f"/api/v2/dags/{dag_id}/assets/queuedEvents")
        return int(body["total_entries"])

    def dag_idle(self, dag_id: str) -> bool:
        """No queued or running run, and no queued asset event that would create one."""
        states = self.dag_run_states(dag_id)
        return not states.get("queued") and not states.get("running") and self.queued_asset_events(dag_id) == 0

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        body = self.api(
            "GET",
            f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
            params={"full_content": True},
            headers={"Accept": "application/json"},
        )
        content = body.get("content") if isinstance(body, dict) else body
        if isinstance(content, list):
            return "\n".join(str(line.get("event", line)) if isinstance(line, dict) else str(line) for line in content)
        return str(content)

    # -- metadata DB (read-only, for what the REST API does not expose) ----------------------------
    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        uri = f"file:{self.db_path}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=30)
        try:
            yield conn
        finally:
            conn.close()

    def query_db(self, sql: str, params: Iterable[Any] = ()) -> list[tuple[Any, ...]]:
        """Run one read-only query on the metadata DB (``?`` placeholders, for either DB)."""
        if self.is_postgres:
            return self._query_postgres(sql, tuple(params))
        with self._db() as conn:
            return list(conn.execute(sql, tuple(params)).fetchall())

    def _query_postgres(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        import psycopg2
        from sqlalchemy.engine import make_url

        assert self.sql_alchemy_conn is not None
        url = make_url(self.sql_alchemy_conn)
        try:
            conn = psycopg2.connect(
                host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database
            )
        except psycopg2.Error as exc:
            raise AirflowEnvError(f"cannot connect to the metadata DB: {exc}") from exc
        try:
            conn.set_session(readonly=True, autocommit=True)
            with conn.cursor() as cursor:
                # Our queries hold no literal "?" and no "%": the placeholders map one to one to
                # psycopg2's (without parameters, psycopg2 leaves the text alone).
                cursor.execute(sql.replace("?", "%s"), params or None)
                return list(cursor.fetchall())
        except psycopg2.Error as exc:
            # As an AirflowEnvError, wait_until retries it like a busy SQLite file.
            raise AirflowEnvError(f"metadata DB query failed: {exc}") from exc
        finally:
            conn.close()

    def running_watchers(self) -> list[tuple[str, str, int | None]]:
        """``(asset name, watcher name, triggerer job id)`` of every registered asset watcher."""
        rows = self.query_db(
            "SELECT a.name, w.name, t.triggerer_id FROM asset_watcher w "
            "JOIN asset a ON a.id = w.asset_id JOIN trigger t ON t.id = w.trigger_id ORDER BY a.name"
        )
        return [(str(a), str(w), None if t is None else int(t)) for a, w, t in rows]

    def alive_triggerer_ids(self) -> set[int]:
        """Triggerer jobs that are running and heart-beat in the last 10 seconds."""
        recent = "now() - interval '10 seconds'" if self.is_postgres else "datetime('now', '-10 seconds')"
        rows = self.query_db(
            f"SELECT id FROM job WHERE job_type = 'TriggererJob' AND state = 'running' AND latest_heartbeat >= {recent}"
        )
        return {int(row[0]) for row in rows}

    def latest_triggerer_job_id(self) -> int:
        rows = self.query_db("SELECT max(id) FROM job WHERE job_type = 'TriggererJob'")
        return int(rows[0][0] or 0)

    def wait_for_watchers(
        self, watcher_names: Iterable[str], *, newer_than_job: int = 0, timeout: float = 240.0
    ) -> list[tuple[str, str, int | None]]:
        """
        Wait until every named watcher's trigger is assigned to a live triggerer.

        ``newer_than_job``: only count triggerer jobs with a larger id (after a restart, the killed
        triggerer still looks alive until its heartbeat is 10 s old).
        """
        wanted = set(watcher_names)

        def ready() -> list[tuple[str, str, int | None]] | None:
            rows = self.running_watchers()
            alive = {job for job in self.alive_triggerer_ids() if job > newer_than_job}
            assigned = {watcher for _, watcher, job in rows if job is not None and job in alive}
            return rows if wanted <= assigned else None

        return self.wait_until(ready, timeout=timeout, what=f"watchers {sorted(wanted)} to run in a triggerer")

    def restart_triggerer(self, *, kill: bool = True) -> int:
        """``kill -9`` (or stop) the triggerer and start a new one; return the previous job id."""
        previous = self.latest_triggerer_job_id()
        if kill:
            self.kill("triggerer")
        else:
            self.components["triggerer"].stop()
        self.components["triggerer"].start()
        return previous

    def login_hint(self) -> str:
        return f"{self.api_url}  (login: admin / {self.admin_password})"
