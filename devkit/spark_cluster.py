"""
A throwaway Spark standalone cluster (1 master + N workers) and a Spark Connect server, on loopback.

Used by ``tests/e2e/test_spark_cluster.py`` and ``python -m devkit.demo --spark standalone|connect``::

    with SparkCluster() as cluster:
        cluster.master_url                 # spark://127.0.0.1:<port>
        cluster.connect_url                # sc://127.0.0.1:<port>
        cluster.standalone_connection()    # an Airflow ``spark`` connection (dict) for that master
        cluster.connect_connection()       # an Airflow ``spark_connect`` connection for the server

Everything comes from the installed ``pyspark`` (its ``bin/spark-class`` and ``bin/spark-submit``;
pyspark 4 ships the Spark Connect server jar in ``jars/``), needs Java 17 on ``PATH`` and no network
beyond 127.0.0.1. Each process runs in the foreground in its own process group (no
``sbin/start-*.sh`` daemonizing: this object owns the processes), with its log, ``SPARK_CONF_DIR``
(empty: no stray ``spark-defaults.conf`` applies), scratch and worker directories under one
temporary directory that :meth:`SparkCluster.stop` deletes.

Invariants:

* Ready means usable: :meth:`SparkCluster.start` returns once the master's ``/json/`` lists every
  worker ``ALIVE`` and, with ``connect``, the server accepts on its gRPC port and the master has
  granted its application every core it asked for (its executors run on the workers).
* Cores are shared between applications: a standalone application takes every free core unless
  ``spark.cores.max`` caps it, and an application that gets none waits forever. The Connect
  server is capped at ``connect_cores`` and :meth:`SparkCluster.standalone_connection` caps a
  driver at what is left (``workers * worker_cores - connect_cores``), so the server and one
  Airflow task can run side by side.
* Nothing outlives :meth:`SparkCluster.stop`: a worker starts its executors in its own process
  group, so SIGTERM then SIGKILL of each group takes them too; :meth:`SparkCluster.leftover_pids`
  finds any process whose command line still names the temporary directory (every JVM of the
  cluster has ``SPARK_CONF_DIR`` on its class path).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx

from devkit.ports import free_port
from devkit.processes import stop_process_group

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

LOOPBACK: Final = "127.0.0.1"
CONNECT_SERVER_CLASS: Final = "org.apache.spark.sql.connect.service.SparkConnectServer"


class SparkClusterError(RuntimeError):
    """The cluster did not start; the message carries the tail of every process's log."""


