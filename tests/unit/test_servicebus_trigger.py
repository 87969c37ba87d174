"""Service Bus trigger and producer: settings, key, serialization, connection parsing, dispositions.

The disposition tests drive the real ``SharedStreamManager`` with a fake SDK receiver (no broker,
no sleeps beyond event-loop turns); the wire-level behaviour is in tests/integration/servicebus.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from azure.servicebus.amqp import AmqpMessageBodyType
from azure.servicebus.exceptions import MessageLockLostError

from airflow_shared_stream_provider import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider.producers import servicebus as sbp
from airflow_shared_stream_provider.producers.servicebus import (
    POISON_REASON,
    REJECTED_REASON,
    ServiceBusSharedStreamProducer,
    connection_info,
    envelope_fields,
)
from airflow_shared_stream_provider.triggers.servicebus import (
    ServiceBusSharedStreamTrigger,
    ServiceBusStreamSettings,
)
from devkit.runner import RunnerSim, record_producers, settle, wait_until

SECRET = "c2VjcmV0LWtleS12YWx1ZQ=="
CONN_STR = (
    f"Endpoint=sb://127.0.0.1:5672;SharedAccessKeyName=root;SharedAccessKey={SECRET};UseDevelopmentEmulator=true;"
)


# -- settings, key, serialization --------------------------------------------------------------------
def test_filters_do_not_change_the_key() -> None:
    plain = ServiceBusSharedStreamTrigger(queue_name="orders")
    filtered = ServiceBusSharedStreamTrigger(
        queue_name="orders", match={"body.region": "eu"}, filter_function="pkg.mod.func", on_filter_error="skip"
    )
    assert plain.shared_stream_key() == filtered.shared_stream_key()


def test_serialize_round_trips_with_the_real_class_path_and_no_secret() -> None:
    trigger = ServiceBusSharedStreamTrigger(
        topic_name="orders", subscription_name="airflow", azure_service_bus_conn_id="sb", match={"body.x": 1}
    )
    path, kwargs = trigger.serialize()
    assert path == "airflow_shared_stream_provider.triggers.servicebus.ServiceBusSharedStreamTrigger"
    json.dumps(kwargs)  # JSON-safe
    assert kwargs["azure_service_bus_conn_id"] == "sb"
    assert "SharedAccessKey" not in json.dumps(kwargs)
    again = ServiceBusSharedStreamTrigger(**kwargs)
    assert again.shared_stream_key() == trigger.shared_stream_key()
    assert again.serialize() == (path, kwargs)


def test_session_options_serialize_round_trip() -> None:
    trigger = ServiceBusSharedStreamTrigger(
        topic_name="orders", subscription_name="s", sessions=True, max_concurrent_sessions=4, session_idle_timeout=1.5
    )
    _, kwargs = trigger.serialize()
    assert (kwargs["sessions"], kwargs["max_concurrent_sessions"], kwargs["session_idle_timeout"]) == (True, 4, 1.5)
    again = ServiceBusSharedStreamTrigger(**kwargs)
    assert again.shared_stream_key() == trigger.shared_stream_key()
    plain = ServiceBusSharedStreamTrigger(topic_name="orders", subscription_name="s")
    assert ServiceBusSharedStreamTrigger(**plain.serialize()[1]).settings.sessions is False  # defaults round-trip


def test_a_subclass_serializes_under_its_own_path_and_shares_the_stream() -> None:
    class OnlyBig(ServiceBusSharedStreamTrigger):
        pass

    sub = OnlyBig(queue_name="orders")
    assert sub.serialize()[0].endswith("OnlyBig")
    assert sub.shared_stream_key() == ServiceBusSharedStreamTrigger(queue_name="orders").shared_stream_key()


def test_entity_path() -> None:
    assert ServiceBusStreamSettings(queue_name="q").entity_path == "q"
    assert ServiceBusStreamSettings(topic_name="t", subscription_name="s").entity_path == "t/Subscriptions/s"


# -- connection ---------------------------------------------------------------------------------
def test_connection_string_in_schema_is_used() -> None:
    info = connection_info("sb", schema=CONN_STR, host=None, extras={})
    assert info.connection_string == CONN_STR
    assert SECRET not in info.describe()
    assert "sb://127.0.0.1:5672" in info.describe()


@pytest.mark.parametrize("unset", [None, "", "None", "  none ", "null"])
def test_unset_schema_falls_back_to_extras(unset: Any) -> None:
    info = connection_info("sb", schema=unset, host=None, extras={"connection_string": CONN_STR})
    assert info.connection_string == CONN_STR
    info = connection_info(
        "sb", schema=unset, host=None, extras={"fully_qualified_namespace": "ns.servicebus.windows.net"}
    )
    assert info.connection_string is None
    assert info.fully_qualified_namespace == "ns.servicebus.windows.net"


def test_namespace_with_managed_identity_and_legacy_prefixed_extras() -> None:
    info = connection_info(
        "sb",
        schema="None",
        host=None,
        extras={
            "extra__azure_service_bus__fully_qualified_namespace": "sb://ns.servicebus.windows.net/",
            "managed_identity_client_id": "client-1",
            "workload_identity_tenant_id": "",
        },
    )
    assert info.fully_qualified_namespace == "ns.servicebus.windows.net"
    assert info.managed_identity_client_id == "client-1"
    assert info.workload_identity_tenant_id is None
    assert "DefaultAzureCredential" in info.describe()


async def test_connection_is_read_through_the_task_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SB_UNIT", json.dumps({"conn_type": "azure_service_bus", "schema": CONN_STR}))
    info = await sbp.load_connection_info("sb_unit")
    assert info.connection_string == CONN_STR


async def test_malformed_connection_string_does_not_echo_it() -> None:
    producer = ServiceBusSharedStreamProducer(ServiceBusStreamSettings(queue_name="q"), stream_key="k")
    bad = f"SharedAccessKey={SECRET}"
    with pytest.raises(SharedStreamConfigError) as caught:
        producer._make_client(sbp.ServiceBusConnectionInfo("sb", connection_string=bad))
    assert SECRET not in str(caught.value)
    await producer.aclose()


# -- envelope -----------------------------------------------------------------------------------
class FakeMessage:
    """The attributes of ``ServiceBusReceivedMessage`` the producer reads."""

    def __init__(
        self, body: bytes, *, seq: int, delivery_count: int = 0, lock_seconds: float = 30.0, **kw: Any
    ) -> None:
        self.body_type = AmqpMessageBodyType.DATA
        self.body: Any = iter([body])
        self._raw = body
        self.sequence_number = seq
        self.delivery_count = delivery_count
        self.message_id = kw.get("message_id")
        self.application_properties = kw.get("application_properties")
        self.session_id = kw.get("session_id")
        self.correlation_id = None
        self.subject = kw.get("subject")
        self.content_type = "application/json"
        self.partition_key = None
        self.enqueued_time_utc = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
        self.locked_until_utc = datetime.now(timezone.utc) + timedelta(seconds=lock_seconds)
        self.lock_token = uuid.uuid4()


def test_envelope_decodes_bytes_properties_and_uses_broker_fields() -> None:
    message = FakeMessage(
        b'{"region": "eu"}',
        seq=42,
        delivery_count=2,
        application_properties={b"kind": b"order", b"n": 7},
        subject="orders",
        session_id="s-1",
    )
    fields = envelope_fields(message, entity_path="q")  # type: ignore[arg-type]
    assert fields["message_id"] == "q/42"  # no sender message id: the sequence number
    assert fields["attributes"] == {"kind": "order", "n": "7"}
    assert fields["delivery_attempt"] == 3
    assert fields["published_at"] == "2026-01-02T03:04:05+00:00"
    assert fields["body"] == b'{"region": "eu"}'
    meta = fields["metadata"]
    assert (meta["sequence_number"], meta["delivery_count"], meta["session_id"], meta["subject"]) == (
        42,
        2,
        "s-1",
        "orders",
    )
    with_id = FakeMessage(b"x", seq=1, message_id="m-1")
    assert envelope_fields(with_id, entity_path="q")["message_id"] == "m-1"  # type: ignore[arg-type]


def test_value_and_sequence_bodies_become_json_text() -> None:
    message = FakeMessage(b"", seq=1)
    message.body_type = AmqpMessageBodyType.VALUE
    message.body = {"a": 1}
    assert sbp.message_body(message) == '{"a": 1}'  # type: ignore[arg-type]
    message.body_type = AmqpMessageBodyType.SEQUENCE
    message.body = iter([[1, 2]])
    assert sbp.message_body(message) == "[[1, 2]]"  # type: ignore[arg-type]


# -- the producer on the real manager, with a fake receiver ------------------------------------
class FakeReceiver:
    def __init__(self) -> None:
        self.available: list[FakeMessage] = []
        self.actions: list[tuple[str, int, str | None, str | None]] = []
        self.lost: set[int] = set()
        self.renewed: list[int] = []
        self.closed = False
        self.arrived = asyncio.Event()

    def publish(self, message: FakeMessage) -> None:
        self.available.append(message)
        self.arrived.set()

    async def __aenter__(self) -> FakeReceiver:
        return self

    async def receive_messages(self, max_message_count: int, max_wait_time: float) -> list[FakeMessage]:
        if not self.available:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout=min(max_wait_time, 0.05))
            except asyncio.TimeoutError:
                return []
        batch, self.available = self.available[:max_message_count], self.available[max_message_count:]
        return batch

    async def _act(self, name: str, message: FakeMessage, reason: str | None = None, desc: str | None = None) -> None:
        if message.sequence_number in self.lost:
            raise MessageLockLostError(message="lock lost")
        self.actions.append((name, message.sequence_number, reason, desc))

    async def complete_message(self, message: FakeMessage) -> None:
        await self._act("complete", message)

    async def abandon_message(self, message: FakeMessage) -> None:
        await self._act("abandon", message)

    async def dead_letter_message(self, message: FakeMessage, reason: str, error_description: str) -> None:
        await self._act("dead_letter", message, reason, error_description)

    async def renew_message_lock(self, message: FakeMessage) -> datetime:
        if message.sequence_number in self.lost:
            raise MessageLockLostError(message="lock lost")
        self.renewed.append(message.sequence_number)
        return datetime.now(timezone.utc) + timedelta(seconds=30)

    async def close(self) -> None:
        self.closed = True


class FakeClient:
    async def close(self) -> None:
        return None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeReceiver:
    receiver = FakeReceiver()
    monkeypatch.setenv("AIRFLOW_CONN_SB_FAKE", json.dumps({"conn_type": "azure_service_bus", "schema": CONN_STR}))
    monkeypatch.setattr(ServiceBusSharedStreamProducer, "_make_client", lambda self, info: FakeClient())
    monkeypatch.setattr(ServiceBusSharedStreamProducer, "_make_receiver", lambda self, client: receiver)
    return receiver


def fake_trigger(**kwargs: Any) -> ServiceBusSharedStreamTrigger:
    return ServiceBusSharedStreamTrigger(queue_name="orders", azure_service_bus_conn_id="sb_fake", **kwargs)


def reject_eu(envelope: dict[str, Any]) -> bool:
    if envelope["body"]["region"] == "eu":
        raise RejectMessage("no eu orders here")
    return True


def body(i: int, region: str = "us") -> bytes:
    return json.dumps({"order_id": i, "region": region}).encode()


async def test_fan_out_and_complete_only_after_persistence(fake: FakeReceiver) -> None:
    for i in range(4):
        fake.publish(FakeMessage(body(i, ("eu", "us")[i % 2]), seq=i + 1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, fake_trigger())
        runner.add(2, fake_trigger(match={"body.region": "eu"}))
        await wait_until(lambda: len(runner.pending) >= 6, timeout=10, what="6 events")
        await settle()
        assert fake.actions == []  # nothing completed before persistence
        runner.persist()
        await wait_until(lambda: len(fake.actions) == 4, timeout=10, what="4 settlements")
    assert sorted(fake.actions) == [("complete", i, None, None) for i in range(1, 5)]
    assert runner.count(1) == 4 and runner.count(2) == 2
    assert fake.closed


async def test_reject_dead_letters_with_reason_and_description(fake: FakeReceiver) -> None:
    fake.publish(FakeMessage(body(1, "eu"), seq=1))
    fake.publish(FakeMessage(body(2, "us"), seq=2))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, fake_trigger(filter_function=f"{__name__}.reject_eu"))
        runner.add(2, fake_trigger())
        await wait_until(lambda: len(fake.actions) == 2, timeout=10, what="2 settlements")
    by_seq = {seq: (name, reason, desc) for name, seq, reason, desc in fake.actions}
    assert by_seq[2] == ("complete", None, None)
    name, reason, desc = by_seq[1]
    assert (name, reason) == ("dead_letter", REJECTED_REASON)
    assert desc is not None and "no eu orders here" in desc


def deep_value(depth: int) -> list[Any]:
    """An AMQP value body nested ``depth`` lists deep (a sender's SDK in another language can send it)."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


async def assert_dead_lettered_alone(fake: FakeReceiver, unreadable: FakeMessage, error: str) -> None:
    """
    ``unreadable`` (seq 1), then a good message (seq 2), to two watchers on the real manager: the
    first is dead-lettered with ``envelope failed: <error>``, the second reaches both watchers and
    is completed, and no watcher fails (the stream goes on).
    """
    fake.publish(unreadable)
    fake.publish(FakeMessage(body(2, "eu"), seq=2))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, fake_trigger())
        runner.add(2, fake_trigger())
        await wait_until(lambda: len(fake.actions) == 2, timeout=10, what="2 settlements")
        assert not runner.failures
    assert runner.count(1) == runner.count(2) == 1  # the good message, at both watchers
    dead = [action for action in fake.actions if action[0] == "dead_letter"]
    assert [(name, seq) for name, seq, _, _ in dead] == [("dead_letter", 1)]
    assert f"envelope failed: {error}" in str(dead[0][3])
    assert ("complete", 2, None, None) in fake.actions


