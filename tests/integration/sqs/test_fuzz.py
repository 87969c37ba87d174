"""
Fuzzed input through a real SQS endpoint (moto server, or SQS_ENDPOINT_URL): see tests/integration/fuzz.py.

Streams: a standard queue (one envelope per event), a standard queue in batch mode and a FIFO queue
in batch mode with fuzzed MessageGroupIds. Input: every body category of the shared strategies
(binary bodies go as base64 + ``content-transfer-encoding``, as the producer documents), up to
SQS's 10 message attributes of every DataType (String, Number, Binary, custom labels) with odd
names and values. SQS's documented limits are checked on what the producer dead-letters, because
moto does not enforce them.
"""

from __future__ import annotations

import base64
import string
from collections.abc import Mapping
from typing import Any, Final

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from hypothesis import strategies as st

from devkit.kits.sqs import TRANSFER_ENCODING, original_bytes, sqs_body
from devkit.runner import RunnerSim
from tests.integration import fuzz
from tests.integration.contract import wait_until_settled
from tests.integration.fuzz import MAX_PAYLOAD_BYTES, RAISE_ATTRIBUTE, DeadRecord, FuzzMessage, FuzzSession, session
from tests.integration.sqs.conftest import SqsAdapter

pytestmark = [pytest.mark.integration, pytest.mark.sqs]

__all__ = ["session"]  # the fixture, shared by every broker's test_fuzz.py

MAX_ATTRIBUTES: Final = 10
GROUP_ID_ALPHABET: Final = string.ascii_letters + string.digits + string.punctuation


def valid_sqs_char(char: str) -> bool:
    """SQS bodies and String attribute values: #x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF."""
    return char in "\t\n\r" or " " <= char <= "\ud7ff" or "\ue000" <= char <= "\ufffd" or char >= "\U00010000"


def valid_sqs_text(text: str) -> bool:
    return all(valid_sqs_char(char) for char in text)


SQS_CHARS: Final = st.characters(
    codec="utf-8", min_codepoint=0x20, exclude_characters="\ufffe\uffff"
) | st.sampled_from("\t\n\r")


def valid_attribute_name(name: str) -> bool:
    lowered = name.lower()
    return (
        ".." not in name
        and not name.startswith(".")
        and not name.endswith(".")
        and not lowered.startswith(("aws.", "amazon."))
        # Not generated: on SQS an original x-dead-letter-* attribute wins over the producer's.
        and not lowered.startswith(fuzz.DEAD_LETTER_PREFIX)
        and lowered not in (RAISE_ATTRIBUTE, TRANSFER_ENCODING)
    )


attribute_names = (
    st.from_regex(r"[A-Za-z0-9_.\-]{1,40}", fullmatch=True) | st.sampled_from(["n" * 256, "A.b-c_d", "0", "_"])
).filter(valid_attribute_name)

attribute_values: st.SearchStrategy[dict[str, Any]] = st.one_of(
    st.builds(
        lambda label, text: {"DataType": "String" + label, "StringValue": text},
        st.sampled_from(["", "", ".fuzz", ".ñ-label"]),
        st.text(SQS_CHARS, min_size=1, max_size=48) | st.sampled_from(["x" * 1024, " ", "\t\r\n", "\U0001f600" * 30]),
    ),
    st.builds(
        lambda label, number: {"DataType": "Number" + label, "StringValue": number},
        st.sampled_from(["", ".int"]),
        st.integers(min_value=-(10**37), max_value=10**37).map(str) | st.sampled_from(["-0.5", "1E+5", "0.000001"]),
    ),
    st.builds(
        lambda label, data: {"DataType": "Binary" + label, "BinaryValue": data},
        st.sampled_from(["", ".gz"]),
        st.binary(min_size=1, max_size=48),
    ),
)


def attribute_text(value: Mapping[str, Any]) -> str:
    """What the envelope shows for one SQS message attribute (binary: UTF-8 text, else ``base64:``)."""
    if "StringValue" in value:
        return str(value["StringValue"])
    raw = bytes(value["BinaryValue"])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(raw).decode("ascii")


def needs_transfer_encoding(body: bytes | None) -> bool:
    return bool(sqs_body(body or b"")[1])


def wire_attributes(message: FuzzMessage) -> dict[str, dict[str, Any]]:
    attributes = {name: dict(value) for name, value in message.extras["attributes"].items()}
    if message.raise_text is not None:
        attributes[RAISE_ATTRIBUTE] = {"DataType": "String", "StringValue": message.raise_text}
    return attributes


def sqs_known_bug(message: FuzzMessage) -> str | None:
    """SQS-only exclusions (see tests/integration/fuzz.py known_bug): each has its xfail reproduction."""
    reason = fuzz.marked_reason(message)
    if reason is not None and not valid_sqs_text(reason[:1024]):
        # test_a_reason_with_characters_sqs_refuses_is_made_sendable
        return "dead-letter reason with characters SQS refuses in an attribute value"
    return None


