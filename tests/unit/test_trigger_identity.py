"""
KafkaSharedStreamTrigger: its key and defaults (the rules every broker shares are in
test_trigger_identity_every_broker.py, its parse-time errors in test_config_errors_every_broker.py).
"""

from __future__ import annotations

from typing import Any

import pytest

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


def test_unknown_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="topic_name"):
        KafkaSharedStreamTrigger(topics=["a"], topic_name="b")  # type: ignore[call-arg]


def test_the_default_group_id_names_connection_and_topics() -> None:
    settings = KafkaSharedStreamTrigger(topics=["b", "a"]).settings
    assert settings.effective_group_id() == "airflow-shared-stream.kafka_default.a+b"
