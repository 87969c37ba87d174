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
        trigger_group_id="from-trigger",
        derived_group_id="derived",
    )
    assert config.consumer["bootstrap_servers"] == "b1:9092,b2:9092"
    assert config.consumer["group_id"] == "from-trigger"
    assert config.group.source == "trigger"
    assert config.consumer["auto_offset_reset"] == "latest"
    assert config.consumer["session_timeout_ms"] == 15000
    assert config.consumer["security_protocol"] == "SASL_SSL"
    assert config.consumer["sasl_mechanism"] == "SCRAM-SHA-512"
    assert config.ssl == {"cafile": "/etc/ca.pem"}
    assert config.common["sasl_plain_password"] == "s3cret"
    assert "s3cret" not in repr(config.redacted())
    assert config.redacted()["sasl_plain_password"] == "***"


def test_defaults_are_plaintext_and_earliest() -> None:
    config = kafka_client_config("k", {"bootstrap.servers": "b:9092"}, trigger_group_id=None, derived_group_id="g")
    assert config.consumer["security_protocol"] == "PLAINTEXT"
    assert config.consumer["auto_offset_reset"] == "earliest"


@pytest.mark.parametrize("value", [True, "true", "True", "1"])
def test_auto_commit_is_refused_with_the_reason(value: object) -> None:
    with pytest.raises(SharedStreamConfigError, match=r"enable\.auto\.commit=true.*lose messages"):
        kafka_client_config(
            "k",
            {"bootstrap.servers": "b:9092", "enable.auto.commit": value},
            trigger_group_id=None,
            derived_group_id="g",
        )


@pytest.mark.parametrize(
    ("trigger_group_id", "extras", "expected", "source"),
    [
        ("from-trigger", {"group.id": "from-connection"}, "from-trigger", "trigger"),
        (None, {"group.id": " from-connection "}, "from-connection", "connection"),
        (None, {}, "derived", "derived"),
        ("from-trigger", {}, "from-trigger", "trigger"),
        # The trigger wins, so a blank group.id it overrides is never used and not an error.
        ("from-trigger", {"group.id": ""}, "from-trigger", "trigger"),
    ],
)
def test_group_precedence_is_trigger_then_connection_then_derived(
    trigger_group_id: str | None, extras: dict[str, object], expected: str, source: str
) -> None:
    config = kafka_client_config(
        "kafka_x",
        {"bootstrap.servers": "b:9092", **extras},
        trigger_group_id=trigger_group_id,
        derived_group_id="derived",
    )
    assert config.consumer["group_id"] == expected
    assert config.group.group_id == expected
    assert config.group.source == source


def test_the_group_origin_names_the_source_and_the_connection() -> None:
    def origin(trigger_group_id: str | None, extras: dict[str, object]) -> str:
        config = kafka_client_config(
            "kafka_x",
            {"bootstrap.servers": "b:9092", **extras},
            trigger_group_id=trigger_group_id,
            derived_group_id="derived",
        )
        return config.group.origin()

    assert origin("t", {"group.id": "c"}) == "the trigger's group_id"
    assert origin(None, {"group.id": "c"}) == "group.id of connection 'kafka_x'"
    assert origin(None, {}) == "derived: no group_id on the trigger, no group.id in connection 'kafka_x'"


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_connection_group_that_would_be_used_is_an_error(blank: str) -> None:
    with pytest.raises(SharedStreamConfigError, match=r"connection 'k' sets an empty group\.id"):
        kafka_client_config(
            "k", {"bootstrap.servers": "b:9092", "group.id": blank}, trigger_group_id=None, derived_group_id="d"
        )


def test_the_config_repr_shows_no_secret() -> None:
    config = kafka_client_config(
        "k",
        {
            "bootstrap.servers": "b:9092",
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.username": "svc",
            "sasl.password": "sasl-s3cret",
            "ssl.key.location": "/etc/key.pem",
            "ssl.key.password": "key-s3cret",
        },
        trigger_group_id=None,
        derived_group_id="g",
    )
    for text in (repr(config), str(config), f"{config}", repr([config])):
        assert "s3cret" not in text
        assert "svc" in text and "/etc/key.pem" in text  # what is not secret stays readable
    assert repr(config).count("'***'") == 3  # consumer and common SASL password, the SSL key password
    assert config.ssl["password"] == "key-s3cret"  # masked in the repr only
