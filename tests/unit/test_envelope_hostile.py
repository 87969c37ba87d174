"""
Hostile input at the envelope stage (issue 20): nesting around the decoders' recursion limits,
values ``json.dumps`` refuses, and the producer's envelope stage guard on the real manager.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_shared_stream_provider._core.envelope import (
    ENVELOPE_FAILED,
    MAX_BODY_DEPTH,
    body_bytes_of,
    build_envelope,
)
from devkit.memory import MemoryBroker, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until
from tests.integration.fuzz import JSON_DEPTH_LIMIT, json_depth, serialise_deep

_names = itertools.count()


def envelope_of(body: bytes | str | None, **overrides: Any) -> tuple[dict[str, Any], str | None]:
    fields: dict[str, Any] = {
        "broker": "sqs",
        "source": "q",
        "message_id": "m-1",
        "body": body,
        "attributes": {},
        "published_at": None,
        "delivery_attempt": 1,
        "metadata": {},
        "max_payload_bytes": 1 << 20,
        "oversize_policy": "dead_letter",
    }
    fields.update(overrides)
    return build_envelope(**fields)


def nested(depth: int, kind: str, *, padding: int = 0) -> bytes:
    """JSON nested ``depth`` containers deep, its innermost value a string of ``padding`` bytes."""
    leaf = b'"' + b"x" * padding + b'"'
    if kind == "list":
        return b"[" * depth + leaf + b"]" * depth
    return b'{"a":' * depth + leaf + b"}" * depth


def test_the_documented_depth_limit_is_the_one_enforced() -> None:
    assert MAX_BODY_DEPTH == JSON_DEPTH_LIMIT == 64


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("depth", [1, 63, 64])
def test_json_up_to_the_depth_limit_is_delivered_as_json(depth: int, kind: str) -> None:
    raw = nested(depth, kind)
    envelope, forced = envelope_of(raw)
    assert forced is None
    assert envelope["body_encoding"] == "json" and json_depth(envelope["body"]) == depth
    assert "body_depth_exceeded" not in envelope
    serialise_deep(envelope)


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("depth", [65, 299, 300, 995, 996, 1000, 5000])
@pytest.mark.parametrize("padding", [0, 12_000])
def test_json_deeper_than_the_limit_is_delivered_as_flagged_text(depth: int, kind: str, padding: int) -> None:
    raw = nested(depth, kind, padding=padding)
    envelope, forced = envelope_of(raw)
    assert forced is None
    assert (envelope["body_encoding"], envelope["body"]) == ("text", raw.decode())
    assert envelope["body_depth_exceeded"] is True
    assert body_bytes_of(envelope) == raw  # nothing lost
    serialise_deep(envelope)


def _at_depth(frames: int, call: Any) -> Any:
    return _at_depth(frames - 1, call) if frames else call()


@pytest.mark.parametrize("frames", [0, 100, 200])
def test_bodies_just_under_the_decoders_limit_do_not_break_the_size_check(frames: int) -> None:
    # The bug: msgspec decodes a body a few levels under its limit; over ~11 KB the envelope
    # takes the exact size check, whose json.dumps needs the body's levels and one more, and
    # raised RecursionError into the receive loop. Every depth around the limit, from a stack
    # already ``frames`` deep.
    outcomes: list[tuple[int, str, bool]] = []

    def sweep() -> None:
        for depth in range(1000 - frames - 40, 1001 - frames):
            envelope, forced = envelope_of(nested(depth, "list", padding=12_000), max_payload_bytes=65536)
            outcomes.append((depth, envelope["body_encoding"], envelope.get("body_depth_exceeded", False)))
            assert forced is None

    _at_depth(frames, sweep)
    assert all(encoding == "text" and flagged for _, encoding, flagged in outcomes), outcomes


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(min_value=0, max_value=1200),
    kind=st.sampled_from(["list", "object", "mixed"]),
    padding=st.sampled_from([0, 100, 12_000]),
    tail=st.sampled_from([b"", b"x", b"\xff", b"]", b"}"]),
    cap=st.sampled_from([2048, 65536]),
)
def test_any_nesting_never_raises_and_always_serialises_deep(
    depth: int, kind: str, padding: int, tail: bytes, cap: int
) -> None:
    if kind == "mixed":
        raw = b'[{"k":' * depth + b"0" + b"}]" * depth + tail
    else:
        raw = nested(depth, kind, padding=padding) + tail
    for policy in ("dead_letter", "truncate"):
        envelope, _ = envelope_of(raw, max_payload_bytes=cap, oversize_policy=policy)
        serialise_deep(envelope)
        if envelope["body_encoding"] == "json":
            assert json_depth(envelope["body"]) <= MAX_BODY_DEPTH


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("cannot be rendered")


def _circular() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    return loop


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (_circular(), "ValueError: Circular reference detected"),
        (_Unprintable(), "RuntimeError: cannot be rendered"),
        ({(1, 2): "tuple key"}, "TypeError: keys must be str"),
    ],
)
def test_metadata_json_refuses_dead_letters_the_message_instead_of_raising(value: Any, error: str) -> None:
    # A producer's metadata that json.dumps cannot write (reached when the body is large enough
    # for the exact size check): the envelope builder raised it into the receive loop.
    raw = b"x" * 20_000
    envelope, forced = envelope_of(raw, metadata={"odd": value}, max_payload_bytes=65536)
    assert forced is not None and forced.startswith(f"{ENVELOPE_FAILED}: {error}")
    assert envelope["envelope_error"] is True and envelope["metadata"] == {}
    assert body_bytes_of(envelope) == raw  # base64 of the original: it fits
    json.dumps(envelope)


def test_the_fallback_envelope_drops_a_body_over_the_cap() -> None:
    envelope, forced = envelope_of(b"x" * 20_000, metadata={"odd": _circular()}, max_payload_bytes=4096)
    assert forced is not None and forced.startswith(ENVELOPE_FAILED)
    assert (envelope["body"], envelope["body_encoding"], envelope["body_bytes"]) == (None, "none", 20_000)
    assert len(json.dumps(envelope)) <= 4096


# -- the envelope stage guard, on the real manager --------------------------------------------------------
@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    name = f"hostile-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


async def _settle(runner: RunnerSim, broker: MemoryBroker, count: int) -> None:
    def step() -> bool:
        runner.persist()
        return len(broker.committed) + len(broker.dead_letters) >= count or bool(runner.failures)

    await wait_until(step, timeout=20, what=f"{count} messages settled")


async def test_a_message_whose_envelope_fails_is_dead_lettered_and_the_stream_goes_on(broker: MemoryBroker) -> None:
    # A producer bug the type checker cannot see at run time (an attribute value that is not a
    # str) makes build_envelope raise in the receive loop. Without the guard the stream ended:
    # every watcher failed and the message came back to fail again on every restart.
    before = broker.publish(b'{"n": 1}')
    poison = broker.publish(b'{"n": 2}', attributes={"count": 7})  # type: ignore[dict-item]
    after = broker.publish(b'{"n": 3}')
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, MemorySharedStreamTrigger(broker_name=broker.name))
        runner.add(2, MemorySharedStreamTrigger(broker_name=broker.name, match={"body.n": [1, 2, 3]}))
        await _settle(runner, broker, 3)
        assert not runner.failures, f"a watcher failed: {runner.failures!r}"
        assert runner.alive(1) and runner.alive(2)
    assert sorted(broker.committed) == sorted([before, after])
    [(dead_id, reason)] = broker.dead_letters
    assert dead_id == poison
    assert reason is not None and f"{ENVELOPE_FAILED}: TypeError: " in reason
    for watcher in (1, 2):
        assert [p["body"] for p in runner.persisted[watcher]] == [{"n": 1}, {"n": 3}]


async def test_deep_bodies_around_the_decoders_limit_flow_through_the_real_manager(broker: MemoryBroker) -> None:
    # Every depth from 900 to 1000 levels (> 11 KB each), among plain messages: before the depth
    # cap the depths a few levels under msgspec's limit at the producer's stack raised
    # RecursionError out of the size check and ended the stream.
    deep = [broker.publish(nested(depth, "list", padding=12_000)) for depth in range(900, 1001)]
    plain = broker.publish(b'{"n": 1}')
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, MemorySharedStreamTrigger(broker_name=broker.name))
        await _settle(runner, broker, len(deep) + 1)
        assert not runner.failures, f"a watcher failed: {runner.failures!r}"
    assert sorted(broker.committed) == sorted([*deep, plain]) and not broker.dead_letters
    for payload in runner.persisted[1]:
        serialise_deep(payload)
        if payload["body"] != {"n": 1}:
            assert payload["body_encoding"] == "text" and payload["body_depth_exceeded"] is True
