"""
The aiobotocore session of an ``aws`` connection: the same identity the amazon provider's hook gets.

* **With apache-airflow-providers-amazon installed** the session is the provider's own: its
  ``AwsConnectionWrapper`` reads the connection and its ``SessionFactory`` (``[aws]
  session_factory`` when configured, else ``BaseSessionFactory``) builds the session, exactly as
  ``AwsBaseHook.get_session(deferrable=True)`` / ``get_async_conn`` do. Every ``assume_role_method``
  (``assume_role``, ``assume_role_with_saml``, ``assume_role_with_web_identity`` with file or
  Google federation), ``profile_name``, ``session_kwargs`` credentials and
  ``service_config.sts.endpoint_url`` therefore mean what they mean to the hook, and a custom
  session factory applies too. The factory is synchronous (the first AssumeRole call, an IdP
  request): it runs in a worker thread, as the hook's ``get_async_conn`` does (``sync_to_async``).
* **Without it** this module builds the session itself from :class:`AwsConnection`: static keys
  (login / password, extras, ``session_kwargs``), ``profile_name`` through botocore's shared
  config and credentials files, ``role_arn`` with ``assume_role`` (STS ``AssumeRole``) or
  ``assume_role_with_web_identity`` with ``file`` federation (STS ``AssumeRoleWithWebIdentity``
  with the token file), the STS endpoint from ``service_config.sts.endpoint_url`` only and the
  default ``RoleSessionName`` ``Airflow_<conn_id>``, all as the provider does. What needs the
  provider (SAML through an IdP, Google federation) is refused with a
  :class:`SharedStreamConfigError` naming the extra.

Either way, assumed-role credentials are refreshable, as upstream: botocore refreshes them before
they expire (15 minutes ahead, mandatory at 10). Two things differ from the provider's async
session, on purpose: a synchronous refresher of the provider runs in a worker thread instead of
blocking the triggerer's event loop for an STS round trip, and every secret key and session token
STS hands out is registered with Airflow's secrets masker (the provider's async session registers
none; its ``get_credentials`` does).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any

from airflow_shared_stream_provider._core.connections import register_secrets
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError, broker_sdk
from airflow_shared_stream_provider.producers.aws_connection import AwsConnection

with broker_sdk("sqs"):
    from aiobotocore.config import AioConfig
    from aiobotocore.credentials import (
        AioAssumeRoleWithWebIdentityCredentialFetcher,
        AioDeferredRefreshableCredentials,
        AioRefreshableCredentials,
    )
    from aiobotocore.session import AioSession, get_session
    from botocore.credentials import FileWebIdentityTokenLoader
    from botocore.exceptions import BotoCoreError, ClientError

AMAZON_PROVIDER_MODULE = "airflow.providers.amazon.aws.hooks.base_aws"
_INVALID_SESSION_NAME = re.compile(r"[^\w+=,.@-]+")

OnCall = Callable[[], None]


def amazon_provider_available() -> bool:
    """True when the amazon provider's session machinery imports (the session is then its own)."""
    try:
        __import__(AMAZON_PROVIDER_MODULE)
    except ImportError:
        return False
    return True


def default_role_session_name(conn_id: str | None) -> str:
    """
    The provider's default ``RoleSessionName``: ``Airflow_<conn_id>`` slugified to STS's allowed
    characters (python-slugify, an Airflow dependency, as the provider does). The session name is
    part of the assumed-role identity (``assumed-role/<role>/<session name>``).
    """
    from slugify import slugify

    return str(slugify(f"Airflow_{conn_id}", regex_pattern=_INVALID_SESSION_NAME.pattern))


async def create_session(
    connection: AwsConnection,
    *,
    config: AioConfig | None = None,
    on_sts_call: OnCall | None = None,
    use_amazon_provider: bool | None = None,
) -> AioSession:
    """
    The session for ``connection`` (see the module docstring). ``config`` is the client config the
    STS client uses too (the provider passes the connection's ``config_kwargs`` there);
    ``on_sts_call`` is called before each STS call this module makes; ``use_amazon_provider``
    forces one path (None: the provider's when it imports).
    """
    if use_amazon_provider is None:
        use_amazon_provider = amazon_provider_available()
    if use_amazon_provider:
        return await _provider_session(connection)
    return _own_session(connection, config=config, on_sts_call=on_sts_call)


# -- with the amazon provider --------------------------------------------------------------------------
async def _provider_session(connection: AwsConnection) -> AioSession:
    from airflow.providers.amazon.aws.hooks import base_aws
    from airflow.providers.amazon.aws.utils.connection_wrapper import AwsConnectionWrapper
    from botocore.config import Config

    def build() -> AioSession:
        # What AwsBaseHook(aws_conn_id, region_name=...).get_session(deferrable=True) does, with the
        # connection already read (asynchronously) by our reader. base_aws.SessionFactory is the
        # class the hook uses: resolved once from [aws] session_factory.
        wrapper = AwsConnectionWrapper(conn=connection.connection, region_name=connection.region_name)
        factory = base_aws.SessionFactory(
            conn=wrapper, region_name=connection.region_name, config=wrapper.botocore_config or Config()
        )
        session: AioSession = factory.create_session(deferrable=True)
        return session

    try:
        session = await asyncio.to_thread(build)
    except (SharedStreamConfigError, BotoCoreError, ClientError):
        # An AWS error of the first AssumeRole call goes to the caller as it is: it tells a
        # rejected credential from an unreachable endpoint (see sqs_client.SqsApi.explain).
        raise
    except Exception as exc:
        # NotImplementedError (an unsupported method), AirflowException (federation), a missing
        # requests_gssapi for SAML...
        raise SharedStreamConfigError(
            f"connection {connection.conn_id!r}: the amazon provider could not build an AWS session "
            f"({connection.describe()}): {type(exc).__name__}: {exc}"
        ) from exc
    credentials = getattr(session, "_credentials", None)
    refresh = getattr(credentials, "_refresh_using", None)
    if refresh is not None:
        # The provider's refreshers are synchronous (a boto3 STS client, an IdP request): aiobotocore
        # would call them on the event loop. Run them in a worker thread and mask what they return.
        credentials._refresh_using = _masked(refresh)  # type: ignore[union-attr]
        if getattr(credentials, "_expiry_time", None) is not None:
            # assume_role / SAML: the first credentials were fetched by the factory, not by the
            # wrapped refresher. Reading them may refresh (advisory; a failure keeps them).
            frozen = await credentials.get_frozen_credentials()  # type: ignore[union-attr]
            await register_secrets(frozen.secret_key, frozen.token)
    return session


