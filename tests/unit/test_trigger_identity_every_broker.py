"""
The identity rules every broker's trigger follows, written once over the broker registry: filters
and a filter-only subclass share the stream; ``serialize()`` round-trips under a subclass's own
class path, and the plain trigger's is the public path users import; ``serialize()`` and the key
hold the connection id, never what the connection holds. A broker added to the registry without a
case here fails :func:`test_every_registry_broker_has_a_case`.
"""

from __future__ import annotations

import importlib
import json
import textwrap
from dataclasses import dataclass
from typing import Any

import pytest

from airflow_shared_stream_provider.brokers import BROKERS, BrokerSpec, broker_spec, load


@dataclass(frozen=True)
class Case:
    source: dict[str, Any]  # the stream's source arguments
    dead_letter: dict[str, Any]  # a dead-letter argument for the round trip ({} where built in)
    connection: dict[str, Any]  # the Airflow connection behind the conn id, secrets included
    secrets: tuple[str, ...]  # what must appear neither in serialize() nor in the key


CONN_ID = "identity_prod"
CASES: dict[str, Case] = {
    "kafka": Case(
        source={"topics": ["orders"]},
        dead_letter={"dlq_topic": "orders.dlq"},
        connection={
            "conn_type": "kafka",
            "extra": {
                "bootstrap.servers": "b:9093",
                "sasl.username": "svc-airflow",
                "sasl.password": "kafka-secret-pw",
            },
        },
        secrets=("svc-airflow", "kafka-pw"),
    ),
    "sqs": Case(
        source={"queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"},
        dead_letter={"dlq_queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq"},
        connection={
            "conn_type": "aws",
            "login": "AKIAEXAMPLEKEYID0000",
            "password": "very-secret-access-key",
            "extra": {"aws_session_token": "session-token-secret", "role_arn": "arn:aws:iam::1:role/r"},
        },
        secrets=("AKIAEXAMPLEKEYID0000", "very-secret-access-key", "session-token-secret"),
    ),
    "pubsub": Case(
        source={"subscription": "projects/proj-a/subscriptions/orders-sub"},
        dead_letter={"dead_letter_topic": "orders-dead-letter"},
        connection={
            "conn_type": "google_cloud_platform",
            "extra": {"keyfile_dict": {"private_key": "gcp-secret-private-key", "client_email": "svc@proj-a.iam"}},
        },
        secrets=("gcp-secret-private-key",),
    ),
    "servicebus": Case(
        source={"queue_name": "orders"},
        dead_letter={},  # every Service Bus entity has its own dead-letter sub-queue
        connection={
            "conn_type": "azure_service_bus",
            "schema": "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=svc;SharedAccessKey=sb-secret-key",
        },
        secrets=("sb-secret-key",),
    ),
    "redis": Case(
        source={"stream": "orders"},
        dead_letter={"dead_letter_stream": "orders:dlq"},
        connection={
            "conn_type": "redis",
            "host": "redis.internal",
            "login": "svc-airflow",
            "password": "very-secret-password",
            "extra": {"db": 3, "ssl": True, "ssl_keyfile": "/secret/key.pem"},
        },
        secrets=("very-secret-password", "svc-airflow", "redis.internal", "/secret/key.pem"),
    ),
}


def _accept_eu(self: Any, envelope: Any) -> bool:
    return bool(envelope["body"].get("region") == "eu")


def _filter_only_subclass(spec: BrokerSpec) -> type[Any]:
    """A user subclass that only filters, defined in this module (its class path is this module's)."""
    name = f"EuOnly{spec.name.title()}Trigger"
    cls = type(name, (load(spec.trigger),), {"accept": _accept_eu, "__module__": __name__, "__qualname__": name})
    globals()[name] = cls  # serialize() names it by module and qualname; the round trip imports it
    return cls


SUBCLASSES: dict[str, type[Any]] = {spec.name: _filter_only_subclass(spec) for spec in BROKERS}
NAMES = sorted(CASES)


def base(name: str) -> dict[str, Any]:
    return {**CASES[name].source, broker_spec(name).conn_id_arg: CONN_ID}


def test_every_registry_broker_has_a_case() -> None:
    assert sorted(spec.name for spec in BROKERS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_filters_and_filter_only_subclasses_share_the_stream(name: str) -> None:
    trigger = load(broker_spec(name).trigger)
    plain = trigger(**base(name)).shared_stream_key()
    assert trigger(**base(name), match={"body.region": "eu"}).shared_stream_key() == plain
    assert trigger(**base(name), filter_function="pkg.mod.f").shared_stream_key() == plain
    assert trigger(**base(name), on_filter_error="skip").shared_stream_key() == plain
    assert SUBCLASSES[name](**base(name)).shared_stream_key() == plain
    hash(plain)


@pytest.mark.parametrize("name", NAMES)
def test_serialize_round_trips_under_the_real_class_path(name: str) -> None:
    spec = broker_spec(name)
    subclass = SUBCLASSES[name]
    trigger = subclass(**base(name), **CASES[name].dead_letter, match={"attributes.type": ["a", "b"]})
    classpath, kwargs = trigger.serialize()
    assert classpath == f"{__name__}.{subclass.__name__}"
    json.dumps(kwargs)  # kwargs live in the metadata DB
    again = subclass(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert again.shared_stream_key() == trigger.shared_stream_key()
    plain_path, _ = load(spec.trigger)(**base(name)).serialize()
    assert (
        plain_path
        == spec.trigger_path
        == f"airflow_shared_stream_provider.triggers.{name}.{plain_path.rsplit('.')[-1]}"
    )


@pytest.mark.parametrize("name", NAMES)
def test_serialize_holds_the_connection_id_never_secrets(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case, spec = CASES[name], broker_spec(name)
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(case.connection))
    trigger = load(spec.trigger)(**base(name))
    _, kwargs = trigger.serialize()
    text = json.dumps(kwargs) + repr(trigger.shared_stream_key())
    assert kwargs[spec.conn_id_arg] == CONN_ID
    assert not {k for k in kwargs if any(word in k for word in ("password", "secret", "token", "key_"))}
    for secret in case.secrets:
        assert secret not in text


@pytest.mark.parametrize("name", NAMES)
def test_the_module_docstring_example_runs_and_shares_one_stream(name: str) -> None:
    # The example users copy from the trigger module's docstring (help(), the API docs): it runs,
    # and its two watchers' triggers are distinct (Airflow keeps one trigger row per distinct
    # serialisation) yet share one stream.
    module = importlib.import_module(broker_spec(name).trigger_module)
    doc = module.__doc__ or ""
    start = doc.index("::\n", doc.index("Example")) + 3
    end = doc.find("\n\n", doc.index("eu_orders, us_orders", start))
    namespace: dict[str, Any] = {}
    exec(textwrap.dedent(doc[start : end if end != -1 else None]), namespace)  # our own docstring
    eu, us = namespace["eu_orders"], namespace["us_orders"]
    (eu_watcher,), (us_watcher,) = eu.watchers, us.watchers
    assert eu_watcher.trigger.serialize() != us_watcher.trigger.serialize()
    assert eu_watcher.trigger.shared_stream_key() == us_watcher.trigger.shared_stream_key()
