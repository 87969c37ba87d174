"""
The Redis Streams test kit: a real ``redis-server`` (``devkit.redis_broker.start_redis``: the one
``REDIS_URL`` names unless ``own``), the upstream ``redis`` connection, and :class:`RedisOrders`,
one stream with its dead-letter stream and what the consumer group still holds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import redis

from airflow_shared_stream_provider.triggers.redis import DEFAULT_GROUP
from devkit.demo_types import OrderMessage
from devkit.kits import BrokerKit, Item, OrdersById
from devkit.redis_broker import RedisServer, start_redis

REDIS_STREAM: Final = "orders"
REDIS_DEAD_LETTER_STREAM: Final = "orders:dead-letter"
REDIS_CONN_ID: Final = "redis_default"
# Replies returned as Redis sends them: redis-py's parsers make dicts of an entry's fields, which
# drop a repeated field name and cannot be indexed as the flat list the readers here expect.
RAW_REPLIES: Final = ("XRANGE",)

# One field list of an entry: name, value, name, value, ... (names may repeat, anything binary).
Fields = Sequence[bytes | str]


@dataclass
class RedisOrders(OrdersById):
    """
    One stream on one server: a publisher and what the consumer group still holds. Its client is
    sync and independent of the watchers' (the integration tests assert stream state through it,
    from a worker thread: ``asyncio.to_thread``).
    """

    source_field = "stream"
    source_arg = "stream"

    server: RedisServer
    stream: str = REDIS_STREAM
    dead_letter_stream: str = REDIS_DEAD_LETTER_STREAM
    # The watchers' consumer group (the trigger's ``group``), whose state :meth:`group` reads.
    group_name: str = DEFAULT_GROUP
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        # Any: redis-py's sync client leaves execute_command untyped.
        self.client: Any = redis.Redis(**self.server.client_kwargs(), protocol=2)
        for command in RAW_REPLIES:
            self.client.set_response_callback(command, lambda response, **_: response)
        self._lock = threading.Lock()
        # Held for each chunk's XADDs and for a whole server restart: a publish waits out the
        # restart. redis-py retries a refused connection for about 4 s only (10 tries, backoff
        # capped at 1 s), and a chunk resent by hand after a failure could add entries twice.
        self.server_lock = threading.Lock()

    chunk_size = 100

    def _send(self, chunk: list[Item]) -> list[str]:
        """XADD each body (its ``body`` field; the key, where given, in ``key``) in one pipeline; the entry ids."""
        return self.add_entries([("body", body) if key is None else ("body", body, "key", key) for body, key in chunk])

    def add_entries(self, entries: Sequence[Fields], *, entry_id: str = "*") -> list[str]:
        """
        XADD each entry with exactly its fields, in order, in one pipeline; the entry ids. ``entry_id``:
        the id of every entry (``*``: the server's; an explicit id is for a single entry).
        """
        with self.server_lock:
            pipe = self.client.pipeline(transaction=False)
            for fields in entries:
                pipe.execute_command("XADD", self.stream, entry_id, *fields)
            return [bytes(added).decode() for added in pipe.execute()]

    def group(self) -> dict[bytes, Any] | None:
        """``XINFO GROUPS`` of the watchers' consumer group (None before the stream or the group exists)."""
        try:
            groups = self.client.execute_command("XINFO", "GROUPS", self.stream)
        except redis.ResponseError:
            return None
        for group in groups:
            info = {bytes(group[i]): group[i + 1] for i in range(0, len(group) - 1, 2)}
            if info.get(b"name") == self.group_name.encode():
                return info
        return None

    def backlog(self) -> int:
        """Entries the group has not acknowledged: pending plus not yet delivered (all, before the group exists)."""
        info = self.group()
        if info is None:
            return int(self.client.xlen(self.stream))
        last = bytes(info[b"last-delivered-id"]).decode()
        undelivered = self.client.execute_command("XRANGE", self.stream, f"({last}", "+")
        return int(info[b"pending"]) + len(undelivered)

    def dead_lettered(self) -> int:
        return int(self.client.xlen(self.dead_letter_stream))

    def dead_letter_entries(self) -> list[tuple[bytes, list[bytes]]]:
        """Every entry of the dead-letter stream: its id and its flat field list, in order."""
        reply = self.client.execute_command("XRANGE", self.dead_letter_stream, "-", "+")
        return [(bytes(entry_id), [bytes(f) for f in fields]) for entry_id, fields in reply]

    def dead_letters(self) -> dict[str, str]:
        """``x-dead-letter-message-id -> x-dead-letter-reason`` of the dead-letter stream's entries."""
        out: dict[str, str] = {}
        for _, raw in self.dead_letter_entries():
            fields = {raw[i]: raw[i + 1] for i in range(0, len(raw) - 1, 2)}
            source = fields.get(b"x-dead-letter-message-id", b"").decode("utf-8", "replace")
            out[source] = fields.get(b"x-dead-letter-reason", b"").decode("utf-8", "replace")
        return out

    def unsettled(self) -> int:
        return self.backlog()

    def diagnostics(self) -> str:
        return f"group {self.group()!r}; {self.dead_lettered()} dead-lettered entr(ies)"

    def close(self, *, delete: bool = False) -> None:
        """Close the client (``delete``: remove the stream and its dead-letter stream first)."""
        try:
            if delete:
                self.client.delete(self.stream, self.dead_letter_stream)
        finally:
            self.client.close()


class RedisKit(BrokerKit):
    """
    ``redis-server`` on a free loopback port (append-only file), or the server ``REDIS_URL`` names
    unless ``own``; on such an external server :meth:`stop` deletes the streams made ``temporary``.
    """

    name = "redis"
    own_by_default = False

    def __init__(self, *, own: bool | None = None) -> None:
        super().__init__(own=own)
        self.server: RedisServer | None = None
        self.temporary: list[RedisOrders] = []

    def start(self) -> str:
        self.server = start_redis(own=self.own)
        where = f"{self.server.host}:{self.server.port}"
        if self.server.external:
            return f"redis-server {where} (REDIS_URL)"
        return f"redis-server {where} (append-only file, fsync every second)"

    def stop(self) -> None:
        try:
            while self.temporary:
                self.temporary.pop().close(delete=self.server is not None and self.server.external)
        finally:
            if self.server is not None:
                self.server.close()
                self.server = None

    def connection(self) -> dict[str, Any]:
        assert self.server is not None, "the Redis kit is not started"
        return self.server.connection()

    def stream(self, name: str, *, dead_letter_stream: str | None = None, temporary: bool = False) -> RedisOrders:
        """
        Stream ``name`` and its dead-letter stream (``<name>:dead-letter`` by default); the watchers
        create the group. ``temporary``: :meth:`stop` deletes both from an external server.
        """
        assert self.server is not None, "the Redis kit is not started"
        dlq = f"{name}:dead-letter" if dead_letter_stream is None else dead_letter_stream
        orders = RedisOrders(self.server, name, dlq)
        if temporary:
            self.temporary.append(orders)
        return orders
