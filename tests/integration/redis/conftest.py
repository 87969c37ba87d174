"""
Redis Streams integration fixtures: a real ``redis-server`` and a fresh stream per test.

By default the Redis kit (``devkit.kits.redis.RedisKit``) starts one ``redis-server`` on a free
loopback port for the session (append-only persistence in a temporary directory). With ``REDIS_URL`` set, no
server is started and the tests run against that one; every test uses keys of its own (a random
suffix) and deletes them afterwards, so a shared server is fine.

Stream state is always asserted through an independent client, never through the producer under test.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import pytest
import redis.asyncio as aioredis

from airflow_shared_stream_provider.triggers.redis import RedisSharedStreamTrigger
from devkit.kits.redis import Fields, RedisKit, RedisOrders
from devkit.redis_broker import RedisServer
from tests.integration.contract import KitAdapter

CONN_ID = "redis_shared_stream_it"


@pytest.fixture(scope="session")
def redis_kit() -> Iterator[RedisKit]:
    """The Redis kit: REDIS_URL's server, else a redis-server started here (never skipped)."""
    with RedisKit() as kit:
        yield kit


@pytest.fixture(scope="session")
def redis_server(redis_kit: RedisKit) -> RedisServer:
    """The server under test (the kit's)."""
    assert redis_kit.server is not None, "the Redis kit is not started"
    return redis_kit.server


@pytest.fixture
def redis_connection(redis_kit: RedisKit, monkeypatch: pytest.MonkeyPatch) -> str:
    """An Airflow ``redis`` connection (env var) pointing at the server; returns its conn id."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(redis_kit.connection()))
    return CONN_ID


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """The independent async client of the Redis-only inspections (binary replies, RESP2)."""
    client = aioredis.Redis(**redis_server.client_kwargs(), protocol=2)
    # Entries as Redis sends them (redis-py's parsers make dicts, which drop a repeated field).
    for command in ("XRANGE", "XREADGROUP", "XAUTOCLAIM", "XPENDING"):
        client.set_response_callback(command, lambda response, **_: response)
    try:
        yield client
    finally:
        await client.aclose()


class RedisAdapter(KitAdapter[RedisOrders, RedisSharedStreamTrigger]):
    """
    :class:`tests.integration.contract.BrokerAdapter` for Redis Streams (plus helpers for Redis-only
    tests) over the kit's stream: publishing, the group's state, dead letters and cleanup are the
    kit's. The async ``client`` is kept for the raw inspections only Redis-only tests make
    (XPENDING, XINFO CONSUMERS, XAUTOCLAIM).
    """

    broker = "redis"
    trigger_class = RedisSharedStreamTrigger
    quick: ClassVar[dict[str, Any]] = {"block": 0.2, "claim_idle": 10}

    def __init__(self, client: aioredis.Redis, conn_id: str, kit: RedisOrders) -> None:
        super().__init__(kit, conn_id)
        self.client = client
        self.stream = kit.stream
        self.dead_letter_stream = kit.dead_letter_stream
        self.group = kit.group_name

    @classmethod
    def fresh(cls, client: aioredis.Redis, conn_id: str, server: RedisServer) -> RedisAdapter:
        """A fresh stream (a random name) and its ``<name>:dead-letter`` stream on ``server``."""
        name = f"it-{uuid.uuid4().hex[:12]}"
        return cls(client, conn_id, RedisOrders(server, name, f"{name}:dead-letter"))

    def trigger_options(self) -> dict[str, Any]:
        return {"redis_conn_id": self.conn_id, "dead_letter_stream": self.dead_letter_stream, "group": self.group}

    async def publish(self, bodies: Sequence[bytes], *, attributes: Mapping[str, str] | None = None) -> None:
        await self.publish_ids(bodies, attributes=attributes)

    async def publish_ids(self, bodies: Sequence[bytes], *, attributes: Mapping[str, str] | None = None) -> list[bytes]:
        """XADD each body (field ``body``) with ``attributes`` as further fields; the entry ids, in order."""
        extra = [part for pair in (attributes or {}).items() for part in pair]
        entries: list[Fields] = [["body", body, *extra] for body in bodies]
        return [entry_id.encode() for entry_id in await self.in_thread(self.kit.add_entries, entries)]

    async def publish_fields(self, fields: Sequence[bytes | str], *, entry_id: str = "*") -> bytes:
        """XADD one entry with exactly these fields (any names, repeats, binary)."""
        added = await self.in_thread(self.kit.add_entries, [fields], entry_id=entry_id)
        return added[0].encode()

    async def group_info(self) -> dict[bytes, Any] | None:
        return await self.in_thread(self.kit.group)

    async def pending(self) -> list[tuple[bytes, bytes, int, int]]:
        """The group's pending entries: (id, consumer, idle ms, times delivered)."""
        try:
            reply = await self.client.execute_command("XPENDING", self.stream, self.group, "-", "+", 100_000)
        except Exception:
            return []
        return [(bytes(i), bytes(c), int(idle), int(n)) for i, c, idle, n in reply]

    async def dead_letter_entries(self) -> list[tuple[bytes, list[bytes]]]:
        """Every dead-letter entry: (id, its flat field list, in order)."""
        return await self.in_thread(self.kit.dead_letter_entries)

    async def dead_lettered(self) -> list[bytes]:
        bodies = []
        for _, fields in await self.dead_letter_entries():
            values = dict(zip(fields[::2], fields[1::2], strict=True))
            bodies.append(values.get(b"body", b""))
        return bodies

    async def cleanup(self) -> None:
        """Delete the stream and its dead-letter stream; close the kit stream's client."""
        await self.in_thread(self.kit.close, delete=True)


@pytest.fixture
async def adapter(
    redis_client: aioredis.Redis, redis_connection: str, redis_server: RedisServer
) -> AsyncIterator[RedisAdapter]:
    """A fresh stream + dead-letter stream for one test, deleted afterwards."""
    adapter = RedisAdapter.fresh(redis_client, redis_connection, redis_server)
    try:
        yield adapter
    finally:
        await adapter.cleanup()
