"""
The Redis Streams broker of the real-triggerer benchmark (``bench/triggerer_bench.py``): a real
``redis-server`` (``devkit.redis_broker``) for the run, one stream per case, published with
pipelined ``XADD`` (one paced ``XADD`` per message in the steady phase).
"""

from __future__ import annotations

import threading
from typing import Any

import redis

from airflow_shared_stream_provider.brokers import broker_spec
from bench.triggerer_bench import BenchBroker, BenchStream, BodyFactory, paced
from devkit.redis_broker import RedisServer, start_redis


class RedisBroker(BenchBroker):
    name = "redis"

    def __init__(self) -> None:
        self.server: RedisServer | None = None

    def start(self) -> str:
        self.server = start_redis()
        return f"redis-server {self.server.host}:{self.server.port} (append-only file, fsync every second)"

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def stream(self, case_id: str) -> BenchStream:
        assert self.server is not None
        return RedisStream(self.server, f"bench-{case_id}")


class RedisStream(BenchStream):
    conn_id = "bench_redis"

    def __init__(self, server: RedisServer, stream: str) -> None:
        self.server = server
        self.stream = stream
        # Any: redis-py's sync client leaves execute_command untyped.
        self.client: Any = redis.Redis(**server.client_kwargs(), protocol=2)

    def publish(
        self, count: int, body: BodyFactory, *, rate: float | None = None, stop: threading.Event | None = None
    ) -> int:
        sent = 0
        if rate:
            for index in paced(count, rate, stop):
                self.client.execute_command("XADD", self.stream, "*", "body", body(index))
                sent += 1
            return sent
        for start in range(0, count, 500):
            pipe = self.client.pipeline(transaction=False)
            for index in range(start, min(count, start + 500)):
                pipe.execute_command("XADD", self.stream, "*", "body", body(index))
            sent += len(pipe.execute())
        return sent

    def trigger(self, impl: str) -> tuple[str, dict[str, Any]]:
        return (
            broker_spec("redis").trigger_path,
            {"stream": self.stream, "redis_conn_id": self.conn_id},
        )

    def connections(self, impl: str) -> dict[str, Any]:
        return {self.conn_id: self.server.connection()}
