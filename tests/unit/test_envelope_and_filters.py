"""The envelope (decoding, size cap) and the declarative filters."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider._core.envelope import (
    body_bytes_of,
    build_envelope,
    decode_body,
    iso_from_epoch_ms,
    iso_timestamp,
    text_attributes,
)
from airflow_shared_stream_provider._core.filtering import MessageFilter
from airflow_shared_stream_provider.brokers import BrokerName


@pytest.mark.parametrize(
    ("raw", "body", "encoding"),
    [
        (b'{"a": 1}', {"a": 1}, "json"),
        (b"[1, 2]", [1, 2], "json"),
        (b"42", 42, "json"),
        (b"true", True, "json"),
        (b'{"a": ', '{"a": ', "text"),
        (b"hello", "hello", "text"),
        ("d\u00e9j\u00e0".encode(), "d\u00e9j\u00e0", "text"),
        (b"\xff\xfe\x00", "//4A", "base64"),
        (b"", "", "text"),
        (None, None, "json"),
    ],
)
def test_bodies_decode_to_json_then_text_then_base64(raw: bytes | None, body: Any, encoding: str) -> None:
    assert decode_body(raw) == (body, encoding)


@given(st.binary(max_size=512))
def test_any_bytes_give_a_json_safe_body_that_round_trips(raw: bytes) -> None:
    body, encoding = decode_body(raw)
    json.dumps(body)
    envelope = {"body": body, "body_encoding": encoding}
    if encoding == "json":
        assert json.loads(body_bytes_of(envelope)) == body
    else:
        assert body_bytes_of(envelope) == raw


@pytest.mark.parametrize("raw", [b"NaN", b"[Infinity]", b'"\\ud800"', b"1e400", b'{"a": 1} trailing'])
def test_what_strict_json_refuses_is_delivered_as_text(raw: bytes) -> None:
    # json.loads would take these, but NaN, infinities and lone surrogates cannot be stored in the
    # metadata DB's JSON column: the body is the text instead.
    body, encoding = decode_body(raw)
    assert (body, encoding) == (raw.decode(), "text")
    json.dumps(body, allow_nan=False).encode("utf-8")


@given(st.integers(min_value=-(10**13), max_value=10**14))
def test_epoch_milliseconds_render_like_datetime_isoformat(milliseconds: int) -> None:
    # Exact oracle (datetime.fromtimestamp(ms / 1000) rounds through a float far from 1970).
    expected = (datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(milliseconds=milliseconds)).isoformat()
    assert iso_from_epoch_ms(milliseconds) == expected
    assert iso_timestamp(milliseconds, unit="ms") == expected


@given(st.integers(min_value=0, max_value=10**13), st.lists(st.integers(min_value=-2500, max_value=2500), max_size=30))
def test_epoch_millisecond_caches_never_mix_neighbouring_stamps(base: int, steps: list[int]) -> None:
    # Runs of equal, same-second and neighbouring-second stamps, as one fetch of records carries:
    # both caches (last millisecond, last second) must hand back exactly the oracle's text.
    for step in steps:
        milliseconds = base + step
        expected = (datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(milliseconds=milliseconds)).isoformat()
        assert iso_from_epoch_ms(milliseconds) == expected


@pytest.mark.parametrize(
    ("value", "unit"),
    [
        (2**62, "ms"),  # a Kafka CreateTime is any int64: year 146 million
        (2**63 - 1, "ms"),
        (-(2**62), "ms"),
        (253_402_300_800_000, "ms"),  # the first millisecond of the year 10000
        (2**62, "s"),  # a Pub/Sub publish_time's seconds (OSError on this platform's time_t)
        (1e300, "s"),
        (float("nan"), "s"),
        (float("inf"), "ms"),
    ],
)
def test_a_stamp_no_datetime_can_hold_is_none_not_an_error(value: float, unit: Literal["s", "ms"]) -> None:
    assert iso_timestamp(value, unit=unit) is None
    if isinstance(value, int) and unit == "ms":
        assert iso_from_epoch_ms(value) is None
        assert iso_from_epoch_ms(1_700_000_000_000) == "2023-11-14T22:13:20+00:00"  # the caches still work after it


def test_the_last_millisecond_a_datetime_holds_still_renders() -> None:
    assert iso_from_epoch_ms(253_402_300_799_999) == "9999-12-31T23:59:59.999000+00:00"


def test_headers_become_text_with_base64_for_binary_values() -> None:
    assert text_attributes([("type", b"order"), (b"bin", b"\xff")]) == {"type": "order", "bin": "base64:/w=="}


def _envelope(body: bytes, limit: int, policy: Any) -> tuple[dict[str, Any], str | None]:
    return build_envelope(
        broker=BrokerName("kafka"),
        source="t",
        message_id="t/0/1",
        body=body,
        attributes={"k": "v"},
        published_at=None,
        delivery_attempt=1,
        metadata={},
        max_payload_bytes=limit,
        oversize_policy=policy,
    )


def test_the_size_cap_counts_the_serialized_envelope() -> None:
    small, forced = _envelope(b'{"x": "' + b"a" * 100 + b'"}', 1024, "dead_letter")
    assert forced is None and small["body"] == {"x": "a" * 100}
    # Control characters grow 6x when JSON-escaped: 300 raw bytes exceed a 1024-byte cap.
    _, forced = _envelope(b"\x01" * 300, 1024, "dead_letter")
    assert forced is not None and "payload too large" in forced
    truncated, forced = _envelope(b"y" * 5000, 1024, "truncate")
    assert forced is None
    assert truncated["body"] is None and truncated["body_truncated"] and truncated["body_bytes"] == 5000
    assert len(json.dumps(truncated)) <= 1024


ENVELOPE = {
    "body": {"region": "eu", "amount": 3, "flag": True, "items": [{"sku": "a"}]},
    "attributes": {"type": "order"},
}


@pytest.mark.parametrize(
    ("match", "expected"),
    [
        ({"body.region": "eu"}, True),
        ({"body.region": "us"}, False),
        ({"body.region": ["us", "eu"]}, True),
        ({"body.region": "eu", "attributes.type": "order"}, True),
        ({"body.region": "eu", "attributes.type": "refund"}, False),
        ({"body.amount": 3.0}, True),
        ({"body.amount": True}, False),
        ({"body.flag": 1}, False),
        ({"body.flag": True}, True),
        ({"body.items.0.sku": "a"}, True),
        ({"body.items.5.sku": "a"}, False),
        ({"body.missing": None}, False),
        ({"body.region.deeper": "eu"}, False),
    ],
)
def test_match_semantics(match: dict[str, Any], expected: bool) -> None:
    assert MessageFilter(match, None).decide(ENVELOPE) is expected


def test_filter_function_errors_name_what_is_missing() -> None:
    with pytest.raises(SharedStreamConfigError, match="cannot import module 'no_such_pkg'"):
        MessageFilter(None, "no_such_pkg.f").decide(ENVELOPE)
    with pytest.raises(SharedStreamConfigError, match="has no callable 'nope'"):
        MessageFilter(None, "json.nope").decide(ENVELOPE)
