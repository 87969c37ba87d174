"""
The upstream providers' Airflow connections, read directly: ``aws`` (SQS), ``google_cloud_platform``
(Pub/Sub) and ``azure_service_bus``. This provider declares no connection type and uses none of
the upstream hooks; no broker SDK is imported here, the producer builds its client from what is
read.

Rules every reader keeps:

* a connection that does not exist means the SDK's default credentials (the AWS chain, Google's
  Application Default Credentials); Service Bus has no such default and needs its connection;
* extras may carry the legacy ``extra__<conn type>__`` prefix, as the upstream hooks accept;
* nothing read here reaches a log line or an error message: ``describe()`` says where without
  secrets, and errors name the extra or field, never its value;
* nothing read here shows in a ``repr`` either (tracebacks with locals, Sentry, debuggers print
  dataclasses through it): every dataclass below prints only what ``describe()`` says, or hides
  its secret fields;
* a configuration mistake is a :class:`SharedStreamConfigError` that names the connection
  (:func:`config_error`), so the watchers' failure says what to fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit, urlunsplit

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

if TYPE_CHECKING:
    from airflow.sdk import Connection
    from google.auth.credentials import Credentials


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


def prefixed_extra(extras: Mapping[str, Any], name: str, conn_type: str) -> Any:
    """Extra ``name``, else its legacy ``extra__<conn_type>__<name>`` form; ``""`` counts as unset."""
    value = extras.get(name)
    if value in (None, ""):
        value = extras.get(f"extra__{conn_type}__{name}")
    return None if value == "" else value


# -- aws ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AwsConnection:
    """What an AWS client is built from: read from the Airflow connection (never logged: has secrets)."""

    region_name: str | None
    endpoint_url: str | None
    access_key_id: str | None
    secret_access_key: str | None
    session_token: str | None
    role_arn: str | None
    assume_role_kwargs: dict[str, Any]
    config_kwargs: dict[str, Any]
    verify: bool | str | None
    connection_found: bool

    def __repr__(self) -> str:
        # Replaces the generated repr, which printed the secret key and session token (and
        # assume_role_kwargs / config_kwargs, which may hold an ExternalId or proxy credentials).
        return f"AwsConnection({self.describe()})"

    __str__ = __repr__

    def describe(self) -> str:
        """Secret-free description for logs and errors."""
        creds = (
            "access key from the connection"
            if self.access_key_id
            else ("default credential chain" if not self.connection_found else "connection without keys (chain)")
        )
        parts = [f"region={self.region_name or '<chain default>'}", f"credentials={creds}"]
        if self.endpoint_url:
            parts.append(f"endpoint_url={without_userinfo(self.endpoint_url)}")
        if self.role_arn:
            parts.append(f"role_arn={self.role_arn}")
        return ", ".join(parts)


def without_userinfo(url: str) -> str:
    """``url`` without a ``user:password@`` part (an endpoint or proxy URL may carry one)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"<redacted>@{host}"))


async def load_aws_connection(
    conn_id: str | None, *, service: str, region_name: str | None, fallback_region: str | None
) -> AwsConnection:
    """
    Read the upstream ``aws`` connection shape.

    login/password = access key id / secret access key; extras ``region_name``, ``endpoint_url``
    (or ``service_config.<service>.endpoint_url``), ``aws_session_token``, ``role_arn`` (+
    ``assume_role_kwargs``), ``config_kwargs``, ``verify``. The region is ``region_name`` (the
    trigger's), else the connection's, else ``fallback_region`` (e.g. from a queue URL). No
    ``conn_id``, or a connection that does not exist, means the default AWS credential chain.
    """
    extras: dict[str, Any] = {}
    login = password = None
    found = False
    conn = await read_connection(conn_id) if conn_id else None
    if conn is not None:
        found = True
        login, password = conn.login or None, conn.password or None
        extras = await conn.aextra_dejson() if hasattr(conn, "aextra_dejson") else conn.extra_dejson
    service_config = extras.get("service_config") or {}
    own_config = service_config.get(service) if isinstance(service_config, dict) else None
    endpoint = (own_config or {}).get("endpoint_url") or extras.get("endpoint_url")
    config_kwargs = extras.get("config_kwargs") or {}
    if not isinstance(config_kwargs, dict):
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: extra config_kwargs must be a JSON object, got {config_kwargs!r}"
        )
    assume_kwargs = extras.get("assume_role_kwargs") or {}
    if not isinstance(assume_kwargs, dict):
        raise SharedStreamConfigError(f"connection {conn_id!r}: extra assume_role_kwargs must be an object")
    region = region_name or extras.get("region_name") or config_kwargs.get("region_name") or fallback_region
    return AwsConnection(
        region_name=region,
        endpoint_url=endpoint,
        access_key_id=login or extras.get("aws_access_key_id"),
        secret_access_key=password or extras.get("aws_secret_access_key"),
        session_token=extras.get("aws_session_token"),
        role_arn=extras.get("role_arn"),
        assume_role_kwargs=assume_kwargs,
        config_kwargs=config_kwargs,
        verify=extras.get("verify"),
        connection_found=found,
    )


