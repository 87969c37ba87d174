"""
KafkaSharedStreamTrigger: its key, parse-time validation and defaults (the rules every broker
shares are in test_trigger_identity_every_broker.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

BASE: dict[str, Any] = {"topics": ["orders"], "kafka_config_id": "kafka_prod"}


class RegionOnlyTrigger(KafkaSharedStreamTrigger):
    """A user subclass that only filters: it must share the stream with its siblings."""

    def accept(self, envelope: Any) -> bool:
        return bool(envelope["body"].get("region") == "eu")


def test_spellings_of_one_topic_list_share_the_stream() -> None:
    # The rules every broker shares (filters, subclasses, serialize, secrets) are in
    # test_trigger_identity_every_broker.py; this is Kafka's own: a repeated topic is one topic.
    plain = KafkaSharedStreamTrigger(**BASE)
    assert (
        plain.shared_stream_key()
        == KafkaSharedStreamTrigger(topics=["orders", "orders"], kafka_config_id="kafka_prod").shared_stream_key()
    )
    assert RegionOnlyTrigger(**BASE).shared_stream_key() == plain.shared_stream_key()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
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
)
def test_bad_arguments_fail_at_parse_time_naming_the_setting(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SharedStreamConfigError, match=message):
        KafkaSharedStreamTrigger(**kwargs)


def test_unknown_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="topic_name"):
        KafkaSharedStreamTrigger(topics=["a"], topic_name="b")  # type: ignore[call-arg]


def test_the_default_group_id_names_connection_and_topics() -> None:
    settings = KafkaSharedStreamTrigger(topics=["b", "a"]).settings
    assert settings.effective_group_id() == "airflow-shared-stream.kafka_default.a+b"
