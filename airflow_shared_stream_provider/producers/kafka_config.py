"""
Map the upstream Kafka connection (librdkafka-style extras) to aiokafka keyword arguments.

The connection is the one ``apache-airflow-providers-apache-kafka`` users already have (conn type
``kafka``; the config lives in the extras, keys as librdkafka spells them). We read it directly
instead of declaring the connection type (the upstream provider owns it).

Every supported key is in :data:`_CONSUMER_KEYS`; keys that only matter to librdkafka's own
internals and are harmless here are in :data:`_IGNORED_KEYS`; anything else is an error naming the
key, so a typo in a security setting can never silently fall back to plaintext.

``retry.backoff.ms`` defaults to :data:`DEFAULT_RETRY_BACKOFF_MS` (aiokafka's own default is 100 ms).
aiokafka has no exponential reconnect backoff (no ``reconnect.backoff.ms``): every component
(metadata, coordinator, fetcher) retries a failed connection after ``retry_backoff_ms``, so with
100 ms a stream reconnects about 40 times a second for as long as a broker is down.

The consumer group is resolved here too (:func:`resolve_group`): the trigger's ``group_id``, else the
connection's ``group.id`` (the upstream provider requires one, so a user moving over keeps their group
and its committed offsets), else the name derived from connection and topics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from airflow_shared_stream_provider._core.connections import register_secrets
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

DEFAULT_RETRY_BACKOFF_MS = 1000
"""
``retry_backoff_ms`` unless the connection sets ``retry.backoff.ms``: how long aiokafka waits before
it retries a failed request or connection (a fixed pause, aiokafka has no growing reconnect
backoff). 1 s keeps a broker outage at a few reconnects a second per stream (measured through
the fault proxy: 208 in a 5 s refusal at aiokafka's 100 ms, see docs/reliability.md) and adds at
most about a second to the recovery after it.
"""


def _text(value: Any) -> str:
    return str(value).strip()


def _int(value: Any) -> int:
    return int(str(value).strip())


def _bool(value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _lower(value: Any) -> str:
    return str(value).strip().lower()


# librdkafka key -> (aiokafka consumer kwarg, converter)
_CONSUMER_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "bootstrap.servers": ("bootstrap_servers", _text),
    "client.id": ("client_id", _text),
    "group.id": ("group_id", _text),
    "group.instance.id": ("group_instance_id", _text),
    "auto.offset.reset": ("auto_offset_reset", _lower),
    "session.timeout.ms": ("session_timeout_ms", _int),
    "heartbeat.interval.ms": ("heartbeat_interval_ms", _int),
    "max.poll.interval.ms": ("max_poll_interval_ms", _int),
    "request.timeout.ms": ("request_timeout_ms", _int),
    "retry.backoff.ms": ("retry_backoff_ms", _int),
    "metadata.max.age.ms": ("metadata_max_age_ms", _int),
    "connections.max.idle.ms": ("connections_max_idle_ms", _int),
    "fetch.max.bytes": ("fetch_max_bytes", _int),
    "fetch.min.bytes": ("fetch_min_bytes", _int),
    "fetch.wait.max.ms": ("fetch_max_wait_ms", _int),
    "max.partition.fetch.bytes": ("max_partition_fetch_bytes", _int),
    "isolation.level": ("isolation_level", _lower),
    "check.crcs": ("check_crcs", _bool),
    "security.protocol": ("security_protocol", lambda v: _text(v).upper()),
    "sasl.mechanism": ("sasl_mechanism", lambda v: _text(v).upper()),
    "sasl.mechanisms": ("sasl_mechanism", lambda v: _text(v).upper()),
    "sasl.username": ("sasl_plain_username", _text),
    "sasl.password": ("sasl_plain_password", _text),
    "sasl.kerberos.service.name": ("sasl_kerberos_service_name", _text),
    "sasl.kerberos.domain.name": ("sasl_kerberos_domain_name", _text),
}
_SSL_KEYS = {
    "ssl.ca.location": "cafile",
    "ssl.certificate.location": "certfile",
    "ssl.key.location": "keyfile",
    "ssl.key.password": "password",
}
_IGNORED_KEYS = frozenset(
    {
        "enable.auto.offset.store",  # librdkafka-only bookkeeping; commits are explicit here
        "socket.keepalive.enable",
        "log_level",
        "debug",
    }
)
_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER")
_OFFSET_RESETS = ("earliest", "latest", "none")
_SECRET_HINTS = ("password", "secret", "token")
_SECRET_KEYS = ("sasl.password", "ssl.key.password")


GroupSource = Literal["trigger", "connection", "derived"]


@dataclass(frozen=True)
class ResolvedGroup:
    """The consumer group a stream uses, and which of the three sources it came from."""

    group_id: str
    source: GroupSource
    conn_id: str

    def origin(self) -> str:
        """Where the group came from, for logs and errors."""
        if self.source == "trigger":
            return "the trigger's group_id"
        if self.source == "connection":
            return f"group.id of connection {self.conn_id!r}"
        return f"derived: no group_id on the trigger, no group.id in connection {self.conn_id!r}"


def resolve_group(
    conn_id: str, connection_group_id: str | None, *, trigger_group_id: str | None, derived_group_id: str
) -> ResolvedGroup:
    """
    Precedence: the trigger's ``group_id`` > the connection's ``group.id`` > ``derived_group_id``.

    The connection's value matters because the upstream provider requires ``group.id`` in the very
    same connection: ignoring it would put a migrating user in a new group, which re-reads the
    topic (``auto.offset.reset=earliest``) or is refused by group ACLs. A blank ``group.id`` that
    would be used is an error, not a silent fall-back to the derived group.
    """
    if trigger_group_id:
        return ResolvedGroup(trigger_group_id, "trigger", conn_id)
    if connection_group_id is not None:
        if not connection_group_id:
            raise SharedStreamConfigError(
                f"connection {conn_id!r} sets an empty group.id; set a group name or remove the key"
            )
        return ResolvedGroup(connection_group_id, "connection", conn_id)
    return ResolvedGroup(derived_group_id, "derived", conn_id)


@dataclass
class KafkaClientConfig:
    """aiokafka kwargs for the consumer, and the subset (security + bootstrap) for the DLQ producer."""

    consumer: dict[str, Any]
    common: dict[str, Any]
    group: ResolvedGroup
    ssl: dict[str, Any] = field(default_factory=dict)
    check_hostname: bool = True

    def redacted(self) -> dict[str, Any]:
        """The consumer kwargs with secrets masked, safe to log."""
        return _masked(self.consumer)

    def __repr__(self) -> str:
        # Not the dataclass repr: a config ends up in tracebacks, debug logs and test output, and
        # the SASL password (consumer and common) and the SSL key password (ssl) must not.
        return (
            f"KafkaClientConfig(consumer={_masked(self.consumer)!r}, common={_masked(self.common)!r}, "
            f"group={self.group!r}, ssl={_masked(self.ssl)!r}, check_hostname={self.check_hostname!r})"
        )


def _masked(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the value of every secret-looking name (password, secret, token) masked."""
    return {k: ("***" if any(h in k for h in _SECRET_HINTS) else v) for k, v in kwargs.items()}


def kafka_client_config(
    conn_id: str, extras: Mapping[str, Any], *, trigger_group_id: str | None, derived_group_id: str
) -> KafkaClientConfig:
    """
    Translate one connection's extras; the consumer's ``group_id`` is :func:`resolve_group`'s.

    Refuses ``enable.auto.commit=true``: the shared stream commits offsets only after the derived
    events are persisted; auto-commit would commit on its own schedule and lose messages on a
    triggerer crash.
    """
    consumer: dict[str, Any] = {}
    ssl: dict[str, Any] = {}
    check_hostname = True
    for raw_key, value in extras.items():
        key = raw_key.strip()
        if key == "enable.auto.commit":
            try:
                enabled = _bool(value)
            except ValueError as exc:
                raise SharedStreamConfigError(f"connection {conn_id!r}: {key}={value!r}: {exc}") from exc
            if enabled:
                raise SharedStreamConfigError(
                    f"connection {conn_id!r} sets enable.auto.commit=true: shared streams commit offsets only "
                    "after the asset events are persisted, and auto-commit would commit on its own schedule "
                    "and lose messages when the triggerer crashes. Remove it or set it to false."
                )
            continue
        if key in _IGNORED_KEYS:
            continue
        if key == "ssl.endpoint.identification.algorithm":
            check_hostname = _lower(value) not in ("none", "")
            continue
        if key in _SSL_KEYS:
            ssl[_SSL_KEYS[key]] = _text(value)
            continue
        mapped = _CONSUMER_KEYS.get(key)
        if mapped is None:
            raise SharedStreamConfigError(
                f"connection {conn_id!r}: unsupported Kafka setting {key!r}. Supported: "
                f"{', '.join(sorted([*_CONSUMER_KEYS, *_SSL_KEYS, 'ssl.endpoint.identification.algorithm']))}"
            )
        name, convert = mapped
        try:
            consumer[name] = convert(value)
        except ValueError as exc:
            raise SharedStreamConfigError(f"connection {conn_id!r}: {key}={value!r} is not valid: {exc}") from exc
    if not consumer.get("bootstrap_servers"):
        raise SharedStreamConfigError(f"connection {conn_id!r} has no bootstrap.servers in its extras")
    protocol = consumer.setdefault("security_protocol", "PLAINTEXT")
    if protocol not in _SECURITY_PROTOCOLS:
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: security.protocol {protocol!r} not in {_SECURITY_PROTOCOLS}"
        )
    mechanism = consumer.get("sasl_mechanism")
    if mechanism is not None and mechanism not in _SASL_MECHANISMS:
        raise SharedStreamConfigError(f"connection {conn_id!r}: sasl.mechanism {mechanism!r} not in {_SASL_MECHANISMS}")
    if protocol.startswith("SASL") and mechanism is None:
        raise SharedStreamConfigError(f"connection {conn_id!r}: security.protocol {protocol} needs sasl.mechanism")
    if mechanism == "OAUTHBEARER":
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: sasl.mechanism OAUTHBEARER needs a token provider object, which a "
            "connection cannot carry; use SCRAM or PLAIN over SASL_SSL"
        )
    consumer.setdefault("retry_backoff_ms", DEFAULT_RETRY_BACKOFF_MS)
    reset = consumer.setdefault("auto_offset_reset", "earliest")
    if reset not in _OFFSET_RESETS:
        raise SharedStreamConfigError(f"connection {conn_id!r}: auto.offset.reset {reset!r} not in {_OFFSET_RESETS}")
    # group.id went through _text like every key; it is popped and put back resolved, so the consumer
    # never sees a group other than the one logged and claimed by the producer.
    group = resolve_group(
        conn_id,
        consumer.pop("group_id", None),
        trigger_group_id=trigger_group_id,
        derived_group_id=derived_group_id,
    )
    consumer["group_id"] = group.group_id
    common_keys = (
        "bootstrap_servers",
        "client_id",
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
        "sasl_kerberos_service_name",
        "sasl_kerberos_domain_name",
        "request_timeout_ms",
        "retry_backoff_ms",
        "metadata_max_age_ms",
        "connections_max_idle_ms",
    )
    common = {k: consumer[k] for k in common_keys if k in consumer}
    return KafkaClientConfig(consumer=consumer, common=common, group=group, ssl=ssl, check_hostname=check_hostname)


async def load_kafka_client_config(
    conn_id: str, *, trigger_group_id: str | None, derived_group_id: str
) -> KafkaClientConfig:
    """
    Read the ``kafka`` connection ``conn_id`` and translate it (:func:`kafka_client_config`).

    The SASL password and the SSL key password are registered with Airflow's secrets masker first,
    as read and as used (stripped), before anything can fail on them: Airflow masks the whole extra
    text and, by name, the extras it is told about, but registers the latter synchronously, which
    does not reach the triggerer's supervisor from a producer's task (see
    :func:`~airflow_shared_stream_provider._core.connections.register_secrets`).
    """
    from airflow.sdk import BaseHook

    try:
        connection = await BaseHook.aget_connection(conn_id)
    except Exception as exc:
        raise SharedStreamConfigError(f"Kafka connection {conn_id!r} could not be read: {exc}") from exc
    extras = connection.extra_dejson
    for raw_key, value in extras.items():
        if raw_key.strip() in _SECRET_KEYS and value is not None:
            await register_secrets(str(value), _text(value))
    return kafka_client_config(conn_id, extras, trigger_group_id=trigger_group_id, derived_group_id=derived_group_id)
