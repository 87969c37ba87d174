"""
The Redis Streams side of the demo (``python -m devkit.demo --broker redis``): a real
``redis-server`` (``devkit.redis_broker``), the ``orders`` stream with its consumer group and
dead-letter stream, and the example Dags of ``example_dags/example_redis_orders.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from airflow_shared_stream_provider.triggers.redis import DEFAULT_GROUP
from devkit.demo_streams import DemoStream, paced_chunks
from devkit.demo_types import BrokerRestart, OrderMessage, Settlement
from devkit.redis_broker import RedisServer, start_redis

REDIS_STREAM = "orders"
REDIS_DEAD_LETTER_STREAM = "orders:dead-letter"
REDIS_CONN_ID = "redis_default"


@dataclass
class RedisOrders:
    """The ``orders`` stream on one server: a publisher and what the consumer group still holds."""

    server: RedisServer
    stream: str = REDIS_STREAM
    dead_letter_stream: str = REDIS_DEAD_LETTER_STREAM
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # Any: redis-py's sync client leaves execute_command untyped.
        self.client: Any = redis.Redis(**self.server.client_kwargs(), protocol=2)
        self._lock = threading.Lock()
        # Held for each chunk's XADDs and for a whole server restart: a publish waits out the
        # restart. redis-py retries a refused connection for about 4 s only (10 tries, backoff
        # capped at 1 s), and a chunk resent by hand after a failure could add entries twice.
        self.server_lock = threading.Lock()

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """XADD each order (its bytes in the ``body`` field, its key in ``key``), in order, paced."""
        for chunk in paced_chunks(messages, size=100, rate=rate, stop=stop):
            with self.server_lock:
                pipe = self.client.pipeline(transaction=False)
                for message in chunk:
                    pipe.execute_command("XADD", self.stream, "*", "body", message.value, "key", message.key)
                ids = pipe.execute()
            with self._lock:
                self.published.update((bytes(entry_id).decode(), m) for entry_id, m in zip(ids, chunk, strict=True))

    def backlog(self) -> int:
        """Entries the group has not acknowledged: pending plus not yet delivered (all, before the group exists)."""
        try:
            groups = self.client.execute_command("XINFO", "GROUPS", self.stream)
        except redis.ResponseError:
            return 0
        for group in groups:
            info = {bytes(group[i]): group[i + 1] for i in range(0, len(group) - 1, 2)}
            if info.get(b"name") == DEFAULT_GROUP.encode():
                last = bytes(info[b"last-delivered-id"]).decode()
                undelivered = self.client.execute_command("XRANGE", self.stream, f"({last}", "+")
                return int(info[b"pending"]) + len(undelivered)
        return int(self.client.xlen(self.stream))

    def dead_lettered(self) -> int:
        return int(self.client.xlen(self.dead_letter_stream))

    def close(self) -> None:
        self.client.close()


class RedisDemoStream(DemoStream[RedisOrders]):
    broker = "redis"
    dag_files = ("example_redis_orders.py", "order_filters.py", "order_events.py", "orders_spark.py")
    source_label = f"stream {REDIS_STREAM}"
    dlq_label = f"stream {REDIS_DEAD_LETTER_STREAM}"

    def __init__(self) -> None:
        super().__init__()
        self._server: RedisServer | None = None

    def start(self) -> str:
        self._server = start_redis()
        self._orders = RedisOrders(self._server)
        where = f"{self._server.host}:{self._server.port}"
        return f"redis-server {where}; stream {REDIS_STREAM} (its group is created by the watchers)"

    def stop(self) -> None:
        if self._orders is not None:
            self._orders.close()
        if self._server is not None:
            self._server.close()
            self._server = None

    @property
    def published(self) -> int:
        return len(self.orders.published)

    def restart_unsupported(self) -> str | None:
        if self._server is None:
            return "the redis demo stream is not started"
        if self._server.external:
            # host:port only: the URL may carry a password, and this reason goes into result files.
            where = f"{self._server.host}:{self._server.port}"
            return f"an external Redis ({where}, REDIS_URL) is not this run's to restart"
        return None

    def restart_keeping_data(self, down_seconds: float = 0.0) -> BrokerRestart:
        # SIGTERM: Redis fsyncs its append-only file and saves its RDB snapshot before it exits;
        # start() runs it again on the same port and data directory, so the stream, its consumer
        # group, the pending entries and the dead-letter stream are all back. Clients (the
        # watchers' producer, this publisher) reconnect by themselves.
        reason = self.restart_unsupported()
        if reason is not None:
            raise NotImplementedError(reason)
        server = self._server
        assert server is not None
        with self.orders.server_lock:
            began = time.monotonic()
            server.stop()
            stop_s = time.monotonic() - began
            time.sleep(down_seconds)
            server.start()
            down_s = time.monotonic() - began
        return BrokerRestart(f"{server.host}:{server.port}", round(stop_s, 2), round(down_s, 2))

    def connections(self) -> dict[str, Any]:
        assert self._server is not None
        return {REDIS_CONN_ID: self._server.connection()}

    def dag_env(self) -> dict[str, str]:
        return {
            "ORDERS_REDIS_STREAM": REDIS_STREAM,
            "ORDERS_REDIS_DEAD_LETTER_STREAM": REDIS_DEAD_LETTER_STREAM,
            "ORDERS_REDIS_CONN_ID": REDIS_CONN_ID,
        }

    def settlement(self) -> Settlement:
        # An entry is settled once the group acknowledged it (every watcher's events stored) or it
        # was copied to the dead-letter stream and then acknowledged.
        backlog = self.orders.backlog()
        published = self.published
        return Settlement(
            max(0, published - backlog), published, f"{backlog} not acknowledged in stream {REDIS_STREAM}"
        )

    def dead_lettered(self) -> int:
        return self.orders.dead_lettered()
