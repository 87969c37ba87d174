"""
The Redis Streams :class:`~tests.e2e.loop_brokers.LoopBroker` of the kill loops: a real
``redis-server`` of the loop's own (or ``REDIS_URL``), the stream ``kill-loop`` and its consumer
group, a paced publisher (``XADD``, one order per entry in the ``body`` field) and the group's
state (pending plus not yet delivered) as "unsettled".
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import redis

from airflow_shared_stream_provider.triggers.redis import DEFAULT_GROUP
from devkit.demo_streams import paced_chunks
from devkit.demo_types import OrderMessage
from devkit.redis_broker import start_redis
from tests.e2e.loop_brokers import LoopBroker


class RedisLoop(LoopBroker):
    name = "redis"

    def __init__(self) -> None:
        self.server = start_redis()
        # Unique per loop: REDIS_URL may name a server other runs use too.
        self.source = f"kill-loop-{uuid.uuid4().hex[:8]}"
        self.dead_letter_stream = f"{self.source}:dead-letter"
        self.client = redis.Redis(**self.server.client_kwargs(), protocol=2)
        self._ids: list[str] = []
        self._lock = threading.Lock()

    def connection(self) -> dict[str, Any]:
        return self.server.connection()

    def trigger_kwargs(self) -> dict[str, Any]:
        # claim_idle at the SQS / Service Bus loops' lease (30 s, the default): a killed
        # triggerer's entries come back after it.
        return {"stream": self.source, "dead_letter_stream": self.dead_letter_stream, "block": 1.0}

    def publish(self, messages: Sequence[OrderMessage], *, rate: float, stop: threading.Event) -> None:
        for chunk in paced_chunks(messages, size=1, rate=rate, stop=stop):
            for message in chunk:
                entry_id = self.client.execute_command("XADD", self.source, "*", "body", message.value)
                with self._lock:
                    self._ids.append(bytes(entry_id).decode())

    def published_ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def close(self) -> None:
        try:
            if self.server.external:
                self.client.delete(self.source, self.dead_letter_stream)
        finally:
            self.client.close()
            self.server.close()

    def _group(self) -> dict[bytes, Any] | None:
        try:
            groups = self.client.execute_command("XINFO", "GROUPS", self.source)
        except redis.ResponseError:
            return None
        for group in groups:
            info = {bytes(group[i]): group[i + 1] for i in range(0, len(group) - 1, 2)}
            if info.get(b"name") == DEFAULT_GROUP.encode():
                return info
        return None

    def unsettled(self) -> int:
        info = self._group()
        if info is None:
            return int(self.client.xlen(self.source))
        last = bytes(info[b"last-delivered-id"]).decode()
        undelivered = self.client.execute_command("XRANGE", self.source, f"({last}", "+")
        return int(info[b"pending"]) + len(undelivered)

    def diagnostics(self) -> str:
        info = self._group()
        dead = self.client.xlen(self.dead_letter_stream)
        return f"group {info!r}; {dead} dead-lettered entr(ies)"
