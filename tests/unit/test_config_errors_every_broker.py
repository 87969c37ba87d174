"""
Parse-time configuration errors of every broker's trigger, over the broker registry: a bad
argument raises one ``SharedStreamConfigError`` that names the setting, before any Dag runs; and
the stream key covers every settings field the broker's producer modules read (else the first
subscriber's settings would win silently). A broker added to the registry without a table here
fails :func:`test_every_registry_broker_has_a_table`.

Each table lists what is refused for that broker: its own settings, and the common ones written
once in ``StreamSettings`` (checked through every broker, since each broker's trigger passes them on).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.brokers import BROKERS, broker_spec, load

SQS_QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"

# The arguments every row of a broker starts from (a row's own arguments replace them).
BASES: dict[str, dict[str, Any]] = {
    "kafka": {},
    "sqs": {"queue_url": SQS_QUEUE, "aws_conn_id": "aws_prod"},
    "pubsub": {"subscription": "projects/proj-a/subscriptions/orders-sub"},
    "servicebus": {},
    "redis": {"stream": "orders", "redis_conn_id": "redis_prod"},
}

# (arguments, what the error says): the message is matched literally, anywhere in the error.
CONFIG_ERRORS: dict[str, list[tuple[dict[str, Any], str]]] = {
    "kafka": [
        ({"topics": "orders"}, "list of topic names"),
        ({"topics": []}, "non-empty list"),
        ({"topics": ["a"], "dlq_topic": "a"}, "must not be one of the watched topics"),
        ({"topics": ["a"], "match": {"": 1}}, "dotted path"),
        ({"topics": ["a"], "match": {"body.x": {"nested": 1}}}, "str/int/float/bool/None"),
        ({"topics": ["a"], "match": {"body.x": []}}, "could never match"),
        ({"topics": ["a"], "filter_function": "nodots"}, "dotted path"),
        ({"topics": ["a"], "on_filter_error": "explode"}, "on_filter_error"),
        ({"topics": ["a"], "oversize_policy": "drop"}, "oversize_policy"),
        ({"topics": ["a"], "max_payload_bytes": 10}, "max_payload_bytes"),
        ({"topics": ["a"], "max_delivery_attempts": 0}, "max_delivery_attempts"),
        ({"topics": ["a"], "poll_timeout": 0}, "poll_timeout"),
        ({"topics": ["a"], "on_partial_assignment": "ignore"}, "on_partial_assignment"),
    ],
    "sqs": [
        ({"queue_url": "orders"}, "queue_url must be a full SQS queue URL"),
        ({"queue_url": ""}, "queue_url must be a non-empty string"),
        ({"queue_url": "https://sqs.eu-west-1.amazonaws.com/1/a b"}, "queue_url must be a full SQS queue URL"),
        ({"dlq_queue_url": SQS_QUEUE}, "dlq_queue_url must differ from queue_url"),
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
    "pubsub": [
        ({"project_id": "proj-b"}, "project_id"),
        ({"project_id": ""}, "project_id must be a non-empty string"),
        ({"subscription": ""}, "subscription"),
        ({"dead_letter_topic": "projects/p/subscriptions/x-abc"}, "dead_letter_topic"),
        ({"max_messages": 0}, "max_messages"),
        ({"max_messages": 1001}, "max_messages"),
        ({"max_messages": True}, "max_messages"),
        ({"pull_timeout": 0}, "pull_timeout"),
        ({"ack_deadline_seconds": 5}, "ack_deadline_seconds"),
        ({"ack_deadline_seconds": 601}, "ack_deadline_seconds"),
        ({"ack_deadline_seconds": 30.5}, "ack_deadline_seconds"),
        ({"ack_flush_interval": -1}, "ack_flush_interval"),
        ({"gcp_conn_id": ""}, "gcp_conn_id"),
        ({"max_delivery_attempts": 0}, "max_delivery_attempts"),
        ({"on_filter_error": "explode"}, "on_filter_error"),
        ({"match": {"body.x": {"nested": 1}}}, "match"),
    ],
    "servicebus": [
        ({}, "either queue_name"),
        ({"queue_name": "q", "topic_name": "t", "subscription_name": "s"}, "not both"),
        ({"queue_name": "q", "subscription_name": "s"}, "not both"),
        ({"topic_name": "t"}, "needs subscription_name"),
        ({"subscription_name": "s"}, "needs topic_name"),
        ({"queue_name": ""}, "queue_name must be a non-empty string"),
        ({"queue_name": "q", "prefetch_count": -1}, "prefetch_count"),
        ({"queue_name": "q", "prefetch_count": True}, "prefetch_count"),
        ({"queue_name": "q", "max_message_count": 0}, "max_message_count"),
        ({"queue_name": "q", "max_wait_time": 0}, "max_wait_time"),
        ({"queue_name": "q", "renew_locks": "yes"}, "renew_locks"),
        ({"queue_name": "q", "azure_service_bus_conn_id": ""}, "azure_service_bus_conn_id"),
        ({"queue_name": "q", "max_delivery_attempts": 0}, "max_delivery_attempts"),
        ({"queue_name": "q", "sessions": "yes"}, "sessions must be True or False"),
        ({"queue_name": "q", "sessions": True, "max_concurrent_sessions": 0}, "max_concurrent_sessions must be"),
        ({"queue_name": "q", "sessions": True, "max_concurrent_sessions": 101}, "max_concurrent_sessions must be <="),
        ({"queue_name": "q", "sessions": True, "max_concurrent_sessions": 2.5}, "max_concurrent_sessions must be an"),
        ({"queue_name": "q", "sessions": True, "max_concurrent_sessions": True}, "max_concurrent_sessions must be an"),
        ({"queue_name": "q", "sessions": True, "session_idle_timeout": 0}, "session_idle_timeout must be"),
        ({"queue_name": "q", "max_concurrent_sessions": 3}, "max_concurrent_sessions=3 only applies to session"),
        ({"queue_name": "q", "session_idle_timeout": 9.0}, "session_idle_timeout=9.0 only applies to session"),
    ],
    "redis": [
        ({"stream": ""}, "stream must be a non-empty string"),
        ({"dead_letter_stream": "orders"}, "dead_letter_stream must differ from stream"),
        ({"group": " "}, "group must be a non-empty string"),
        ({"group_start_id": "latest"}, "group_start_id must be"),
        ({"claim_idle": 0.5}, "claim_idle must be a number >= 1"),
        ({"hold_backoff": 40}, "hold_backoff must be <= 30"),
        ({"read_count": 0}, "read_count must be a number >= 1"),
        ({"read_count": 1.5}, "read_count must be an int"),
        ({"block": 0}, "block must be a number >= 0.01"),
        ({"dead_letter_maxlen": 0}, "dead_letter_maxlen must be a number >= 1"),
        ({"create_group": "yes"}, "create_group must be True or False"),
    ],
}

NAMES = sorted(CONFIG_ERRORS)
ROWS = [
    pytest.param(name, kwargs, message, id=f"{name}-{index}")
    for name in NAMES
    for index, (kwargs, message) in enumerate(CONFIG_ERRORS[name])
]
PRODUCERS = Path(__file__).resolve().parents[2] / "airflow_shared_stream_provider" / "producers"


def test_every_registry_broker_has_a_table() -> None:
    assert sorted(spec.name for spec in BROKERS) == NAMES == sorted(BASES)


@pytest.mark.parametrize(("name", "kwargs", "message"), ROWS)
def test_a_bad_argument_fails_at_parse_time_naming_the_setting(name: str, kwargs: dict[str, Any], message: str) -> None:
    trigger = load(broker_spec(name).trigger)
    with pytest.raises(SharedStreamConfigError, match=re.escape(message)):
        trigger(**{**BASES[name], **kwargs})


@pytest.mark.parametrize("name", NAMES)
def test_the_key_covers_every_setting_the_producer_reads(name: str) -> None:
    """
    Every ``settings.<name>`` read in the broker's producer modules (those that name its settings
    class) is a settings field, which the key holds, or a property or method of the settings class,
    which derives from fields.
    """
    settings = load(broker_spec(name).settings)
    modules = [path for path in sorted(PRODUCERS.glob("*.py")) if settings.__name__ in path.read_text()]
    read = {word for path in modules for word in re.findall(r"\bsettings\.([a-z_]+)", path.read_text())}
    fields = {f.name for f in dataclasses.fields(settings)}
    derived = {
        word for word in read - fields if callable(getattr(settings, word, None)) or _is_property(settings, word)
    }
    assert modules, f"no producer module names {settings.__name__}"
    assert read, f"{name}: the producer reads no settings?"
    assert read - fields - derived == set(), f"{name}: read by the producer but not in the key"


def _is_property(cls: type[Any], name: str) -> bool:
    return isinstance(getattr(cls, name, None), property)
