"""
The Redis side of the Redis Streams producer (:mod:`.redis`): the connection, the client, the
commands and scripts it sends, what their errors mean, and the wire format of stream entries.
What each outcome does on the stream (dispositions, leases) stays in :mod:`.redis`.

* **Connection**: the upstream ``redis`` connection type (apache-airflow-providers-redis's
  ``RedisHook``), read directly: host, port, login = username, password (``none`` / ``false`` /
  empty mean none, as upstream), extra ``db`` (or a numeric schema), extras ``ssl``,
  ``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_keyfile``, ``ssl_certfile``, ``ssl_check_hostname``.
  A connection that does not exist is a configuration error (there is no default server). Nothing
  read here reaches a log line, an error or a ``repr`` but :meth:`RedisConnection.describe`.
* **Client**: ``redis.asyncio.Redis`` with binary replies (``decode_responses=False``: every field
  of an entry is bytes a sender chose), a socket timeout above the ``XREADGROUP`` block, and the
  raw reply of ``XREADGROUP`` / ``XAUTOCLAIM`` (redis-py's parsers turn an entry into a dict,
  which drops a repeated field name: the dead-letter copy must keep the entry as it was).
* **Scripts** (Lua, atomic on the server): the *lease* of a pending entry is its idle time. Renewing
  it, giving it back (idle time set so that ``XAUTOCLAIM`` takes it again) and holding it (idem,
  with the delivery count set back) all act only on entries this consumer still owns: an entry
  another consumer claimed meanwhile is reported lost, never taken back from it.
* **Errors**: :func:`is_transient` tells a network blip or a busy server (retried) from a mistake
  (raised as :class:`SharedStreamConfigError` naming the stream, the group and the connection).
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from airflow_shared_stream_provider._core.connections import read_connection, read_extras, register_secrets
from airflow_shared_stream_provider._core.dead_letter import MESSAGE_ID, ORIGINAL_PREFIX, PREFIX, REASON, SOURCE
from airflow_shared_stream_provider._core.envelope import iso_from_epoch_ms, text_value
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError, broker_sdk
from airflow_shared_stream_provider.triggers.redis import RedisStreamSettings

with broker_sdk("redis"):
    from redis import exceptions as redis_errors
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

CONSUMER_PREFIX: Final = "airflow-shared-stream:"
"""Consumer names this provider creates in a group (``<prefix><host>:<pid>:<random>``)."""
STALE_CONSUMER_SECONDS: Final = 3600.0
"""A consumer of ours with nothing pending and idle this long is deleted when a stream opens."""
GROUP_FIELD: Final = PREFIX + "group"
CLIENT_RETRIES = 3
"""
redis-py's own retries of one command on a connection error or timeout (0.25 s, 0.5 s, 1 s apart,
with jitter): a short blip (a failover, a restart) never reaches the stream. Set explicitly, not
left to the library's default, which changes between redis-py versions; what outlasts them is the
receive loop's error streak (:mod:`.redis`).
"""
_SSL_EXTRAS: Final = (
    "ssl",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_check_hostname",
)
_SSL_CERT_REQS: Final = ("required", "optional", "none")
_NO_PASSWORD: Final = ("none", "false", "")
REDIS_ERRORS: Final[tuple[type[Exception], ...]] = (redis_errors.RedisError, OSError)
"""What a Redis call raises when Redis (or reaching it) failed."""

# -- scripts -----------------------------------------------------------------------------------------
# KEYS[1] = stream; ARGV = group, consumer, idle ms, then (entry id, retry count) pairs; a retry
# count of -1 keeps the entry's delivery count. Each entry this consumer owns gets its idle time
# set to ``idle ms`` (0: a renewed lease; claim_idle: claimable at once); the others (acknowledged,
# or claimed by another consumer since) are returned: their lease is lost.
SET_IDLE_SCRIPT: Final = """
local lost = {}
for i = 4, #ARGV, 2 do
  local id = ARGV[i]
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if pending[1] and pending[1][2] == ARGV[2] then
    if ARGV[i + 1] == '-1' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[3], 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[3], 'RETRYCOUNT', ARGV[i + 1], 'JUSTID')
    end
  else
    lost[#lost + 1] = id
  end
end
return lost
"""
# KEYS[1] = stream; ARGV = group, entry ids: each entry's times-delivered (0: no longer pending).
DELIVERY_COUNTS_SCRIPT: Final = """
local counts = {}
for i = 2, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  counts[i - 1] = pending[1] and pending[1][4] or 0
end
return counts
"""
# KEYS[1] = stream; ARGV = group, consumer, idle ms: delete the consumer if nothing is pending for
# it and it has been idle that long (atomic: it cannot read an entry between the check and the delete).
DELETE_IDLE_CONSUMER_SCRIPT: Final = """
local consumers = redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
for _, consumer in ipairs(consumers) do
  local info = {}
  for j = 1, #consumer, 2 do info[consumer[j]] = consumer[j + 1] end
  if info['name'] == ARGV[2] then
    if info['pending'] == 0 and info['idle'] >= tonumber(ARGV[3]) then
      return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    end
    return -1
  end
end
return -1
"""


def _raw_reply(response: Any, **_options: Any) -> Any:
    return response


def is_transient(exc: BaseException) -> bool:
    """A network blip, a timeout, a busy or loading server (retry the call), not a configuration mistake."""
    if isinstance(exc, redis_errors.AuthenticationError):
        return False
    if isinstance(exc, redis_errors.ConnectionError | redis_errors.TimeoutError | OSError):
        return True
    if isinstance(exc, redis_errors.BusyLoadingError | redis_errors.TryAgainError):
        return True
    if isinstance(exc, redis_errors.ResponseError):
        # A replica promoted, a script timeout elsewhere, memory pressure: the server's state, not ours.
        return str(exc).split(" ", 1)[0] in ("READONLY", "BUSY", "MASTERDOWN", "LOADING", "OOM", "CLUSTERDOWN")
    return False


def error_code(exc: BaseException) -> str:
    """The first word of a Redis error reply (``NOGROUP``, ``WRONGTYPE``, ``NOPERM``...), else ''."""
    text = str(exc)
    first = text.split(" ", 1)[0]
    return first if first.isupper() else ""


# -- the connection ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RedisConnection:
    """What the client is built from: read from the Airflow connection (never logged: has a password)."""

    conn_id: str
    host: str
    port: int
    db: int
    username: str | None
    password: str | None = field(repr=False)
    ssl: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"RedisConnection({self.describe()})"

    __str__ = __repr__

    def describe(self) -> str:
        """Secret-free description for logs and errors."""
        auth = f"user {self.username!r}" if self.username else ("password" if self.password else "no auth")
        tls = "tls" if self.ssl.get("ssl") else "plain"
        return f"redis_conn_id={self.conn_id!r}, {self.host}:{self.port}/{self.db} ({tls}, {auth})"


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def connection_from_fields(
    conn_id: str, *, host: Any, port: Any, login: Any, password: Any, schema: Any, extras: dict[str, Any]
) -> RedisConnection:
    """The upstream ``redis`` connection's fields as client settings; errors name the field, never a value."""

    def refuse(what: str) -> SharedStreamConfigError:
        return SharedStreamConfigError(f"Redis connection {conn_id!r}: {what}")

    try:
        port_number = int(port) if port not in (None, "") else 6379
    except (TypeError, ValueError):
        raise refuse("port must be a number") from None
    db_value = extras.get("db")
    schema_db = str(schema).strip() if schema not in (None, "") else ""
    if schema_db and not schema_db.isdigit():
        raise refuse("schema, when set, must be the database number (or set the extra 'db')")
    if db_value in (None, ""):
        db_value = schema_db or 0
    elif schema_db and str(db_value).strip() != schema_db:
        raise refuse("the schema and the extra 'db' name two different databases")
    try:
        db = int(db_value)
    except (TypeError, ValueError):
        raise refuse("the extra 'db' must be a database number") from None
    if db < 0:
        raise refuse("the extra 'db' must be a database number >= 0")
    ssl = {name: extras[name] for name in _SSL_EXTRAS if extras.get(name) not in (None, "")}
    if "ssl" in ssl:
        ssl["ssl"] = _flag(ssl["ssl"])
    if "ssl_check_hostname" in ssl:
        ssl["ssl_check_hostname"] = _flag(ssl["ssl_check_hostname"])
    reqs = ssl.get("ssl_cert_reqs")
    if reqs is not None and str(reqs).lower() not in _SSL_CERT_REQS:
        raise refuse(f"the extra 'ssl_cert_reqs' must be one of {_SSL_CERT_REQS}")
    if reqs is not None:
        ssl["ssl_cert_reqs"] = str(reqs).lower()
    secret = None if password is None or str(password).lower() in _NO_PASSWORD else str(password)
    return RedisConnection(
        conn_id=conn_id,
        host=str(host) if host else "localhost",
        port=port_number,
        db=db,
        username=str(login) if login else None,
        password=secret,
        ssl=ssl,
    )


async def load_redis_connection(conn_id: str) -> RedisConnection:
    """Read the upstream ``redis`` connection ``conn_id``; one that does not exist is a configuration error."""
    conn = await read_connection(conn_id)
    if conn is None:
        raise SharedStreamConfigError(
            f"Redis connection {conn_id!r} does not exist: create a connection of type 'redis' (host, port, "
            "password, extra 'db')"
        )
    extras = await read_extras(conn)
    if not isinstance(extras, dict):
        raise SharedStreamConfigError(f"Redis connection {conn_id!r}: the extra must be a JSON object")
    # Airflow masks a connection's password field itself; registered here too, as every broker's
    # reader does with what it reads, so that the guarantee does not rest on how it was fetched.
    await register_secrets(conn.password)
    return connection_from_fields(
        conn_id,
        host=conn.host,
        port=conn.port,
        login=conn.login,
        password=conn.password,
        schema=conn.schema,
        extras=extras,
    )


def consumer_name() -> str:
    """This producer's consumer in the group: ours (prefix), and unique (host, pid, random)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:60]
    return f"{CONSUMER_PREFIX}{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def make_client(connection: RedisConnection, settings: RedisStreamSettings, *, client_name: str) -> Redis:
    """The stream's client: binary replies, raw entry replies, a socket timeout above the block."""
    client = Redis(
        host=connection.host,
        port=connection.port,
        db=connection.db,
        username=connection.username,
        password=connection.password,
        decode_responses=False,
        # RESP2: what every Redis with XAUTOCLAIM (6.2+) speaks, and the reply shapes parsed here.
        protocol=2,
        # A blocked XREADGROUP must never hit the socket timeout.
        socket_timeout=settings.block + 30.0,
        socket_connect_timeout=10.0,
        health_check_interval=30,
        client_name=re.sub(r"\s", "_", client_name),
        retry=Retry(ExponentialWithJitterBackoff(base=0.25, cap=2.0), CLIENT_RETRIES),
        **connection.ssl,
    )
    client.set_response_callback("XREADGROUP", _raw_reply)
    client.set_response_callback("XAUTOCLAIM", _raw_reply)
    return client


# -- the wire format of entries -------------------------------------------------------------------------
@dataclass(slots=True)
class Entry:
    """One stream entry as Redis sent it: its id and its flat ``[field, value, field, value...]`` list."""

    entry_id: bytes
    fields: list[bytes]


def entries_of(reply: Any) -> list[Entry]:
    """The entries of an ``XREADGROUP`` stream reply or of ``XAUTOCLAIM``'s second item (``nil`` fields: deleted)."""
    out: list[Entry] = []
    for item in reply or ():
        entry_id, fields = item[0], item[1]
        out.append(Entry(bytes(entry_id), list(fields) if fields is not None else []))
    return out


def published_at(entry_id: str) -> str | None:
    """
    The millisecond part of an entry id as ISO-8601 (the server's clock when XADD made the id), or
    None: an explicit id may be anything up to 2**64 - 1, which is no date.
    """
    milliseconds, _, _ = entry_id.partition("-")
    if not milliseconds.isdigit():
        return None
    return iso_from_epoch_ms(int(milliseconds))


def split_fields(fields: Sequence[bytes], body_field: bytes) -> tuple[bytes | None, dict[str, str]]:
    """
    ``(body, attributes)`` of an entry: the first ``body_field`` value, and every other field as
    text (bytes that are not UTF-8 as ``base64:...``). A field name given twice: the first wins
    (the dead-letter copy keeps every one).
    """
    body: bytes | None = None
    found = False
    attributes: dict[str, str] = {}
    for index in range(0, len(fields) - 1, 2):
        name, value = fields[index], fields[index + 1]
        if name == body_field and not found:
            body, found = bytes(value), True
            continue
        attributes.setdefault(text_value(name), text_value(value))
    return body, attributes


_PREFIX_BYTES: Final = PREFIX.encode()
_ORIGINAL_BYTES: Final = ORIGINAL_PREFIX.encode()


def dead_letter_fields(fields: Sequence[bytes], *, reason: str, source: str, entry_id: str, group: str) -> list[bytes]:
    """
    The dead-letter copy of an entry: its fields in order (a sender's ``x-dead-letter-*`` field,
    any case, renamed ``x-original-<name>``, prefixed again while that name is taken, so that on
    the copy those names are only ever the provider's; see ``_core/dead_letter.py``), then
    ``x-dead-letter-reason`` / ``-source`` / ``-message-id`` / ``-group``. Redis has no field
    limit: nothing is dropped.
    """
    names = {bytes(fields[index]) for index in range(0, len(fields) - 1, 2)}
    out: list[bytes] = []
    for index in range(0, len(fields) - 1, 2):
        name = bytes(fields[index])
        if name.lower().startswith(_PREFIX_BYTES):
            renamed = _ORIGINAL_BYTES + name
            while renamed in names:
                renamed = _ORIGINAL_BYTES + renamed
            names.add(renamed)
            name = renamed
        out += (name, bytes(fields[index + 1]))
    for label, text in ((REASON, reason), (SOURCE, source), (MESSAGE_ID, entry_id), (GROUP_FIELD, group)):
        out += (label.encode(), text.encode("utf-8", "surrogatepass"))
    return out


__all__ = [
    "CONSUMER_PREFIX",
    "DELETE_IDLE_CONSUMER_SCRIPT",
    "DELIVERY_COUNTS_SCRIPT",
    "REDIS_ERRORS",
    "SET_IDLE_SCRIPT",
    "STALE_CONSUMER_SECONDS",
    "Entry",
    "RedisConnection",
    "connection_from_fields",
    "consumer_name",
    "dead_letter_fields",
    "entries_of",
    "error_code",
    "is_transient",
    "load_redis_connection",
    "make_client",
    "published_at",
    "redis_errors",
    "split_fields",
]
