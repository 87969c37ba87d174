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
  (:func:`config_error`), so the watchers' failure says what to fix;
* every secret is registered with Airflow's secrets masker as it is read (:func:`register_secrets`),
  in the exact form a library or a traceback could print it (the SharedAccessKey inside a Service
  Bus connection string, the PEM inside a keyfile JSON), so that a log line that does print one
  shows ``***``. Airflow itself masks a connection's password, its whole extra text and extras with
  sensitive names, but neither the schema field (Service Bus's connection string) nor the parts of
  a value, nor credentials obtained later (STS, see ``producers/aws_session.py``).
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


def prefixed_extra(extras: Mapping[str, Any], name: str, conn_type: str) -> Any:
    """Extra ``name``, else its legacy ``extra__<conn_type>__<name>`` form; ``""`` counts as unset."""
    value = extras.get(name)
    if value in (None, ""):
        value = extras.get(f"extra__{conn_type}__{name}")
    return None if value == "" else value


# -- aws ---------------------------------------------------------------------------------------------
AWS_ASSUME_ROLE_METHODS: Final = ("assume_role", "assume_role_with_saml", "assume_role_with_web_identity")
"""The ``assume_role_method`` values the amazon provider knows (``assume_role`` unless set)."""
AWS_WEB_IDENTITY_FEDERATIONS: Final = ("file", "google")
_AWS_SESSION_CREDENTIAL_KEYS: Final = frozenset({"aws_access_key_id", "aws_secret_access_key", "aws_session_token"})


@dataclass(frozen=True, slots=True)
class AwsConnection:
    """
    What an AWS client is built from: read from the Airflow connection (never logged: has secrets).

    ``connection`` is the Airflow connection itself: with the amazon provider installed the session
    is built from it by the provider's own ``AwsConnectionWrapper`` / ``SessionFactory``
    (``producers/aws_session.py``), so every field below only serves the reader without it, errors
    and :meth:`describe`.
    """

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
    conn_id: str | None = None
    profile_name: str | None = None
    # None without role_arn (the provider reads the method only with a role, and so do we).
    assume_role_method: str | None = None
    # service_config.sts.endpoint_url: where the provider sends AssumeRole*; never endpoint_url.
    sts_endpoint_url: str | None = None
    web_identity_federation: str | None = None
    web_identity_token_file: str | None = None
    connection: Connection | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        # Replaces the generated repr, which printed the secret key and session token (and
        # assume_role_kwargs / config_kwargs, which may hold an ExternalId or proxy credentials).
        return f"AwsConnection({self.describe()})"

    __str__ = __repr__

    def describe(self) -> str:
        """Secret-free description for logs and errors."""
        if self.access_key_id:
            creds = "access key from the connection"
        elif self.profile_name:
            creds = f"profile {self.profile_name!r}"
        elif not self.connection_found:
            creds = "default credential chain"
        else:
            creds = "connection without keys (chain)"
        parts = [f"region={self.region_name or '<chain default>'}", f"credentials={creds}"]
        if self.endpoint_url:
            parts.append(f"endpoint_url={without_userinfo(self.endpoint_url)}")
        if self.role_arn:
            parts.append(f"role_arn={self.role_arn}")
            parts.append(f"assume_role_method={self.assume_role_method}")
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


def _aws_static_credentials(
    login: str | None, password: str | None, extras: Mapping[str, Any], session_kwargs: Mapping[str, Any]
) -> tuple[str | None, str | None, str | None]:
    """
    The access key pair and session token, in the amazon provider's order (its
    ``AwsConnectionWrapper._get_credentials``): login + password, else the extras'
    ``aws_access_key_id`` + ``aws_secret_access_key``, else the same pair in ``session_kwargs``; the
    token from ``aws_session_token``, else ``session_kwargs``. A lone login or password is kept so
    that the producer can refuse it by name instead of silently using the credential chain.
    """
    key_id, secret = login, password
    if not (login and password):
        if extras.get("aws_access_key_id") and extras.get("aws_secret_access_key"):
            key_id, secret = extras["aws_access_key_id"], extras["aws_secret_access_key"]
        elif session_kwargs.get("aws_access_key_id") and session_kwargs.get("aws_secret_access_key"):
            key_id, secret = session_kwargs["aws_access_key_id"], session_kwargs["aws_secret_access_key"]
    token = extras.get("aws_session_token") or session_kwargs.get("aws_session_token")
    return key_id or None, secret or None, token or None


async def load_aws_connection(
    conn_id: str | None, *, service: str, region_name: str | None, fallback_region: str | None
) -> AwsConnection:
    """
    Read the upstream ``aws`` connection shape.

    login/password = access key id / secret access key (or the extras ``aws_access_key_id`` /
    ``aws_secret_access_key``, or those in ``session_kwargs``); extras ``region_name``,
    ``endpoint_url`` (or ``service_config.<service>.endpoint_url``), ``aws_session_token``,
    ``profile_name``, ``role_arn`` (+ ``assume_role_method``, ``assume_role_kwargs``,
    ``service_config.sts.endpoint_url``, the ``assume_role_with_web_identity_*`` extras),
    ``config_kwargs``, ``verify``. The region is ``region_name`` (the trigger's), else the
    connection's, else ``fallback_region`` (e.g. from a queue URL). No ``conn_id``, or a connection
    that does not exist, means the default AWS credential chain.

    Refused here, whoever builds the session: an unknown ``assume_role_method`` or web identity
    federation, and ``session_kwargs`` keys other than the three credentials (the amazon provider
    reads only those and ignores the rest, so a profile or region put there would silently not
    apply). The secret key and session token are registered with Airflow's masker.
    """
    extras: dict[str, Any] = {}
    login = password = None
    found = False
    conn = await read_connection(conn_id) if conn_id else None
    if conn is not None:
        found = True
        login, password = conn.login or None, conn.password or None
        extras = await read_extras(conn)

    def error(cause: str) -> SharedStreamConfigError:
        return SharedStreamConfigError(f"connection {conn_id!r}: {cause}")

    def object_extra(name: str) -> dict[str, Any]:
        value = extras.get(name) or {}
        if not isinstance(value, dict):
            raise error(f"extra {name} must be a JSON object, got {type(value).__name__}")
        return value

    service_config = object_extra("service_config")
    own_config = service_config.get(service) or {}
    sts_config = service_config.get("sts") or {}
    if not isinstance(own_config, dict) or not isinstance(sts_config, dict):
        raise error(f"service_config.{service} and service_config.sts must be JSON objects")
    endpoint = own_config.get("endpoint_url") or extras.get("endpoint_url")
    config_kwargs = object_extra("config_kwargs")
    assume_kwargs = object_extra("assume_role_kwargs")
    session_kwargs = object_extra("session_kwargs")
    ignored = sorted(set(session_kwargs) - _AWS_SESSION_CREDENTIAL_KEYS)
    if ignored:
        raise error(
            f"session_kwargs key(s) {ignored} are not supported: the amazon provider reads only "
            f"{sorted(_AWS_SESSION_CREDENTIAL_KEYS)} there (and ignores the rest); put profile_name and "
            "region_name in the extras themselves"
        )
    role_arn = extras.get("role_arn") or None
    method: str | None = None
    federation = token_file = None
    if role_arn:
        method = extras.get("assume_role_method") or "assume_role"
        if method not in AWS_ASSUME_ROLE_METHODS:
            raise error(f"extra assume_role_method {method!r} is not one of {list(AWS_ASSUME_ROLE_METHODS)}")
        if method == "assume_role_with_web_identity":
            federation = extras.get("assume_role_with_web_identity_federation")
            if federation not in AWS_WEB_IDENTITY_FEDERATIONS:
                raise error(
                    f"extra assume_role_with_web_identity_federation {federation!r} is not one of "
                    f"{list(AWS_WEB_IDENTITY_FEDERATIONS)} (required with assume_role_with_web_identity)"
                )
            token_file = extras.get("assume_role_with_web_identity_token_file") or os.environ.get(
                "AWS_WEB_IDENTITY_TOKEN_FILE"
            )
    key_id, secret, token = _aws_static_credentials(login, password, extras, session_kwargs)
    await register_secrets(secret, token)
    region = region_name or extras.get("region_name") or config_kwargs.get("region_name") or fallback_region
    return AwsConnection(
        region_name=region,
        endpoint_url=endpoint,
        access_key_id=key_id,
        secret_access_key=secret,
        session_token=token,
        role_arn=role_arn,
        assume_role_kwargs=assume_kwargs,
        config_kwargs=config_kwargs,
        verify=extras.get("verify"),
        connection_found=found,
        conn_id=conn_id,
        profile_name=extras.get("profile_name") or None,
        assume_role_method=method,
        sts_endpoint_url=sts_config.get("endpoint_url"),
        web_identity_federation=federation,
        web_identity_token_file=token_file,
        connection=conn,
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
    As the google provider's ``GoogleBaseHook``: ``keyfile_dict``, ``key_path``,
    ``credential_config_file`` and ``key_secret_name`` exclude each other (an error, not a
    precedence). Refused by name, since without them the credentials would silently be another
    identity: ``key_secret_name`` (a key in Secret Manager) and the client-credentials grant
    (``idp_issuer_url``, with ``client_id``, ``client_secret``, ``idp_extra_params``). With
    ``PUBSUB_EMULATOR_HOST`` set (read as the client library does) there are no credentials: the
    emulator needs none. The keyfile JSON, its private key (also a key_path file's) and a
    ``client_secret`` are registered with Airflow's secrets masker as read.
    """
    connection = await read_connection(conn_id)
    extras: dict[str, Any] = {}
    if connection is not None:
        extras = dict(await read_extras(connection))
    keyfile_dict = prefixed_extra(extras, "keyfile_dict", GCP)
    await register_secrets(
        keyfile_dict if isinstance(keyfile_dict, str) else None,
        _private_key(keyfile_dict),
        prefixed_extra(extras, "client_secret", GCP),
    )
    sources = [name for name in _GCP_KEY_SOURCES if prefixed_extra(extras, name, GCP)]
    if len(sources) > 1:
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: extras {sources} exclude each other (as for the google provider's hook); keep one"
        )
    if prefixed_extra(extras, "key_secret_name", GCP):
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: extra 'key_secret_name' (key in Secret Manager) is not supported by the "
            "shared-stream provider; use keyfile_dict, key_path or Application Default Credentials"
        )
    # The hook uses client_id / client_secret only with idp_issuer_url (and ignores them without).
    idp = [name for name in _GCP_IDP_EXTRAS if prefixed_extra(extras, name, GCP)]
    if prefixed_extra(extras, "idp_issuer_url", GCP):
        raise SharedStreamConfigError(
            f"connection {conn_id!r}: extra(s) {idp} (the client-credentials grant through an IdP) are not "
            "supported by the shared-stream provider; use credential_config_file (workload identity federation), "
            "keyfile_dict, key_path or Application Default Credentials"
        )
    project = prefixed_extra(extras, "project", GCP)
    emulator_host = os.environ.get("PUBSUB_EMULATOR_HOST") or None
    if emulator_host:
        return GcpConnection(credentials=None, project=project, emulator_host=emulator_host)
    read: list[str] = []
    try:
        credentials, cred_project = await asyncio.to_thread(_gcp_credentials, conn_id, extras, read)
    finally:
        # A key file's private key, registered even when building the credentials failed.
        await register_secrets(*read)
    return GcpConnection(credentials=credentials, project=project or cred_project, emulator_host=None)


_GCP_KEY_SOURCES: Final = ("keyfile_dict", "key_path", "credential_config_file", "key_secret_name")
_GCP_IDP_EXTRAS: Final = ("idp_issuer_url", "client_id", "client_secret", "idp_extra_params")


def _private_key(keyfile: Any) -> str | None:
    """The ``private_key`` of a service-account keyfile (a JSON text or an object), if readable."""
    if isinstance(keyfile, str):
        try:
            keyfile = json.loads(keyfile)
        except ValueError:
            return None
    key = keyfile.get("private_key") if isinstance(keyfile, Mapping) else None
    return key if isinstance(key, str) else None


def _gcp_credentials(conn_id: str, extras: Mapping[str, Any], read: list[str]) -> tuple[Credentials, str | None]:
    """
    Blocking (files, metadata server): run in a thread. google-auth comes with the ``pubsub`` extra.
    The private key of a ``key_path`` file is appended to ``read`` (for the caller to register).
    """
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
            # Read here rather than by from_service_account_file, so that its private key is known.
            with open(str(key_path), encoding="utf-8") as key_file:
                info = json.load(key_file)
            if key := _private_key(info):
                read.append(key)
            credentials = service_account.Credentials.from_service_account_info(info, scopes=scopes)  # type: ignore[no-untyped-call]
            project = info.get("project_id")
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
