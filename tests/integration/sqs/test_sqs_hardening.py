"""
SQS against moto: a sender cannot forge the dead-letter fields, a DLQ that resolves to the queue
itself is refused at start, and FIFO fences do not grow with the number of message groups.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers.sqs import SqsSharedStreamProducer
from devkit.runner import RunnerSim, record_producers, wait_until
from tests.integration.contract import wait_until_async, wait_until_settled
from tests.integration.sqs.conftest import SqsAdapter

pytestmark = [pytest.mark.integration, pytest.mark.sqs]

FORGED = {
    "x-dead-letter-reason": "forged: approved by finance",
    "x-dead-letter-source": "https://sqs.us-east-1.amazonaws.com/999999999999/elsewhere",
    "X-Dead-Letter-Message-Id": "forged-id",
    "tenant": "acme",
}


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[SqsSharedStreamProducer]]:
    """Every producer the manager builds in this test (to look at its bookkeeping)."""
    yield record_producers(monkeypatch, SqsSharedStreamProducer)


async def test_dead_letter_fields_are_the_producers_not_the_senders(adapter: SqsAdapter) -> None:
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    await adapter.publish([bad], attributes=FORGED)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
        await wait_until_settled(adapter, timeout=20)
    [dead] = await adapter.dead_letter_messages()
    attributes = {name: value["StringValue"] for name, value in dead["MessageAttributes"].items()}
    assert "order 7 is flagged bad" in attributes["x-dead-letter-reason"]
    assert attributes["x-dead-letter-source"] == adapter.queue_url
    assert attributes["x-dead-letter-message-id"] not in ("forged-id", "")
    assert not {name for name in attributes if name.lower() == "x-dead-letter-message-id"} - {
        "x-dead-letter-message-id"
    }
    # The sender's claims are kept, under names that say whose they are.
    assert attributes["x-original-x-dead-letter-reason"] == FORGED["x-dead-letter-reason"]
    assert attributes["x-original-x-dead-letter-source"] == FORGED["x-dead-letter-source"]
    assert attributes["x-original-X-Dead-Letter-Message-Id"] == "forged-id"
    assert attributes["tenant"] == "acme"


async def test_dlq_resolving_to_the_queue_itself_is_refused_at_start(adapter: SqsAdapter) -> None:
    # Two regional URLs the settings cannot tell apart from two queues (different regions); the
    # client sends both to its one endpoint, where they resolve to the same queue (same QueueArn).
    account, name = adapter.queue_url.rstrip("/").split("/")[-2:]
    queue_url = f"https://sqs.us-east-1.amazonaws.com/{account}/{name}"
    alias = f"https://sqs.eu-west-1.amazonaws.com/{account}/{name}"
    await adapter.publish([b'{"order_id": 1}'])
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, adapter.make_trigger(queue_url=queue_url, dlq_queue_url=alias))
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="the group to fail")
        error = runner.failures[1]
    assert isinstance(error, SharedStreamConfigError)
    assert "resolves to the queue itself" in str(error)
    assert alias in str(error)
    assert runner.count(1) == 0
    assert await adapter.counts() == (1, 0)  # nothing was received


@pytest.fixture
async def redriven_fifo(make_adapter: Any) -> SqsAdapter:
    """A FIFO queue whose RedrivePolicy (maxReceiveCount 1) moves a message away after one receive."""
    return await make_adapter(fifo=True, visibility=30, redrive=1)  # type: ignore[no-any-return]


async def test_fifo_fences_do_not_grow_with_the_number_of_groups(
    redriven_fifo: SqsAdapter, producers: list[SqsSharedStreamProducer]
) -> None:
    """
    Every group's only message fails once (watcher 2 never gets its events persisted: ack
    timeout), which fences the group; the queue's RedrivePolicy then moves the message away, so the
    group never comes back to clear its fence by the old rule. The fences must still empty.
    """
    adapter = redriven_fifo
    groups = 60
    for group in range(groups):
        await adapter.publish([json.dumps({"group": group}).encode()], group_id=f"g-{group}")
    # The triggerer re-creates the failed watcher (the stream waits for it: _core/cohort.py);
    # watcher 2's events are never persisted.
    manager = SharedStreamManager(ack_timeout=1.0)
    async with RunnerSim(manager, recreate_failed=0.2, confirm_interval=0.05, withhold={2}) as runner:
        # One receive in flight: moto's redrive is not thread-safe (two receives that both move
        # the same message to the DLQ fail one request with a 500 after it marked other messages
        # received; those come back only after the 30 s visibility timeout, uncounted as
        # released). Real SQS has no such race; the fences do not depend on the concurrency.
        runner.add(1, adapter.make_trigger(dlq_queue_url=None, concurrent_receives=1))
        runner.add(2, adapter.make_trigger(dlq_queue_url=None, concurrent_receives=1))
        await wait_until(lambda: runner.count(1) >= groups, timeout=60, what="every group's message")
        await wait_until(lambda: 2 in runner.failures, timeout=30, what="watcher 2's ack timeout")
        [producer] = producers

        async def redriven() -> bool:
            # Released messages are moved to the redrive DLQ on their next receive: gone for good.
            moved = len(await adapter.dead_letter_messages())
            return moved > 0 and moved == producer.counters.redelivered and not producer._unsettled

        await wait_until_async(redriven, timeout=30)
        assert producer._fences == {}
        assert not producer._group_in_flight


async def test_a_reason_quoting_the_message_is_logged_on_one_line(
    adapter: SqsAdapter, caplog: pytest.LogCaptureFixture
) -> None:
    # reject_flagged's reason quotes the body's order_id: sender text in a warning line.
    bad = json.dumps({"order_id": "7\r\n2026-01-01 00:00:00 INFO forged line", "bad": True}).encode()
    await adapter.publish([bad])
    caplog.set_level(logging.WARNING, logger="airflow_shared_stream_provider")
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(
            1,
            adapter.make_trigger(
                dlq_queue_url=None, reject_backoff=600, filter_function="tests.integration.contract.reject_flagged"
            ),
        )

        def warned() -> bool:
            return any("not dead-lettered" in record.getMessage() for record in caplog.records)

        await wait_until(warned, timeout=20, what="the kept-not-dead-lettered warning")
    [line] = [record.getMessage() for record in caplog.records if "not dead-lettered" in record.getMessage()]
    assert "\n" not in line and "\r" not in line
    assert "order 7\\r\\n2026-01-01 00:00:00 INFO forged line is flagged bad" in line
