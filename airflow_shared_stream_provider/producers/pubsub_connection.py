"""
The upstream ``google_cloud_platform`` Airflow connection of a Pub/Sub subscription, read directly
(the rules every reader keeps: :mod:`airflow_shared_stream_provider._core.connections`), and its
Google credentials. google-auth is imported only inside the functions that build credentials (it
comes with the ``pubsub`` extra); the GAPIC clients are built in :mod:`.pubsub_client`.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from airflow_shared_stream_provider._core.connections import read_connection, read_extras, register_secrets
from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

if TYPE_CHECKING:
    from google.auth.credentials import Credentials

GCP: Final = "google_cloud_platform"
CLOUD_PLATFORM_SCOPE: Final = "https://www.googleapis.com/auth/cloud-platform"


def prefixed_extra(extras: Mapping[str, Any], name: str, conn_type: str) -> Any:
    """Extra ``name``, else its legacy ``extra__<conn_type>__<name>`` form; ``""`` counts as unset."""
    value = extras.get(name)
    if value in (None, ""):
        value = extras.get(f"extra__{conn_type}__{name}")
    return None if value == "" else value


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
