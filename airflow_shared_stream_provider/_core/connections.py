"""
Reading an Airflow connection, for every broker's connection reader: the task SDK lookup, the
extras, the configuration error that names the connection, and the secrets masker. Nothing here
knows a connection type; each broker's reader sits beside its producer
(``producers/aws_connection.py``: ``aws`` for SQS; ``producers/pubsub_connection.py``:
``google_cloud_platform``; ``producers/servicebus_connection.py``: ``azure_service_bus``; Redis and
Kafka read theirs in ``producers/redis_client.py`` and ``producers/kafka_config.py``). This provider
declares no connection type and uses none of the upstream hooks; no broker SDK is imported by a
reader, the producer builds its client from what is read.

Rules every reader keeps:

* a connection that does not exist means the SDK's default credentials (the AWS chain, Google's
  Application Default Credentials); Service Bus has no such default and needs its connection;
* extras may carry the legacy ``extra__<conn type>__`` prefix, as the upstream hooks accept;
* nothing read reaches a log line or an error message: ``describe()`` says where without
  secrets, and errors name the extra or field, never its value;
* nothing read shows in a ``repr`` either (tracebacks with locals, Sentry, debuggers print
  dataclasses through it): every connection dataclass prints only what ``describe()`` says, or
  hides its secret fields;
* a configuration mistake is a :class:`SharedStreamConfigError` that names the connection
  (:func:`config_error`), so the watchers' failure says what to fix;
* every secret is registered with Airflow's secrets masker as it is read (:func:`register_secrets`),
  in the exact form a library or a traceback could print it (the SharedAccessKey inside a Service
  Bus connection string, the PEM inside a keyfile JSON), so that a log line that does print one
  shows ``***``. Airflow itself masks a connection's password, its whole extra text and extras with
  sensitive names, but neither the schema field (Service Bus's connection string) nor the parts of
  a value, nor credentials obtained later (STS, see ``producers/aws_session.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

if TYPE_CHECKING:
    from airflow.sdk import Connection


def config_error(subject: str, cause: str, exc: BaseException | None = None) -> SharedStreamConfigError:
    """``<subject>: <cause>`` as a configuration error, chained to the broker error ``exc``."""
    error = SharedStreamConfigError(f"{subject}: {cause}")
    error.__cause__ = exc
    return error


async def read_connection(conn_id: str) -> Connection | None:
    """The Airflow connection ``conn_id`` through the task SDK (async); None when it does not exist."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return await BaseHook.aget_connection(conn_id)
    except AirflowNotFoundException:
        return None


async def register_secrets(*values: Any) -> None:
    """
    Register each non-empty string of ``values`` with Airflow's secrets masker.

    ``amask_secret`` (task SDK) adds it to this process's masker *and*, in a triggerer, sends it to
    the supervisor process: trigger code runs in the TriggerRunner subprocess, whose log lines are
    masked only when the supervisor writes them, with the masks it was sent. The synchronous
    ``mask_secret`` cannot send from a coroutine that has no greenback portal (a shared-stream
    producer's task has none) and then registers the secret in the subprocess only, where nothing
    masks; hence the async form. Values shorter than ``[logging] min_length_masked_secret`` (5) are
    skipped by Airflow itself, as for every other secret.
    """
    try:
        from airflow.sdk.log import amask_secret
    except ImportError:  # pragma: no cover - task SDK before amask_secret
        from airflow.sdk.log import mask_secret

        for value in values:
            if isinstance(value, str) and value:
                mask_secret(value)
        return
    for value in values:
        if isinstance(value, str) and value:
            await amask_secret(value)


async def read_extras(connection: Connection) -> Any:
    """
    The connection's extra as decoded JSON: ``aextra_dejson`` (it reads the extra without blocking
    the triggerer's loop) where the task SDK has it, else ``extra_dejson``. The caller checks the type.
    """
    if hasattr(connection, "aextra_dejson"):
        return await connection.aextra_dejson()
    return connection.extra_dejson
