"""
The Redis Streams side of the demo (``python -m devkit.demo --broker redis``): a real
``redis-server`` (``devkit.redis_broker``), the ``orders`` stream with its consumer group and
dead-letter stream, and the example Dags of ``example_dags/example_redis_orders.py``.
"""

from __future__ import annotations

import time
from typing import Any

from devkit.demo_streams import DemoStream
from devkit.demo_types import BrokerRestart, Settlement
from devkit.kits.redis import REDIS_CONN_ID, REDIS_DEAD_LETTER_STREAM, REDIS_STREAM, RedisKit, RedisOrders
from devkit.redis_broker import RedisServer

__all__ = ["REDIS_CONN_ID", "REDIS_DEAD_LETTER_STREAM", "REDIS_STREAM", "RedisDemoStream", "RedisOrders"]


class RedisDemoStream(DemoStream[RedisOrders]):
    broker = "redis"
    source_label = f"stream {REDIS_STREAM}"
    dlq_label = f"stream {REDIS_DEAD_LETTER_STREAM}"

    def __init__(self) -> None:
        super().__init__()
        self.redis: RedisKit | None = None

    @property
    def _server(self) -> RedisServer | None:
        return None if self.redis is None else self.redis.server

    def start(self) -> str:
        kit = self.kit = self.redis = RedisKit()
        kit.start()
        self._orders = kit.stream(REDIS_STREAM, dead_letter_stream=REDIS_DEAD_LETTER_STREAM)
        assert kit.server is not None
        where = f"{kit.server.host}:{kit.server.port}"
        return f"redis-server {where}; stream {REDIS_STREAM} (its group is created by the watchers)"

    def stop(self) -> None:
        if self._orders is not None:
            self._orders.close()
        super().stop()
        self.redis = None

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
        assert self.kit is not None
        return {REDIS_CONN_ID: self.kit.connection()}

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