async def test_a_value_body_that_cannot_become_json_is_dead_lettered_and_the_stream_goes_on(
    fake: FakeReceiver,
) -> None:
    unreadable = FakeMessage(b"", seq=1)
    unreadable.body_type = AmqpMessageBodyType.VALUE
    unreadable.body = deep_value(20_000)  # json_safe / json.dumps raise RecursionError on it
    await assert_dead_lettered_alone(fake, unreadable, "RecursionError")


async def test_properties_the_envelope_cannot_read_dead_letter_the_message_and_the_stream_goes_on(
    fake: FakeReceiver,
) -> None:
    # AMQP's application-properties section is a map, but the SDK hands on whatever a sender's
    # encoder wrote there (a list here). Before: reading it raised in _to_delivery, outside the
    # envelope guard, and ended the stream for every watcher; the message came back at each restart.
    odd = FakeMessage(b'{"kind": "odd"}', seq=1)
    odd.application_properties = [1, 2, 3]  # type: ignore[assignment]
    odd.session_id = [4, 5]  # type: ignore[assignment]  # group-id is a string in AMQP; a list is no lane
    await assert_dead_lettered_alone(fake, odd, "TypeError")


async def test_ack_timeout_abandons_and_the_poison_cap_dead_letters(fake: FakeReceiver) -> None:
    now = [0.0]
    fake.publish(FakeMessage(body(1), seq=1, delivery_count=0))
    fake.publish(FakeMessage(body(2), seq=2, delivery_count=2))  # third attempt: reaches the cap
    manager = SharedStreamManager(ack_timeout=0.1, _now=lambda: now[0])
    async with RunnerSim(manager) as runner:
        runner.add(1, fake_trigger(max_delivery_attempts=3))
        await wait_until(lambda: len(runner.pending) >= 2, timeout=10, what="2 events")
        now[0] += 1.0  # never persisted: the ack timeout fails both
        await wait_until(lambda: len(fake.actions) == 2, timeout=10, what="2 settlements")
    by_seq = {seq: (name, reason) for name, seq, reason, _ in fake.actions}
    assert by_seq == {1: ("abandon", None), 2: ("dead_letter", POISON_REASON)}


