"""SqsSharedStreamTrigger: identity (key, serialize), parse-time validation, import hygiene."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.triggers.sqs import (
    SqsSharedStreamTrigger,
    is_fifo_url,
    region_from_queue_url,
)

QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"
BASE: dict[str, Any] = {"queue_url": QUEUE, "aws_conn_id": "aws_prod"}


def test_the_message_queue_trigger_scheme_builds_the_sqs_trigger() -> None:
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger

    generic = MessageQueueTrigger(scheme="shared+sqs", queue_url=QUEUE, aws_conn_id="aws_prod", match={"body.a": 1})
    classpath, kwargs = generic.serialize()
    assert classpath == "airflow_shared_stream_provider.triggers.sqs.SqsSharedStreamTrigger"
    rebuilt = SqsSharedStreamTrigger(**kwargs)
    assert rebuilt.shared_stream_key() == SqsSharedStreamTrigger(**BASE).shared_stream_key()
    assert rebuilt.match == {"body.a": 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queue_url": "orders"}, "queue_url must be a full SQS queue URL"),
        ({"queue_url": ""}, "queue_url must be a non-empty string"),
        ({"queue_url": "https://sqs.eu-west-1.amazonaws.com/1/a b"}, "queue_url must be a full SQS queue URL"),
        ({"dlq_queue_url": QUEUE}, "dlq_queue_url must differ from queue_url"),
        ({"dlq_queue_url": "dlq"}, "dlq_queue_url must be a full SQS queue URL"),
        ({"region_name": "us-east-1"}, "is in region 'eu-west-1' but region_name is 'us-east-1'"),
        ({"aws_conn_id": ""}, "aws_conn_id must be a non-empty string"),
        ({"wait_time_seconds": 21}, "wait_time_seconds must be <= 20"),
        ({"wait_time_seconds": 1.5}, "wait_time_seconds must be an int"),
        ({"visibility_timeout": 0}, "visibility_timeout must be a number >= 1"),
        ({"visibility_timeout": 43_201}, "visibility_timeout must be <= 43200"),
        ({"concurrent_receives": 0}, "concurrent_receives must be a number >= 1"),
        ({"concurrent_receives": 11}, "concurrent_receives must be <= 10"),
        ({"hold_backoff": True}, "hold_backoff must be an int"),
        ({"reject_backoff": -1}, "reject_backoff must be a number >= 0"),
        ({"max_delivery_attempts": 0}, "max_delivery_attempts"),
        ({"max_payload_bytes": 10}, "max_payload_bytes"),
        ({"oversize_policy": "drop"}, "oversize_policy"),
        ({"on_filter_error": "explode"}, "on_filter_error"),
        ({"match": {"": 1}}, "match key"),
        ({"filter_function": "not a path"}, "filter_function"),
    ],
)
def test_bad_arguments_fail_at_parse_time_naming_the_setting(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SharedStreamConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SqsSharedStreamTrigger(**{**BASE, **kwargs})


def test_unknown_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        SqsSharedStreamTrigger(**BASE, sqs_queue=QUEUE)  # type: ignore[call-arg]


def test_aws_conn_id_none_means_the_default_credential_chain() -> None:
    trigger = SqsSharedStreamTrigger(queue_url=QUEUE, aws_conn_id=None)
    assert trigger.serialize()[1]["aws_conn_id"] is None


@pytest.mark.parametrize(
    ("url", "region"),
    [
        ("https://sqs.eu-west-1.amazonaws.com/123456789012/q", "eu-west-1"),
        ("https://sqs.us-gov-west-1.amazonaws.com/123456789012/q", "us-gov-west-1"),
        ("https://eu-central-1.queue.amazonaws.com/123456789012/q.fifo", "eu-central-1"),
        ("https://sqs.cn-north-1.amazonaws.com.cn/123456789012/q", "cn-north-1"),
        ("http://localhost:4566/000000000000/q", None),
        ("http://127.0.0.1:5000/123456789012/q", None),
    ],
)
def test_region_is_read_from_regional_queue_urls(url: str, region: str | None) -> None:
    assert region_from_queue_url(url) == region


def test_fifo_is_told_by_the_queue_name() -> None:
    assert is_fifo_url("https://sqs.eu-west-1.amazonaws.com/1/q.fifo")
    assert not is_fifo_url(QUEUE)
    assert SqsSharedStreamTrigger(queue_url=QUEUE + ".fifo").settings.fifo
