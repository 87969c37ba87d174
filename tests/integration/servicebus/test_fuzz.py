"""
Fuzzed input through the Service Bus test broker (or SERVICEBUS_CONNECTION_STRING): see
tests/integration/fuzz.py.

Streams: a queue (one envelope per event) and one in batch mode. Input: every body category of the
shared strategies, application properties of every type the SDK sends (strings with odd
characters, integers, floats including NaN and infinities, booleans, UTF-8 bytes, null) and sender-set
ids: message_id (up to the SDK's 128 characters), correlation_id, subject, content_type.
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusSender
from hypothesis import strategies as st

from tests.integration import fuzz
from tests.integration.fuzz import RAISE_ATTRIBUTE, DeadRecord, FuzzMessage, FuzzSession, session
from tests.integration.servicebus.conftest import ServiceBusAdapter, ServiceBusEnv

pytestmark = [pytest.mark.integration, pytest.mark.servicebus]

__all__ = ["session"]  # the fixture, shared by every broker's test_fuzz.py

REJECTED_REASON: Final = "RejectedByWatcher"
# Not generated: the broker keeps a dead letter's reason and description in these properties.
RESERVED: Final = ("DeadLetterReason", "DeadLetterErrorDescription", RAISE_ATTRIBUTE)

property_names = (st.text(min_size=1, max_size=24) | st.sampled_from(["\x00", "é", "🔑", "n" * 300, "a b"])).filter(
    lambda name: name not in RESERVED
)
property_values = st.one_of(
    st.text(max_size=32),
    st.sampled_from(["", "\x00", "v" * 1024, "\ud7ff\ue000\U0010ffff"]),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),  # the SDK sends a Python int as an AMQP int
    st.floats(),  # NaN and infinities included
    st.booleans(),
    st.text(max_size=16).map(str.encode),  # the SDK sends bytes as text (it refuses bytes that are not UTF-8)
    st.none(),
)
many_properties = st.integers(min_value=30, max_value=100).map(lambda n: {f"p{i}": i for i in range(n)})
content_types = st.from_regex(r"[ -~]{1,40}", fullmatch=True) | st.just("application/json; charset=utf-8")
ids = st.text(min_size=1, max_size=24) | st.sampled_from(["x" * 128, "\x00", "é" * 128, "🔑" * 64, " "])


@st.composite
def servicebus_messages(draw: st.DrawFn) -> FuzzMessage:
    body, huge = draw(fuzz.bodies())
    raise_text = draw(fuzz.raise_texts())
    properties = draw(st.dictionaries(property_names, property_values, max_size=8) | many_properties)
    message_kwargs: dict[str, str] = {}
    for name in ("message_id", "correlation_id", "subject", "content_type"):
        # content_type is an AMQP symbol: ASCII only.
        value = draw(st.none() | (content_types if name == "content_type" else ids))
        if value is not None:
            message_kwargs[name] = value
    return FuzzMessage(body, raise_text, huge, {"properties": properties, "message": message_kwargs})


def property_text(value: Any) -> str:
    """What the envelope shows for one application property."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode("ascii")
    return str(value)


def sent_properties(message: FuzzMessage) -> dict[str | bytes, Any]:
    properties: dict[str | bytes, Any] = dict(message.extras["properties"])
    if message.raise_text is not None:
        properties[RAISE_ATTRIBUTE] = message.raise_text
    return properties


def make(
    body: bytes | None,
    *,
    properties: Mapping[str, Any] | None = None,
    message: Mapping[str, str] | None = None,
    **fields: Any,
) -> FuzzMessage:
    """A plain message (``fuzz.MakeMessage``): no application properties, every id the SDK's."""
    return FuzzMessage(body, extras={"properties": dict(properties or {}), "message": dict(message or {})}, **fields)


class ServiceBusFuzzTarget(fuzz.FuzzTargetBase[ServiceBusAdapter]):
    """A queue and its $DeadLetterQueue, for the fuzzing property (and the hostile corpus)."""

    _sender: ServiceBusSender | None = None

    async def publish_one(self, message: FuzzMessage) -> None:
        # One sender for the whole test (opening one costs about a second), closed by close().
        if self._sender is None:
            client = self.adapter.sb.client if self.adapter.sb is not None else None
            assert client is not None
            self._sender = client.get_queue_sender(self.adapter.queue)
            await self._sender.__aenter__()
        await self._sender.send_messages(
            ServiceBusMessage(
                message.body, application_properties=sent_properties(message), **message.extras.get("message", {})
            )
        )

    async def close(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            await sender.close()

    async def dead_letters(self) -> list[DeadRecord]:
        return [
            DeadRecord(index, dead.body, dead.description, {"reason": dead.reason})
            for index, dead in enumerate(await self.adapter.dead_letters())
        ]

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str]:
        return {property_text(name): property_text(value) for name, value in sent_properties(message).items()}

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        assert record.attributes["reason"] == REJECTED_REASON, f"dead-letter reason {record.attributes['reason']!r}"


@pytest.fixture
async def fuzz_targets(sb: ServiceBusEnv, sb_conn: str) -> AsyncIterator[list[ServiceBusFuzzTarget]]:
    """A queue and one in batch mode (also test_hostile.py's); their senders closed after the test."""
    targets = [
        ServiceBusFuzzTarget(ServiceBusAdapter.on(sb, sb_conn, await sb.create_queue("fuzz")), "single"),
        ServiceBusFuzzTarget(ServiceBusAdapter.on(sb, sb_conn, await sb.create_queue("fuzz")), "batch", batch_size=4),
    ]
    try:
        yield targets
    finally:
        for target in targets:
            await target.close()


@fuzz.fuzz_test(
    servicebus_messages(),
    [
        *fuzz.standard_examples(make),
        make(
            b"",
            properties={"nan": math.nan, "inf": -math.inf, "bin": "é".encode(), "none": None, "big": 2**31 - 1},
            message={"message_id": "\x00" * 128, "subject": "é", "correlation_id": " "},
        ),
    ],
)
async def test_fuzzed_input_is_delivered_or_dead_lettered(session: FuzzSession, batch: list[FuzzMessage]) -> None:
    await session.run(batch)