@st.composite
def sqs_messages(draw: st.DrawFn, *, fifo: bool = False) -> FuzzMessage:
    body, huge = draw(fuzz.bodies())
    raise_text = draw(fuzz.raise_texts(SQS_CHARS))
    room = MAX_ATTRIBUTES - (raise_text is not None) - needs_transfer_encoding(body)
    attributes = draw(st.dictionaries(attribute_names, attribute_values, max_size=room))
    extras: dict[str, Any] = {"attributes": attributes}
    if fifo:
        extras["group_id"] = draw(
            st.text(GROUP_ID_ALPHABET, min_size=1, max_size=16) | st.sampled_from(["g", "~" * 128, "a/b\\c"])
        )
    return FuzzMessage(body, raise_text, huge, extras)


def make(
    body: bytes | None, *, attributes: Mapping[str, Mapping[str, Any]] | None = None, **fields: Any
) -> FuzzMessage:
    """A plain message (``fuzz.MakeMessage``): no message attributes, the target's default group id."""
    return FuzzMessage(body, extras={"attributes": dict(attributes or {})}, **fields)


class SqsFuzzTarget(fuzz.FuzzTargetBase[SqsAdapter]):
    """A queue (standard or FIFO) and its DLQ, for the fuzzing property (and the hostile corpus)."""

    def __init__(self, adapter: SqsAdapter, name: str, *, batch_size: int = 1, fifo: bool = False) -> None:
        super().__init__(adapter, name, batch_size=batch_size)
        self.fifo = fifo
        self._dead: dict[str, dict[str, Any]] = {}

    async def publish_one(self, message: FuzzMessage) -> None:
        assert message.body is not None
        await self.adapter.publish(
            [message.body],
            message_attributes=wire_attributes(message),
            group_id=message.extras.get("group_id", "fuzz") if self.fifo else None,
        )

    async def dead_letters(self) -> list[DeadRecord]:
        """
        Every message dead-lettered so far. Each is received once and deleted, and kept here: a
        FIFO queue hides the rest of a message group while one of its messages is in flight, so
        listing by receiving and releasing (``SqsAdapter.dead_letter_messages``) misses some.
        """
        for raw in await self.adapter.in_thread(self.adapter.kit.take_dead_letter_messages):
            self._dead.setdefault(raw["MessageId"], raw)
        records = []
        for raw in self._dead.values():
            attributes = raw.get("MessageAttributes") or {}
            reason = attributes.get(fuzz.DEAD_LETTER_REASON, {}).get("StringValue")
            records.append(DeadRecord(raw["MessageId"], original_bytes(raw), reason, attributes))
        return records

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str]:
        attributes = {name: attribute_text(value) for name, value in wire_attributes(message).items()}
        if needs_transfer_encoding(message.body):
            attributes[TRANSFER_ENCODING] = "base64"
        return attributes

    def reason_may_be_missing(self, message: FuzzMessage) -> bool:
        return len(self.expected_attributes(message)) >= MAX_ATTRIBUTES

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        attributes = record.attributes
        sent = wire_attributes(message)
        for name, value in sent.items():
            kept = attributes.get(name)
            assert kept is not None and attribute_text(kept) == attribute_text(value), f"DLQ lost attribute {name!r}"
        assert len(attributes) <= MAX_ATTRIBUTES, f"DLQ message has {len(attributes)} attributes (SQS allows 10)"
        for name, value in attributes.items():
            text = value.get("StringValue")
            assert text is None or valid_sqs_text(text), f"DLQ attribute {name!r} = {text!r}: SQS refuses it"


@pytest.fixture
async def fuzz_targets(make_adapter: Any) -> list[SqsFuzzTarget]:
    """A standard queue, one in batch mode and a FIFO queue in batch mode (also test_hostile.py's)."""
    return [
        SqsFuzzTarget(await make_adapter(fifo=fifo, visibility=30), name, batch_size=batch_size, fifo=fifo)
        for name, batch_size, fifo in (("standard", 1, False), ("standard-batch", 4, False), ("fifo-batch", 4, True))
    ]


@fuzz.fuzz_test(
    sqs_messages(fifo=True).filter(lambda m: sqs_known_bug(m) is None), [make(b""), *fuzz.standard_examples(make)]
)
async def test_fuzzed_input_is_delivered_or_dead_lettered(session: FuzzSession, batch: list[FuzzMessage]) -> None:
    await session.run(batch)


