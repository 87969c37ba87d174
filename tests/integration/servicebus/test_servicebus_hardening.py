"""
Service Bus through the real SDK: the dead-letter reason on a DLQ message is the provider's even
when the sender forged one, and sender-chosen ids reach the log only on one line.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider.producers.servicebus import REJECTED_REASON
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async
from tests.servicebus_broker.codec import Described, ULong, encode_value
from tests.servicebus_broker.message import (
    AMQP_SEQUENCE,
    AMQP_VALUE,
    APP_PROPERTIES,
    DATA,
    PROPERTIES,
    parse_message,
)

from .conftest import ServiceBusEnv

pytestmark = [pytest.mark.integration, pytest.mark.servicebus, pytest.mark.timeout(120)]


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_dead_letter_reason_is_the_providers_not_the_senders(sb: ServiceBusEnv, sb_conn: str) -> None:
    queue = await sb.create_queue("forged", lock_duration=30)
    forged = {
        "DeadLetterReason": "forged: approved by finance",
        "DeadLetterErrorDescription": "forged description",
        "origin": "shop",
    }
    bad = json.dumps({"order_id": 7, "bad": True}).encode()
    await sb.publish(queue, [bad], attributes=forged)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(
            1,
            ServiceBusSharedStreamTrigger(
                queue_name=queue,
                azure_service_bus_conn_id=sb_conn,
                max_wait_time=0.5,
                filter_function="tests.integration.contract.reject_flagged",
            ),
        )

        async def dead() -> bool:
            return len(await sb.dead_letters(queue)) == 1

        await wait_until_async(dead, timeout=30)
    [message] = await sb._peek(queue, dead_letter=True)  # through the SDK, as a DLQ consumer reads it
    properties = {text(k): text(v) for k, v in (message.application_properties or {}).items()}
    assert message.dead_letter_reason == REJECTED_REASON == properties["DeadLetterReason"]
    description = message.dead_letter_error_description
    assert description is not None and "order 7 is flagged bad" in description
    assert properties["DeadLetterErrorDescription"] == description
    assert properties["origin"] == "shop"


async def test_sender_session_ids_reach_the_log_on_one_line(
    sb: ServiceBusEnv, sb_conn: str, caplog: pytest.LogCaptureFixture
) -> None:
    if not sb.local:
        pytest.skip("a session id with CR/LF is for the test broker (Azure may refuse it)")
    queue = await sb.create_queue("logsafe", lock_duration=30, requires_session=True)
    forged = "s-1\r\n2026-01-01 00:00:00 INFO forged line\x1b[2K"
    await sb.publish(queue, [b'{"n": 1}'], session_id=forged)
    caplog.set_level(logging.INFO, logger="airflow_shared_stream_provider")
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(
            1,
            ServiceBusSharedStreamTrigger(
                queue_name=queue,
                azure_service_bus_conn_id=sb_conn,
                sessions=True,
                max_wait_time=0.5,
                session_idle_timeout=0.3,
            ),
        )
        await wait_until(lambda: runner.count(1) == 1, timeout=30, what="the event")
        assert runner.persisted[1][0]["metadata"]["session_id"] == forged  # watchers see the real id

        def logged_release() -> bool:
            return any("releasing session" in record.getMessage() for record in caplog.records)

        await wait_until(logged_release, timeout=30, what="the idle session's release to be logged")
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("airflow_shared_stream_provider")]
    about_session = [line for line in ours if "s-1" in line]
    assert any("accepted session s-1\\r\\n2026-01-01" in line for line in about_session), about_session
    assert any("releasing session s-1\\r\\n" in line for line in about_session), about_session
    for line in about_session:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line, line


def _encoded(*sections: tuple[int, Any]) -> bytes:
    return b"".join(encode_value(Described(ULong(code), value)) for code, value in sections)


# The properties section's fields, in order (AMQP 1.0 part 3, 3.2.4).
PROPERTY_FIELDS: Final = (
    "message_id",
    "user_id",
    "to",
    "subject",
    "reply_to",
    "correlation_id",
    "content_type",
    "content_encoding",
    "absolute_expiry_time",
    "creation_time",
    "group_id",
)


def _properties(**fields: Any) -> tuple[int, list[Any]]:
    """An AMQP properties section: message-id, user-id, to, subject, reply-to, correlation-id, ..."""
    return PROPERTIES, [fields.get(name) for name in PROPERTY_FIELDS]


# The odd messages' body: valid JSON, so that only their odd sections are hostile.
ODD_BODY = (DATA, b'{"kind": "odd"}')
# Sections of types AMQP does not allow where they stand (or allows, but no Azure SDK writes), as a
# non-Azure encoder may send them. No SDK sender can write them: the test broker is handed the bytes.
ODD_SECTIONS: dict[str, tuple[bytes, bool]] = {
    # name: (the encoded message, whether the envelope can carry it: delivered, else dead-lettered)
    "application-properties as a list, group-id as a list": (
        _encoded(_properties(message_id=b"odd-1", group_id=[4, 5]), (APP_PROPERTIES, [1, 2, 3]), ODD_BODY),
        False,
    ),
    "message-id, correlation-id and subject as lists and maps": (
        _encoded(_properties(message_id=[1, 2], correlation_id={"a": 1}, subject=[b"x"]), ODD_BODY),
        True,
    ),
    "content-type and expiry of the wrong types": (
        _encoded(_properties(content_type=[1], absolute_expiry_time="soon", creation_time=b"x"), ODD_BODY),
        True,
    ),
    "application-property keys that are not strings, values that are maps and lists": (
        _encoded((APP_PROPERTIES, {1: "int key", b"k": {"nested": [1, 2]}, "list": [None, 1.5]}), ODD_BODY),
        True,
    ),
    "an amqp-sequence body": (_encoded((AMQP_SEQUENCE, [1, "two", b"three"])), True),
    "an amqp-value body of a map with binary keys": (_encoded((AMQP_VALUE, {b"\xff": [b"\x00"], 1: None})), True),
}


@pytest.mark.parametrize("case", ODD_SECTIONS, ids=list(ODD_SECTIONS))
async def test_sections_of_odd_amqp_types_are_delivered_or_dead_lettered_and_the_stream_goes_on(
    sb: ServiceBusEnv, sb_conn: str, request: pytest.FixtureRequest, case: str
) -> None:
    """
    Through the SDK's receiver, a message with odd section types, then a good one, to two watchers:
    the odd one is delivered to both or dead-lettered with ``envelope failed``, the good one reaches
    both, nothing is left unsettled and no watcher fails. The first case ended the stream before
    59e73bb (the envelope raised outside its guard; the poll failed for every subscriber).
    """
    if not sb.local:
        pytest.skip("the message is handed to the test broker directly (no SDK sender can write it)")
    payload, deliverable = ODD_SECTIONS[case]
    handle = request.getfixturevalue("servicebus_broker")
    queue = await sb.create_queue("odd-sections", lock_duration=30)
    odd = parse_message(payload)
    handle.call(lambda broker: broker.entity(queue).enqueue(odd))
    await sb.publish(queue, [b'{"kind": "good"}'])
    trigger: dict[str, Any] = {"queue_name": queue, "azure_service_bus_conn_id": sb_conn, "max_wait_time": 0.5}
    expected = 2 if deliverable else 1
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, ServiceBusSharedStreamTrigger(**trigger))
        runner.add(2, ServiceBusSharedStreamTrigger(**trigger))
        await wait_until(
            lambda: runner.count(1) == runner.count(2) == expected, timeout=30, what=f"{expected} events at both"
        )

        async def settled() -> bool:
            return await sb.unsettled(queue) == 0 and len(await sb.dead_letters(queue)) == (0 if deliverable else 1)

        await wait_until_async(settled, timeout=30)
        assert not runner.failures
    bodies = [event["body"] for event in runner.persisted[1]]
    assert bodies[-1] == {"kind": "good"}
    if not deliverable:
        [dead] = await sb.dead_letters(queue)
        assert dead.body == b'{"kind": "odd"}'
        assert dead.description is not None and "envelope failed: TypeError" in dead.description, dead
