"""
``StreamTriggerEvent``: a short ``repr`` (the triggerer's "Trigger fired event" log line) and a
payload that crosses the real runner -> supervisor channel unchanged, as a plain ``TriggerEvent``.
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
from airflow.jobs.triggerer_job_runner import TriggerEventEntry, TriggerRunnerSupervisor, messages
from airflow.sdk.execution_time.comms import _RequestFrame
from airflow.triggers.base import TriggerEvent

from airflow_shared_stream_provider._core.events import StreamTriggerEvent, describe_payload
from devkit.memory import MemorySharedStreamTrigger


def _envelope(offset: int, body_size: int = 400) -> dict[str, Any]:
    return {
        "broker": "kafka",
        "source": "orders",
        "message_id": f"orders/0/{offset}",
        "body": {"seq": offset, "note": "x" * body_size},
        "attributes": {},
    }


def test_a_batch_is_named_by_its_size_and_its_first_and_last_message() -> None:
    event = StreamTriggerEvent({"messages": [_envelope(i) for i in range(500)]})
    text = repr(event)
    assert text == "TriggerEvent<batch of 500 kafka messages 'orders/0/0' .. 'orders/0/499'>"


def test_a_single_envelope_is_named_by_broker_and_id() -> None:
    assert repr(StreamTriggerEvent(_envelope(7))) == "TriggerEvent<kafka message 'orders/0/7'>"
    assert describe_payload({"messages": [_envelope(3)]}) == "batch of 1 kafka messages 'orders/0/3'"


def test_other_payloads_keep_their_repr_cut_to_a_line() -> None:
    marker = {"marker": "flush", "broker": "sqs", "after_message_id": "m-1", "quiet_seconds": 5.0}
    assert describe_payload(marker) == repr(marker)
    long = describe_payload({"user": "y" * 10_000})
    assert len(long) < 300
    assert long.endswith("characters)")
    # a dict that merely has a "messages" key among others is not a batch of ours
    assert describe_payload({"messages": [1], "other": 2}) == repr({"messages": [1], "other": 2})


def test_the_event_crosses_the_triggerer_channel_as_a_plain_trigger_event() -> None:
    """The runner -> supervisor path of Airflow 3.3: pydantic dump, msgpack frame, supervisor decode."""
    payload = {"messages": [_envelope(i, body_size=2000) for i in range(40)]}
    changes = messages.TriggerStateChanges(
        events=[TriggerEventEntry(trigger_id=4, event=StreamTriggerEvent(payload), persist_seq=9)]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pydantic serialization warning would be a schema mismatch
        frame = _RequestFrame(id=1, body=changes.model_dump())
        wire = bytes(frame.as_bytes())
    body = msgspec.msgpack.Decoder(_RequestFrame).decode(wire[4:]).body
    received = TriggerRunnerSupervisor.decoder.validate_python(body)
    assert isinstance(received, messages.TriggerStateChanges)
    assert received.events is not None
    entry = received.events[0]
    assert type(entry.event) is TriggerEvent
    assert entry.event.payload == payload
    assert entry.persist_seq == 9


def test_watchers_yield_stream_trigger_events() -> None:
    trigger = MemorySharedStreamTrigger(broker_name="events-repr", batch_size=10)
    assert isinstance(trigger.make_event(_envelope(1)), StreamTriggerEvent)
    assert isinstance(trigger.make_batch_event([_envelope(1), _envelope(2)]), StreamTriggerEvent)
    assert isinstance(trigger.make_flush_marker("orders/0/2"), StreamTriggerEvent)
