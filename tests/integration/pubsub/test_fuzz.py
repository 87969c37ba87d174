"""
Fuzzed input through Google's Pub/Sub emulator (or PUBSUB_EMULATOR_HOST): see tests/integration/fuzz.py.

Streams: a plain subscription (one envelope per event) and an ordering-enabled subscription in
batch mode. Input: every body category of the shared strategies, attributes up to Pub/Sub's limits
(100 per message, keys up to 256 bytes, values up to 1024 bytes, odd characters, empty values),
ordering keys up to 1024 bytes. The emulator enforces none of those limits, so they are checked on
what the producer dead-letters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from hypothesis import strategies as st

from devkit.runner import RunnerSim
from tests.integration import fuzz
from tests.integration.fuzz import MAX_PAYLOAD_BYTES, RAISE_ATTRIBUTE, DeadRecord, FuzzMessage, FuzzSession, session
from tests.integration.pubsub.conftest import PubSubAdapter

pytestmark = [pytest.mark.integration, pytest.mark.pubsub]

__all__ = ["session"]  # the fixture, shared by every broker's test_fuzz.py

MAX_ATTRIBUTES: Final = 100
MAX_KEY_BYTES: Final = 256
MAX_VALUE_BYTES: Final = 1024
MAX_ORDERING_KEY_BYTES: Final = 1024


def utf8_size(text: str) -> int:
    return len(text.encode())


def valid_key(key: str) -> bool:
    return (
        0 < utf8_size(key) <= MAX_KEY_BYTES
        and not key.startswith("goog")  # reserved by Pub/Sub
        # Not generated: the producer overwrites original x-dead-letter-* attributes on purpose.
        and not key.startswith(fuzz.DEAD_LETTER_PREFIX)
        and key != RAISE_ATTRIBUTE
    )


keys = (st.text(min_size=1, max_size=24) | st.sampled_from(["k" * 256, "é" * 128, "a.b/c d", "\x00", "🔑"])).filter(
    valid_key
)
values = st.text(max_size=32) | st.sampled_from(["", "v" * 1024, "é" * 512, "\x00\x01\x02", " ", "\U0001f600" * 256])
few_attributes = st.dictionaries(keys, values, max_size=6)
many_attributes = st.integers(min_value=90, max_value=MAX_ATTRIBUTES).map(lambda n: {f"a{i}": "" for i in range(n)})
ordering_keys = st.just("") | st.text(min_size=1, max_size=16) | st.sampled_from(["k" * 1024, "é" * 512, '"' * 64])


def pubsub_known_bug(message: FuzzMessage) -> str | None:
    """Pub/Sub-only exclusions (see tests/integration/fuzz.py known_bug): each has its xfail reproduction."""
    reason = fuzz.marked_reason(message)
    if reason is not None and utf8_size(reason[: MAX_VALUE_BYTES - 1]) > MAX_VALUE_BYTES:
        # test_a_long_non_ascii_reason_is_cut_to_the_attribute_limit
        return "dead-letter reason over Pub/Sub's 1024-byte attribute value limit"
    return None


@st.composite
def pubsub_messages(draw: st.DrawFn) -> FuzzMessage:
    body, huge = draw(fuzz.bodies())
    raise_text = draw(fuzz.raise_texts())
    attributes = dict(draw(few_attributes | many_attributes))
    while len(attributes) + (raise_text is not None) > MAX_ATTRIBUTES:
        attributes.popitem()
    if not body and not attributes and raise_text is None:
        attributes["empty-body"] = ""  # Pub/Sub refuses a message with neither data nor attributes
    ordering_key = draw(ordering_keys)
    return FuzzMessage(body, raise_text, huge, {"attributes": attributes, "ordering_key": ordering_key})


def sent_attributes(message: FuzzMessage) -> dict[str, str]:
    attributes = dict(message.extras["attributes"])
    if message.raise_text is not None:
        attributes[RAISE_ATTRIBUTE] = message.raise_text
    return attributes


def make(
    body: bytes | None, *, attributes: Mapping[str, str] | None = None, ordering_key: str = "", **fields: Any
) -> FuzzMessage:
    """A plain message (``fuzz.MakeMessage``): no attributes (but one if it has no data), no ordering key."""
    attrs = dict(attributes or {})
    if not body and not attrs and fields.get("raise_text") is None:
        attrs["empty-body"] = ""  # Pub/Sub refuses a message with neither data nor attributes
    return FuzzMessage(body, extras={"attributes": attrs, "ordering_key": ordering_key}, **fields)


class PubSubFuzzTarget(fuzz.FuzzTargetBase[PubSubAdapter]):
    """A topic, its watched subscription and dead-letter topic, for the fuzzing property (and the hostile corpus)."""

    async def publish_one(self, message: FuzzMessage) -> None:
        assert message.body is not None
        await self.adapter.publish(
            [message.body], attributes=sent_attributes(message), ordering_key=message.extras.get("ordering_key")
        )

    async def dead_letters(self) -> list[DeadRecord]:
        return [
            DeadRecord(index, data, attributes.get(fuzz.DEAD_LETTER_REASON), attributes)
            for index, (data, attributes) in enumerate(await self.adapter.dead_letters())
        ]

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str]:
        return sent_attributes(message)

    def reason_may_be_missing(self, message: FuzzMessage) -> bool:
        return len(sent_attributes(message)) >= MAX_ATTRIBUTES

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        attributes = record.attributes
        for name, value in sent_attributes(message).items():
            assert attributes.get(name) == value, f"the dead letter lost attribute {name!r}"
        assert len(attributes) <= MAX_ATTRIBUTES, f"dead letter with {len(attributes)} attributes (Pub/Sub: 100)"
        for name, value in attributes.items():
            assert utf8_size(name) <= MAX_KEY_BYTES, f"dead-letter attribute key {name!r} over 256 bytes"
            assert utf8_size(value) <= MAX_VALUE_BYTES, f"dead-letter attribute {name!r} over 1024 bytes: {value!r}"


@pytest.fixture
async def fuzz_targets(make_adapter: Any) -> list[PubSubFuzzTarget]:
    """A plain subscription and an ordered one in batch mode (also test_hostile.py's)."""
    return [
        PubSubFuzzTarget(await make_adapter(), "plain"),
        PubSubFuzzTarget(await make_adapter(enable_message_ordering=True), "ordered-batch", batch_size=4),
    ]


@fuzz.fuzz_test(
    pubsub_messages().filter(lambda m: pubsub_known_bug(m) is None),
    [
        *fuzz.standard_examples(make),
        make(b"", attributes={f"a{i}": "" for i in range(MAX_ATTRIBUTES)}, ordering_key="k"),
    ],
)
async def test_fuzzed_input_is_delivered_or_dead_lettered(session: FuzzSession, batch: list[FuzzMessage]) -> None:
    await session.run(batch)


# -- provider bugs found by the fuzzing (excluded from the generated input above) ------------------------
# Regression test of a bug this fuzzing found (fixed): _core/envelope.py build_envelope skips the exact size check
# when (body + attributes) * 6 + 512 <= max_payload_bytes, but source, message_id and metadata are not counted (here
# a Pub/Sub ordering key; a Kafka key, unbounded even under the def
async def test_small_body_with_long_metadata_is_checked_against_the_cap(adapter: PubSubAdapter) -> None:
    await adapter.publish([b"x"], ordering_key='"' * 1000)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(max_payload_bytes=MAX_PAYLOAD_BYTES))
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        assert not runner.failures
        assert await adapter.unsettled() == 0
    sizes = [fuzz.payload_size(p) for p in runner.persisted[1]]
    assert all(size <= MAX_PAYLOAD_BYTES for size in sizes), f"envelope of {sizes} bytes, cap {MAX_PAYLOAD_BYTES}"


# Regression test of a bug this fuzzing found (fixed): producers/pubsub.py _dead_letter_message cuts the reason at
# 1023 characters, but Pub/Sub limits attribute values to 1024 bytes: a non-ASCII reason over the limit makes
# Publish fail with InvalidArgument on Pub/Sub (the emulator accepts it),
async def test_a_long_non_ascii_reason_is_cut_to_the_attribute_limit(adapter: PubSubAdapter) -> None:
    await adapter.publish([b"x"], attributes={RAISE_ATTRIBUTE: "é" * 500})  # 1000 bytes: a valid attribute
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.fuzz.raise_on_marked"))
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        assert not runner.failures
    [(_, attributes)] = await adapter.dead_letters()
    for name, value in attributes.items():
        assert utf8_size(value) <= MAX_VALUE_BYTES, f"Pub/Sub refuses attribute {name!r} of {utf8_size(value)} bytes"
