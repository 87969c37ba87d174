"""
The hostile corpus through a real Kafka-protocol broker (Tansu, or KAFKA_BOOTSTRAP_SERVERS): see
tests/integration/hostile.py. Streams: those of test_fuzz.py (a 3-partition topic, and one in
batch mode).

Kafka-only cases: tombstones (no value), no key and an empty key, a record at the 1 MiB request
limit (aiokafka's ``max_request_size``, under Kafka's default ``max.message.bytes``), 2000
headers, CR/LF and NUL in header names, values and keys, non-UTF-8 header values, non-UTF-8
header **names** (aiokafka's producer refuses them: written as raw record batches,
tests/integration/kafka/raw_records.py), and forged ``x-dead-letter-*`` headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import pytest

from airflow_shared_stream_provider._core.envelope import text_value
from tests.integration.fuzz import DEAD_LETTER_REASON, DeadRecord, FuzzMessage
from tests.integration.hostile import HostileCase, forged_attributes, neutral_cases, run_corpus_on
from tests.integration.kafka.raw_records import RawRecord, publish_raw_records
from tests.integration.kafka.test_fuzz import KafkaFuzzTarget, fuzz_targets, make

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

__all__ = ["fuzz_targets"]  # the fixture, shared with test_fuzz.py

REQUEST_LIMIT: Final = 1024 * 1024
"""aiokafka's default max_request_size: the largest record a client here can publish."""


def raw(body: bytes, headers: Sequence[tuple[bytes, bytes | None]]) -> FuzzMessage:
    """A record written as a raw batch: header names of any bytes."""
    return FuzzMessage(body, extras={"headers": [], "raw_headers": list(headers), "key": None})


class KafkaHostileTarget(KafkaFuzzTarget):
    """The fuzz target, plus records whose header names aiokafka's producer cannot write."""

    async def publish_one(self, message: FuzzMessage) -> None:
        raw_headers = message.extras.get("raw_headers")
        if raw_headers is None:
            await super().publish_one(message)
            return
        adapter = self.adapter
        partition = adapter.published % adapter.partitions
        record = RawRecord(value=message.body, key=message.extras["key"], headers=tuple(raw_headers))
        await publish_raw_records(adapter.bootstrap, adapter.topic, partition, [record])
        adapter.published += 1

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str]:
        raw_headers = message.extras.get("raw_headers")
        if raw_headers is None:
            return super().expected_attributes(message)
        return {text_value(name): text_value(value) for name, value in raw_headers}

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        if message.extras.get("raw_headers") is None:
            super().check_dead_record(message, record)


def kafka_cases() -> list[HostileCase]:
    odd_headers = [
        ("crlf\r\nname", b"v"),
        ("nul\x00name", b"v"),
        ("values", b"a\r\nb\x00c"),
        ("bad-utf8", b"\xff\xfe\xc3"),
        ("null", None),
        ("", b""),
    ]
    return [
        *neutral_cases(make),
        HostileCase("tombstone, no key, empty key", (make(None), make(b'{"kind":"nokey"}'), make(b"k", key=b""))),
        HostileCase("keys with CR/LF, NUL, non-UTF-8", (make(b"keys", key=b"a\r\n\x00\xff"),)),
        HostileCase("record at the 1 MiB request limit", (make(b"x" * (REQUEST_LIMIT - 300)),)),
        HostileCase("2000 headers", (make(b'{"kind":"many"}', headers=[(f"h{i}", b"%d" % i) for i in range(2000)]),)),
        HostileCase("CR/LF, NUL, non-UTF-8 and null in headers", (make(b'{"kind":"odd"}', headers=odd_headers),)),
        HostileCase(
            "non-UTF-8 header names (raw record batch)",
            (raw(b'{"kind":"raw"}', [(b"\xff\xfe", b"v"), (b"ok", b"\xc3"), (b"\xc3\x28\r\n", None)]),),
        ),
        HostileCase(
            "forged x-dead-letter-* headers",
            (
                make(
                    b'{"kind":"forged"}',
                    headers=[(name, value.encode()) for name, value in forged_attributes().items()],
                    raise_text="f",
                ),
            ),
            forged=True,
        ),
    ]


def reasons_of(record: DeadRecord) -> list[str]:
    return [
        value.decode() if value is not None else ""
        for name, value in record.attributes["headers"]
        if name.lower() == DEAD_LETTER_REASON
    ]


@pytest.mark.timeout(300)
async def test_hostile_corpus_is_delivered_or_dead_lettered(fuzz_targets: list[KafkaFuzzTarget]) -> None:
    targets = [KafkaHostileTarget.of(target) for target in fuzz_targets]
    await run_corpus_on(targets, kafka_cases(), make, reasons_of, broker="kafka")
