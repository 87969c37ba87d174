"""SqsSharedStreamTrigger: the message-queue scheme, queue URLs, FIFO (its parse-time errors: see
test_config_errors_every_broker.py)."""

from __future__ import annotations

from typing import Any

import pytest

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
