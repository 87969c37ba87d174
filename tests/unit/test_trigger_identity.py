"""Serialization and shared_stream_key rules every broker trigger follows (Kafka as the example)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

BASE: dict[str, Any] = {"topics": ["orders"], "kafka_config_id": "kafka_prod"}


class RegionOnlyTrigger(KafkaSharedStreamTrigger):
    """A user subclass that only filters: it must share the stream with its siblings."""

    def accept(self, envelope: Any) -> bool:
        return bool(envelope["body"].get("region") == "eu")


def test_serialize_round_trips_and_uses_the_real_class_path() -> None:
    trigger = RegionOnlyTrigger(**BASE, match={"body.type": ["a", "b"]})
    classpath, kwargs = trigger.serialize()
    assert classpath == f"{__name__}.RegionOnlyTrigger"
    json.dumps(kwargs)  # kwargs live in the metadata DB
    again = RegionOnlyTrigger(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert again.shared_stream_key() == trigger.shared_stream_key()


def test_filters_and_subclasses_do_not_change_the_key() -> None:
    plain = KafkaSharedStreamTrigger(**BASE)
    assert (
        plain.shared_stream_key() == KafkaSharedStreamTrigger(**BASE, match={"body.region": "eu"}).shared_stream_key()
    )
    assert plain.shared_stream_key() == KafkaSharedStreamTrigger(**BASE, filter_function="a.b").shared_stream_key()
    assert plain.shared_stream_key() == RegionOnlyTrigger(**BASE).shared_stream_key()
    assert (
        plain.shared_stream_key()
        == KafkaSharedStreamTrigger(topics=["orders", "orders"], kafka_config_id="kafka_prod").shared_stream_key()
    )


def test_serialize_holds_connection_ids_only() -> None:
    _, kwargs = KafkaSharedStreamTrigger(**BASE).serialize()
    assert kwargs["kafka_config_id"] == "kafka_prod"
    assert not {k for k in kwargs if any(s in k for s in ("password", "secret", "token", "key_"))}


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
