"""
Secrets read from connections are registered with Airflow's secrets masker as they are read: after
our reader read the connection, a forced traceback carrying the secret, logged with
``log.exception`` in the TriggerRunner, is masked in the log the triggerer's supervisor writes
(``tests/triggerer_logs.py`` says what of the triggerer is emulated in process). Each case has its
control: with the provider's registration removed (Airflow's own masking of the password and the
extras left on), the same secret is in that log, so these tests fail when the registration goes.
SQS (STS-issued keys; the connection's own are masked by Airflow already) is in
``tests/integration/sqs/test_aws_identity.py``, next to moto.

Secrets are long and unique: Airflow masks every registered value (of 5 characters or more)
wherever it appears in a log line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from airflow_shared_stream_provider.producers.kafka_config import load_kafka_client_config
from airflow_shared_stream_provider.producers.pubsub_connection import load_gcp_connection
from airflow_shared_stream_provider.producers.servicebus_connection import load_connection_info
from tests.triggerer_logs import assert_leaks, assert_masked, triggerer_logs, without_our_registration

REGISTERED = {"registered": True, "registration removed (control)": False}
SASL_PASSWORD = "kafka-sasl-password-7c1e9f0b3d"
SSL_KEY_PASSWORD = "kafka-ssl-key-password-52aa81e4"
SAS_KEY = "c2hhcmVkLWFjY2Vzcy1rZXktb2YtdGhlLXRlc3Q9PQ8f3b"


def set_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, connection: dict[str, object]) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))
    return conn_id


@pytest.mark.parametrize("registered", REGISTERED.values(), ids=REGISTERED.keys())
async def test_kafka_sasl_and_ssl_key_passwords_are_masked(registered: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    extras = {
        "bootstrap.servers": "127.0.0.1:9",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "stream-reader",
        # Padded, as pasted into a form: the client gets (and a library prints) it stripped.
        "sasl.password": f" {SASL_PASSWORD} ",
        "ssl.key.password": SSL_KEY_PASSWORD,
    }
    conn_id = set_connection(monkeypatch, "kafka_mask_unit", {"conn_type": "kafka", "extra": extras})
    if not registered:
        without_our_registration(monkeypatch)
    with triggerer_logs(monkeypatch) as logs:
        config = await load_kafka_client_config(conn_id, trigger_group_id=None, derived_group_id="g")
        password = config.consumer["sasl_plain_password"]
        assert password == SASL_PASSWORD
        try:
            raise RuntimeError(f"SASL authentication failed with {password!r} (key password {config.ssl['password']})")
        except RuntimeError:
            logs.log_exception("Kafka shared stream failed")
    if registered:
        assert_masked(logs, monkeypatch, SASL_PASSWORD, SSL_KEY_PASSWORD)
    else:
        assert_leaks(logs, monkeypatch, SASL_PASSWORD)


def private_key_pem() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def keyfile(pem: str) -> dict[str, str]:
    return {
        "type": "service_account",
        "project_id": "mask-project",
        "private_key_id": "0123456789abcdef",
        "private_key": pem,
        "client_email": "reader@mask-project.iam.gserviceaccount.com",
        "client_id": "1234567890",
        "token_uri": "https://oauth2.googleapis.com/token",
    }


@pytest.mark.parametrize("source", ["keyfile_dict", "key_path"])
@pytest.mark.parametrize("registered", REGISTERED.values(), ids=REGISTERED.keys())
async def test_gcp_private_key_is_masked(
    registered: bool, source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    pem = private_key_pem()
    if source == "keyfile_dict":
        extra = {"keyfile_dict": json.dumps(keyfile(pem))}
    else:
        path = tmp_path / "key.json"
        path.write_text(json.dumps(keyfile(pem)))
        extra = {"key_path": str(path)}
    conn_id = set_connection(monkeypatch, "gcp_mask_unit", {"conn_type": "google_cloud_platform", "extra": extra})
    if not registered:
        without_our_registration(monkeypatch)
    with triggerer_logs(monkeypatch) as logs:
        connection = await load_gcp_connection(conn_id)
        assert connection.project == "mask-project"
        try:
            raise RuntimeError(f"could not sign the token request with\n{pem}")
        except RuntimeError:
            logs.log_exception("Pub/Sub shared stream failed")
    if registered:
        assert_masked(logs, monkeypatch, pem)
    else:
        assert_leaks(logs, monkeypatch, pem)


@pytest.mark.parametrize("registered", REGISTERED.values(), ids=REGISTERED.keys())
async def test_service_bus_connection_string_and_key_are_masked(
    registered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection_string = (
        "Endpoint=sb://mask-ns.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;"
        f"SharedAccessKey={SAS_KEY}"
    )
    # The upstream form keeps the connection string in the schema field, which Airflow never masks.
    conn_id = set_connection(
        monkeypatch, "sb_mask_unit", {"conn_type": "azure_service_bus", "schema": connection_string}
    )
    if not registered:
        without_our_registration(monkeypatch)
    with triggerer_logs(monkeypatch) as logs:
        info = await load_connection_info(conn_id)
        assert info.connection_string == connection_string
        try:
            raise RuntimeError(f"AMQP CBS token refused for {connection_string} (key {SAS_KEY})")
        except RuntimeError:
            logs.log_exception("Service Bus shared stream failed")
    if registered:
        assert_masked(logs, monkeypatch, connection_string, SAS_KEY)
    else:
        assert_leaks(logs, monkeypatch, SAS_KEY)


async def test_redis_password_is_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Redis (the fifth broker): the password field, which Airflow masks itself and our reader
    registers too, is masked after a forced traceback. No control case: with our registration
    removed Airflow's own masking still hides it (what this test pins down for the fifth broker).
    """
    pytest.importorskip("redis")
    from airflow_shared_stream_provider.producers.redis_client import load_redis_connection

    password = "redis-password-0e8d4c2a9b71"
    conn_id = set_connection(
        monkeypatch,
        "redis_mask_unit",
        {"conn_type": "redis", "host": "127.0.0.1", "port": 6390, "login": "svc", "password": password},
    )
    with triggerer_logs(monkeypatch) as logs:
        connection = await load_redis_connection(conn_id)
        assert connection.password == password
        try:
            raise RuntimeError(f"WRONGPASS invalid username-password pair for svc:{password}")
        except RuntimeError:
            logs.log_exception("Redis shared stream failed")
    assert_masked(logs, monkeypatch, password)
