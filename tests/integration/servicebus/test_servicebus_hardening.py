"""
Service Bus through the real SDK: the dead-letter reason on a DLQ message is the provider's even
when the sender forged one, and sender-chosen ids reach the log only on one line.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider.producers.servicebus import REJECTED_REASON
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.integration.contract import wait_until_async
from tests.servicebus_broker.codec import Described, ULong, encode_value
from tests.servicebus_broker.message import APP_PROPERTIES, DATA, PROPERTIES, parse_message

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


def _odd_sections_payload(body: bytes) -> bytes:
    """
    An AMQP message whose application-properties section is a list and whose group-id (the
    session id) is a list: types AMQP does not allow there, which a non-Azure encoder may write.
    The SDK's sender cannot make them, so the test broker is handed the encoded message directly.
    """
    properties = [b"odd-sections-1"] + [None] * 9 + [[4, 5]]  # message-id ... group-id (field 10)
    return b"".join(
        encode_value(Described(ULong(section), value))
        for section, value in ((PROPERTIES, properties), (APP_PROPERTIES, [1, 2, 3]), (DATA, body))
    )


async def test_property_sections_of_another_type_are_dead_lettered_through_the_sdk_and_the_stream_goes_on(
    sb: ServiceBusEnv, sb_conn: str, request: pytest.FixtureRequest
) -> None:
    """
    Through the SDK's receiver: the odd message is dead-lettered with ``envelope failed`` and the
    good one behind it reaches both watchers (before 59e73bb the envelope raised outside its guard
    and ended the stream; the unit test drives a fake receiver, this one the SDK's decoding).
    """
    if not sb.local:
        pytest.skip("the message is handed to the test broker directly (no SDK sender can write it)")
    handle = request.getfixturevalue("servicebus_broker")
    queue = await sb.create_queue("odd-sections", lock_duration=30)
    odd = parse_message(_odd_sections_payload(b'{"kind": "odd"}'))
    handle.call(lambda broker: broker.entity(queue).enqueue(odd))
    await sb.publish(queue, [b'{"kind": "good"}'])
    trigger: dict[str, Any] = {"queue_name": queue, "azure_service_bus_conn_id": sb_conn, "max_wait_time": 0.5}
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        runner.add(1, ServiceBusSharedStreamTrigger(**trigger))
        runner.add(2, ServiceBusSharedStreamTrigger(**trigger))
        await wait_until(lambda: runner.count(1) == runner.count(2) == 1, timeout=30, what="the good message twice")

        async def settled() -> bool:
            return len(await sb.dead_letters(queue)) == 1 and await sb.unsettled(queue) == 0

        await wait_until_async(settled, timeout=30)
        assert not runner.failures
    assert [event["body"] for event in runner.persisted[1]] == [{"kind": "good"}]
    [dead] = await sb.dead_letters(queue)
    assert dead.body == b'{"kind": "odd"}'
    assert dead.description is not None and "envelope failed: TypeError" in dead.description, dead
