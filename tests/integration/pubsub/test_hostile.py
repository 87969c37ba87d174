"""
The hostile corpus through Google's Pub/Sub emulator (or PUBSUB_EMULATOR_HOST): see
tests/integration/hostile.py. Streams: those of test_fuzz.py (a plain subscription, and an
ordered one in batch mode).

Pub/Sub-only cases: a message at the 10 MB data limit, the 100 attributes Pub/Sub allows (256-byte
keys, 1024-byte values), CR/LF and NUL in attribute keys, values and ordering keys, and forged
``x-dead-letter-*`` attributes. Attributes and ordering keys are proto strings: they cannot carry
non-UTF-8 bytes (the client refuses them); message ids are the server's.
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.integration.fuzz import DEAD_LETTER_REASON, DeadRecord
from tests.integration.hostile import HostileCase, forged_attributes, neutral_cases, run_corpus_on
from tests.integration.pubsub.test_fuzz import MAX_ATTRIBUTES, PubSubFuzzTarget, fuzz_targets, make

pytestmark = [pytest.mark.integration, pytest.mark.pubsub]

__all__ = ["fuzz_targets"]  # the fixture, shared with test_fuzz.py

DATA_LIMIT: Final = 10 * 1000 * 1000
"""Pub/Sub's limit on a message's data (10 MB; the publish request is limited to 10 MB too)."""


def pubsub_cases() -> list[HostileCase]:
    hundred = {f"{'k' * 250}{i:03d}": "v" * 300 for i in range(MAX_ATTRIBUTES)}  # 55 KiB: under the cap
    return [
        *neutral_cases(make),
        # Under the request limit with its attributes and framing.
        HostileCase("data at the 10 MB limit", (make(b"x" * (DATA_LIMIT - 64 * 1024)),)),
        HostileCase("100 attributes, 256-byte keys", (make(b'{"kind":"hundred"}', attributes=hundred),)),
        HostileCase(
            "100 attributes, 1024-byte values (over the cap)",
            (make(b"{}", attributes={f"a{i}": "v" * 1024 for i in range(100)}),),
        ),
        HostileCase(
            "CR/LF and NUL in attributes and ordering keys",
            (
                make(
                    b'{"kind":"crlf"}',
                    attributes={"crlf\r\nkey": "a\r\nb", "nul\x00key": "a\x00b", "empty": ""},
                    ordering_key="o\r\n\x00k",
                ),
            ),
        ),
        HostileCase(
            "forged x-dead-letter-* attributes",
            (make(b'{"kind":"forged"}', attributes=forged_attributes(), raise_text="f"),),
            forged=True,
        ),
    ]


def reasons_of(record: DeadRecord) -> list[str]:
    return [value for name, value in record.attributes.items() if name.lower() == DEAD_LETTER_REASON]


@pytest.mark.timeout(300)
async def test_hostile_corpus_is_delivered_or_dead_lettered(fuzz_targets: list[PubSubFuzzTarget]) -> None:
    await run_corpus_on(fuzz_targets, pubsub_cases(), make, reasons_of, broker="pubsub")
