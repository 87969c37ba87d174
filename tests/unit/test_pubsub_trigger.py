"""Pub/Sub trigger and producer units: key, serialization, config, connection, ack results, lanes."""
# mypy: disable-error-code="no-untyped-call"

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider.triggers.pubsub import (
    PubSubSharedStreamTrigger,
    split_subscription,
)

SUB = "projects/proj-a/subscriptions/orders-sub"


def trigger(**kwargs: Any) -> PubSubSharedStreamTrigger:
    kwargs.setdefault("subscription", SUB)
    return PubSubSharedStreamTrigger(**kwargs)


def test_a_short_name_without_project_keeps_project_id_in_the_key() -> None:
    short = PubSubSharedStreamTrigger(subscription="orders-sub")
    assert short.settings.project_id is None
    assert short.shared_stream_key() != trigger().shared_stream_key()
    assert (
        short.shared_stream_key()
        != PubSubSharedStreamTrigger(subscription="orders-sub", gcp_conn_id="x").shared_stream_key()
    )


def test_filters_do_not_change_the_key_and_spellings_of_one_subscription_share_it() -> None:
    base = trigger().shared_stream_key()
    assert trigger(match={"body.region": "eu"}).shared_stream_key() == base
    assert trigger(filter_function="tests.integration.contract.reject_flagged").shared_stream_key() == base
    assert trigger(on_filter_error="skip").shared_stream_key() == base
    assert PubSubSharedStreamTrigger(subscription="orders-sub", project_id="proj-a").shared_stream_key() == base
    # A short dead-letter topic is resolved in the subscription's project.
    assert (
        trigger(dead_letter_topic="dead").shared_stream_key()
        == trigger(dead_letter_topic="projects/proj-a/topics/dead").shared_stream_key()
    )


def test_serialize_round_trips_and_holds_no_secret() -> None:
    original = trigger(dead_letter_topic="dead", match={"attributes.kind": ["a", "b"]}, max_messages=7)
    path, kwargs = original.serialize()
    assert path == "airflow_shared_stream_provider.triggers.pubsub.PubSubSharedStreamTrigger"
    json.dumps(kwargs)  # JSON-safe
    assert kwargs["gcp_conn_id"] == "google_cloud_default"
    assert not {"keyfile_dict", "key_path", "credentials", "password"} & set(kwargs)
    again = PubSubSharedStreamTrigger(**kwargs)
    assert again.serialize() == (path, kwargs)
    assert again.shared_stream_key() == original.shared_stream_key()


def test_a_subclass_serializes_under_its_own_path_and_shares_the_stream() -> None:
    class OnlyBig(PubSubSharedStreamTrigger):
        def accept(self, envelope: Any) -> bool:
            return bool(envelope["body"]["amount"] > 100)

    sub = OnlyBig(subscription=SUB)
    assert sub.serialize()[0].endswith("OnlyBig")
    assert sub.shared_stream_key() == trigger().shared_stream_key()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("orders-sub", (None, "orders-sub")),
        ("projects/my-proj/subscriptions/orders.v2", ("my-proj", "orders.v2")),
        ("projects/p1/subscriptions/a~b+c%d_e-f", ("p1", "a~b+c%d_e-f")),
    ],
)
def test_subscription_paths_parse(given: str, expected: tuple[str | None, str]) -> None:
    assert split_subscription(given) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "ab",  # too short
        "1abc",  # must start with a letter
        "goog-sub",  # reserved prefix
        "projects/p/topics/t-abc",  # a topic path
        "projects//subscriptions/abc",
        "projects/p/subscriptions/abc/extra",
        "with space",
    ],
)
def test_bad_subscriptions_are_refused_at_parse_time(bad: str) -> None:
    with pytest.raises(SharedStreamConfigError, match="subscription"):
        trigger(subscription=bad)


def test_short_names_resolve_against_the_connection_project() -> None:
    settings = PubSubSharedStreamTrigger(subscription="orders-sub", dead_letter_topic="dead").settings
    path = settings.subscription_path("conn-proj")
    assert path == "projects/conn-proj/subscriptions/orders-sub"
    assert settings.dead_letter_topic_path(path) == "projects/conn-proj/topics/dead"
    with pytest.raises(SharedStreamConfigError, match="no project is known"):
        settings.subscription_path(None)


# -- producer pieces (no broker) -------------------------------------------------------------------


def test_run_is_not_a_standalone_path() -> None:
    with pytest.raises(NotImplementedError):
        trigger().run().__anext__().send(None)  # type: ignore[attr-defined]


async def test_connection_extras_with_the_old_prefix_and_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_shared_stream_provider.producers.pubsub import load_connection

    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_OLD",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"extra__google_cloud_platform__project": "old-p"}}),
    )
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    conn = await load_connection("gcp_old")
    assert (conn.project, conn.credentials, conn.emulator_host) == ("old-p", None, "127.0.0.1:1")
    missing = await load_connection("no_such_conn")  # a missing connection is not an error (ADC)
    assert missing.project is None


