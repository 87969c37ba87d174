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
