"""
A named hostile corpus through the real brokers (issue 20): the broker-neutral cases and checks.

Each broker's ``test_hostile.py`` runs :func:`run_corpus` on the streams of its fuzz fixture (the
same targets, watchers and dead-letter readers as ``test_fuzz.py``, see tests/integration/fuzz.py)
with the default ``max_payload_bytes`` (65536), case by case. A case is a few hostile messages,
published between two good ones (JSON with ``kind: "a"``, so all three watchers fire on them).

For each stream and case (:func:`check_case`):

* no watcher fails, every watcher is still running;
* each good message reaches every watcher exactly once and is not dead-lettered;
* the broker settles: nothing unsettled, and nothing re-read (the same property holds again
  after :data:`QUIET_SECONDS`, and every envelope has ``delivery_attempt == 1``);
* each hostile message is delivered (decoded as docs/envelope.md says: the oracle of
  ``fuzz.expected_decoding``; JSON deeper than 64 levels as text with ``body_depth_exceeded``) or
  dead-lettered with a reason (only where the broker's attribute limit leaves no room may the
  reason be missing), and never both unless a watcher's filter raised on it;
* a forged ``x-dead-letter-*`` attribute never stands for the provider's: a forged case is marked
  for the raising filter, and its dead letter must carry exactly one reason, the provider's;
* every event payload is at most ``max_payload_bytes`` and serialises with ``json.dumps``, Airflow's
  serde and ``BaseSerialization`` from a caller 200 frames deep (``fuzz.serialise_deep``).

What happened to each case is printed (``pytest -s``) as ``HOSTILE <broker>/<stream> <case>: ...``
lines, the source of the table in docs/reliability.md ("Hostile input").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from tests.integration.fuzz import (
    DEAD_LETTER_PREFIX,
    DEAD_LETTER_REASON,
    JSON_DEPTH_LIMIT,
    RAISE_ATTRIBUTE,
    WATCHERS,
    DeadRecord,
    FuzzMessage,
    FuzzSession,
    FuzzStream,
    FuzzTarget,
    MakeMessage,
    canonical,
    expected_decoding,
    fuzz_session,
    json_depth,
    marked_reason,
    message_key,
    payload_size,
    retry_assertion,
)

HOSTILE_PAYLOAD_BYTES: Final = 65536
"""The watchers' ``max_payload_bytes``: the default, so that hostile messages can be delivered."""
CASE_TIMEOUT: Final = 45.0
QUIET_SECONDS: Final = 1.0
FORGED_REASON: Final = "forged by the sender"
DEPTHS: Final = (299, 300, 995, 996, 1000, 5000)
"""Around msgspec's limit (~996 levels from an empty stack) and Airflow's (~397 from 200 frames)."""


@dataclass(frozen=True)
class HostileCase:
    """One named case: its hostile messages; ``forged``: they carry forged ``x-dead-letter-*``."""

    name: str
    messages: tuple[FuzzMessage, ...]
    forged: bool = False


@dataclass
class CaseOutcome:
    """What one stream did with one case's hostile messages (for the printed report)."""

    delivered: list[str] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)


def deep_list(depth: int, *, padding: int = 0) -> bytes:
    return b"[" * depth + b'"' + b"x" * padding + b'"' + b"]" * depth


def deep_object(depth: int, *, padding: int = 0) -> bytes:
    return b'{"a":' * depth + b'"' + b"x" * padding + b'"' + b"}" * depth


def neutral_cases(make: MakeMessage) -> list[HostileCase]:
    """The cases every broker can carry as they are: bodies only (``make(body)``)."""
    deep = [deep_list(depth) for depth in DEPTHS] + [deep_object(depth) for depth in DEPTHS]
    # Over 11 KB (so the size check's json.dumps runs) and a few levels under msgspec's limit,
    # which depends on how deep the producer's receive loop is: every depth from 880 to 1000.
    deep_large = [deep_list(depth, padding=11_000) for depth in range(880, 1001)]
    deep_large += [deep_object(depth, padding=11_000) for depth in (900, 960, 990)]
    return [
        HostileCase("empty body", (make(b""),)),
        HostileCase(
            "deep JSON 299-5000 levels",
            (*(make(body) for body in deep), make(deep_list(JSON_DEPTH_LIMIT)), make(deep_list(65))),
        ),
        HostileCase("deep JSON 880-1000 levels, > 11 KB", tuple(make(body) for body in deep_large)),
        HostileCase(
            "invalid UTF-8 inside JSON strings",
            tuple(make(body) for body in (b'["\xff"]', b'{"k":"\xc3"}', b'{"\xed\xa0\x80":1}', b'"a\x80b"')),
        ),
        HostileCase("NUL and control bytes in the body", (make(b"a\x00b\r\n\x1b"), make(b'{"k":"\\u0000"}'))),
    ]


