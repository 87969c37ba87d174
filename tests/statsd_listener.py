"""
A StatsD collector for tests: a UDP socket on a free loopback port that keeps every packet.

It parses the plain StatsD line format (``name:value|type[|@rate]``), with InfluxDB-style tags in
the name (``name,tag=value,tag2=value2``, what Airflow sends with ``statsd_influxdb_enabled``) and
DogStatsD tags after the type (``|#tag:value,tag2:value2``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    kind: str  # "c" counter, "g" gauge, "ms" timer, ...
    tags: tuple[tuple[str, str], ...]

    def tag(self, key: str) -> str | None:
        return dict(self.tags).get(key)


def parse_line(line: str) -> Metric | None:
    """One StatsD line, or None if it is not one."""
    head, sep, rest = line.partition(":")
    if not sep:
        return None
    fields = rest.split("|")
    if len(fields) < 2:
        return None
    tags: list[tuple[str, str]] = []
    name, *influx = head.split(",")
    for item in influx:
        key, _, value = item.partition("=")
        tags.append((key, value))
    for extra in fields[2:]:
        if extra.startswith("#"):
            for item in extra[1:].split(","):
                key, _, value = item.partition(":")
                tags.append((key, value))
    try:
        number = float(fields[0])
    except ValueError:
        return None
    return Metric(name, number, fields[1], tuple(tags))


class StatsdListener:
    """Collects StatsD packets in a thread until closed; ``metrics()`` returns what arrived so far."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.2)
        self.port: int = self._socket.getsockname()[1]
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="statsd-listener", daemon=True)

    def __enter__(self) -> StatsdListener:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            lines = data.decode("utf-8", "replace").splitlines()
            with self._lock:
                self._lines.extend(line for line in lines if line)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def metrics(self, prefix: str = "") -> list[Metric]:
        parsed = (parse_line(line) for line in self.lines())
        return [metric for metric in parsed if metric is not None and metric.name.startswith(prefix)]

    def wait_for(self, predicate: Callable[[list[Metric]], bool], *, timeout: float, what: str) -> list[Metric]:
        """Poll until ``predicate(metrics)`` is true; raise with what arrived otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if predicate(metrics):
                return metrics
            if time.monotonic() > deadline:
                names = sorted({m.name for m in metrics})
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; metric names seen: {names}")
            time.sleep(0.5)
