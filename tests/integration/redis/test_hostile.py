"""
The hostile corpus through a real redis-server (or REDIS_URL): see tests/integration/hostile.py.
Streams: those of test_fuzz.py (one envelope per event, and batch mode).

Every field of a Redis entry is the sender's, and Redis limits almost nothing: Redis-only cases
are a 16 MiB value (Redis takes up to 512 MB), 2,000 small fields (delivered) and 20,000 (over the
payload cap: dead-lettered with all of them), binary field names and values (NUL, CR/LF, invalid
UTF-8, an empty name), a field name given twice, an entry without the body field, forged
``x-dead-letter-*`` fields, and an entry id whose millisecond part is no date (last: every later
id of the stream is above it).
"""

from __future__ import annotations

from typing import Final

import pytest

from tests.integration.fuzz import DEAD_LETTER_REASON, DeadRecord
from tests.integration.hostile import HostileCase, forged_attributes, neutral_cases, run_corpus_on
from tests.integration.redis.test_fuzz import RedisFuzzTarget, fuzz_targets, make

pytestmark = [pytest.mark.integration, pytest.mark.redis]

__all__ = ["fuzz_targets"]  # the fixture, shared with test_fuzz.py

LARGE_VALUE: Final = 16 * 1024 * 1024
# Just past 9999-12-31T23:59:59.999: a valid id (Redis takes any 64-bit millisecond part), no date.
NO_DATE_ID: Final = "253402300800000-0"


def redis_cases() -> list[HostileCase]:
    return [
        *neutral_cases(make),
        HostileCase("a 16 MiB value", (make(b"x" * LARGE_VALUE),)),
        HostileCase(
            "2,000 small fields",
            (make(b'{"kind":"many"}', fields=[(b"f%d" % i, b"v") for i in range(2000)]),),
        ),
        HostileCase(
            "20,000 fields (over the cap)",
            (make(b'{"kind":"too-many"}', fields=[(b"f%d" % i, b"v" * 4) for i in range(20_000)]),),
        ),
        HostileCase(
            "binary field names and values",
            (
                make(
                    b'{"kind":"binary"}',
                    fields=[
                        (b"a\x00b", b"\x00\r\n\x00"),
                        (b"crlf\r\nname", b"a\r\nb"),
                        (b"\xff\xfe", b"\xff\xfe\xc3"),
                        (b"", b"empty name"),
                        (b"\x1b[31mred", b"\x1b[0m"),
                    ],
                ),
            ),
        ),
        HostileCase(
            "a field name given twice, body too",
            (make(b'{"kind":"twice"}', fields=[(b"a", b"1"), (b"a", b"2"), (b"body", b"second body")]),),
        ),
        HostileCase("no body field", (make(None, fields=[(b"event", b"created"), (b"id", b"7")]),)),
        HostileCase(
            "forged x-dead-letter-* fields",
            (
                make(
                    b'{"kind":"forged"}',
                    fields=[(k.encode(), v.encode()) for k, v in forged_attributes().items()],
                    raise_text="f",
                ),
            ),
            forged=True,
        ),
        HostileCase("an entry id that is no date", (make(b'{"kind":"late"}', entry_id=NO_DATE_ID),)),
    ]


def reasons_of(record: DeadRecord) -> list[str]:
    fields = record.attributes["fields"]
    return [
        value.decode()
        for name, value in zip(fields[::2], fields[1::2], strict=True)
        if name.lower() == DEAD_LETTER_REASON.encode()
    ]


@pytest.mark.timeout(240)
async def test_hostile_corpus_is_delivered_or_dead_lettered(fuzz_targets: list[RedisFuzzTarget]) -> None:
    await run_corpus_on(fuzz_targets, redis_cases(), make, reasons_of, broker="redis")