# -- provider bugs found by the fuzzing (excluded from the generated input above) ------------------------
# Regression test of a bug this fuzzing found (fixed): _core/envelope.py decode_body catches only
# msgspec.DecodeError, but msgspec raises UnicodeDecodeError for invalid UTF-8 inside a JSON string: the producer's
# receive loop raises, the group ends (every watcher fails) and the message is never
async def test_invalid_utf8_inside_a_json_string_does_not_crash_the_stream(adapter: SqsAdapter) -> None:
    await adapter.publish([b'["\xff"]', b"after"])
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        assert not runner.failures, f"the stream crashed: {runner.failures!r}"
        assert await adapter.unsettled() == 0
    assert sorted(p["body_encoding"] for p in runner.persisted[1]) == ["base64", "text"]


# Regression test of a bug this fuzzing found (fixed): _core/envelope.py decode_body lets msgspec's RecursionError
# through (JSON nested ~1000 deep or more): the producer's receive loop raises, the group ends and the message is
# never settled
async def test_deeply_nested_json_does_not_crash_the_stream(adapter: SqsAdapter) -> None:
    await adapter.publish([b"[" * 5000 + b"]" * 5000])
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        assert not runner.failures, f"the stream crashed: {runner.failures!r}"
        assert await adapter.unsettled() == 0
    assert [p["body_encoding"] for p in runner.persisted[1]] in (["text"], ["json"])


# Regression test of a bug this fuzzing found (fixed): _core/batching.py Batcher.add starts a batch at
# _BATCH_OVERHEAD but never checks it for the first envelope: a batch of one envelope under the cap is up to 15
# bytes over it
async def test_a_batch_of_one_envelope_near_the_cap_stays_under_it(adapter: SqsAdapter) -> None:
    options: dict[str, Any] = {"max_payload_bytes": MAX_PAYLOAD_BYTES, "batch_size": 4, "batch_timeout": 0.2}
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(**options))
        await adapter.publish([b"x"])
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        probe = runner.persisted[1][0]["messages"][0]
        # Timestamps drop ".fff000" when their milliseconds are 0: count the probe's at full length.
        stamps = (probe["published_at"], probe["metadata"].get("first_received_at"))
        probe_size = fuzz.payload_size(probe) + sum(7 for stamp in stamps if stamp and "." not in stamp)
        # The same envelope with a longer body: 4 bytes under the cap (every other field keeps its size).
        near_cap = b"x" * (1 + MAX_PAYLOAD_BYTES - 4 - probe_size)
        await adapter.publish([near_cap])
        # Alone in a batch it would be over the cap ({"messages":[...]} adds 15 bytes): in batch mode
        # an envelope is capped at max_payload_bytes less that wrapper, so this one is dead-lettered
        # as oversize (intact), and no event payload over the cap is ever stored.
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        assert not runner.failures
    assert runner.count(1) == 1, "the near-cap message must not fire a batch over the cap"
    assert await adapter.dead_lettered() == [near_cap]
    for payload in runner.persisted[1]:
        size = fuzz.payload_size(payload)
        assert size <= MAX_PAYLOAD_BYTES, f"batch payload of {size} bytes, cap {MAX_PAYLOAD_BYTES}"


# Regression test of a bug this fuzzing found (fixed): producers/sqs.py _dead_letter_record sends the reason as the
# x-dead-letter-reason attribute unchecked; a reason with a character SQS refuses in attribute values (here NUL,
# from the message's own text) makes SendMessageBatch fail on AWS (mot
async def test_a_reason_with_characters_sqs_refuses_is_made_sendable(adapter: SqsAdapter) -> None:
    marked = {RAISE_ATTRIBUTE: {"DataType": "String", "StringValue": "bad:"}}
    await adapter.publish([b"a\x00b"], message_attributes=marked)  # sent as base64 (NUL is no SQS text)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.fuzz.raise_on_marked"))
        await fuzz.settle_or_fail(runner, adapter.unsettled)
        assert not runner.failures
    [dead] = await adapter.dead_letter_messages()
    for name, value in dead["MessageAttributes"].items():
        text = value.get("StringValue")
        assert text is None or valid_sqs_text(text), f"SQS refuses attribute {name!r} = {text!r}"


# Regression test of a bug this fuzzing found (fixed): _core/trigger.py filter_shared_stream (and _filter_batch)
# format the reason as f'filter raised {type(exc).__name__}: {exc}' inside the except block; an exception whose
# __str__ raises escapes, the watcher's trigger fails, the manager resolve
async def test_a_filter_exception_that_cannot_be_rendered_still_dead_letters(adapter: SqsAdapter) -> None:
    await adapter.publish([b"first"], message_attributes={RAISE_ATTRIBUTE: {"DataType": "String", "StringValue": "x"}})
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.fuzz.raise_unprintable_on_marked"))
        runner.add(2, adapter.make_trigger())
        await wait_until_settled(adapter, timeout=20)
        dead = await adapter.dead_lettered()
        assert dead == [b"first"], f"deleted, never dead-lettered nor delivered to the raising watcher: {dead}"
        assert not runner.failures, f"the watcher failed: {runner.failures!r}"
