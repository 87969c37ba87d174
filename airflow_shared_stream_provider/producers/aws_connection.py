"""
The upstream ``aws`` Airflow connection, read directly (the rules every reader keeps:
:mod:`airflow_shared_stream_provider._core.connections`), and what an AWS error code says about
it. Read for SQS (:mod:`.sqs_client`) and turned into a session by :mod:`.aws_session`; imports no
AWS SDK.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit, urlunsplit

from airflow_shared_stream_provider._core.connections import read_connection, read_extras, register_secrets
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

if TYPE_CHECKING:
    from airflow.sdk import Connection

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
