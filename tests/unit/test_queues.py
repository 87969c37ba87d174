"""
common-messaging's deprecated ``MessageQueueTrigger(queue=URI)`` form: each of our providers matches
its own URIs only and builds the trigger a direct declaration would (same shared_stream_key).
"""

from __future__ import annotations

from typing import Any

import pytest
from airflow.exceptions import AirflowProviderDeprecationWarning
from airflow.providers.common.messaging.triggers.msg_queue import MESSAGE_QUEUE_PROVIDERS, MessageQueueTrigger

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.brokers import BROKERS, load
from airflow_shared_stream_provider.queues import (
    KafkaSharedStreamQueueProvider,
    PubSubSharedStreamQueueProvider,
    ServiceBusSharedStreamQueueProvider,
    SqsSharedStreamQueueProvider,
)
from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger
from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger
from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

SQS_URL = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"

# (queue URI, keyword arguments next to it, the equivalent direct declaration)
CASES: list[tuple[str, dict[str, Any], Any]] = [
    (
        "shared+kafka:///orders,payments",
        {},
        lambda: KafkaSharedStreamTrigger(topics=["orders", "payments"]),
    ),
    (
        "shared+kafka://kafka_prod/orders",
        {"group_id": "g1"},
        lambda: KafkaSharedStreamTrigger(topics=["orders"], kafka_config_id="kafka_prod", group_id="g1"),
    ),
    (
        "shared+sqs+" + SQS_URL,
        {"aws_conn_id": "aws_prod"},
        lambda: SqsSharedStreamTrigger(queue_url=SQS_URL, aws_conn_id="aws_prod"),
    ),
    (
        "shared+sqs+http://localhost:5000/123456789012/orders",
        {},
        lambda: SqsSharedStreamTrigger(queue_url="http://localhost:5000/123456789012/orders"),
    ),
    (
        "shared+pubsub://my-project/orders-sub",
        {"gcp_conn_id": "gcp_prod"},
        lambda: PubSubSharedStreamTrigger(subscription="orders-sub", project_id="my-project", gcp_conn_id="gcp_prod"),
    ),
    (
        "shared+servicebus:///orders",
        {},
        lambda: ServiceBusSharedStreamTrigger(queue_name="orders"),
    ),
    (
        "shared+servicebus://sb_prod/orders/Subscriptions/audit",
        {"max_message_count": 50},
        lambda: ServiceBusSharedStreamTrigger(
            topic_name="orders", subscription_name="audit", azure_service_bus_conn_id="sb_prod", max_message_count=50
        ),
    ),
]


def _from_queue(queue: str, **kwargs: Any) -> Any:
    with pytest.warns(AirflowProviderDeprecationWarning, match="`queue` parameter is deprecated"):
        generic = MessageQueueTrigger(queue=queue, **kwargs)
    return generic.trigger


@pytest.mark.parametrize(("queue", "kwargs", "direct"), CASES, ids=[case[0] for case in CASES])
def test_a_queue_uri_builds_the_trigger_a_direct_declaration_would(queue: str, kwargs: dict[str, Any], direct) -> None:
    built = _from_queue(queue, **kwargs)
    expected = direct()
    assert type(built) is type(expected)
    assert built.shared_stream_key() == expected.shared_stream_key()
    assert built.serialize() == expected.serialize()


@pytest.mark.parametrize("queue", [case[0] for case in CASES])
def test_exactly_one_registered_provider_matches_each_uri(queue: str) -> None:
    # common-messaging refuses a URI two providers match; ours must not overlap anyone's.
    matching = [type(p).__name__ for p in MESSAGE_QUEUE_PROVIDERS if p.queue_matches(queue)]
    assert len(matching) == 1, matching
    assert matching[0].endswith("SharedStreamQueueProvider")


@pytest.mark.parametrize(
    "queue",
    [
        "kafka://broker:9092/orders",
        SQS_URL,
        "sqs://orders",
        "pubsub://project/sub",
        "google+pubsub://project/sub",
        "azure+servicebus://ns/orders",
        "shared+kafkax://x/orders",
        "shared+sqs://orders",
    ],
)
def test_other_uris_match_none_of_ours(queue: str) -> None:
    providers = [load(spec.queue_provider)() for spec in BROKERS]  # every registry broker's
    assert not [type(p).__name__ for p in providers if p.queue_matches(queue)]


@pytest.mark.parametrize(
    ("provider", "queue", "message"),
    [
        (KafkaSharedStreamQueueProvider(), "shared+kafka://conn", "is not shared\\+kafka://"),
        (KafkaSharedStreamQueueProvider(), "shared+kafka:///a,,b", "empty topic name"),
        (KafkaSharedStreamQueueProvider(), "shared+kafka:///a/b", "is not shared\\+kafka://"),
        (SqsSharedStreamQueueProvider(), "shared+sqs+https://sqs.eu-west-1.amazonaws.com/orders", "queue URL"),
        (PubSubSharedStreamQueueProvider(), "shared+pubsub:///orders-sub", "<project>/<subscription>"),
        (PubSubSharedStreamQueueProvider(), "shared+pubsub://p/a/b", "<project>/<subscription>"),
        (ServiceBusSharedStreamQueueProvider(), "shared+servicebus://conn/", "is not shared\\+servicebus://"),
        (ServiceBusSharedStreamQueueProvider(), "shared+servicebus:///t/rules/s", "is not shared\\+servicebus://"),
        (ServiceBusSharedStreamQueueProvider(), "shared+servicebus:///q/", "empty path segment"),
    ],
)
def test_a_malformed_uri_of_our_scheme_names_the_expected_form(provider: Any, queue: str, message: str) -> None:
    assert provider.queue_matches(queue)
    with pytest.raises(SharedStreamConfigError, match=message):
        provider.trigger_kwargs(queue)


def test_an_argument_in_the_uri_and_as_a_keyword_is_refused() -> None:
    with pytest.raises(SharedStreamConfigError, match="sets topics, which is also given as a keyword"):
        _from_queue("shared+kafka:///orders", topics=["payments"])
    with pytest.raises(SharedStreamConfigError, match="sets kafka_config_id"):
        _from_queue("shared+kafka://a/orders", kafka_config_id="b")


def test_a_uri_without_topics_takes_them_from_the_keywords() -> None:
    # Like the upstream Kafka provider: the topics may be a keyword when the URI's path is empty.
    built = _from_queue("shared+kafka://kafka_prod", topics=["orders"])
    assert (
        built.shared_stream_key()
        == KafkaSharedStreamTrigger(topics=["orders"], kafka_config_id="kafka_prod").shared_stream_key()
    )
