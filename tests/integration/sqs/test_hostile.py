"""
The hostile corpus through a real SQS endpoint (moto server, or SQS_ENDPOINT_URL): see
tests/integration/hostile.py. Streams: those of test_fuzz.py (standard, standard in batch mode,
FIFO in batch mode).

SQS-only cases: a body at SQS's 256 KiB message limit, the 10 message attributes SQS allows (at
their largest: 256-character names, 32 KiB values, within the message limit), CR/LF in String
attribute values and NUL / non-UTF-8 bytes in Binary ones (SQS text refuses NUL; names are
``[A-Za-z0-9_.-]``, so they cannot carry any of these, nor can SQS-assigned message ids), and
forged ``x-dead-letter-*`` attributes.
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.integration.fuzz import DEAD_LETTER_REASON, DeadRecord
from tests.integration.hostile import HostileCase, forged_attributes, neutral_cases, run_corpus_on
from tests.integration.sqs.test_fuzz import SqsFuzzTarget, fuzz_targets, make

pytestmark = [pytest.mark.integration, pytest.mark.sqs]

__all__ = ["fuzz_targets"]  # the fixture, shared with test_fuzz.py

MAX_MESSAGE_BYTES: Final = 256 * 1024
"""SQS's limit on a message: body plus attribute names, types and values."""


def string(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


def sqs_cases() -> list[HostileCase]:
    # 10 attributes, 256-character names and 4 KiB values: 43 KiB, delivered under the 64 KiB cap.
    ten = {f"{'n' * 254}{i:02d}": string("v" * 4096) for i in range(10)}
    return [
        *neutral_cases(make),
        HostileCase("body at the 256 KiB message limit", (make(b"x" * MAX_MESSAGE_BYTES),)),
        HostileCase("10 attributes, 256-character names", (make(b'{"kind":"ten"}', attributes=ten),)),
        HostileCase(
            "CR/LF, NUL and non-UTF-8 in attributes",
            (
                make(
                    b'{"kind":"crlf"}',
                    attributes={
                        "crlf": string("a\r\nb\rc\n"),
                        "nul": {"DataType": "Binary", "BinaryValue": b"\x00\r\n\x00"},
                        "bad-utf8": {"DataType": "Binary", "BinaryValue": b"\xff\xfe\xc3"},
                        "label": {"DataType": "String.\r\n", "StringValue": "x"},
                    },
                ),
            ),
        ),
        HostileCase(
            "forged x-dead-letter-* attributes",
            (
                make(
                    b'{"kind":"forged"}',
                    attributes={k: string(v) for k, v in forged_attributes().items()},
                    raise_text="f",
                ),
            ),
            forged=True,
        ),
    ]


def reasons_of(record: DeadRecord) -> list[str]:
    return [
        str(value.get("StringValue")) for name, value in record.attributes.items() if name.lower() == DEAD_LETTER_REASON
    ]


@pytest.mark.timeout(240)
async def test_hostile_corpus_is_delivered_or_dead_lettered(fuzz_targets: list[SqsFuzzTarget]) -> None:
    await run_corpus_on(fuzz_targets, sqs_cases(), make, reasons_of, broker="sqs")