def _masked(refresh: Callable[[], Any]) -> Callable[[], Awaitable[dict[str, Any]]]:
    """``refresh`` as a coroutine (in a worker thread when synchronous) whose secrets are masked."""
    is_async = inspect.iscoroutinefunction(refresh)

    @functools.wraps(refresh)
    async def wrapped() -> dict[str, Any]:
        metadata: dict[str, Any] = await refresh() if is_async else await asyncio.to_thread(refresh)
        await register_secrets(metadata.get("secret_key"), metadata.get("token"))
        return metadata

    return wrapped


# -- without it ----------------------------------------------------------------------------------------
def _base_session(connection: AwsConnection) -> AioSession:
    """Static keys and profile on a session, like the provider's ``_apply_session_kwargs``."""
    session = get_session()
    if connection.profile_name:
        session.set_config_variable("profile", connection.profile_name)
    if connection.access_key_id or connection.secret_access_key or connection.session_token:
        session.set_credentials(connection.access_key_id, connection.secret_access_key, connection.session_token)
    if connection.region_name:
        session.set_config_variable("region", connection.region_name)
    return session


def _own_session(connection: AwsConnection, *, config: AioConfig | None, on_sts_call: OnCall | None) -> AioSession:
    base = _base_session(connection)
    if not connection.role_arn:
        return base
    method = connection.assume_role_method
    if method == "assume_role_with_saml" or connection.web_identity_federation == "google":
        what = (
            "assume_role_method 'assume_role_with_saml' (an IdP login)"
            if method == "assume_role_with_saml"
            else "assume_role_with_web_identity_federation 'google' (a Google ID token)"
        )
        raise SharedStreamConfigError(
            f"connection {connection.conn_id!r}: extra {what} needs apache-airflow-providers-amazon "
            "installed in the triggerer's environment (the shared-stream provider then builds the session "
            "through it); without it only assume_role and assume_role_with_web_identity with 'file' "
            "federation are supported"
        )

    def sts_client(call_config: AioConfig | None = None) -> Any:
        # The provider's STS client: the connection's client config (merged with the fetcher's own,
        # e.g. unsigned for AssumeRoleWithWebIdentity), service_config.sts.endpoint_url or AWS's.
        if on_sts_call is not None:
            on_sts_call()
        merged = config.merge(call_config) if config is not None and call_config is not None else call_config or config
        return base.create_client(
            "sts", region_name=connection.region_name, endpoint_url=connection.sts_endpoint_url, config=merged
        )

    credentials: AioRefreshableCredentials
    if method == "assume_role_with_web_identity":
        if not connection.web_identity_token_file:
            raise SharedStreamConfigError(
                f"connection {connection.conn_id!r}: assume_role_with_web_identity with 'file' federation "
                "needs the extra assume_role_with_web_identity_token_file or AWS_WEB_IDENTITY_TOKEN_FILE"
            )
        fetcher = AioAssumeRoleWithWebIdentityCredentialFetcher(
            client_creator=lambda _service, config=None: sts_client(config),
            web_identity_token_loader=FileWebIdentityTokenLoader(connection.web_identity_token_file),
            role_arn=connection.role_arn,
            extra_args=dict(connection.assume_role_kwargs),
        )
        credentials = AioDeferredRefreshableCredentials(
            refresh_using=_masked(fetcher.fetch_credentials), method="assume-role-with-web-identity"
        )
    else:
        role_arn = connection.role_arn
        kwargs: Mapping[str, Any] = {
            "RoleSessionName": default_role_session_name(connection.conn_id),
            **connection.assume_role_kwargs,
            "RoleArn": role_arn,
        }

        async def assume_role() -> dict[str, Any]:
            async with sts_client() as sts:
                response = await sts.assume_role(**kwargs)
            issued = response["Credentials"]
            expiry = issued["Expiration"]
            return {
                "access_key": issued["AccessKeyId"],
                "secret_key": issued["SecretAccessKey"],
                "token": issued["SessionToken"],
                "expiry_time": expiry.isoformat() if isinstance(expiry, datetime) else expiry,
            }

        # Deferred: the first AssumeRole happens at the first call, where its errors are explained.
        credentials = AioDeferredRefreshableCredentials(refresh_using=_masked(assume_role), method="sts-assume-role")
    session = get_session()
    # aiobotocore has no public setter for refreshable credentials; the provider does the same.
    session._credentials = credentials  # type: ignore[attr-defined]
    if connection.region_name:
        session.set_config_variable("region", connection.region_name)
    return session
