"""
The SQS producer on the real ``SharedStreamManager``, against an in-memory SQS client (no broker).

The fake implements the SQS calls the producer makes (receive with receive counts and receipt
handles, batch delete / visibility / send with per-entry failures, FIFO group locks), so each
disposition, the retry rules and the lease keeper can be checked call by call. Ack timeouts run on
an injected clock. The real endpoint is covered by ``tests/integration/sqs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncGenerator, Hashable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome, SharedStreamManager
from botocore.exceptions import ClientError

from airflow_shared_stream_provider.producers.sqs import SqsAdvanceError, SqsDelivery, SqsSharedStreamProducer
from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger, SqsStreamSettings
from devkit.runner import RunnerSim, settle, wait_until

QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"
FIFO_QUEUE = QUEUE + ".fifo"
DLQ = QUEUE + "-dlq"
_ids = itertools.count(1)


@dataclass
class FakeMessage:
    message_id: str
    body: str
    attributes: dict[str, Any]
    group: str | None
    receive_count: int = 0
    visible_at: float = 0.0
    handle: str | None = None


@dataclass
class FakeQueue:
    url: str
    fifo: bool = False
    messages: list[FakeMessage] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    calls: list[tuple[str, int]] = field(default_factory=list)
    visibility_changes: list[tuple[str, int]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    # Failure injection: server faults for the next N delete calls; handles refused as not in flight.
    delete_server_faults: int = 0
    stale_handles: set[str] = field(default_factory=set)
    arrived: asyncio.Event | None = None

    def publish(self, body: str, *, attributes: dict[str, str] | None = None, group: str | None = None) -> str:
        message_id = f"m-{next(_ids)}"
        attrs = {k: {"DataType": "String", "StringValue": v} for k, v in (attributes or {}).items()}
        self.messages.append(FakeMessage(message_id, body, attrs, group))
        if self.arrived is not None:
            self.arrived.set()
        return message_id

    def by_id(self, message_id: str) -> FakeMessage:
        return next(m for m in self.messages if m.message_id == message_id)

    def visible(self) -> list[FakeMessage]:
        now = time.monotonic()
        return [m for m in self.messages if m.visible_at <= now]

    def in_flight(self) -> list[FakeMessage]:
        now = time.monotonic()
        return [m for m in self.messages if m.visible_at > now]


class FakeSqsClient:
    """The subset of the aiobotocore SQS client the producer uses."""

    def __init__(self, *queues: FakeQueue) -> None:
        self.queues = {q.url: q for q in queues}

    def _queue(self, url: str, operation: str) -> FakeQueue:
        queue = self.queues.get(url)
        if queue is None:
            raise ClientError(
                {"Error": {"Code": "AWS.SimpleQueueService.NonExistentQueue", "Message": "no such queue"}}, operation
            )
        return queue

    async def get_queue_attributes(self, *, QueueUrl: str, AttributeNames: list[str]) -> dict[str, Any]:
        queue = self._queue(QueueUrl, "GetQueueAttributes")
        queue.calls.append(("GetQueueAttributes", 0))
        return {"Attributes": {"FifoQueue": "true" if queue.fifo else "false", "VisibilityTimeout": "30"}}

    async def receive_message(
        self, *, QueueUrl: str, MaxNumberOfMessages: int, WaitTimeSeconds: int, VisibilityTimeout: int, **_: Any
    ) -> dict[str, Any]:
        queue = self._queue(QueueUrl, "ReceiveMessage")
        if queue.arrived is None:
            queue.arrived = asyncio.Event()
        deadline = time.monotonic() + WaitTimeSeconds
        while True:
            locked = {m.group for m in queue.in_flight()} if queue.fifo else set()
            chosen: list[FakeMessage] = []
            for message in queue.visible():
                if queue.fifo and message.group in locked:
                    continue
                chosen.append(message)
                if len(chosen) == MaxNumberOfMessages:
                    break
            if chosen or time.monotonic() >= deadline:
                break
            queue.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(queue.arrived.wait(), timeout=max(0.0, deadline - time.monotonic()))
        queue.calls.append(("ReceiveMessage", len(chosen)))
        out = []
        for message in chosen:
            message.receive_count += 1
            message.visible_at = time.monotonic() + VisibilityTimeout
            message.handle = f"{message.message_id}#{message.receive_count}"
            system = {"ApproximateReceiveCount": str(message.receive_count), "SentTimestamp": "1700000000000"}
            if message.group is not None:
                system["MessageGroupId"] = message.group
            out.append(
                {
                    "MessageId": message.message_id,
                    "ReceiptHandle": message.handle,
                    "Body": message.body,
                    "Attributes": system,
                    "MessageAttributes": message.attributes,
                }
            )
        return {"Messages": out} if out else {}

    def _held(self, queue: FakeQueue, handle: str) -> FakeMessage | None:
        if handle in queue.stale_handles:
            return None
        return next((m for m in queue.messages if m.handle == handle and m.visible_at > time.monotonic()), None)

    async def delete_message_batch(self, *, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        queue = self._queue(QueueUrl, "DeleteMessageBatch")
        queue.calls.append(("DeleteMessageBatch", len(Entries)))
        if queue.delete_server_faults:
            queue.delete_server_faults -= 1
            return {"Failed": [{"Id": e["Id"], "SenderFault": False, "Code": "InternalError"} for e in Entries]}
        ok, failed = [], []
        for entry in Entries:
            message = self._held(queue, entry["ReceiptHandle"])
            if message is None:
                failed.append({"Id": entry["Id"], "SenderFault": True, "Code": "ReceiptHandleIsInvalid"})
                continue
            queue.messages.remove(message)
            queue.deleted.append(message.message_id)
            ok.append({"Id": entry["Id"]})
        return {"Successful": ok, "Failed": failed}

    async def change_message_visibility_batch(self, *, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        queue = self._queue(QueueUrl, "ChangeMessageVisibilityBatch")
        queue.calls.append(("ChangeMessageVisibilityBatch", len(Entries)))
        ok, failed = [], []
        for entry in Entries:
            message = self._held(queue, entry["ReceiptHandle"])
            if message is None:
                failed.append({"Id": entry["Id"], "SenderFault": True, "Code": "ReceiptHandleIsInvalid"})
                continue
            message.visible_at = time.monotonic() + entry["VisibilityTimeout"]
            queue.visibility_changes.append((message.message_id, entry["VisibilityTimeout"]))
            ok.append({"Id": entry["Id"]})
        if queue.arrived is not None:
            queue.arrived.set()
        return {"Successful": ok, "Failed": failed}

    async def send_message_batch(self, *, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        queue = self._queue(QueueUrl, "SendMessageBatch")
        queue.calls.append(("SendMessageBatch", len(Entries)))
        queue.dead_letters.extend(Entries)
        return {"Successful": [{"Id": e["Id"]} for e in Entries]}


clients: dict[str, FakeSqsClient] = {}
producers: list[FakeClientProducer] = []


class FakeClientProducer(SqsSharedStreamProducer):
    def __init__(self, settings: SqsStreamSettings, *, stream_key: Hashable) -> None:
        super().__init__(settings, stream_key=stream_key)
        producers.append(self)

    async def _connect(self) -> Any:
        return clients[self.settings.queue_url]


class FakeSqsTrigger(SqsSharedStreamTrigger):
    producer_class_path = f"{__name__}.FakeClientProducer"


@pytest.fixture
def sqs() -> Any:
    queue, dlq = FakeQueue(QUEUE), FakeQueue(DLQ)
    client = FakeSqsClient(queue, dlq)
    clients[QUEUE] = client
    producers.clear()
    yield queue, dlq
    clients.clear()
    producers.clear()


def trigger(**kwargs: Any) -> FakeSqsTrigger:
    options: dict[str, Any] = {"queue_url": QUEUE, "dlq_queue_url": DLQ, "wait_time_seconds": 1}
    options.update(kwargs)
    return FakeSqsTrigger(**options)


def order(i: int, **extra: Any) -> str:
    return json.dumps({"order_id": i, "region": ("eu", "us", "apac")[i % 3], **extra})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def api_calls(queue: FakeQueue, name: str) -> int:
    return sum(1 for call, _ in queue.calls if call == name)


async def test_fan_out_with_filters_and_one_batch_delete_per_receive(sqs: Any) -> None:
    queue, _ = sqs
    for i in range(30):
        queue.publish(order(i), attributes={"type": "order"})
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger())
        runner.add(2, trigger(match={"body.region": "eu"}))
        runner.add(3, trigger(match={"attributes.type": "order", "body.region": ["us", "apac"]}))
        await wait_until(lambda: len(runner.pending) == 60, timeout=10, what="60 events")
        assert queue.deleted == []  # nothing persisted yet: nothing deleted
        runner.persist()
        await wait_until(lambda: len(queue.deleted) == 30, timeout=10, what="30 deletes")
    assert (runner.count(1), runner.count(2), runner.count(3)) == (30, 10, 20)
    envelope = runner.persisted[1][0]
    assert envelope["broker"] == "sqs"
    assert envelope["source"] == QUEUE
    assert envelope["attributes"] == {"type": "order"}
    assert envelope["published_at"] == "2023-11-14T22:13:20+00:00"
    assert envelope["delivery_attempt"] == 1
    assert envelope["message_id"].startswith("m-")
    receives = [n for call, n in queue.calls if call == "ReceiveMessage" and n]
    deletes = [n for call, n in queue.calls if call == "DeleteMessageBatch"]
    assert receives == [10, 10, 10]
    assert deletes == [10, 10, 10]  # one DeleteMessageBatch per receive call
    assert len(receives) + len(deletes) <= 0.2 * 30  # the busy-path API budget
    assert producers[0].counters.committed == 30


async def test_reject_sends_to_the_dlq_before_deleting(sqs: Any) -> None:
    queue, dlq = sqs
    bad = queue.publish(order(1, bad=True), attributes={"tenant": "acme"})
    queue.publish(order(2))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, trigger(filter_function="tests.integration.contract.reject_flagged"))
        runner.add(2, trigger())
        await wait_until(lambda: len(queue.messages) == 0, timeout=10, what="the queue to drain")
    [record] = dlq.dead_letters
    assert record["MessageBody"] == order(1, bad=True)
    assert record["MessageAttributes"]["tenant"]["StringValue"] == "acme"
    assert "order 1 is flagged bad" in record["MessageAttributes"]["x-dead-letter-reason"]["StringValue"]
    assert record["MessageAttributes"]["x-dead-letter-message-id"]["StringValue"] == bad
    assert "MessageGroupId" not in record  # standard DLQ
    assert runner.count(2) == 2


async def test_ack_timeout_redelivers_with_visibility_zero_and_never_deletes(sqs: Any) -> None:
    queue, _ = sqs
    message_id = queue.publish(order(1))
    clock = Clock()
    manager = SharedStreamManager(ack_timeout=0.5, _now=clock)
    async with RunnerSim(manager) as runner:
        runner.add(1, trigger())
        await wait_until(lambda: len(runner.pending) == 1, timeout=10, what="the event")
        clock.now += 1.0  # the persistence confirmation never comes
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="the ack timeout")
        await wait_until(lambda: (message_id, 0) in queue.visibility_changes, timeout=10, what="the release")
    assert queue.deleted == []
    assert type(runner.failures[1]).__name__ == "AckTimeout"
    assert producers[0].counters.redelivered == 1
    assert producers[0].counters.committed == 0


async def test_poison_cap_dead_letters_on_the_receive_count(sqs: Any) -> None:
    queue, dlq = sqs
    message_id = queue.publish(order(1))
    queue.by_id(message_id).receive_count = 2  # delivered twice before
    clock = Clock()
    async with RunnerSim(SharedStreamManager(ack_timeout=0.5, _now=clock)) as runner:
        runner.add(1, trigger(max_delivery_attempts=3))
        await wait_until(lambda: len(runner.pending) == 1, timeout=10, what="the event")
        assert runner.pending[0].event.payload["delivery_attempt"] == 3
        clock.now += 1.0
        await wait_until(lambda: queue.deleted == [message_id], timeout=10, what="the poison delete")
    [record] = dlq.dead_letters
    assert "poison message" in record["MessageAttributes"]["x-dead-letter-reason"]["StringValue"]
    assert producers[0].counters.poison == 1


async def test_a_delete_that_keeps_failing_raises_and_is_not_counted(sqs: Any) -> None:
    queue, _ = sqs
    message_id = queue.publish(order(1))
    queue.delete_server_faults = 99
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, trigger())
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="the group to fail")
    assert isinstance(runner.failures[1], SqsAdvanceError)
    assert "DeleteMessageBatch" in str(runner.failures[1])
    assert api_calls(queue, "DeleteMessageBatch") == 3
    assert [m.message_id for m in queue.messages] == [message_id]  # still in the queue: not lost
    assert producers[0].counters.committed == 0


async def test_a_transient_delete_failure_is_retried(sqs: Any) -> None:
    queue, _ = sqs
    queue.publish(order(1))
    queue.delete_server_faults = 1
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, trigger())
        await wait_until(lambda: len(queue.deleted) == 1, timeout=10, what="the delete")
        assert not runner.failures
    assert api_calls(queue, "DeleteMessageBatch") == 2
    assert producers[0].counters.committed == 1


async def test_a_delete_refused_for_a_lost_lease_counts_as_redelivered(sqs: Any) -> None:
    queue, _ = sqs
    queue.publish(order(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger())
        await wait_until(lambda: len(runner.pending) == 1, timeout=10, what="the event")
        handle = queue.messages[0].handle
        assert handle is not None
        queue.stale_handles.add(handle)  # SQS gave the message to someone else meanwhile
        runner.persist()
        await wait_until(lambda: producers[0].counters.advanced == 1, timeout=10, what="the advance")
        assert not runner.failures
    counters = producers[0].counters
    assert (counters.committed, counters.redelivered, counters.leases_lost) == (0, 1, 1)


async def test_the_lease_keeper_extends_visibility_until_the_ack_timeout(sqs: Any) -> None:
    queue, _ = sqs
    message_id = queue.publish(order(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger(visibility_timeout=30))
        await wait_until(lambda: len(runner.pending) == 1, timeout=10, what="the event")
        producer = producers[0]
        leases = producer._leases
        assert leases is not None and len(leases) == 1
        now = time.monotonic()
        assert await leases.renew_due(now) == 0  # not due yet
        assert await leases.renew_due(now + 25) == 1  # within the renew margin: extended
        assert queue.visibility_changes == [(message_id, 30)]
        assert producer.counters.leases_renewed == 1
        assert await leases.renew_due(now + producer._max_hold + 1) == 0  # past the ack timeout: let go
        assert len(leases) == 0
        runner.persist()
        await wait_until(lambda: queue.deleted == [message_id], timeout=10, what="the delete")


async def test_dispositions_hold_and_no_dlq_policy(sqs: Any) -> None:
    queue, _ = sqs
    first = queue.publish(order(1))
    second = queue.publish(order(2))
    settings = trigger(dlq_queue_url=None, hold_backoff=2, reject_backoff=77).settings
    producer = FakeClientProducer(settings, stream_key=("unit", "hold"))
    stream = cast(AsyncGenerator[tuple[Any, Any], None], producer.open_stream())
    try:
        (_, a), (_, b) = [await anext(stream), await anext(stream)]
        assert isinstance(a, SqsDelivery) and isinstance(b, SqsDelivery)
        await producer.advance(
            [
                AdvanceItem(a, AdvanceOutcome(acked=0, failed=0)),
                AdvanceItem(b, AdvanceOutcome(acked=1, failed=0, rejected=1)),
            ]
        )
        assert queue.visibility_changes == [(first, 2), (second, 77)]  # held; rejected without a DLQ: kept
        assert queue.deleted == []
        assert producer.counters.held == 1
        # A held message comes back with the hold not counted as a delivery attempt.
        queue.by_id(first).visible_at = 0
        _, again = await anext(stream)
        assert again.message_id == first and again.delivery_attempt == 1
        await producer.advance([AdvanceItem(again, AdvanceOutcome(acked=1, failed=0))])
        assert queue.deleted == [first]
    finally:
        await stream.aclose()
        await producer.aclose()


async def test_fifo_a_redelivered_message_takes_the_rest_of_its_group_with_it(sqs: Any) -> None:
    queue = FakeQueue(FIFO_QUEUE, fifo=True)
    clients[FIFO_QUEUE] = FakeSqsClient(queue)
    a1 = queue.publish("a1", group="A")
    a2 = queue.publish("a2", group="A")
    b1 = queue.publish("b1", group="B")
    producer = FakeClientProducer(trigger(queue_url=FIFO_QUEUE, dlq_queue_url=None).settings, stream_key=("unit", "f"))
    stream = cast(AsyncGenerator[tuple[Any, Any], None], producer.open_stream())
    try:
        got = [(await anext(stream))[1] for _ in range(3)]
        assert [d.message_id for d in got] == [a1, a2, b1]
        assert (
            producer.get_advance_lane(got[0]) == producer.get_advance_lane(got[1]) != producer.get_advance_lane(got[2])
        )
        await producer.advance(
            [
                AdvanceItem(got[0], AdvanceOutcome(acked=0, failed=1)),
                AdvanceItem(got[1], AdvanceOutcome(acked=1, failed=0)),
            ]
        )
        await producer.advance([AdvanceItem(got[2], AdvanceOutcome(acked=1, failed=0))])
        assert queue.deleted == [b1]  # group B is not held back by group A
        assert queue.visibility_changes == [(a1, 0), (a2, 0)]  # a2 is not deleted past a1
        assert producer.counters.redelivered == 2
        # Group A comes back in order.
        again = [(await anext(stream))[1] for _ in range(2)]
        assert [(d.message_id, d.delivery_attempt) for d in again] == [(a1, 2), (a2, 2)]
        await producer.advance([AdvanceItem(d, AdvanceOutcome(acked=1, failed=0)) for d in again])
        assert queue.deleted == [b1, a1, a2]
    finally:
        await stream.aclose()
        await producer.aclose()


async def test_a_backlog_never_overflows_watchers_behind_the_executor_hop(sqs: Any, queue_size: int) -> None:
    queue, _ = sqs
    for i in range(400):
        queue.publish(order(i))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), executor_hop=True, confirm_interval=0.01) as runner:
        for trigger_id in range(1, 4):
            runner.add(trigger_id, trigger())
        await wait_until(lambda: len(queue.deleted) == 400, timeout=60, what="400 deletes")
        assert not runner.failures, runner.failures
    assert all(runner.count(t) == 400 for t in (1, 2, 3))
    assert queue_size == 64


async def test_clean_stop_releases_messages_still_in_flight(sqs: Any) -> None:
    queue, _ = sqs
    message_id = queue.publish(order(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger())
        await wait_until(lambda: len(runner.pending) == 1, timeout=10, what="the event")
    await settle()
    assert queue.visibility_changes == [(message_id, 0)]
    assert queue.deleted == []


async def test_missing_queue_is_a_config_error_naming_it(sqs: Any) -> None:
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger(dlq_queue_url=QUEUE + "-missing"))
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="the failure")
    message = str(runner.failures[1])
    assert QUEUE in message and "dlq_queue_url" in message and "does not exist" in message


async def test_a_receive_call_is_deleted_in_one_batch_even_when_it_resolves_in_parts(sqs: Any) -> None:
    queue, _ = sqs
    ids = [queue.publish(order(i)) for i in range(3)]
    producer = FakeClientProducer(trigger().settings, stream_key=("unit", "parts"))
    stream = cast(AsyncGenerator[tuple[Any, Any], None], producer.open_stream())
    try:
        got = [(await anext(stream))[1] for _ in range(3)]
        assert len({producer.get_advance_lane(d) for d in got}) == 1  # one lane per receive call
        await producer.advance([AdvanceItem(got[0], AdvanceOutcome(acked=1, failed=0))])
        await producer.advance([AdvanceItem(got[1], AdvanceOutcome(acked=0, failed=1))])
        assert queue.deleted == []  # held back (still leased) until the call is complete
        assert queue.visibility_changes == [(ids[1], 0)]  # a redelivery is not held back
        await producer.advance([AdvanceItem(got[2], AdvanceOutcome(acked=1, failed=0))])
        assert queue.deleted == [ids[0], ids[2]]
        assert api_calls(queue, "DeleteMessageBatch") == 1
        assert producer.counters.committed == 2
    finally:
        await stream.aclose()
        await producer.aclose()


async def test_a_clean_close_deletes_what_was_held_back_and_releases_the_rest(sqs: Any) -> None:
    queue, _ = sqs
    ids = [queue.publish(order(i)) for i in range(2)]
    producer = FakeClientProducer(trigger().settings, stream_key=("unit", "close"))
    stream = cast(AsyncGenerator[tuple[Any, Any], None], producer.open_stream())
    try:
        got = [(await anext(stream))[1] for _ in range(2)]
        await producer.advance([AdvanceItem(got[0], AdvanceOutcome(acked=1, failed=0))])
        assert queue.deleted == []
    finally:
        await stream.aclose()
        await producer.aclose()
    assert queue.deleted == [ids[0]]
    assert queue.visibility_changes == [(ids[1], 0)]


async def test_concurrent_receives_stay_within_credit_and_deliver_everything(sqs: Any, queue_size: int) -> None:
    queue, _ = sqs
    for i in range(200):
        queue.publish(order(i))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), executor_hop=True, confirm_interval=0.01) as runner:
        runner.add(1, trigger(concurrent_receives=4))
        runner.add(2, trigger(concurrent_receives=4, match={"body.region": "eu"}))
        await wait_until(lambda: len(queue.deleted) == 200, timeout=60, what="200 deletes")
        assert not runner.failures, runner.failures
    assert sorted(p["body"]["order_id"] for p in runner.persisted[1]) == list(range(200))
    assert runner.count(2) == 67
    assert max(n for call, n in queue.calls if call == "ReceiveMessage") <= 10
