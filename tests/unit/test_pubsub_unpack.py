"""
A ``Pull`` response's messages copied out of the protobuf (``pubsub_client.unpack``), on real
``google.pubsub_v1`` protobuf objects: every byte from the server is hostile, its ``publish_time``
too. Before: a stamp outside a datetime's range raised from the pull (an OSError past the
platform's time_t) and ended the stream; the same message came back at every re-creation.
"""

from __future__ import annotations

import pytest

pubsub_v1 = pytest.importorskip("google.pubsub_v1")

from airflow_shared_stream_provider.producers.pubsub_client import Pulled, unpack  # noqa: E402


def received(seconds: int, nanos: int = 0) -> object:
    message = pubsub_v1.PubsubMessage(data=b"\xff body", attributes={"k": "v"}, message_id="m-1", ordering_key="key")
    pb = pubsub_v1.ReceivedMessage(ack_id="a-1", message=message, delivery_attempt=3)
    raw = pubsub_v1.ReceivedMessage.pb(pb)
    raw.message.publish_time.seconds = seconds
    raw.message.publish_time.nanos = nanos
    return raw


def expected(published_at: str | None) -> Pulled:
    return Pulled(
        ack_id="a-1",
        message_id="m-1",
        ordering_key="key",
        delivery_attempt=3,
        attributes={"k": "v"},
        published_at=published_at,
        data=b"\xff body",
    )


def test_a_message_is_copied_out_whole() -> None:
    assert unpack([received(1_700_000_000, 123_000_000)]) == [expected("2023-11-14T22:13:20.123000+00:00")]


@pytest.mark.parametrize("seconds", [2**62, 2**63 - 1, -(2**62), 253_402_300_800])
def test_a_publish_time_no_datetime_can_hold_gives_no_stamp_not_a_failed_pull(seconds: int) -> None:
    assert unpack([received(seconds), received(1_700_000_000)]) == [
        expected(None),
        expected("2023-11-14T22:13:20+00:00"),
    ]
