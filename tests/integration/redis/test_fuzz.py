"""
Fuzzed input through a real redis-server (or REDIS_URL): see tests/integration/fuzz.py.

Streams: one envelope per event, and batch mode. Input: every body category of the shared
strategies in the ``body`` field, plus up to 8 more fields with binary names and values (NUL,
CR/LF, invalid UTF-8, names repeated, an empty name). Every field of an entry is the sender's: the
dead-letter copy must keep them all, in order, and a sender's ``x-dead-letter-*`` field is renamed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import pytest
import redis.asyncio as aioredis
from hypothesis import strategies as st

from airflow_shared_stream_provider._core.envelope import text_value
from devkit.redis_broker import RedisServer
from tests.integration import fuzz
from tests.integration.fuzz import RAISE_ATTRIBUTE, DeadRecord, FuzzMessage, FuzzSession, session
from tests.integration.redis.conftest import RedisAdapter

pytestmark = [pytest.mark.integration, pytest.mark.redis]

__all__ = ["session"]  # the fixture, shared by every broker's test_fuzz.py

BODY: Final = b"body"
DEAD_LETTER_PREFIX: Final = fuzz.DEAD_LETTER_PREFIX.encode()
ORIGINAL_PREFIX: Final = b"x-original-"


def wire_fields(message: FuzzMessage) -> list[bytes]:
    """The entry's fields as published: ``body`` first (unless None), the extra fields, the raise marker."""
    fields: list[bytes] = [] if message.body is None else [BODY, message.body]
    for name, value in message.extras.get("fields", ()):
        fields += (name, value)
    if message.raise_text is not None:
        fields += (RAISE_ATTRIBUTE.encode(), message.raise_text.encode("utf-8", "surrogatepass"))
    return fields


def expected_attributes(fields: Sequence[bytes]) -> dict[str, str]:
    """Every field but the first ``body``, as text, the first of a repeated name winning (docs/redis.md)."""
    attributes: dict[str, str] = {}
    body_seen = False
    for index in range(0, len(fields) - 1, 2):
        name, value = fields[index], fields[index + 1]
        if name == BODY and not body_seen:
            body_seen = True
            continue
        attributes.setdefault(text_value(name), text_value(value))
    return attributes


def make(
    body: bytes | None, *, fields: list[tuple[bytes, bytes]] | None = None, entry_id: str = "*", **options: Any
) -> FuzzMessage:
    """A plain entry (``fuzz.MakeMessage``): the body field alone, its id the server's."""
    extras: dict[str, Any] = {"fields": list(fields or [])}
    if entry_id != "*":
        extras["entry_id"] = entry_id
    return FuzzMessage(body, extras=extras, **options)


class RedisFuzzTarget(fuzz.FuzzTargetBase[RedisAdapter]):
    """A stream and its dead-letter stream, for the fuzzing property (and the hostile corpus)."""

    async def publish_one(self, message: FuzzMessage) -> None:
        entry_id = message.extras.get("entry_id", "*")
        await self.adapter.publish_fields(wire_fields(message), entry_id=entry_id)

    async def dead_letters(self) -> list[DeadRecord]:
        records = []
        for entry_id, fields in await self.adapter.dead_letter_entries():
            pairs = list(zip(fields[::2], fields[1::2], strict=True))
            body = next((value for name, value in pairs if name == BODY), None)
            reason = next((value.decode() for name, value in pairs if name == fuzz.DEAD_LETTER_REASON.encode()), None)
            records.append(DeadRecord(entry_id, body, reason, {"fields": fields}))
        return records

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str]:
        return expected_attributes(wire_fields(message))

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        """Every original field is kept, in order (a sender's ``x-dead-letter-*`` renamed), then the provider's."""
        kept = list(record.attributes["fields"])
        original = wire_fields(message)
        assert len(kept) >= len(original) + 8, "the dead-letter copy lost fields"
        for index in range(0, len(original), 2):
            name = original[index]
            if name.lower().startswith(DEAD_LETTER_PREFIX):
                assert kept[index].startswith(ORIGINAL_PREFIX), f"a sender's {name!r} kept its name"
            else:
                assert kept[index] == name, f"field {index // 2} renamed: {kept[index]!r} != {name!r}"
            assert kept[index + 1] == original[index + 1], f"field {name!r} changed"
        added = kept[len(original) :]
        assert added[0::2] == [
            b"x-dead-letter-reason",
            b"x-dead-letter-source",
            b"x-dead-letter-message-id",
            b"x-dead-letter-group",
        ]
        assert added[3] == self.adapter.stream.encode()


FIELD_NAMES: Final = st.binary(min_size=0, max_size=12) | st.sampled_from(
    [b"a\x00b", b"crlf\r\n", b"\xff\xfe", b"body", b"x-dead-letter-reason", b"X-Dead-Letter-Source", b"type", b""]
)
FIELD_VALUES: Final = st.binary(max_size=48) | st.sampled_from([b"\x00", b"a\r\nb", b"\xc3", b"x" * 1024])


@st.composite
def redis_messages(draw: st.DrawFn) -> FuzzMessage:
    body, huge = draw(fuzz.bodies())
    raise_text = draw(fuzz.raise_texts(max_size=24))
    names = draw(st.lists(FIELD_NAMES, max_size=8))
    # The raising filter reads its own marker field: a generated field of that name would change it.
    fields = [(name, draw(FIELD_VALUES)) for name in names if name.lower() != RAISE_ATTRIBUTE.encode()]
    return FuzzMessage(body, raise_text, huge, {"fields": fields})


@pytest.fixture
async def fuzz_targets(
    redis_client: aioredis.Redis, redis_connection: str, redis_server: RedisServer
) -> AsyncIterator[list[RedisFuzzTarget]]:
    """A stream read one envelope per event, and one in batch mode (also test_hostile.py's)."""
    targets = [
        RedisFuzzTarget(RedisAdapter.fresh(redis_client, redis_connection, redis_server), name, batch_size=batch_size)
        for name, batch_size in (("plain", 1), ("batch", 4))
    ]
    try:
        yield targets
    finally:
        for target in targets:
            await target.adapter.cleanup()


@fuzz.fuzz_test(redis_messages())
async def test_fuzzed_input_is_delivered_or_dead_lettered(session: FuzzSession, batch: list[FuzzMessage]) -> None:
    await session.run(batch)