async def test_lost_lock_is_counted_and_the_group_survives(fake: FakeReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    made = record_producers(monkeypatch, ServiceBusSharedStreamProducer)
    fake.lost.add(1)
    fake.publish(FakeMessage(body(1), seq=1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, fake_trigger())
        await wait_until(lambda: bool(made) and made[0].counters.leases_lost == 1, timeout=10, what="lost lock counted")
        fake.publish(FakeMessage(body(2), seq=2))
        await wait_until(lambda: len(fake.actions) == 1, timeout=10, what="the next message completed")
        assert runner.alive(1) and not runner.failures
    assert fake.actions == [("complete", 2, None, None)]


async def test_prefetched_message_with_an_expired_lock_is_skipped(fake: FakeReceiver) -> None:
    fake.publish(FakeMessage(body(1), seq=1, lock_seconds=-1))
    fake.publish(FakeMessage(body(2), seq=2))
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.01) as runner:
        runner.add(1, fake_trigger())
        await wait_until(lambda: len(fake.actions) == 1, timeout=10, what="one settlement")
    assert [p["metadata"]["sequence_number"] for p in runner.persisted[1]] == [2]


async def test_locks_of_messages_in_flight_are_renewed(fake: FakeReceiver) -> None:
    fake.publish(FakeMessage(body(1), seq=1, lock_seconds=1.2))  # renewed 0.4 s before expiry
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, fake_trigger())
        await wait_until(lambda: bool(fake.renewed), timeout=10, what="a renewal")
        runner.persist()
        await wait_until(lambda: len(fake.actions) == 1, timeout=10, what="the completion")
    assert fake.renewed[0] == 1


async def test_lanes_are_session_id_else_per_message() -> None:
    producer = ServiceBusSharedStreamProducer(ServiceBusStreamSettings(queue_name="q"), stream_key="k")
    payload = sbp.ServiceBusDelivery(None, 1, None, "t", "s-1")  # type: ignore[arg-type]
    assert producer.get_advance_lane(payload) == "s-1"
    await producer.aclose()