def pyspark_home() -> Path:
    """The installed pyspark package directory: a complete ``SPARK_HOME`` (bin/, sbin/, jars/)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


@dataclass
class SparkProcess:
    """One foreground Spark JVM (``spark-class`` / ``spark-submit`` exec into java) in its own process group."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"===== devkit: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.log_path.parent,
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group (Spark's shutdown hooks stop executors), then SIGKILL what is left."""
        proc = self.process
        if proc is None:
            return
        stop_process_group(proc, timeout)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class SparkCluster:
    """
    A standalone master, ``workers`` workers and (with ``connect``) a Spark Connect server whose
    application runs on those workers. Ports are picked (free loopback ports) at construction, so
    :attr:`master_url`, :attr:`connect_url` and the connection dicts are known before :meth:`start`.

    :param workers: number of worker processes.
    :param worker_cores: cores each worker offers (a scheduling budget, not a CPU pin).
    :param worker_memory: memory each worker offers to executors.
    :param executor_memory: memory of each executor (Connect server's and standalone drivers').
    :param connect: also start a Spark Connect server.
    :param connect_cores: ``spark.cores.max`` of the Connect server's application.
    :param connect_memory: heap of the Connect server (its driver).
    :param daemon_memory: heap of the master and worker daemons (``SPARK_DAEMON_MEMORY``).
    :param startup_timeout: seconds to wait for each readiness condition.
    :param spark_home: a Spark distribution; default: the installed pyspark.
    :param keep_dir: keep the temporary directory (logs) after :meth:`stop`.
    """

    workers: int = 2
    worker_cores: int = 2
    worker_memory: str = "1g"
    executor_memory: str = "512m"
    connect: bool = True
    connect_cores: int = 2
    connect_memory: str = "1g"
    daemon_memory: str = "256m"
    startup_timeout: float = 180.0
    spark_home: Path | None = None
    keep_dir: bool = False

    master_port: int = field(default=0, init=False)
    master_ui_port: int = field(default=0, init=False)
    connect_port: int = field(default=0, init=False)
    # The temporary directory; still set (but deleted) after stop(), for leftover_pids().
    workdir: Path | None = field(default=None, init=False)
    processes: dict[str, SparkProcess] = field(default_factory=dict, init=False)
    _running: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.connect and self.connect_cores >= self.workers * self.worker_cores:
            raise ValueError("connect_cores must leave cores for standalone drivers")
        self.master_port = free_port()
        self.master_ui_port = free_port()
        self.connect_port = free_port() if self.connect else 0

    # -- addresses --------------------------------------------------------------------------------
    @property
    def master_url(self) -> str:
        return f"spark://{LOOPBACK}:{self.master_port}"

    @property
    def master_ui_url(self) -> str:
        return f"http://{LOOPBACK}:{self.master_ui_port}"

    @property
    def connect_url(self) -> str:
        if not self.connect:
            raise SparkClusterError("this cluster has no Spark Connect server (connect=False)")
        return f"sc://{LOOPBACK}:{self.connect_port}"

    @property
    def driver_cores(self) -> int:
        """Cores one standalone driver may take while the Connect server holds its own."""
        return self.workers * self.worker_cores - (self.connect_cores if self.connect else 0)

    def standalone_connection(self, **extra: str) -> dict[str, Any]:
        """
        An Airflow ``spark`` connection for the master: ``@task.pyspark`` makes the Airflow task the
        driver (client mode) with ``spark.master=spark://127.0.0.1:<port>``; the extras are Spark
        settings (``extra`` adds or overrides some).
        """
        settings = {
            # Executors connect back to the driver: keep it on loopback, whatever the hostname says.
            "spark.driver.host": LOOPBACK,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.cores.max": str(self.driver_cores),
            "spark.executor.cores": "1",
            "spark.executor.memory": self.executor_memory,
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            **extra,
        }
        return {"conn_type": "spark", "host": f"spark://{LOOPBACK}", "port": self.master_port, "extra": settings}

    def connect_connection(self, user_id: str | None = None) -> dict[str, Any]:
        """
        An Airflow ``spark_connect`` connection for the server (``spark.remote=sc://127.0.0.1:<port>``).
        ``user_id`` (the connection's login) is sent with every request and shows in the server's log.
        """
        connection: dict[str, Any] = {
            "conn_type": "spark_connect",
            "host": f"sc://{LOOPBACK}",
            "port": self.connect_port,
        }
        if user_id:
            connection["login"] = user_id
        return connection

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> SparkCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> SparkCluster:
        """Start the master, the workers and the Connect server; return once all are usable."""
        if self._running:
            raise SparkClusterError("the cluster is already started")
        self._running = True
        self.processes = {}
        self.workdir = Path(tempfile.mkdtemp(prefix="devkit-spark-cluster-"))
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        home = self.spark_home or pyspark_home()
        self._add(
            "master",
            [
                str(home / "bin" / "spark-class"),
                "org.apache.spark.deploy.master.Master",
                *("--host", LOOPBACK, "--port", str(self.master_port), "--webui-port", str(self.master_ui_port)),
            ],
        )
        self.wait_until(lambda: self.master_state().get("status") == "ALIVE", what="the master to be ALIVE")
        for index in range(1, self.workers + 1):
            work_dir = self._dir(f"worker-{index}")
            self._add(
                f"worker-{index}",
                [
                    str(home / "bin" / "spark-class"),
                    "org.apache.spark.deploy.worker.Worker",
                    *("--host", LOOPBACK, "--webui-port", str(free_port())),
                    *("--cores", str(self.worker_cores), "--memory", self.worker_memory),
                    *("--work-dir", str(work_dir), self.master_url),
                ],
            )
        # The Connect server's application needs executors, so workers first; it starts while they
        # register (the master grants cores as they come).
        if self.connect:
            # The launcher runs the Connect server like a daemon: SPARK_DAEMON_MEMORY sets its heap
            # (not --driver-memory), and a driver needs at least 450 MiB.
            self._add("connect", self._connect_argv(home), SPARK_DAEMON_MEMORY=self.connect_memory)
        self.wait_until(lambda: self.alive_workers() >= self.workers, what=f"{self.workers} workers to register ALIVE")
        if self.connect:
            self.wait_until(self._connect_ready, what="the Spark Connect server to accept and get its executors")

    def _connect_argv(self, home: Path) -> list[str]:
        settings = {
            "spark.connect.grpc.binding.address": LOOPBACK,
            "spark.connect.grpc.binding.port": str(self.connect_port),
            "spark.driver.host": LOOPBACK,
            "spark.driver.bindAddress": LOOPBACK,
            "spark.ui.enabled": "false",
            "spark.cores.max": str(self.connect_cores),
            "spark.executor.cores": "1",
            "spark.executor.memory": self.executor_memory,
            "spark.sql.shuffle.partitions": "2",
        }
        argv = [
            str(home / "bin" / "spark-submit"),
            *("--class", CONNECT_SERVER_CLASS, "--name", "Spark Connect server"),
            *("--master", self.master_url, "--driver-memory", self.connect_memory),
        ]
        for key, value in settings.items():
            argv += ["--conf", f"{key}={value}"]
        return argv

    def stop(self) -> None:
        """Stop the Connect server, the workers (and their executors), the master; delete the directory."""
        atexit.unregister(self.stop)
        for name in reversed(list(self.processes)):
            self.processes[name].stop()
        if self._running and self.workdir is not None and not self.keep_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self._running = False

    # -- state ------------------------------------------------------------------------------------
    def master_state(self) -> dict[str, Any]:
        """The master web UI's JSON (``/json/``): workers, applications, cores; {} while it is down."""
        try:
            response = httpx.get(f"{self.master_ui_url}/json/", timeout=5)
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        return dict(response.json())

    def alive_workers(self) -> int:
        return sum(1 for worker in self.master_state().get("workers", []) if worker.get("state") == "ALIVE")

    def applications(self, *, completed: bool = True) -> list[dict[str, Any]]:
        """Active (and, by default, completed) applications the master has seen: ``name``, ``cores``, ..."""
        state = self.master_state()
        return list(state.get("activeapps", [])) + (list(state.get("completedapps", [])) if completed else [])

    def _connect_ready(self) -> bool:
        if not _accepts(self.connect_port):
            return False
        apps = [app for app in self.applications(completed=False) if app.get("name") == "Spark Connect server"]
        return bool(apps) and int(apps[0].get("cores", 0)) >= self.connect_cores

    def log_path(self, name: str) -> Path:
        """Log file of one process (``master``, ``worker-1``, ..., ``connect``); gone after :meth:`stop`."""
        return self.processes[name].log_path

    def log_tails(self, lines: int = 30) -> str:
        return "\n".join(
            f"----- {name} ({'running' if proc.alive else 'exited'}, {proc.log_path}) -----\n{proc.log_tail(lines)}"
            for name, proc in self.processes.items()
        )

    def leftover_pids(self, marker: str | None = None) -> list[int]:
        """
        Pids of processes whose command line contains ``marker`` (default: this cluster's directory,
        which is on every cluster JVM's class path as ``SPARK_CONF_DIR``). Empty after :meth:`stop`.
        """
        if marker is None and self.workdir is None:
            return []
        needle = (marker or str(self.workdir)).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
        return pids

    # -- helpers ----------------------------------------------------------------------------------
    def _dir(self, name: str) -> Path:
        assert self.workdir is not None
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("SPARK_", "PYSPARK_"))}
        env.update(
            {
                "SPARK_HOME": str(self.spark_home or pyspark_home()),
                "SPARK_CONF_DIR": str(self._dir("conf")),
                "SPARK_LOG_DIR": str(self._dir("logs")),
                "SPARK_LOCAL_DIRS": str(self._dir("scratch")),
                "SPARK_LOCAL_IP": LOOPBACK,
                "SPARK_DAEMON_MEMORY": self.daemon_memory,
                # The master's REST submission server listens on the fixed port 6066: not needed, and
                # two clusters (or another Spark) on one machine would collide on it.
                "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
                # Only used if a job ever ships Python code to the executors (this pipeline does not).
                "PYSPARK_PYTHON": sys.executable,
            }
        )
        return env

    def _add(self, name: str, argv: list[str], **env: str) -> None:
        process = SparkProcess(name, argv, {**self._env(), **env}, self._dir("logs") / f"{name}.log")
        self.processes[name] = process
        process.start()

    def wait_until(self, predicate: Callable[[], bool], *, what: str, interval: float = 0.3) -> None:
        """Poll ``predicate()`` until truthy; fail fast (with the logs) if a process exited."""
        deadline = time.monotonic() + self.startup_timeout
        while True:
            for name, process in self.processes.items():
                if not process.alive:
                    raise SparkClusterError(f"spark {name} exited while waiting for {what}\n{self.log_tails()}")
            if predicate():
                return
            if time.monotonic() >= deadline:
                raise SparkClusterError(
                    f"timed out after {self.startup_timeout:.0f}s waiting for {what}\n{self.log_tails()}"
                )
            time.sleep(interval)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=0.5):
        return True
    return False


def main() -> None:
    """``python -m devkit.spark_cluster``: start a cluster, print its addresses, run until Ctrl-C."""
    with SparkCluster() as cluster:
        print(f"master  {cluster.master_url}  (UI {cluster.master_ui_url})")
        print(f"connect {cluster.connect_url}")
        print(f"logs    {cluster.workdir}")
        with contextlib.suppress(KeyboardInterrupt):
            while all(process.alive for process in cluster.processes.values()):
                time.sleep(1)


if __name__ == "__main__":
    main()
