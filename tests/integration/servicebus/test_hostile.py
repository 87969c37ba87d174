"""
The hostile corpus through the Service Bus test broker (or SERVICEBUS_CONNECTION_STRING): see
tests/integration/hostile.py. Streams: those of test_fuzz.py (a queue, and one in batch mode).

Service Bus-only cases: a body at the wire broker's 4 MiB message limit (Premium's default is
1 MiB, Standard's 256 KiB), 1000 application properties, CR/LF and NUL in message ids,
correlation ids, subjects and property names and values, and forged dead-letter properties
(``DeadLetterReason`` / ``DeadLetterErrorDescription``, which the SDK reads a dead letter's reason
from, and ``x-dead-letter-*``). Property values that are not UTF-8 cannot be sent (the SDK refuses
such bytes), nor can names.

Dead letters are read back through the SDK (a peek of the ``$DeadLetterQueue``), as a reader of
the dead-letter queue sees them.
"""

from __future__ import annotations

from typing import Final

import pytest

from devkit.kits.servicebus import body_of
from tests.integration.fuzz import DeadRecord
from tests.integration.hostile import HostileCase, forged_attributes, neutral_cases, run_corpus_on
from tests.integration.servicebus.test_fuzz import REJECTED_REASON, ServiceBusFuzzTarget, fuzz_targets, make

pytestmark = [pytest.mark.integration, pytest.mark.servicebus]

__all__ = ["fuzz_targets"]  # the fixture, shared with test_fuzz.py

MESSAGE_LIMIT: Final = 4 * 1024 * 1024
"""The test broker's max_message_size (tests/servicebus_broker), announced on its links."""


class ServiceBusHostileTarget(ServiceBusFuzzTarget):
    """The fuzz target, reading dead letters through the SDK (where a forged property would show)."""

    async def dead_letters(self) -> list[DeadRecord]:
        peeked = await self.adapter.in_thread(self.adapter.kit.peek, dead_letter=True)
        return [
            DeadRecord(
                message.sequence_number,
                body_of(message),
                message.dead_letter_error_description,
                {"reason": message.dead_letter_reason},
            )
            for message in peeked
        ]


def servicebus_cases() -> list[HostileCase]:
    odd = "a\r\nb\x00c"
    return [
        *neutral_cases(make),
        HostileCase("body at the 4 MiB message limit", (make(b"x" * (MESSAGE_LIMIT - 16 * 1024)),)),
        HostileCase(
            "1000 application properties", (make(b'{"kind":"many"}', properties={f"p{i}": i for i in range(1000)}),)
        ),
        HostileCase(
            "CR/LF and NUL in ids, subject and properties",
            (
                make(
                    b'{"kind":"crlf"}',
                    properties={"crlf\r\nname": odd, "nul\x00name": "v", "bytes": odd.encode()},
                    message={"message_id": "id\r\n\x00", "correlation_id": odd, "subject": odd},
                ),
            ),
        ),
        HostileCase(
            "forged dead-letter properties",
            (
                make(
                    b'{"kind":"forged"}',
                    properties={
                        "DeadLetterReason": "forged reason",
                        "DeadLetterErrorDescription": "forged description",
                        **forged_attributes(),
                    },
                    raise_text="f",
                ),
            ),
            forged=True,
        ),
    ]


def reasons_of(record: DeadRecord) -> list[str]:
    """The reason a dead-letter reader sees: the provider's description under its ``RejectedByWatcher``."""
    reason = record.attributes["reason"]
    description = record.reason or ""
    return [description] if reason == REJECTED_REASON else [f"{reason}", description]


@pytest.mark.timeout(300)
async def test_hostile_corpus_is_delivered_or_dead_lettered(fuzz_targets: list[ServiceBusFuzzTarget]) -> None:
    targets = [ServiceBusHostileTarget.of(target) for target in fuzz_targets]
    try:
        await run_corpus_on(targets, servicebus_cases(), make, reasons_of, broker="servicebus")
    finally:
        for target in targets:
            await target.close()