# What an AWS error code (any service) says about the connection, and which codes mean "busy, retry".
_AWS_BAD_CREDENTIAL_CODES: Final = frozenset(
    {
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "ExpiredToken",
        "InvalidSecurity",
        "MissingAuthenticationToken",
    }
)
_AWS_DENIED_CODES: Final = frozenset({"AccessDenied", "AccessDeniedException", "KMS.AccessDeniedException"})
AWS_THROTTLE_CODES: Final = frozenset(
    {"ThrottlingException", "RequestThrottled", "Throttling", "ServiceUnavailable", "InternalError", "InternalFailure"}
)
# config_kwargs the client config takes from the connection; region_name is read as the region.
_AWS_FORWARDED_CONFIG: Final = frozenset(
    {
        "connect_timeout",
        "read_timeout",
        "retries",
        "max_pool_connections",
        "proxies",
        "user_agent_extra",
        "tcp_keepalive",
        "signature_version",
    }
)


def aws_error_cause(code: str, text: str, *, resource: str) -> str:
    """An AWS error code and message as a cause a user can act on (credentials, access), else as given."""
    if code in _AWS_BAD_CREDENTIAL_CODES:
        return f"AWS rejected the credentials [{code}: {text}]"
    if code in _AWS_DENIED_CODES:
        return f"access denied to {resource!r} [{code}: {text}]"
    return f"{code}: {text}"


def aws_config_kwargs(connection: AwsConnection) -> tuple[dict[str, Any], list[str]]:
    """The connection's ``config_kwargs`` the client config takes, and (sorted) those it cannot."""
    config = connection.config_kwargs
    forwarded = {key: value for key, value in config.items() if key in _AWS_FORWARDED_CONFIG}
    unsupported = sorted(set(config) - _AWS_FORWARDED_CONFIG - {"region_name"})
    return forwarded, unsupported


# -- google_cloud_platform -----------------------------------------------------------------------------
GCP: Final = "google_cloud_platform"
CLOUD_PLATFORM_SCOPE: Final = "https://www.googleapis.com/auth/cloud-platform"


@dataclass(frozen=True, slots=True)
class GcpConnection:
    """What a Google client is built from (never logged: holds credentials)."""

    credentials: Credentials | None = field(repr=False)
    project: str | None
    emulator_host: str | None


async def load_gcp_connection(conn_id: str) -> GcpConnection:
    """
    Read ``conn_id`` (upstream ``google_cloud_platform`` shape) and build its credentials.

    Extras (each also with the legacy ``extra__google_cloud_platform__`` prefix): ``keyfile_dict``,
    ``key_path``, ``credential_config_file``, ``project``, ``scope``, ``impersonation_chain``,
    ``is_anonymous``; none of them (or no connection) means Application Default Credentials.
    ``key_secret_name`` (a key in Secret Manager) is refused by name. With ``PUBSUB_EMULATOR_HOST``
    set (read as the client library does) there are no credentials: the emulator needs none.
    """
    connection = await read_connection(conn_id)
    extras: dict[str, Any] = dict(connection.extra_dejson or {}) if connection is not None else {}
    if prefixed_extra(extras, "key_secret_name", GCP):
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: extra 'key_secret_name' (key in Secret Manager) is not supported by the "
            "shared-stream provider; use keyfile_dict, key_path or Application Default Credentials"
        )
    project = prefixed_extra(extras, "project", GCP)
    emulator_host = os.environ.get("PUBSUB_EMULATOR_HOST") or None
    if emulator_host:
        return GcpConnection(credentials=None, project=project, emulator_host=emulator_host)
    credentials, cred_project = await asyncio.to_thread(_gcp_credentials, conn_id, extras)
    return GcpConnection(credentials=credentials, project=project or cred_project, emulator_host=None)


