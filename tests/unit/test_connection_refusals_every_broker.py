"""
What every broker's connection reader refuses, over the broker registry: an Airflow connection
(of the upstream provider's type) holding a setting the reader cannot honour, or two that
contradict each other, fails with one ``SharedStreamConfigError`` that names the connection id and
the setting, through the reader the producer calls, read from the environment as Airflow would. A
silent fallback would connect as another identity, to another database, or without TLS checks.

A broker added to the registry without a table here fails :func:`test_every_registry_broker_has_a_table`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.brokers import BROKERS, broker_spec


@dataclass(frozen=True)
class Refusal:
    connection: dict[str, Any]  # the Airflow connection's fields, without its conn_type
    named: str  # what the error must say (literally), beside the connection id
    secret: str | None = None  # a value of the connection the error must not echo


async def _read_kafka(conn_id: str) -> object:
    from airflow_shared_stream_provider.producers.kafka_config import load_kafka_client_config

    return await load_kafka_client_config(conn_id, trigger_group_id=None, derived_group_id="g")


async def _read_sqs(conn_id: str) -> object:
    from airflow_shared_stream_provider.producers.aws_connection import load_aws_connection

    return await load_aws_connection(conn_id, service="sqs", region_name=None, fallback_region=None)


async def _read_pubsub(conn_id: str) -> object:
    from airflow_shared_stream_provider.producers.pubsub_connection import load_gcp_connection

    return await load_gcp_connection(conn_id)


async def _read_servicebus(conn_id: str) -> object:
    from airflow_shared_stream_provider.producers.servicebus_connection import load_connection_info

    return await load_connection_info(conn_id)


async def _read_redis(conn_id: str) -> object:
    from airflow_shared_stream_provider.producers.redis_client import load_redis_connection

    return await load_redis_connection(conn_id)


READERS: dict[str, Callable[[str], Awaitable[object]]] = {
    "kafka": _read_kafka,
    "sqs": _read_sqs,
    "pubsub": _read_pubsub,
    "servicebus": _read_servicebus,
    "redis": _read_redis,
}

_KAFKA = "b:9092"
_AWS_REGION = {"region_name": "us-east-1"}
_AWS_ROLE = "arn:aws:iam::123456789012:role/shared-stream-reader"

REFUSALS: dict[str, dict[str, Refusal]] = {
    "kafka": {
        "a misspelt key": Refusal(
            {"extra": {"bootstrap.servers": _KAFKA, "sasl.mechansim": "PLAIN"}},
            "unsupported Kafka setting 'sasl.mechansim'",
        ),
        "no servers": Refusal({"extra": {}}, "no bootstrap.servers"),
        "SASL without a mechanism": Refusal(
            {"extra": {"bootstrap.servers": _KAFKA, "security.protocol": "SASL_SSL"}}, "needs sasl.mechanism"
        ),
        "an unknown protocol": Refusal(
            {"extra": {"bootstrap.servers": _KAFKA, "security.protocol": "TLS"}}, "security.protocol 'TLS'"
        ),
        "a librdkafka-only offset reset": Refusal(
            {"extra": {"bootstrap.servers": _KAFKA, "auto.offset.reset": "smallest"}}, "auto.offset.reset 'smallest'"
        ),
        "a timeout that is no number": Refusal(
            {"extra": {"bootstrap.servers": _KAFKA, "session.timeout.ms": "ten"}},
            "session.timeout.ms='ten' is not valid",
        ),
        "OAUTHBEARER": Refusal(
            {"extra": {"bootstrap.servers": _KAFKA, "security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"}},
            "OAUTHBEARER",
        ),
    },
    "sqs": {
        "unknown assume_role_method": Refusal(
            {"extra": {**_AWS_REGION, "role_arn": _AWS_ROLE, "assume_role_method": "assume_role_magic"}},
            "assume_role_magic",
        ),
        "unknown federation": Refusal(
            {
                "extra": {
                    **_AWS_REGION,
                    "role_arn": _AWS_ROLE,
                    "assume_role_method": "assume_role_with_web_identity",
                    "assume_role_with_web_identity_federation": "okta",
                }
            },
            "assume_role_with_web_identity_federation 'okta'",
        ),
        "profile inside session_kwargs (ignored by the provider)": Refusal(
            {"extra": {**_AWS_REGION, "session_kwargs": {"profile_name": "p"}}},
            "session_kwargs key(s) ['profile_name']",
        ),
    },
    # What GoogleBaseHook refuses (two key sources at once) is refused; what it would honour but this
    # reader cannot (the client-credentials grant through an IdP) is refused by name instead of
    # falling back to Application Default Credentials, which would be another identity.
    "pubsub": {
        "keyfile_dict and key_path": Refusal(
            {"extra": {"keyfile_dict": "{}", "key_path": "/k.json"}}, "['keyfile_dict', 'key_path']"
        ),
        "key_path and credential_config_file (legacy prefix)": Refusal(
            {"extra": {"extra__google_cloud_platform__key_path": "/k.json", "credential_config_file": "/c.json"}},
            "['key_path', 'credential_config_file']",
        ),
        "key_secret_name": Refusal({"extra": {"key_secret_name": "sa-key"}}, "'key_secret_name'"),
        "idp_issuer_url": Refusal(
            {
                "extra": {
                    "idp_issuer_url": "https://idp.example/token",
                    "client_id": "c",
                    "client_secret": "client-secret-0f3a",
                }
            },
            "['idp_issuer_url', 'client_id', 'client_secret']",
            secret="client-secret-0f3a",
        ),
    },
    "servicebus": {
        "nothing usable": Refusal(
            {"schema": "None", "host": "", "extra": {"connection_string": "None"}}, "has neither a connection string"
        ),
        "a credential extra": Refusal(
            {"extra": {"credential": "x", "fully_qualified_namespace": "ns"}}, "'credential' extra is not supported"
        ),
    },
    "redis": {
        "two databases": Refusal(
            {"host": "h", "port": 1, "schema": "1", "extra": {"db": 2}}, "two different databases"
        ),
        "an unknown ssl_cert_reqs": Refusal(
            {"host": "h", "port": 1, "password": "pw-0f3a", "extra": {"ssl_cert_reqs": "x"}},
            "ssl_cert_reqs",
            secret="pw-0f3a",
        ),
    },
}

NAMES = sorted(REFUSALS)
ROWS = [pytest.param(name, case, id=f"{name}: {case}") for name in NAMES for case in REFUSALS[name]]


def test_every_registry_broker_has_a_table() -> None:
    assert sorted(spec.name for spec in BROKERS) == NAMES == sorted(READERS)


@pytest.mark.parametrize(("name", "case"), ROWS)
async def test_a_setting_the_reader_cannot_honour_is_refused_by_name(
    name: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusal = REFUSALS[name][case]
    conn_id = f"{name}_refused_unit"
    connection = {"conn_type": broker_spec(name).connection_type, **refusal.connection}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))
    with pytest.raises(SharedStreamConfigError) as caught:
        await READERS[name](conn_id)
    said = str(caught.value)
    assert conn_id in said
    assert refusal.named in said
    if refusal.secret is not None:
        assert refusal.secret not in said