async def test_bad_keyfile_error_names_the_extra_never_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_shared_stream_provider.producers.pubsub import load_connection

    secret = '{"type": "service_account", "private_key": "TOPSECRET-KEY-MATERIAL"}'
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_BAD",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": secret}}),
    )
    with pytest.raises(SharedStreamConfigError) as info:
        await load_connection("gcp_bad")
    assert "keyfile_dict" in str(info.value)
    assert "TOPSECRET" not in str(info.value)
    assert info.value.__cause__ is None


async def test_key_secret_name_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_shared_stream_provider.producers.pubsub import load_connection

    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_SM", json.dumps({"conn_type": "google_cloud_platform", "extra": {"key_secret_name": "k"}})
    )
    with pytest.raises(SharedStreamConfigError, match="key_secret_name"):
        await load_connection("gcp_sm")


def test_exactly_once_ack_failures_are_read_from_error_info() -> None:
    from google.api_core import exceptions as gexc
    from google.rpc.error_details_pb2 import ErrorInfo

    from airflow_shared_stream_provider.producers.pubsub import ack_failures

    info = ErrorInfo(
        reason="EXACTLY_ONCE_ACKID_FAILURE",
        metadata={"a1": "PERMANENT_FAILURE_INVALID_ACK_ID", "a2": "TRANSIENT_FAILURE_UNORDERED_ACK_ID"},
    )
    exc = gexc.InvalidArgument("some acks failed", details=[info], error_info=info)
    assert ack_failures(exc) == {"a1": "PERMANENT_FAILURE_INVALID_ACK_ID", "a2": "TRANSIENT_FAILURE_UNORDERED_ACK_ID"}
    assert ack_failures(gexc.ServiceUnavailable("down")) is None


class FakeSubscriber:
    """Answers Acknowledge / ModifyAckDeadline from a script of exceptions (None = success)."""

    def __init__(self, script: list[BaseException | None]) -> None:
        self.script = script
        self.calls: list[tuple[str, list[str]]] = []

    async def _answer(self, name: str, request: dict[str, Any]) -> None:
        self.calls.append((name, list(request["ack_ids"])))
        outcome = self.script.pop(0) if self.script else None
        if outcome is not None:
            raise outcome

    async def acknowledge(self, *, request: dict[str, Any], **_: Any) -> None:
        await self._answer("ack", request)

    async def modify_ack_deadline(self, *, request: dict[str, Any], **_: Any) -> None:
        await self._answer("modify", request)


def producer(**kwargs: Any) -> Any:
    from airflow_shared_stream_provider.producers.pubsub import PubSubSharedStreamProducer

    trig = trigger(**kwargs)
    made = PubSubSharedStreamProducer(trig.settings, stream_key=trig.shared_stream_key())
    made.subscription_path = SUB
    return made


async def test_exactly_once_acks_retry_transient_ids_and_report_permanent_ones() -> None:
    from google.api_core import exceptions as gexc
    from google.rpc.error_details_pb2 import ErrorInfo

    info = ErrorInfo(
        reason="EXACTLY_ONCE_ACKID_FAILURE",
        metadata={"a1": "PERMANENT_FAILURE_INVALID_ACK_ID", "a2": "TRANSIENT_FAILURE_OTHER"},
    )
    made = producer()
    fake = FakeSubscriber([gexc.InvalidArgument("eod", details=[info], error_info=info), None])
    made._subscriber = fake
    lost = await made._send("ack", ["a1", "a2", "a3"])
    assert lost == ["a1"]
    assert fake.calls == [("ack", ["a1", "a2", "a3"]), ("ack", ["a2"])]
    assert made.counters.leases_lost == 1


async def test_a_call_that_keeps_failing_is_raised_not_reported_done(monkeypatch: pytest.MonkeyPatch) -> None:
    from google.api_core import exceptions as gexc

    import airflow_shared_stream_provider.producers.pubsub as mod

    monkeypatch.setattr(mod, "RPC_RETRIES", 2)
    made = producer()
    made._subscriber = FakeSubscriber([gexc.ServiceUnavailable("down")] * 10)
    with pytest.raises(gexc.ServiceUnavailable):
        await made._send("ack", ["a1"])
    made._subscriber = FakeSubscriber([gexc.PermissionDenied("no")])
    with pytest.raises(gexc.PermissionDenied):
        await made._send("ack", ["a1"])


async def test_one_invalid_ack_id_does_not_sink_the_batch() -> None:
    from google.api_core import exceptions as gexc

    made = producer()
    fake = FakeSubscriber([gexc.InvalidArgument("Invalid ack id (ack_id=a2)"), None, gexc.InvalidArgument("bad"), None])
    made._subscriber = fake
    assert await made._send("ack", ["a1", "a2", "a3"]) == ["a2"]
    assert fake.calls[1:] == [("ack", ["a1"]), ("ack", ["a2"]), ("ack", ["a3"])]


