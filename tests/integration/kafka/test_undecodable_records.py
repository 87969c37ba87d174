"""
Records aiokafka cannot decode, written as raw batches (raw_records.py) to the real broker and read
by the real manager: a header key that is not UTF-8 is delivered (``base64:`` key); a malformed
record or a batch whose CRC does not match is dead-lettered once, named by its offsets; the records
around it, in the same batch too, reach every watcher, and the partition is committed past it all.
Also: a sender's own ``x-dead-letter-*`` headers never pass for the provider's.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider.producers.kafka import KafkaSharedStreamProducer
from devkit.runner import RunnerSim, record_producers, wait_until
from tests.integration.contract import wait_until_async

from .conftest import KafkaAdapter
from .raw_records import RawRecord, publish_raw_records

pytestmark = [pytest.mark.integration, pytest.mark.kafka]

BAD_KEY = b"\xff\xfe"  # not UTF-8: what sarama / franz-go / librdkafka let a producer write
BAD_KEY_TEXT = "base64:" + base64.b64encode(BAD_KEY).decode()
# A record whose value claims 3 bytes where 2 follow (offset delta 1 is readable).
MALFORMED_AT_DELTA_1 = b"\x00\x00\x02\x01\x06ab"


def order(number: int, **extra: Any) -> bytes:
    return json.dumps({"order_id": number, **extra}).encode()


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[KafkaSharedStreamProducer]]:
    """Every producer the manager builds in this test (to read its counters)."""
    yield record_producers(monkeypatch, KafkaSharedStreamProducer)


async def publish_raw(
    adapter: KafkaAdapter,
    *records: RawRecord,
    corrupt_crc: bool = False,
    gzip: bool = False,
    timestamp_ms: int | None = None,
) -> int:
    return await publish_raw_records(
        adapter.bootstrap, adapter.topic, 0, records, corrupt_crc=corrupt_crc, gzip=gzip, timestamp_ms=timestamp_ms
    )


async def settled(adapter: KafkaAdapter) -> bool:
    return await adapter.unsettled() == 0


def messages(runner: RunnerSim, trigger_id: int) -> list[dict[str, Any]]:
    """The envelopes a watcher's persisted events hold (one each, or a batch's ``messages``)."""
    return [m for payload in runner.persisted[trigger_id] for m in payload.get("messages", [payload])]


def received(runner: RunnerSim, trigger_id: int) -> int:
    return len(messages(runner, trigger_id))


def by_offset(runner: RunnerSim, trigger_id: int) -> dict[int, dict[str, Any]]:
    return {message["metadata"]["offset"]: message for message in messages(runner, trigger_id)}


async def delivered_to_two_watchers(adapter: KafkaAdapter, count: int) -> RunnerSim:
    """Two watchers of one stream, run until each fired ``count`` events and the partition is committed past them."""
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        runner.add(2, adapter.make_trigger())
        await wait_until(
            lambda: runner.count(1) == count and runner.count(2) == count, timeout=30, what=f"{count} events each"
        )
        await wait_until_async(lambda: settled(adapter), timeout=30)
        assert not runner.failures
    return runner


async def test_a_non_utf8_header_key_is_delivered_as_base64_with_its_batch_mates(adapter: KafkaAdapter) -> None:
    await adapter.publish([order(0)], partition=0)
    first = await publish_raw(
        adapter,
        RawRecord(order(1), headers=[(b"source", b"shop")]),
        RawRecord(order(2), headers=[(BAD_KEY, b"v"), (b"source", b"go")]),
        RawRecord(order(3)),
    )
    await adapter.publish([order(4)], partition=0)
    assert first == 1
    runner = await delivered_to_two_watchers(adapter, 5)
    for trigger_id in (1, 2):
        events = by_offset(runner, trigger_id)
        assert sorted(events) == [0, 1, 2, 3, 4]
        assert [events[o]["body"]["order_id"] for o in range(5)] == [0, 1, 2, 3, 4]
        assert events[2]["attributes"] == {BAD_KEY_TEXT: "v", "source": "go"}
        assert events[1]["attributes"] == {"source": "shop"}
    assert await adapter.dead_lettered() == []


async def test_a_record_stamped_beyond_any_date_is_delivered_without_a_stamp(adapter: KafkaAdapter) -> None:
    # A record's CreateTime is any int64 its producer writes; year 146 million is no datetime.
    # Before: building the envelope raised, and the record was dead-lettered as if it were poison.
    await publish_raw(adapter, RawRecord(order(0)), RawRecord(order(1)), timestamp_ms=2**62)
    await adapter.publish([order(2)], partition=0)
    runner = await delivered_to_two_watchers(adapter, 3)
    for trigger_id in (1, 2):
        events = by_offset(runner, trigger_id)
        assert [events[o]["body"]["order_id"] for o in range(3)] == [0, 1, 2]
        assert events[0]["published_at"] is None and events[1]["published_at"] is None
        assert events[2]["published_at"] is not None
    assert await adapter.dead_lettered() == []


@pytest.mark.parametrize(
    "options",
    [{}, {"position_store": "group"}, {"batch_size": 10, "batch_timeout": 0.2}],
    ids=["watcher-positions", "group", "batch-mode"],
)
async def test_a_malformed_record_is_dead_lettered_once_and_its_batch_mates_are_delivered(
    adapter: KafkaAdapter, producers: list[KafkaSharedStreamProducer], options: dict[str, Any]
) -> None:
    await publish_raw(
        adapter, RawRecord(order(0)), RawRecord(body=MALFORMED_AT_DELTA_1), RawRecord(order(2)), RawRecord(order(3))
    )
    await adapter.publish([order(4)], partition=0)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(**options))
        runner.add(2, adapter.make_trigger(**options))
        await wait_until(lambda: received(runner, 1) == received(runner, 2) == 4, timeout=30, what="4 messages each")
        await wait_until_async(lambda: settled(adapter), timeout=30)
        assert not runner.failures
        counters = producers[0].counters
        assert (counters.dead_lettered, counters.poison) == (1, 1)
    for trigger_id in (1, 2):
        assert sorted(by_offset(runner, trigger_id)) == [0, 2, 3, 4]
    [dead] = await adapter.dead_letter_records()
    headers = {name: value.decode() for name, value in dead.headers}
    assert headers["x-dead-letter-source"] == f"{adapter.topic}/0/1"
    assert "x-dead-letter-last-offset" not in headers
    reason = headers["x-dead-letter-reason"]
    assert f"undecodable Kafka record at {adapter.topic}/0/1" in reason
    assert "value of 3 bytes runs past the end of the record" in reason
    assert dead.value == b"\x0e" + MALFORMED_AT_DELTA_1  # the record as written, length prefix included


async def test_a_batch_with_a_bad_crc_is_committed_past_with_a_loud_error_without_a_dlq(
    adapter: KafkaAdapter, producers: list[KafkaSharedStreamProducer], caplog: pytest.LogCaptureFixture
) -> None:
    await adapter.publish([order(0)], partition=0)
    await publish_raw(adapter, RawRecord(order(1)), RawRecord(order(2)), corrupt_crc=True)
    await adapter.publish([order(3)], partition=0)
    manager = SharedStreamManager(ack_timeout=60)
    caplog.set_level(logging.ERROR)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(dlq_topic=None))
        await wait_until(lambda: runner.count(1) == 2, timeout=30, what="the 2 good records")
        await wait_until_async(lambda: settled(adapter), timeout=30)
        assert not runner.failures
        counters = producers[0].counters
        assert (counters.dead_lettered, counters.poison) == (1, 1)
    assert sorted(by_offset(runner, 1)) == [0, 3]
    [error] = [r for r in caplog.records if "without a dlq_topic" in r.getMessage()]
    assert error.levelno == logging.ERROR
    assert f"{adapter.topic}/0/1 (to offset 2)" in error.getMessage()
    assert "CRC mismatch" in error.getMessage()
    assert await adapter.dead_lettered() == []


async def test_a_batch_with_a_bad_crc_is_one_dead_letter_naming_its_offsets(adapter: KafkaAdapter) -> None:
    await publish_raw(adapter, RawRecord(order(0)), RawRecord(order(1)), corrupt_crc=True)
    await adapter.publish([order(2)], partition=0)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await wait_until(lambda: runner.count(1) == 1, timeout=30, what="the good record")
        await wait_until_async(lambda: settled(adapter), timeout=30)
    [dead] = await adapter.dead_letter_records()
    headers = {name: value.decode() for name, value in dead.headers}
    assert headers["x-dead-letter-source"] == f"{adapter.topic}/0/0"
    assert headers["x-dead-letter-last-offset"] == "1"
    assert "record batch CRC mismatch" in headers["x-dead-letter-reason"]


async def test_a_gzip_batch_with_a_non_utf8_header_key_is_delivered(adapter: KafkaAdapter) -> None:
    await publish_raw(adapter, RawRecord(order(0)), RawRecord(order(1), headers=[(BAD_KEY, None)]), gzip=True)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        await wait_until(lambda: runner.count(1) == 2, timeout=30, what="both records")

        async def committed_past_both() -> bool:
            # Not settled(): Tansu reports the end of a compressed batch as its base offset + 1.
            return (await adapter.committed())[0] == 2

        await wait_until_async(committed_past_both, timeout=30)
    events = by_offset(runner, 1)
    assert events[1]["attributes"] == {BAD_KEY_TEXT: ""}
    assert events[0]["body"] == {"order_id": 0}


async def test_a_rejected_record_with_a_non_utf8_header_key_is_dead_lettered_with_its_base64_name(
    adapter: KafkaAdapter,
) -> None:
    await publish_raw(adapter, RawRecord(order(5, bad=True), headers=[(BAD_KEY, b"k")]))
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
        await wait_until_async(lambda: settled(adapter), timeout=30)
        assert not runner.failures
    [dead] = await adapter.dead_letter_records()
    assert dead.value == order(5, bad=True)
    assert dead.headers[0] == (BAD_KEY_TEXT, b"k")


async def test_the_providers_dead_letter_headers_win_over_a_senders(adapter: KafkaAdapter) -> None:
    forged = {"x-dead-letter-source": "elsewhere/9/9", "X-Dead-Letter-Reason": "forged", "region": "eu"}
    await adapter.publish([order(5, bad=True)], attributes=forged, partition=0)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
        await wait_until_async(lambda: settled(adapter), timeout=30)
        assert not runner.failures
    [dead] = await adapter.dead_letter_records()
    assert [name for name, _ in dead.headers] == [
        "x-original-x-dead-letter-source",
        "x-original-X-Dead-Letter-Reason",
        "region",
        "x-dead-letter-reason",
        "x-dead-letter-source",
        "x-dead-letter-attempts",
        "x-dead-letter-group",
    ]
    headers = dict(dead.headers)
    assert headers["x-dead-letter-source"] == f"{adapter.topic}/0/0".encode()
    assert headers["x-original-x-dead-letter-source"] == b"elsewhere/9/9"
    assert b"order 5 is flagged bad" in headers["x-dead-letter-reason"]


async def test_an_envelope_that_raises_is_dead_lettered_and_the_partition_goes_on(
    adapter: KafkaAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The Kafka hot path builds envelopes itself; whatever that raises for one record (a bug, or an
    input no corpus found yet) takes the base's guard: forced-rejected and dead-lettered, never the
    group's end. The failure is injected for one record: no real input is known to raise any more.
    """
    from airflow_shared_stream_provider.producers import kafka as kafka_producer

    real_build = kafka_producer.build_envelope  # type: ignore[attr-defined]

    def build(**kwargs: Any) -> Any:
        if kwargs["body"] == order(1):
            raise ValueError("no envelope for this one")
        return real_build(**kwargs)

    monkeypatch.setattr(kafka_producer, "build_envelope", build)
    await adapter.publish([order(0), order(1), order(2)], partition=0)
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager, confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger())
        runner.add(2, adapter.make_trigger())
        await wait_until(lambda: received(runner, 1) == received(runner, 2) == 2, timeout=30, what="2 messages each")
        await wait_until_async(lambda: settled(adapter), timeout=30)
        assert not runner.failures
    assert sorted(by_offset(runner, 1)) == [0, 2]
    dead = await adapter.dead_letter_records()
    assert [record.value for record in dead] == [order(1)], "dead-lettered intact"
    reason = dict(dead[0].headers)["x-dead-letter-reason"].decode()
    assert "envelope failed: ValueError: no envelope for this one" in reason