def good_message(make: MakeMessage, case: str, where: str) -> FuzzMessage:
    return make(json.dumps({"kind": "a", "guard": f"{case}/{where}"}).encode())


# -- the checks ----------------------------------------------------------------------------------------
def _matches(record: DeadRecord, message: FuzzMessage) -> bool:
    return record.body == message.body


async def check_case(
    session: FuzzSession,
    stream: FuzzStream,
    case: HostileCase,
    good: Sequence[FuzzMessage],
    since: Any,
    reasons_of: Callable[[DeadRecord], list[str]],
    outcome: CaseOutcome,
) -> None:
    """The property of one case on one stream (retried by :func:`run_case` until it holds)."""
    session.assert_healthy()
    target = stream.target
    where = f"{target.name} [{case.name}]"
    unsettled = await target.unsettled()
    assert unsettled == 0, f"{where}: {unsettled} message(s) stuck"
    dead = [record for record in await target.dead_letters() if record.ident not in since.dead]
    fired: dict[str, list[dict[str, Any]]] = {}
    for watcher in WATCHERS:
        payloads = stream.payloads(session.runner, watcher, since)  # serialised 200 frames deep there
        for envelopes in payloads:
            payload = envelopes[0] if target.batch_size == 1 else {"messages": envelopes}
            size = payload_size(payload)
            assert size <= stream.max_payload_bytes, f"{where}: a payload of {size} bytes"
        fired[watcher] = [envelope for envelopes in payloads for envelope in envelopes]
    for envelope in fired["all"]:
        stream.check_envelope(envelope)  # delivery_attempt == 1: nothing was re-read
    keys = {
        watcher: [canonical(e["body_encoding"], e["body"]) for e in envelopes] for watcher, envelopes in fired.items()
    }
    remaining = list(dead)
    for message in good:
        key = message_key(message)
        for watcher in WATCHERS:
            count = keys[watcher].count(key)
            assert count == 1, f"{where}: good message {message.body!r} reached {watcher} {count} times"
        assert not any(_matches(r, message) for r in dead), f"{where}: good message {message.body!r} dead-lettered"
    outcome.delivered.clear()
    outcome.dead.clear()
    unmatched: list[FuzzMessage] = []
    for message in case.messages:
        key = message_key(message)
        delivered = [e for e in fired["all"] if canonical(e["body_encoding"], e["body"]) == key]
        records = [r for r in remaining if _matches(r, message)]
        for record in records:
            remaining.remove(record)
        label = f"{where}: {message!r}"
        assert len(delivered) <= 1 and len(records) <= 1, f"{label}: delivered {len(delivered)}, dead {len(records)}"
        for envelope in delivered:
            check_delivered(envelope, message, target.expected_attributes(message), label)
            outcome.delivered.append(describe_delivered(envelope))
        if records:
            check_dead(records[0], message, case, target, reasons_of, label)
            outcome.dead.append(f"dead-lettered: {records[0].reason}")
        elif not delivered:
            unmatched.append(message)
        elif message.raise_text is not None:
            raise AssertionError(f"{label}: the filter raised on it, not dead-lettered")
    # A dead letter whose value the producer had to leave out (a Kafka record at the size limit,
    # x-dead-letter-omitted) cannot be matched by its bytes: it accounts for one unmatched message.
    good_bodies = {message.body for message in good}
    others = [r for r in remaining if r.body not in good_bodies]
    assert len(others) == len(unmatched), (
        f"{where}: neither delivered nor dead-lettered: {unmatched!r}; unexplained dead letters: {others!r}"
    )
    for message, record in zip(unmatched, others, strict=True):
        assert record.reason or target.reason_may_be_missing(message), f"{where}: dead-lettered without a reason"
        outcome.dead.append(f"dead-lettered without its body: {record.reason}")


def check_delivered(envelope: dict[str, Any], message: FuzzMessage, attributes: Any, label: str) -> None:
    encoding, _ = expected_decoding(message.body)
    assert envelope["body_encoding"] == encoding, f"{label}: body_encoding {envelope['body_encoding']!r}"
    if encoding == "text" and message.body is not None and _deeper_than_limit(message.body):
        assert envelope.get("body_depth_exceeded") is True, f"{label}: deep JSON delivered without the flag"
    if encoding == "json":
        assert json_depth(envelope["body"]) <= JSON_DEPTH_LIMIT
    if attributes is not None:
        assert envelope["attributes"] == attributes, f"{label}: attributes {envelope['attributes']!r}"


