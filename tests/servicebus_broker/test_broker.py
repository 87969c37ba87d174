"""The test broker exercised through the real ``azure.servicebus.aio`` SDK."""

from __future__ import annotations

import asyncio
import datetime
import socket
import struct
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
from azure.servicebus import NEXT_AVAILABLE_SESSION, ServiceBusMessage, ServiceBusReceiveMode, ServiceBusSubQueue
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusError,
    SessionLockLostError,
)

from .fixtures import servicebus_broker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .broker import BrokerHandle

__all__ = ["servicebus_broker"]

pytestmark = [pytest.mark.servicebus, pytest.mark.timeout(60)]


@asynccontextmanager
async def sb_client(broker: BrokerHandle, **kwargs: Any) -> AsyncIterator[ServiceBusClient]:
    async with ServiceBusClient.from_connection_string(broker.connection_string, **kwargs) as client:
        yield client


async def send(client: ServiceBusClient, queue: str, *bodies: str | bytes, **kwargs: object) -> None:
    async with client.get_queue_sender(queue) as sender:
        await sender.send_messages([ServiceBusMessage(body, **kwargs) for body in bodies])  # type: ignore[arg-type]


def body_of(message: object) -> bytes:
    return b"".join(message.body)  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_send_receive_complete_with_application_properties(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        async with client.get_queue_sender("q") as sender:
            await sender.send_messages(
                ServiceBusMessage("hello", application_properties={"kind": "greeting", "n": 7}, message_id="m-1")
            )
        assert servicebus_broker.counts("q").active == 1
        stored = servicebus_broker.messages("q")[0]
        assert stored.message_id == "m-1"
        assert stored.body == b"hello"
        async with client.get_queue_receiver("q") as receiver:
            messages = await receiver.receive_messages(max_message_count=5, max_wait_time=5)
            assert [body_of(m) for m in messages] == [b"hello"]
            (message,) = messages
            assert message.application_properties == {b"kind": b"greeting", b"n": 7}
            assert message.message_id == "m-1"
            assert message.delivery_count == 0
            assert message.sequence_number == 1
            assert message.lock_token is not None
            assert message.locked_until_utc is not None
            assert message.locked_until_utc > datetime.datetime.now(datetime.timezone.utc)
            assert message.enqueued_time_utc is not None
            assert servicebus_broker.counts("q").locked == 1
            await receiver.complete_message(message)
            assert servicebus_broker.counts("q").locked == 0
    assert servicebus_broker.counts("q") == servicebus_broker.counts("q").__class__(0, 0, 0, 0)
    assert servicebus_broker.entity_stats("q")["completed"] == 1


@pytest.mark.asyncio
async def test_batch_and_large_messages(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    large = bytes(range(256)) * 1024  # 256 KiB: several frames in both directions
    async with sb_client(servicebus_broker) as client:
        async with client.get_queue_sender("q") as sender:
            batch = await sender.create_message_batch()
            for i in range(5):
                batch.add_message(ServiceBusMessage(f"batch-{i}"))
            await sender.send_messages(batch)
            await sender.send_messages(ServiceBusMessage(large))
        snapshot = servicebus_broker.messages("q")
        assert [m.body for m in snapshot[:5]] == [f"batch-{i}".encode() for i in range(5)]
        assert snapshot[5].body == large
        assert [m.sequence_number for m in snapshot] == [1, 2, 3, 4, 5, 6]
        async with client.get_queue_receiver("q") as receiver:
            received: list[bytes] = []
            while len(received) < 6:
                batch_received = await receiver.receive_messages(max_message_count=6, max_wait_time=5)
                assert batch_received, "broker stopped delivering"
                for message in batch_received:
                    received.append(body_of(message))
                    await receiver.complete_message(message)
    assert received[:5] == [f"batch-{i}".encode() for i in range(5)]
    assert received[5] == large
    assert servicebus_broker.counts("q").active == 0
    assert servicebus_broker.operations().received["transfer"] > 3  # the large one came in pieces


@pytest.mark.asyncio
async def test_prefetch_and_release_on_close(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", *[f"m{i}" for i in range(20)])
        async with client.get_queue_receiver("q", prefetch_count=10) as receiver:
            messages = await receiver.receive_messages(max_message_count=4, max_wait_time=5)
            assert 1 <= len(messages) <= 4
            # the receiver holds credit for prefetch_count + 1 messages, all locked at the broker
            await servicebus_broker.async_wait_until(lambda b: b.counts("q").locked == 11)
            for message in messages:
                await receiver.complete_message(message)
            completed = len(messages)
        # closing released the prefetched messages without counting a delivery
        counts = servicebus_broker.counts("q")
        assert counts.locked == 0
        assert counts.active == 20 - completed
        assert all(m.delivery_count == 0 for m in servicebus_broker.messages("q"))
        assert servicebus_broker.entity_stats("q")["released"] == 11 - completed


@pytest.mark.asyncio
async def test_abandon_redelivers_with_incremented_delivery_count(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "again")
        async with client.get_queue_receiver("q") as receiver:
            (first,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            assert first.delivery_count == 0
            await receiver.abandon_message(first)
            assert servicebus_broker.messages("q")[0].delivery_count == 1
            (second,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            assert body_of(second) == b"again"
            assert second.delivery_count == 1
            assert second.sequence_number == first.sequence_number
            assert second.lock_token != first.lock_token
            await receiver.complete_message(second)
    assert servicebus_broker.counts("q").active == 0


@pytest.mark.asyncio
async def test_dead_letter_and_receive_from_dead_letter_queue(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "poison")
        async with client.get_queue_receiver("q") as receiver:
            (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            await receiver.dead_letter_message(message, reason="BadFormat", error_description="not json")
        counts = servicebus_broker.counts("q")
        assert (counts.active, counts.locked, counts.dead_lettered) == (0, 0, 1)
        (dead,) = servicebus_broker.dead_letters("q")
        assert (dead.dead_letter_reason, dead.dead_letter_description) == ("BadFormat", "not json")
        assert dead.dead_letter_source == "q"
        async with client.get_queue_receiver("q", sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq_receiver:
            (from_dlq,) = await dlq_receiver.receive_messages(max_message_count=1, max_wait_time=5)
            assert body_of(from_dlq) == b"poison"
            assert from_dlq.dead_letter_reason == "BadFormat"
            assert from_dlq.dead_letter_error_description == "not json"
            assert from_dlq.dead_letter_source == "q"
            await dlq_receiver.complete_message(from_dlq)
    assert servicebus_broker.dead_letters("q") == []


@pytest.mark.asyncio
async def test_renew_lock_extends_locked_until(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q", lock_duration=5)
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "x")
        async with client.get_queue_receiver("q") as receiver:
            (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            before = message.locked_until_utc
            assert before is not None
            await asyncio.sleep(0.3)
            renewed = await receiver.renew_message_lock(message)
            assert renewed > before
            assert message.locked_until_utc == renewed
            assert servicebus_broker.operations().management["com.microsoft:renew-lock"] == 1
            await receiver.complete_message(message)
    assert servicebus_broker.counts("q").active == 0


@pytest.mark.asyncio
async def test_lock_expiry_redelivers_and_stale_settlement_is_lock_lost(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q", lock_duration=1)
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "slow")
        async with client.get_queue_receiver("q") as receiver:
            (stale,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            await servicebus_broker.async_wait_until(lambda b: b.counts("q").active == 1, timeout=5)
            (fresh,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            assert fresh.sequence_number == stale.sequence_number
            assert fresh.delivery_count == 1
            assert servicebus_broker.entity_stats("q")["lock_expired"] == 1
            # The SDK refuses stale locks on its own clock; pretend the client clock lags the broker
            # so the settlement reaches the broker, which must answer message-lock-lost itself.
            stale._expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=1)
            with pytest.raises(MessageLockLostError):
                await receiver.complete_message(stale)
            with pytest.raises(MessageLockLostError):
                await receiver.renew_message_lock(stale)
            await receiver.complete_message(fresh)
    assert servicebus_broker.counts("q").active == 0
    assert servicebus_broker.entity_stats("q")["completed"] == 1


@pytest.mark.asyncio
async def test_max_delivery_count_dead_letters(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q", max_delivery_count=3)
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "doomed")
        async with client.get_queue_receiver("q") as receiver:
            for attempt in range(3):
                (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
                assert message.delivery_count == attempt
                await receiver.abandon_message(message)
            assert await receiver.receive_messages(max_message_count=1, max_wait_time=1) == []
    (dead,) = servicebus_broker.dead_letters("q")
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert dead.delivery_count == 3
    assert servicebus_broker.counts("q").active == 0


@pytest.mark.asyncio
async def test_topic_subscriptions_each_get_a_copy(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_topic("t")
    servicebus_broker.create_subscription("t", "a")
    servicebus_broker.create_subscription("t", "b")
    async with sb_client(servicebus_broker) as client:
        async with client.get_topic_sender("t") as sender:
            await sender.send_messages([ServiceBusMessage(f"e{i}") for i in range(3)])
        for name in ("a", "b"):
            assert servicebus_broker.counts(f"t/Subscriptions/{name}").active == 3
        async with client.get_subscription_receiver("t", "a") as receiver:
            got: list[bytes] = []
            while len(got) < 3:
                messages = await receiver.receive_messages(max_message_count=3, max_wait_time=5)
                assert messages
                for message in messages:
                    got.append(body_of(message))
                    await receiver.complete_message(message)
    assert got == [b"e0", b"e1", b"e2"]
    assert servicebus_broker.counts("t/Subscriptions/a").active == 0
    assert servicebus_broker.counts("t/Subscriptions/b").active == 3


@pytest.mark.asyncio
async def test_peek_messages_does_not_lock(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "p0", "p1", "p2")
        async with client.get_queue_receiver("q") as receiver:
            peeked = await receiver.peek_messages(max_message_count=10)
            assert [body_of(m) for m in peeked] == [b"p0", b"p1", b"p2"]
            assert [m.sequence_number for m in peeked] == [1, 2, 3]
            assert await receiver.peek_messages(max_message_count=10) == []  # continues after the last one
            again = await receiver.peek_messages(max_message_count=2, sequence_number=2)
            assert [body_of(m) for m in again] == [b"p1", b"p2"]
    assert servicebus_broker.counts("q").active == 3


@pytest.mark.asyncio
async def test_receive_and_delete(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "a", "b")
        async with client.get_queue_receiver("q", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
            got: list[bytes] = []
            while len(got) < 2:
                messages = await receiver.receive_messages(max_message_count=2, max_wait_time=5)
                assert messages
                got.extend(body_of(m) for m in messages)
    assert got == [b"a", b"b"]
    assert servicebus_broker.counts("q") == servicebus_broker.counts("q").__class__(0, 0, 0, 0)


@pytest.mark.asyncio
async def test_defer_and_receive_deferred(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "later")
        async with client.get_queue_receiver("q") as receiver:
            (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            await receiver.defer_message(message)
            assert servicebus_broker.counts("q").deferred == 1
            assert await receiver.receive_messages(max_message_count=1, max_wait_time=0.5) == []
            assert message.sequence_number is not None
            (deferred,) = await receiver.receive_deferred_messages([message.sequence_number])
            assert body_of(deferred) == b"later"
            await receiver.complete_message(deferred)  # settles through $management
    assert servicebus_broker.counts("q") == servicebus_broker.counts("q").__class__(0, 0, 0, 0)
    assert servicebus_broker.operations().management["com.microsoft:update-disposition"] == 1


@pytest.mark.asyncio
async def test_unknown_entity_is_not_found(servicebus_broker: BrokerHandle) -> None:
    async with sb_client(servicebus_broker) as client:
        with pytest.raises(MessagingEntityNotFoundError):
            async with client.get_queue_sender("missing") as sender:
                await sender.send_messages(ServiceBusMessage("x"))
        with pytest.raises(MessagingEntityNotFoundError):
            async with client.get_queue_receiver("missing") as receiver:
                await receiver.receive_messages(max_wait_time=1)


@pytest.mark.asyncio
async def test_operations_are_counted(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("q")
    async with sb_client(servicebus_broker) as client:
        await send(client, "q", "a")
        async with client.get_queue_receiver("q") as receiver:
            (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
            await receiver.complete_message(message)
    stats = servicebus_broker.operations()
    assert stats.received["attach"] >= 6  # per client: $cbs pair + entity link
    assert stats.received["transfer"] >= 3  # two put-tokens + the message
    assert stats.received["disposition"] >= 1
    assert stats.management["put-token"] == 2
    assert stats.connections == 2
    assert sum(sum(c.values()) for c in stats.per_connection.values()) >= stats.total_received
    assert stats.messages_enqueued == 1


@pytest.mark.asyncio
async def test_session_queue(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("sq", requires_session=True)
    async with sb_client(servicebus_broker) as client:
        async with client.get_queue_sender("sq") as sender:
            await sender.send_messages([ServiceBusMessage(f"s1-{i}", session_id="s1") for i in range(2)])
            await sender.send_messages(ServiceBusMessage("s2-0", session_id="s2"))
        async with client.get_queue_receiver("sq", session_id="s2") as receiver:
            (message,) = await receiver.receive_messages(max_message_count=5, max_wait_time=2)
            assert (body_of(message), message.session_id) == (b"s2-0", "s2")
            session = receiver.session
            await session.set_state(b"progress")
            assert await session.get_state() == b"progress"
            assert await session.renew_lock() > datetime.datetime.now(datetime.timezone.utc)
            await receiver.complete_message(message)
        async with client.get_queue_receiver("sq", session_id="s1") as receiver:
            got: list[bytes] = []
            while len(got) < 2:
                messages = await receiver.receive_messages(max_message_count=5, max_wait_time=5)
                assert messages
                for message in messages:
                    assert message.session_id == "s1"
                    got.append(body_of(message))
                    await receiver.complete_message(message)
    assert got == [b"s1-0", b"s1-1"]
    assert servicebus_broker.counts("sq").active == 0


async def send_sessions(client: ServiceBusClient, queue: str, sessions: dict[str, int]) -> None:
    """``{"A": 2}`` sends A-0, A-1 with session id A (sessions in the dict's order)."""
    async with client.get_queue_sender(queue) as sender:
        for session_id, count in sessions.items():
            batch = [ServiceBusMessage(f"{session_id}-{i}", session_id=session_id) for i in range(count)]
            await sender.send_messages(batch)


@pytest.mark.asyncio
async def test_next_available_session_hands_out_free_sessions_with_messages_oldest_first(
    servicebus_broker: BrokerHandle,
) -> None:
    servicebus_broker.create_queue("sq", requires_session=True)
    async with sb_client(servicebus_broker) as client:
        await send_sessions(client, "sq", {"A": 2, "B": 1})
        async with client.get_queue_receiver("sq", session_id="empty") as empty:
            assert empty.session.session_id == "empty"  # a named session may be accepted with no message
            first = client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2)
            second = client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2)
            async with first, second:
                # the oldest message's session first, then the next one that is free; never "empty"
                assert (first.session.session_id, second.session.session_id) == ("A", "B")
                assert first.session.locked_until_utc is not None
                assert first.session.locked_until_utc > datetime.datetime.now(datetime.timezone.utc)
                assert servicebus_broker.session_locked("sq", "A")
                got = await first.receive_messages(max_message_count=5, max_wait_time=2)
                assert [body_of(m) for m in got] == [b"A-0", b"A-1"]
                assert all(m.session_id == "A" and m.locked_until_utc is None for m in got)  # the session's lock
                for message in got:
                    await first.complete_message(message)
                (b_message,) = await second.receive_messages(max_message_count=5, max_wait_time=2)
                await second.complete_message(b_message)
    assert servicebus_broker.counts("sq").active == 0
    assert [h.event for h in servicebus_broker.history("sq")] == ["complete"] * 3


@pytest.mark.asyncio
async def test_next_available_session_times_out_when_every_session_is_empty_or_held(
    servicebus_broker: BrokerHandle,
) -> None:
    servicebus_broker.create_queue("sq", requires_session=True)
    async with sb_client(servicebus_broker, retry_total=0) as client:
        await send_sessions(client, "sq", {"A": 1})
        async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1) as holder:
            assert holder.session.session_id == "A"
            with pytest.raises(OperationTimeoutError):  # A is held, nothing else has messages
                async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=0.3):
                    pass
            # a session that gets a message while a receiver waits is handed out at once
            waiting = client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=10)
            opening = asyncio.ensure_future(waiting.__aenter__())
            await asyncio.sleep(0.3)
            assert not opening.done()
            await send_sessions(client, "sq", {"C": 1})
            await asyncio.wait_for(opening, timeout=5)
            assert waiting.session.session_id == "C"
            await waiting.close()


@pytest.mark.asyncio
async def test_session_lock_expiry_frees_the_session_and_redelivers_with_delivery_count_plus_one(
    servicebus_broker: BrokerHandle,
) -> None:
    servicebus_broker.create_queue("sq", requires_session=True, lock_duration=1)
    async with sb_client(servicebus_broker) as client:
        await send_sessions(client, "sq", {"A": 2})
        async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as stale:
            held = await stale.receive_messages(max_message_count=5, max_wait_time=2)
            assert len(held) == 2
            await servicebus_broker.async_wait_until(
                lambda b: b.entity_stats("sq")["session_locks_expired"] == 1, timeout=5
            )
            assert not servicebus_broker.session_locked("sq", "A")
            assert [m.delivery_count for m in servicebus_broker.messages("sq")] == [1, 1]
            # the service detached the owner's link: the old receiver cannot go on
            with pytest.raises(SessionLockLostError):
                await stale.receive_messages(max_message_count=1, max_wait_time=1)
            async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as fresh:
                again = await fresh.receive_messages(max_message_count=5, max_wait_time=2)
                assert [(body_of(m), m.delivery_count) for m in again] == [(b"A-0", 1), (b"A-1", 1)]
                for message in again:
                    await fresh.complete_message(message)
    assert [h.event for h in servicebus_broker.history("sq")] == ["expire", "expire", "complete", "complete"]


@pytest.mark.asyncio
async def test_settling_after_the_session_lock_was_lost_is_session_lock_lost_at_the_broker(
    servicebus_broker: BrokerHandle,
) -> None:
    servicebus_broker.create_queue("sq", requires_session=True, lock_duration=1)
    async with sb_client(servicebus_broker) as client:
        await send_sessions(client, "sq", {"A": 1})
        async with client.get_queue_receiver("sq", session_id="A", max_wait_time=2) as receiver:
            (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=2)
            # Pretend the client clock lags the broker's, so the SDK's own expiry check passes and
            # the settlement reaches the broker, which must answer session-lock-lost itself.
            receiver.session._locked_until_utc = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
                minutes=1
            )
            await servicebus_broker.async_wait_until(lambda b: not b.session_locked("sq", "A"), timeout=5)
            with pytest.raises(SessionLockLostError):
                await receiver.complete_message(message)
    assert servicebus_broker.messages("sq")[0].delivery_count == 1
    assert servicebus_broker.entity_stats("sq")["completed"] == 0


@pytest.mark.asyncio
async def test_renewing_the_session_lock_keeps_its_messages_locked(servicebus_broker: BrokerHandle) -> None:
    servicebus_broker.create_queue("sq", requires_session=True, lock_duration=1)
    async with sb_client(servicebus_broker) as client:
        await send_sessions(client, "sq", {"A": 1})
        async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as receiver:
            (message,) = await receiver.receive_messages(max_message_count=1, max_wait_time=2)
            for _ in range(4):  # two lock durations
                await asyncio.sleep(0.5)
                await receiver.session.renew_lock()
            assert servicebus_broker.counts("sq").locked == 1
            assert servicebus_broker.entity_stats("sq")["session_locks_expired"] == 0
            await receiver.complete_message(message)
    stats = servicebus_broker.entity_stats("sq")
    assert (stats["completed"], stats["session_locks_renewed"], stats["lock_expired"]) == (1, 4, 0)


@pytest.mark.asyncio
async def test_closing_a_session_receiver_releases_its_messages_without_counting(
    servicebus_broker: BrokerHandle,
) -> None:
    servicebus_broker.create_queue("sq", requires_session=True)
    async with sb_client(servicebus_broker) as client:
        await send_sessions(client, "sq", {"A": 3})
        async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as receiver:
            got = await receiver.receive_messages(max_message_count=3, max_wait_time=2)
            assert len(got) == 3
            await receiver.abandon_message(got[0])  # counts a delivery, and comes back first
            assert servicebus_broker.counts("sq").locked >= 2
        await servicebus_broker.async_wait_until(lambda b: b.counts("sq").locked == 0, timeout=5)
        assert [m.delivery_count for m in servicebus_broker.messages("sq")] == [1, 0, 0]
        async with client.get_queue_receiver("sq", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as receiver:
            again: list[bytes] = []
            while len(again) < 3:
                batch = await receiver.receive_messages(max_message_count=3, max_wait_time=2)
                assert batch
                for message in batch:
                    again.append(body_of(message))
                    await receiver.complete_message(message)
    assert again == [b"A-0", b"A-1", b"A-2"]  # still in order
    events = [(h.event, h.sequence_number) for h in servicebus_broker.history("sq")]
    assert events[0] == ("abandon", 1)
    assert sorted(e for e in events if e[0] == "release") == [("release", 2), ("release", 3)]
    assert events[-3:] == [("complete", 1), ("complete", 2), ("complete", 3)]


@pytest.mark.asyncio
async def test_session_and_plain_receivers_are_refused_on_the_wrong_kind_of_entity(
    servicebus_broker: BrokerHandle,
) -> None:
    servicebus_broker.create_queue("plain")
    servicebus_broker.create_queue("sq", requires_session=True)
    async with sb_client(servicebus_broker, retry_total=0) as client:
        with pytest.raises(ServiceBusError, match="does not require sessions"):
            async with client.get_queue_receiver("plain", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1):
                pass
        with pytest.raises(ServiceBusError, match="requires sessions"):
            async with client.get_queue_receiver("sq") as receiver:
                await receiver.receive_messages(max_wait_time=1)
    servicebus_broker.clear_errors()


def test_protocol_errors_are_recorded_not_swallowed(servicebus_broker: BrokerHandle) -> None:
    with socket.create_connection(("127.0.0.1", servicebus_broker.port), timeout=5) as sock:
        sock.sendall(b"AMQP\x00\x01\x00\x00")
        assert sock.recv(8) == b"AMQP\x00\x01\x00\x00"
        sock.sendall(struct.pack(">IBBH", 12, 2, 0, 0) + b"\xff\xff\xff\xff")  # not a performative
        sock.recv(4096)  # the broker closes with a framing error
    servicebus_broker.wait_until(lambda b: bool(b.errors), timeout=5)
    errors = servicebus_broker.clear_errors()
    assert "constructor" in str(errors[0]) or "performative" in str(errors[0])
