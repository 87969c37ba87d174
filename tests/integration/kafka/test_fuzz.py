"""
Fuzzed input through a real Kafka-protocol broker (Tansu, or KAFKA_BOOTSTRAP_SERVERS): see
tests/integration/fuzz.py.

Streams: a 3-partition topic (one envelope per event) and one in batch mode. Input: every body
category of the shared strategies plus tombstones (no value), keys of random bytes (none, empty,
non-UTF-8, up to 3000 bytes), headers with odd names and non-UTF-8 or null values, repeated names,
and up to 200 of them.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from hypothesis import strategies as st

from devkit.runner import RunnerSim
from tests.integration import fuzz
from tests.integration.fuzz import DEAD_LETTER_PREFIX, RAISE_ATTRIBUTE, DeadRecord, FuzzMessage, FuzzSession, session
from tests.integration.kafka.conftest import KafkaAdapter

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

__all__ = ["session"]  # the fixture, shared by every broker's test_fuzz.py

header_names = (st.text(max_size=24) | st.sampled_from(["", "\x00", "é", "🔑" * 8, "n" * 300])).filter(
    lambda name: not name.startswith(DEAD_LETTER_PREFIX) and name != RAISE_ATTRIBUTE
)
header_values = (
    st.none()
    | st.binary(max_size=32)
    | st.text(max_size=32).map(str.encode)
    | st.sampled_from([b"", b"\xff\xfe", b"\xc3", b"\x00", b"\xed\xa0\x80", b"v" * 1024])
)
few_headers = st.lists(st.tuples(header_names, header_values), max_size=8)
many_headers = st.integers(min_value=50, max_value=200).map(lambda n: [(f"h{i % 40}", b"%d" % i) for i in range(n)])
keys = (
    st.none()
    | st.binary(max_size=48)
    | st.sampled_from([b"", b"\x00", b"\xff\xfe\xfd", "clé".encode(), b"k" * 3000])
    | st.binary(min_size=500, max_size=3000)
)


@st.composite
def kafka_messages(draw: st.DrawFn) -> FuzzMessage:
    body, huge = draw(fuzz.bodies() | st.just((None, False)))
    raise_text = draw(fuzz.raise_texts())
    headers = draw(few_headers | many_headers)
    key = draw(keys)
    if body is None and key is None:
        key = b"tombstone"  # a record needs a key or a value
    return FuzzMessage(body, raise_text, huge, {"headers": headers, "key": key})


def header_text(value: bytes | None) -> str:
    if value is None:
        return ""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(value).decode("ascii")


def record_headers(message: FuzzMessage) -> list[tuple[str, bytes | None]]:
    headers: list[tuple[str, bytes | None]] = []
    if message.raise_text is not None:
        headers.append((RAISE_ATTRIBUTE, message.raise_text.encode()))
    headers.extend(message.extras["headers"])
    return headers


def make(
    body: bytes | None, *, headers: Sequence[tuple[str, bytes | None]] = (), key: bytes | None = None, **fields: Any
) -> FuzzMessage:
    """A plain record (``fuzz.MakeMessage``): no headers, no key but for a tombstone's."""
    if body is None and key is None:
        key = b"tombstone"  # a record needs a key or a value
    return FuzzMessage(body, extras={"headers": list(headers), "key": key}, **fields)


class KafkaFuzzTarget(fuzz.FuzzTargetBase[KafkaAdapter]):
    """A topic, its DLQ topic and consumer group, for the fuzzing property (and the hostile corpus)."""

    async def publish_one(self, message: FuzzMessage) -> None:
        await self.adapter.publish([message.body], key=message.extras["key"], headers=record_headers(message))

    async def dead_letters(self) -> list[DeadRecord]:
        records = []
        for record in await self.adapter.dead_letter_records():
            reasons = [value for name, value in record.headers if name == fuzz.DEAD_LETTER_REASON]
            reason = reasons[-1].decode() if reasons else None
            records.append(DeadRecord(record.offset, record.value, reason, {"headers": record.headers}, record.key))
        return records

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str]:
        return {name: header_text(value) for name, value in record_headers(message)}

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        assert record.key == message.extras["key"], "the dead letter lost its key"
        sent = record_headers(message)
        headers = list(record.attributes["headers"])
        assert headers[: len(sent)] == sent, "the dead letter lost or changed headers"
        assert all(name.startswith(DEAD_LETTER_PREFIX) for name, _ in headers[len(sent) :])


@pytest.fixture
async def fuzz_targets(kafka_bootstrap: str, kafka_conn: str) -> list[KafkaFuzzTarget]:
    """A 3-partition topic and one in batch mode, each with its DLQ topic (also test_hostile.py's)."""
    targets = []
    for name, batch_size in (("single", 1), ("batch", 4)):
        adapter = KafkaAdapter(kafka_bootstrap, kafka_conn)
        await adapter.create_topics()
        targets.append(KafkaFuzzTarget(adapter, name, batch_size=batch_size))
    return targets


@fuzz.fuzz_test(
    kafka_messages(),
    [
        make(None),
        *fuzz.standard_examples(make),
        make(b"", headers=[("h", b"\xff"), ("h", None), ("", b"")], key=b"\xff\x00"),
    ],
)
async def test_fuzzed_input_is_delivered_or_dead_lettered(session: FuzzSession, batch: list[FuzzMessage]) -> None:
    await session.run(batch)


# -- provider bugs found by the fuzzing ----------------------------------------------------------------
async def test_a_record_near_the_size_limit_is_dead_lettered_without_its_value(adapter: KafkaAdapter) -> None:
    # Found by the fuzzing: over max_payload_bytes (so dead-lettered) and just small enough for the
    # publisher's 1 MiB request limit, so the dead-letter headers push it over. It used to end the
    # group on MessageSizeTooLargeError at every restart: the partition never moved past it.
    size = 1024 * 1024 - 300
    await adapter.publish([b"x" * size, b"after"], partition=0)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await fuzz.settle_or_fail(runner, adapter.unsettled, timeout=30)
        assert not runner.failures, f"the stream crashed: {runner.failures!r}"
        assert await adapter.unsettled() == 0, "the partition is stuck"
    assert [p["body"] for p in runner.persisted[1]] == ["after"]
    [record] = await adapter.dead_letter_records()
    headers = dict(record.headers)
    assert record.value == b""
    assert headers["x-dead-letter-source"] == f"{adapter.topic}/0/0".encode()
    assert b"payload too large" in headers["x-dead-letter-reason"]
    omitted = headers["x-dead-letter-omitted"].decode()
    assert f"({size} bytes)" in omitted and f"{adapter.topic}/0/0" in omitted
