"""Upstream Kafka connection extras -> aiokafka kwargs: mapping, refusals, clear errors."""

from __future__ import annotations

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers.kafka_config import kafka_client_config


def test_librdkafka_keys_map_to_aiokafka_and_the_trigger_group_wins() -> None:
    config = kafka_client_config(
        "k",
        {
            "bootstrap.servers": "b1:9092,b2:9092",
            "group.id": "from-connection",
            "auto.offset.reset": "Latest",
            "session.timeout.ms": "15000",
            "security.protocol": "sasl_ssl",
            "sasl.mechanisms": "scram-sha-512",
            "sasl.username": "svc",
            "sasl.password": "s3cret",
            "ssl.ca.location": "/etc/ca.pem",
            "enable.auto.commit": "false",
        },
        group_id="from-trigger",
    )
    assert config.consumer["bootstrap_servers"] == "b1:9092,b2:9092"
    assert config.consumer["group_id"] == "from-trigger"
    assert config.consumer["auto_offset_reset"] == "latest"
    assert config.consumer["session_timeout_ms"] == 15000
    assert config.consumer["security_protocol"] == "SASL_SSL"
    assert config.consumer["sasl_mechanism"] == "SCRAM-SHA-512"
    assert config.ssl == {"cafile": "/etc/ca.pem"}
    assert config.common["sasl_plain_password"] == "s3cret"
    assert "s3cret" not in repr(config.redacted())
    assert config.redacted()["sasl_plain_password"] == "***"


def test_defaults_are_plaintext_and_earliest() -> None:
    config = kafka_client_config("k", {"bootstrap.servers": "b:9092"}, group_id="g")
    assert config.consumer["security_protocol"] == "PLAINTEXT"
    assert config.consumer["auto_offset_reset"] == "earliest"


@pytest.mark.parametrize("value", [True, "true", "True", "1"])
def test_auto_commit_is_refused_with_the_reason(value: object) -> None:
    with pytest.raises(SharedStreamConfigError, match=r"enable\.auto\.commit=true.*lose messages"):
        kafka_client_config("k", {"bootstrap.servers": "b:9092", "enable.auto.commit": value}, group_id="g")


@pytest.mark.parametrize(
    ("extras", "message"),
    [
        ({"bootstrap.servers": "b:9092", "sasl.mechansim": "PLAIN"}, "unsupported Kafka setting 'sasl.mechansim'"),
        ({}, "no bootstrap.servers"),
        ({"bootstrap.servers": "b:9092", "security.protocol": "SASL_SSL"}, "needs sasl.mechanism"),
        ({"bootstrap.servers": "b:9092", "security.protocol": "TLS"}, "security.protocol 'TLS'"),
        ({"bootstrap.servers": "b:9092", "auto.offset.reset": "smallest"}, "auto.offset.reset 'smallest'"),
        ({"bootstrap.servers": "b:9092", "session.timeout.ms": "ten"}, "session.timeout.ms='ten' is not valid"),
        (
            {"bootstrap.servers": "b:9092", "security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"},
            "OAUTHBEARER",
        ),
    ],
)
def test_bad_connections_fail_with_an_error_naming_the_setting(extras: dict[str, object], message: str) -> None:
    with pytest.raises(SharedStreamConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        kafka_client_config("k", extras, group_id="g")
