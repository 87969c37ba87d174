"""
Redis Streams integration fixtures: a real ``redis-server`` and a fresh stream per test.

By default ``devkit.redis_broker.start_redis`` starts one ``redis-server`` on a free loopback port
for the session (append-only persistence in a temporary directory). With ``REDIS_URL`` set, no
server is started and the tests run against that one; every test uses keys of its own (a random
suffix) and deletes them afterwards, so a shared server is fine.

Stream state is always asserted through an independent client, never through the producer under test.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis

from airflow_shared_stream_provider.triggers.redis import DEFAULT_GROUP, RedisSharedStreamTrigger
from devkit.redis_broker import RedisServer, start_redis

CONN_ID = "redis_shared_stream_it"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The server under test: REDIS_URL, else a redis-server started here (never skipped)."""
    server = start_redis()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_connection(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """An Airflow ``redis`` connection (env var) pointing at the server; returns its conn id."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(redis_server.connection()))
    return CONN_ID


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """The independent client tests assert stream state with (binary replies, RESP2)."""
    client = aioredis.Redis(**redis_server.client_kwargs(), protocol=2)
    # Entries as Redis sends them (redis-py's parsers make dicts, which drop a repeated field).
    for command in ("XRANGE", "XREADGROUP", "XAUTOCLAIM", "XPENDING"):
        client.set_response_callback(command, lambda response, **_: response)
    try:
        yield client
    finally:
        await client.aclose()


def _pairs(item: Any) -> dict[bytes, Any]:
    return {bytes(item[i]): item[i + 1] for i in range(0, len(item) - 1, 2)}


@dataclass
class RedisAdapter:
    """:class:`tests.integration.contract.BrokerAdapter` for Redis Streams (plus helpers for Redis-only tests)."""

    client: aioredis.Redis
    conn_id: str
    stream: str
    dead_letter_stream: str
    group: str = DEFAULT_GROUP
    trigger_defaults: dict[str, Any] = field(default_factory=dict)
    broker: str = "redis"

    def make_trigger(self, **kwargs: Any) -> RedisSharedStreamTrigger:
        options: dict[str, Any] = {
            "stream": self.stream,
            "redis_conn_id": self.conn_id,
            "dead_letter_stream": self.dead_letter_stream,
            "group": self.group,
            "block": 0.2,
            "claim_idle": 10,
            **self.trigger_defaults,
        }
        options.update(kwargs)
        return RedisSharedStreamTrigger(**options)

    async def publish(self, bodies: Sequence[bytes], *, attributes: Mapping[str, str] | None = None) -> None:
        await self.publish_ids(bodies, attributes=attributes)

    async def publish_ids(self, bodies: Sequence[bytes], *, attributes: Mapping[str, str] | None = None) -> list[bytes]:
        """XADD each body (field ``body``) with ``attributes`` as further fields; the entry ids, in order."""
        pipe = self.client.pipeline(transaction=False)
        for body in bodies:
            fields: list[Any] = ["body", body]
            for name, value in (attributes or {}).items():
                fields += (name, value)
            pipe.execute_command("XADD", self.stream, "*", *fields)
        return [bytes(entry_id) for entry_id in await pipe.execute()]

    async def publish_fields(self, fields: Sequence[bytes | str], *, entry_id: str = "*") -> bytes:
        """XADD one entry with exactly these fields (any names, repeats, binary)."""
        return bytes(await self.client.execute_command("XADD", self.stream, entry_id, *fields))

    async def group_info(self) -> dict[bytes, Any] | None:
        try:
            groups = await self.client.execute_command("XINFO", "GROUPS", self.stream)
        except Exception:
            return None
        for group in groups:
            info = _pairs(group)
            if info.get(b"name") == self.group.encode():
                return info
        return None

    async def pending(self) -> list[tuple[bytes, bytes, int, int]]:
        """The group's pending entries: (id, consumer, idle ms, times delivered)."""
        try:
            reply = await self.client.execute_command("XPENDING", self.stream, self.group, "-", "+", 100_000)
        except Exception:
            return []
        return [(bytes(i), bytes(c), int(idle), int(n)) for i, c, idle, n in reply]

    async def unsettled(self) -> int:
        """Entries not acknowledged by the group: pending plus not yet delivered (all, before the group exists)."""
        info = await self.group_info()
        if info is None:
            return int(await self.client.xlen(self.stream))
        last = bytes(info[b"last-delivered-id"]).decode()
        undelivered = await self.client.execute_command("XRANGE", self.stream, f"({last}", "+")
        return int(info[b"pending"]) + len(undelivered)

    async def dead_letter_entries(self) -> list[tuple[bytes, list[bytes]]]:
        """Every dead-letter entry: (id, its flat field list, in order)."""
        reply = await self.client.execute_command("XRANGE", self.dead_letter_stream, "-", "+")
        return [(bytes(entry_id), [bytes(f) for f in fields]) for entry_id, fields in reply]

    async def dead_lettered(self) -> list[bytes]:
        bodies = []
        for _, fields in await self.dead_letter_entries():
            values = dict(zip(fields[::2], fields[1::2], strict=True))
            bodies.append(values.get(b"body", b""))
        return bodies

    async def cleanup(self) -> None:
        await self.client.delete(self.stream, self.dead_letter_stream)


def fresh_names() -> tuple[str, str]:
    name = f"it-{uuid.uuid4().hex[:12]}"
    return name, f"{name}:dead-letter"


@pytest.fixture
async def adapter(redis_client: aioredis.Redis, redis_connection: str) -> AsyncIterator[RedisAdapter]:
    """A fresh stream + dead-letter stream for one test, deleted afterwards."""
    stream, dlq = fresh_names()
    adapter = RedisAdapter(redis_client, redis_connection, stream, dlq)
    try:
        yield adapter
    finally:
        await adapter.cleanup()