def _deeper_than_limit(raw: bytes) -> bool:
    """Whether ``raw`` is JSON nested deeper than the cap (stdlib parse, iterative count on failure)."""
    try:
        return json_depth(json.loads(raw)) > JSON_DEPTH_LIMIT
    except RecursionError:
        return True
    except ValueError:
        return False


def check_dead(
    record: DeadRecord,
    message: FuzzMessage,
    case: HostileCase,
    target: Any,
    reasons_of: Callable[[DeadRecord], list[str]],
    label: str,
) -> None:
    if record.reason is None:
        assert target.reason_may_be_missing(message), f"{label}: dead-lettered without a reason"
    if case.forged:
        assert message.raise_text is not None
        reasons = reasons_of(record)
        assert reasons == [marked_reason(message)], (
            f"{label}: a forged x-dead-letter-reason stands beside or for the provider's: {reasons!r}"
        )
    else:
        target.check_dead_record(message, record)


def describe_delivered(envelope: dict[str, Any]) -> str:
    flags = [name for name in ("body_depth_exceeded", "body_truncated", "attributes_truncated") if envelope.get(name)]
    return f"delivered ({envelope['body_encoding']}{', ' + ', '.join(flags) if flags else ''})"


# -- the run -----------------------------------------------------------------------------------------------
async def run_case(
    session: FuzzSession,
    case: HostileCase,
    make: MakeMessage,
    reasons_of: Callable[[DeadRecord], list[str]],
    *,
    broker: str,
) -> None:
    """Publish one case between two good messages on every stream; check it there, twice."""
    session.assert_healthy()
    good = [good_message(make, case.name, "before"), good_message(make, case.name, "after")]
    marks = [await stream.mark(session.runner) for stream in session.streams]
    started = time.monotonic()
    for stream in session.streams:
        await stream.target.publish([good[0], *case.messages, good[1]])
    outcomes = [CaseOutcome() for _ in session.streams]

    async def settled(stream: FuzzStream, mark: Any, outcome: CaseOutcome) -> None:
        def check() -> Any:
            return check_case(session, stream, case, good, mark, reasons_of, outcome)

        await retry_assertion(check, timeout=CASE_TIMEOUT)
        # Nothing re-read: the same property (each message once) still holds a moment later.
        await asyncio.sleep(QUIET_SECONDS)
        await check()

    await asyncio.gather(
        *(settled(s, m, o) for s, m, o in zip(session.streams, marks, outcomes, strict=True)),
    )
    elapsed = time.monotonic() - started
    for stream, outcome in zip(session.streams, outcomes, strict=True):
        summary = "; ".join(sorted(set(outcome.delivered)) + sorted(set(outcome.dead)))
        print(f"HOSTILE {broker}/{stream.target.name} {case.name}: {summary} ({elapsed:.1f} s)")


async def run_corpus_on(
    targets: Sequence[FuzzTarget],
    cases: Sequence[HostileCase],
    make: MakeMessage,
    reasons_of: Callable[[DeadRecord], list[str]],
    *,
    broker: str,
) -> None:
    """A broker's whole hostile test: :func:`run_corpus` in a ``fuzz.fuzz_session`` on ``targets``, the default cap."""
    async with fuzz_session(targets, max_payload_bytes=HOSTILE_PAYLOAD_BYTES) as session:
        await run_corpus(session, cases, make, reasons_of, broker=broker)


async def run_corpus(
    session: FuzzSession,
    cases: Sequence[HostileCase],
    make: MakeMessage,
    reasons_of: Callable[[DeadRecord], list[str]],
    *,
    broker: str,
) -> None:
    for case in cases:
        await run_case(session, case, make, reasons_of, broker=broker)


def forged_attributes(reason_name: str = DEAD_LETTER_REASON) -> dict[str, str]:
    """What a sender could forge: the provider's dead-letter attributes, in two spellings."""
    return {
        reason_name: FORGED_REASON,
        DEAD_LETTER_PREFIX + "source": "forged-source",
        "X-Dead-Letter-Attempts": "99",
    }


__all__ = [
    "RAISE_ATTRIBUTE",
    "HostileCase",
    "MakeMessage",
    "forged_attributes",
    "neutral_cases",
    "run_corpus",
]