def _delivery(ack_id: str, key: str = "", pull_index: int = 1) -> Any:
    from airflow_shared_stream_provider._core.envelope import StreamMessage
    from airflow_shared_stream_provider.producers.pubsub import PubSubDelivery

    return PubSubDelivery(
        StreamMessage(envelope={}, seq=1),
        1,
        ack_id=ack_id,
        message_id="m-" + ack_id,
        ordering_key=key,
        pull_index=pull_index,
        data=b"x",
        attributes={},
        published_at=None,
    )


def test_lanes_are_ordering_keys_else_one_per_message() -> None:
    made = producer()
    assert made.get_advance_lane(_delivery("a1", "k")) == made.get_advance_lane(_delivery("a2", "k"))
    assert made.get_advance_lane(_delivery("a1")) != made.get_advance_lane(_delivery("a2"))
    assert made.get_advance_lane(_delivery("k")) != made.get_advance_lane(_delivery("a2", "k"))


async def test_a_nacked_ordering_key_nacks_its_later_messages_from_earlier_pulls() -> None:
    from airflow_shared_stream_provider._core.dispositions import Decision, Disposition
    from airflow_shared_stream_provider._core.producer import Decided

    made = producer()
    fake = FakeSubscriber([])
    made._subscriber = fake
    made._pulls_started = 1
    commit = Decision(Disposition.COMMIT, "ok")
    redeliver = Decision(Disposition.REDELIVER, "failed")
    await made._apply(
        [
            Decided(_delivery("k1", "K"), redeliver),
            Decided(_delivery("k2", "K"), commit),
            Decided(_delivery("u1"), commit),
        ]
    )
    # k1 nacked at once, and k2 (same key, same pull) with it; the unkeyed message is acked (buffered).
    assert fake.calls == [("modify", ["k1", "k2"])]
    assert made._buffer.nacks == []
    assert made._buffer.acks == ["u1"]
    # A K message from a later pull (after the redelivery) is acked normally and lifts the barrier.
    await made._apply([Decided(_delivery("k3", "K", pull_index=2), commit)])
    assert made._buffer.acks == ["u1", "k3"]
    assert "K" not in made._key_barriers


async def test_no_pull_for_a_trickle_of_credit_while_the_slowest_watcher_has_a_backlog() -> None:
    """
    stream_bench, N=10: the slowest watcher's lag bounds the credit (a 204-message window) and
    frees it one message at a time; pulling whatever credit there was made 247 pulls of ~8
    messages for 2,000 (26 at N=1). The base's loop (receive_floor) now starts a pull only when
    it may ask for min(max_messages, half a window): none ahead of the broadcast, and the next one
    waits, without polling, until the slowest watcher has worked its backlog down.
    """
    import asyncio
    import uuid

    from airflow_shared_stream_provider._core.flow import gates

    made = producer(subscription=f"projects/proj-a/subscriptions/pull-floor-{uuid.uuid4().hex[:8]}")
    started: list[int] = []
    made._start_receive = started.append  # records the pulls the base's loop would start
    gate = made.gate
    try:
        for token in range(10):
            gate.register(token)
        assert gate.window == 204 and made.receive_floor() == 100
        gate.hold_bytes(200)
        gate.release_bytes(200)  # small messages: the byte budget does not bound the credit
        assert gate.in_flight_limit == 51  # slow start's first round: 512 events / 10 watchers
        for _ in range(200):
            gate.next_seq()
        gate.advanced(200)  # every message settled (slow start over): only the queues bound the credit
        for token in range(9):
            gate.consumed(token, 200)
        gate.consumed(9, 10)  # the slowest watcher has 190 messages queued: 14 of credit
        assert gate.lag() == 190 and made.credit() == 14

        # A pull of 5 answers; the base would start the next one while these 5 are broadcast.
        made._receive_ahead(5)
        assert started == []  # before the fix: a pull of 9 messages
        for _ in range(5):
            gate.next_seq()  # broadcast: 195 queued for the slowest watcher
        waiting = asyncio.ensure_future(made._next_receives())  # nothing travelling: it waits
        await asyncio.sleep(0.05)
        assert not waiting.done() and started == []
        for token in range(9):
            gate.consumed(token, 205)  # the fast watchers' progress does not wake it ...
        await asyncio.sleep(0.05)
        assert not waiting.done()

        gate.consumed(9, 125)  # ... the slowest one's does: 80 queued, 124 of credit, worth a pull of 100
        assert await asyncio.wait_for(waiting, 1.0) == []
        await made._next_receives()
        assert started == [100]
    finally:
        gates.release(made.stream_key, gate)


async def test_one_key_source_with_the_emulator_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reader's refusals (two key sources, an IdP grant it cannot honour) are in
    # test_connection_refusals_every_broker.py; this is the accepted counterpart.
    from airflow_shared_stream_provider.producers.pubsub_connection import load_gcp_connection

    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_ONE_UNIT",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"key_path": "/k.json", "project": "p1"}}),
    )
    connection = await load_gcp_connection("gcp_one_unit")
    assert (connection.project, connection.credentials) == ("p1", None)
