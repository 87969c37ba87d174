"""
The upstream ``azure_service_bus`` Airflow connection, read directly (the rules every reader keeps:
:mod:`airflow_shared_stream_provider._core.connections`): a connection string, or a namespace for
``DefaultAzureCredential``. Imports no Azure SDK; the clients are built in :mod:`.servicebus`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from airflow_shared_stream_provider._core.connections import register_secrets
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

_UNSET_VALUES: Final = ("", "none", "null")
# Only a scheme and a host name (and port) are ever taken from the Endpoint: a string separated by
# "," or newlines instead of ";" must not let SharedAccessKey=... ride along into a log line.
_ENDPOINT = re.compile(
    r"(?i)(?:^|[;,\s])Endpoint\s*=\s*(?P<endpoint>(?:sb|amqps?|https?)://[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::\d{1,5})?)"
    r"/?(?=$|[;,\s])"
)
# The secret values of a connection string: the key, or a shared access signature.
_SAS_PART = re.compile(r"(?i)(?:^|;)\s*SharedAccess(?:Key|Signature)\s*=\s*([^;]+)")
_HOST_NAME = re.compile(r"(?i)[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::\d{1,5})?")


@dataclass(frozen=True, slots=True)
class ServiceBusConnectionInfo:
    """How to reach the namespace, read from an ``azure_service_bus`` Airflow connection."""

    conn_id: str
    connection_string: str | None = field(default=None, repr=False)
    fully_qualified_namespace: str | None = None
    managed_identity_client_id: str | None = None
    workload_identity_tenant_id: str | None = None

    def __repr__(self) -> str:
        # Replaces the generated repr, which printed the connection string (its SharedAccessKey).
        return f"ServiceBusConnectionInfo({self.describe()})"

    __str__ = __repr__

    def secrets(self) -> tuple[str, ...]:
        """The connection string and the key (or SAS token) inside it: what a library could print."""
        if self.connection_string is None:
            return ()
        parts = [m.group(1).strip() for m in _SAS_PART.finditer(self.connection_string)]
        return (self.connection_string, *parts)

    def describe(self) -> str:
        """The namespace without secrets, for logs and errors."""
        if self.connection_string is not None:
            match = _ENDPOINT.search(self.connection_string)
            endpoint = match.group("endpoint") if match else "<Endpoint not readable>"
            return f"{endpoint} (connection {self.conn_id!r}, connection string)"
        # A namespace is a host name; anything else (a connection string pasted into the host
        # field) is not echoed.
        namespace = self.fully_qualified_namespace or ""
        shown = namespace if _HOST_NAME.fullmatch(namespace) else "<namespace not readable>"
        return f"{shown} (connection {self.conn_id!r}, DefaultAzureCredential)"


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _UNSET_VALUES)


def _azure_extra(extras: Mapping[str, Any], name: str) -> str | None:
    """``name`` or its legacy ``extra__azure_service_bus__`` form, like the upstream hook."""
    for key in (name, f"extra__azure_service_bus__{name}"):
        value = extras.get(key)
        if not _unset(value):
            return str(value).strip()
    return None


def connection_info(conn_id: str, *, schema: Any, host: Any, extras: Mapping[str, Any]) -> ServiceBusConnectionInfo:
    """
    Interpret an ``azure_service_bus`` connection the way the upstream provider does.

    The connection string is the *schema* field (the upstream form relabels it "Connection
    String"), else the ``connection_string`` extra; ``None``, ``""`` and the text ``"None"`` (what
    ``str(None)`` left in connections saved by older forms) count as unset. Without one, the
    ``fully_qualified_namespace`` extra (or the host) is used with ``DefaultAzureCredential``.
    """
    if not _unset(schema):
        return ServiceBusConnectionInfo(conn_id, connection_string=str(schema).strip())
    connection_string = _azure_extra(extras, "connection_string")
    if connection_string is not None:
        return ServiceBusConnectionInfo(conn_id, connection_string=connection_string)
    if _azure_extra(extras, "credential") is not None:
        raise SharedStreamConfigError(
            f"Service Bus connection {conn_id!r}: the 'credential' extra is not supported; put a connection "
            "string in the Connection String (schema) field, or use fully_qualified_namespace with "
            "DefaultAzureCredential (managed_identity_client_id / workload_identity_tenant_id extras)"
        )
    namespace = _azure_extra(extras, "fully_qualified_namespace") or (None if _unset(host) else str(host).strip())
    if namespace is None:
        raise SharedStreamConfigError(
            f"Service Bus connection {conn_id!r} has neither a connection string (schema field or "
            "'connection_string' extra) nor a 'fully_qualified_namespace' extra"
        )
    namespace = re.sub(r"^(?:sb|amqps?)://", "", namespace).rstrip("/")
    return ServiceBusConnectionInfo(
        conn_id,
        fully_qualified_namespace=namespace,
        managed_identity_client_id=_azure_extra(extras, "managed_identity_client_id"),
        workload_identity_tenant_id=_azure_extra(extras, "workload_identity_tenant_id"),
    )


async def load_connection_info(conn_id: str) -> ServiceBusConnectionInfo:
    """
    Read the ``azure_service_bus`` connection (it must exist: there is no default namespace) and
    interpret it. The connection string and its SharedAccessKey (or SharedAccessSignature) are
    registered with Airflow's secrets masker: Airflow masks the password and the extras, never the
    schema field, where the upstream form keeps the connection string.
    """
    from airflow.sdk import BaseHook

    try:
        connection = await BaseHook.aget_connection(conn_id)
    except Exception as exc:
        raise SharedStreamConfigError(f"Service Bus connection {conn_id!r} could not be read: {exc}") from exc
    info = connection_info(
        conn_id, schema=connection.schema, host=connection.host, extras=connection.extra_dejson or {}
    )
    await register_secrets(*info.secrets())
    return info