def _gcp_credentials(conn_id: str, extras: Mapping[str, Any]) -> tuple[Credentials, str | None]:
    """Blocking (files, metadata server): run in a thread. google-auth comes with the ``pubsub`` extra."""
    import google.auth
    import google.auth.exceptions
    from google.auth import credentials as auth_credentials
    from google.auth import impersonated_credentials
    from google.oauth2 import service_account

    def extra(name: str) -> Any:
        return prefixed_extra(extras, name, GCP)

    scope_text = extra("scope")
    scopes = [s.strip() for s in str(scope_text).split(",") if s.strip()] if scope_text else [CLOUD_PLATFORM_SCOPE]
    keyfile_dict = extra("keyfile_dict")
    key_path = extra("key_path")
    config_file = extra("credential_config_file")
    project: str | None = None
    credentials: Any
    try:
        if str(extra("is_anonymous")).lower() == "true":
            credentials = auth_credentials.AnonymousCredentials()  # type: ignore[no-untyped-call]
        elif keyfile_dict:
            info = json.loads(keyfile_dict) if isinstance(keyfile_dict, str) else dict(keyfile_dict)
            credentials = service_account.Credentials.from_service_account_info(info, scopes=scopes)  # type: ignore[no-untyped-call]
            project = info.get("project_id")
        elif key_path:
            if str(key_path).endswith(".p12"):
                raise SharedStreamConfigError(f"connection {conn_id!r}: legacy P12 key_path files are not supported")
            credentials = service_account.Credentials.from_service_account_file(str(key_path), scopes=scopes)  # type: ignore[no-untyped-call]
            project = credentials.project_id
        elif config_file:
            if isinstance(config_file, Mapping):
                credentials, project = google.auth.load_credentials_from_dict(dict(config_file), scopes=scopes)  # type: ignore[no-untyped-call]
            else:
                credentials, project = google.auth.load_credentials_from_file(str(config_file), scopes=scopes)  # type: ignore[no-untyped-call]
        else:
            credentials, project = google.auth.default(scopes=scopes)
    except SharedStreamConfigError:
        raise
    except (ValueError, OSError, google.auth.exceptions.GoogleAuthError) as exc:
        # The message names the extra but never echoes its value (it may be a private key).
        source = (
            "keyfile_dict"
            if keyfile_dict
            else "key_path"
            if key_path
            else "credential_config_file"
            if config_file
            else "Application Default Credentials"
        )
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: cannot load Google credentials from {source}: {type(exc).__name__}"
        ) from None
    chain = _impersonation_chain(extra("impersonation_chain"))
    if chain:
        credentials = impersonated_credentials.Credentials(  # type: ignore[no-untyped-call]
            source_credentials=credentials,
            target_principal=chain[-1],
            delegates=chain[:-1] or None,
            target_scopes=scopes,
        )
    return credentials, project


def _impersonation_chain(value: Any) -> list[str]:
    """The ``impersonation_chain`` extra (one account, comma-separated, or a list) as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        return [str(part).strip() for part in value if str(part).strip()]
    raise SharedStreamConfigError(f"impersonation_chain must be a string or a list, got {type(value).__name__}")


# -- azure_service_bus ---------------------------------------------------------------------------------
_UNSET_VALUES: Final = ("", "none", "null")
# Only a scheme and a host name (and port) are ever taken from the Endpoint: a string separated by
# "," or newlines instead of ";" must not let SharedAccessKey=... ride along into a log line.
_ENDPOINT = re.compile(
    r"(?i)(?:^|[;,\s])Endpoint\s*=\s*(?P<endpoint>(?:sb|amqps?|https?)://[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?(?::\d{1,5})?)"
    r"/?(?=$|[;,\s])"
)
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
    """Read the ``azure_service_bus`` connection (it must exist: there is no default namespace) and interpret it."""
    from airflow.sdk import BaseHook

    try:
        connection = await BaseHook.aget_connection(conn_id)
    except Exception as exc:
        raise SharedStreamConfigError(f"Service Bus connection {conn_id!r} could not be read: {exc}") from exc
    return connection_info(
        conn_id, schema=connection.schema, host=connection.host, extras=connection.extra_dejson or {}
    )
