"""SQS: a DLQ that names the queue itself in another spelling is refused; connection reprs carry no secret."""

from __future__ import annotations

import json

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers.aws_connection import load_aws_connection
from airflow_shared_stream_provider.producers.pubsub_connection import GcpConnection
from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger, queue_identity, same_queue

QUEUE = "https://sqs.us-east-1.amazonaws.com/123456789012/orders"

SAME_QUEUE = {
    "http instead of https": "http://sqs.us-east-1.amazonaws.com/123456789012/orders",
    "upper-case host": "https://SQS.US-EAST-1.AMAZONAWS.COM/123456789012/orders",
    "trailing slash": QUEUE + "/",
    "legacy global endpoint": "https://queue.amazonaws.com/123456789012/orders",
    "legacy regional endpoint": "https://us-east-1.queue.amazonaws.com/123456789012/orders",
    "custom endpoint (region unknown)": "http://localhost:4566/123456789012/orders",
    "VPC endpoint": "https://vpce-0a1b2c3d.sqs.us-east-1.vpce.amazonaws.com/123456789012/orders",
}
OTHER_QUEUE = {
    "another name": "https://sqs.us-east-1.amazonaws.com/123456789012/orders-dlq",
    "name differs in case (SQS names are case-sensitive)": "https://sqs.us-east-1.amazonaws.com/123456789012/Orders",
    "another account": "https://sqs.us-east-1.amazonaws.com/210987654321/orders",
    "another region": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders",
    "legacy endpoint of another region": "https://eu-west-1.queue.amazonaws.com/123456789012/orders",
}


@pytest.mark.parametrize("dlq", SAME_QUEUE.values(), ids=SAME_QUEUE.keys())
def test_a_dlq_naming_the_queue_itself_is_refused_at_parse_time(dlq: str) -> None:
    with pytest.raises(SharedStreamConfigError, match="dlq_queue_url must differ from queue_url"):
        SqsSharedStreamTrigger(queue_url=QUEUE, dlq_queue_url=dlq)
    # Either way round.
    with pytest.raises(SharedStreamConfigError, match="dlq_queue_url must differ from queue_url"):
        SqsSharedStreamTrigger(queue_url=dlq, dlq_queue_url=QUEUE, region_name=None)


@pytest.mark.parametrize("dlq", OTHER_QUEUE.values(), ids=OTHER_QUEUE.keys())
def test_a_dlq_that_is_another_queue_is_accepted(dlq: str) -> None:
    assert not same_queue(QUEUE, dlq)
    assert SqsSharedStreamTrigger(queue_url=QUEUE, dlq_queue_url=dlq).settings.dlq_queue_url == dlq


def test_queue_identity_is_account_name_and_region() -> None:
    assert queue_identity(QUEUE + "/") == ("123456789012", "orders", "us-east-1")
    assert queue_identity("https://queue.amazonaws.com/1/q.fifo") == ("1", "q.fifo", "us-east-1")
    assert queue_identity("http://127.0.0.1:5000/000000000000/q") == ("000000000000", "q", None)


# -- reprs ---------------------------------------------------------------------------------------------
AWS_SECRETS = ("AKIAEXAMPLEKEYID0000", "very-secret-access-key", "session-token-secret", "external-id-secret")


async def test_aws_connection_repr_and_str_hold_no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {
        "aws_session_token": "session-token-secret",
        "role_arn": "arn:aws:iam::1:role/r",
        "assume_role_kwargs": {"ExternalId": "external-id-secret"},
        "endpoint_url": "https://proxyuser:very-secret-access-key@sqs.internal:8443",
        "config_kwargs": {"proxies": {"https": "http://user:very-secret-access-key@proxy:3128"}},
    }
    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_REPR",
        json.dumps(
            {"conn_type": "aws", "login": "AKIAEXAMPLEKEYID0000", "password": "very-secret-access-key", "extra": extra}
        ),
    )
    connection = await load_aws_connection("aws_repr", service="sqs", region_name=None, fallback_region="eu-west-1")
    assert connection.secret_access_key == "very-secret-access-key"  # read, just never printed
    for text in (repr(connection), str(connection), repr({"conn": connection}), connection.describe()):
        for secret in AWS_SECRETS:
            assert secret not in text, (secret, text)
    assert "region=eu-west-1" in repr(connection)
    assert "sqs.internal:8443" in connection.describe()


def test_gcp_connection_repr_holds_no_credentials() -> None:
    connection = GcpConnection(credentials="private-key-material", project="p", emulator_host=None)  # type: ignore[arg-type]
    assert "private-key-material" not in repr(connection)
    assert "project='p'" in repr(connection)
