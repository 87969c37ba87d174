"""
The same ``aws`` connection ends at the same identity through the shared-stream provider as through
the amazon provider's ``AwsBaseHook``: assume role and assume role with web identity against moto's
STS, a profile from a shared credentials file, and session_kwargs credentials. Each case runs the
two paths of ``producers/aws_session.py``: with the amazon provider (its own session factory) and
as if it were not installed (the import made to fail through ``sys.modules``), where what cannot be
honoured is refused by name. The identity is STS ``GetCallerIdentity`` through aiobotocore with the
session the SQS producer gets; the reference is ``AwsBaseHook(aws_conn_id=...).get_session()``.

moto knows the IAM users created here, so two access keys are two identities (an unknown key would
answer with moto's default user, and a wrong choice of credentials would go unseen).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook, BaseSessionFactory
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers import aws_session
from airflow_shared_stream_provider.producers.aws_connection import load_aws_connection
from devkit.runner import RunnerSim, wait_until
from tests.integration.sqs.conftest import SqsAdapter
from tests.triggerer_logs import assert_leaks, assert_masked, triggerer_logs, without_our_registration

from .conftest import REAL_ENDPOINT

pytestmark = [pytest.mark.integration, pytest.mark.sqs]
REGION = "us-east-1"
ACCOUNT = "123456789012"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/shared-stream-reader"
PATHS = ["amazon provider", "without amazon provider"]


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if REAL_ENDPOINT:
        pytest.skip("needs moto's IAM and STS (made-up users and roles)")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AWS_WEB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which session builder: the amazon provider's, or ours as when its import fails."""
    if request.param != PATHS[0]:
        monkeypatch.setitem(sys.modules, aws_session.AMAZON_PROVIDER_MODULE, None)  # type: ignore[arg-type]
    assert aws_session.amazon_provider_available() is (request.param == PATHS[0])
    return str(request.param)


@pytest.fixture(scope="module")
def users(sqs_endpoint: str) -> Iterator[dict[str, tuple[str, str]]]:
    """Two IAM users in moto, ``alice`` and ``bob``: name -> (access key id, secret key)."""
    iam = boto3.client(
        "iam", endpoint_url=sqs_endpoint, region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x"
    )
    keys: dict[str, tuple[str, str]] = {}
    for name in ("alice", "bob"):
        with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
            iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        keys[name] = (key["AccessKeyId"], key["SecretAccessKey"])
    yield keys
    iam.close()


def set_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, **connection: Any) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "aws", **connection}))
    return conn_id


async def our_identity(conn_id: str, endpoint: str) -> str:
    """The ARN STS sees for the session the SQS producer builds from ``conn_id``."""
    connection = await load_aws_connection(conn_id, service="sqs", region_name=None, fallback_region=REGION)
    session = await aws_session.create_session(connection)
    async with session.create_client("sts", endpoint_url=endpoint, region_name=REGION) as sts:
        return str((await sts.get_caller_identity())["Arn"])


async def hook_identity(conn_id: str, endpoint: str) -> str:
    """The ARN STS sees for the amazon provider's hook session of ``conn_id`` (the reference)."""

    def call() -> str:
        session = AwsBaseHook(aws_conn_id=conn_id, client_type="sts").get_session()
        return str(session.client("sts", endpoint_url=endpoint, region_name=REGION).get_caller_identity()["Arn"])

    # AwsBaseHook was imported with this module: hiding the provider (``path``) hides it from ours only.
    return await asyncio.to_thread(call)


async def assert_same_identity(conn_id: str, endpoint: str, expected: str) -> None:
    reference = await hook_identity(conn_id, endpoint)
    assert reference == expected, "the reference itself is not the identity the case sets up"
    assert await our_identity(conn_id, endpoint) == reference


# -- identities ----------------------------------------------------------------------------------------
async def test_assume_role_ends_at_the_hooks_identity(
    users: dict[str, tuple[str, str]], sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_id, secret = users["alice"]
    conn_id = set_connection(
        monkeypatch,
        "aws_assume_it",
        login=key_id,
        password=secret,
        extra={"region_name": REGION, "role_arn": ROLE, "service_config": {"sts": {"endpoint_url": sqs_endpoint}}},
    )
    # No RoleSessionName: the provider's default, Airflow_<conn_id> (slugified), is part of the identity.
    await assert_same_identity(
        conn_id, sqs_endpoint, f"arn:aws:sts::{ACCOUNT}:assumed-role/shared-stream-reader/airflow_aws_assume_it"
    )


async def test_assume_role_with_web_identity_ends_at_the_hooks_identity(
    users: dict[str, tuple[str, str]], sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("eyJhbGciOiJSUzI1NiJ9.e30.web-identity-token-of-the-test")
    conn_id = set_connection(
        monkeypatch,
        "aws_web_identity_it",
        extra={
            "region_name": REGION,
            "role_arn": ROLE,
            "assume_role_method": "assume_role_with_web_identity",
            "assume_role_with_web_identity_federation": "file",
            "assume_role_with_web_identity_token_file": str(token_file),
            # botocore's default session name is a timestamp: fixed here so that two sessions compare.
            "assume_role_kwargs": {"RoleSessionName": "web-identity-it"},
            "service_config": {"sts": {"endpoint_url": sqs_endpoint}},
        },
    )
    await assert_same_identity(
        conn_id, sqs_endpoint, f"arn:aws:sts::{ACCOUNT}:assumed-role/shared-stream-reader/web-identity-it"
    )


async def test_profile_name_ends_at_the_hooks_identity(
    users: dict[str, tuple[str, str]], sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    credentials = tmp_path / "credentials"
    # The default profile is bob: a reader that ignored profile_name would end as bob.
    lines = []
    for profile, user in (("default", "bob"), ("stream-reader", "alice")):
        key_id, secret = users[user]
        lines += [f"[{profile}]", f"aws_access_key_id = {key_id}", f"aws_secret_access_key = {secret}", ""]
    credentials.write_text("\n".join(lines))
    (tmp_path / "config").write_text(f"[default]\nregion = {REGION}\n[profile stream-reader]\nregion = {REGION}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    conn_id = set_connection(monkeypatch, "aws_profile_it", extra={"profile_name": "stream-reader"})
    await assert_same_identity(conn_id, sqs_endpoint, f"arn:aws:iam::{ACCOUNT}:user/alice")


async def test_session_kwargs_credentials_end_at_the_hooks_identity(
    users: dict[str, tuple[str, str]], sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_id, secret = users["bob"]
    conn_id = set_connection(
        monkeypatch,
        "aws_session_kwargs_it",
        extra={"region_name": REGION, "session_kwargs": {"aws_access_key_id": key_id, "aws_secret_access_key": secret}},
    )
    await assert_same_identity(conn_id, sqs_endpoint, f"arn:aws:iam::{ACCOUNT}:user/bob")


# -- refreshable, off the event loop, masked -------------------------------------------------------------
async def test_assumed_role_credentials_refresh_off_the_loop_and_are_masked(
    users: dict[str, tuple[str, str]], sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    15-minute credentials are inside botocore's 15-minute advisory window at once, so every read
    refreshes: each read returns new keys, each refresh of the provider's (synchronous) refresher
    runs off the event loop thread, and every secret key and token STS issued is masked.
    """
    from airflow.sdk._shared.secrets_masker import redact

    key_id, secret = users["alice"]
    conn_id = set_connection(
        monkeypatch,
        "aws_refresh_it",
        login=key_id,
        password=secret,
        extra={
            "region_name": REGION,
            "role_arn": ROLE,
            "assume_role_kwargs": {"DurationSeconds": 900},
            "service_config": {"sts": {"endpoint_url": sqs_endpoint}},
        },
    )
    threads: list[int] = []
    if path == PATHS[0]:
        original = BaseSessionFactory._refresh_credentials

        def recording(self: BaseSessionFactory) -> dict[str, Any]:
            threads.append(threading.get_ident())
            return original(self)

        monkeypatch.setattr(BaseSessionFactory, "_refresh_credentials", recording)
    connection = await load_aws_connection(conn_id, service="sqs", region_name=None, fallback_region=REGION)
    session = await aws_session.create_session(connection)
    credentials = await session.get_credentials()
    first = await credentials.get_frozen_credentials()
    second = await credentials.get_frozen_credentials()
    assert first.access_key != second.access_key, "the assumed-role credentials were not refreshed"
    for issued in (first, second):
        assert redact(issued.secret_key) == "***"
        assert redact(issued.token) == "***"
    if path == PATHS[0]:
        assert len(threads) >= 2
        assert threading.get_ident() not in threads, "a refresh ran on the event loop thread"


# -- refusals without the amazon provider ----------------------------------------------------------------
REFUSED_WITHOUT_PROVIDER: dict[str, tuple[dict[str, Any], str]] = {
    "saml": (
        {"assume_role_method": "assume_role_with_saml", "assume_role_with_saml": {"principal_arn": "p"}},
        "assume_role_method 'assume_role_with_saml'",
    ),
    "google web identity": (
        {
            "assume_role_method": "assume_role_with_web_identity",
            "assume_role_with_web_identity_federation": "google",
        },
        "assume_role_with_web_identity_federation 'google'",
    ),
    "web identity without a token file": (
        {"assume_role_method": "assume_role_with_web_identity", "assume_role_with_web_identity_federation": "file"},
        "assume_role_with_web_identity_token_file",
    ),
}


@pytest.mark.parametrize("case", REFUSED_WITHOUT_PROVIDER, ids=list(REFUSED_WITHOUT_PROVIDER))
async def test_without_the_amazon_provider_what_needs_it_is_refused_by_name(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, aws_session.AMAZON_PROVIDER_MODULE, None)  # type: ignore[arg-type]
    extra, named = REFUSED_WITHOUT_PROVIDER[case]
    conn_id = set_connection(monkeypatch, "aws_refused", extra={"region_name": REGION, "role_arn": ROLE, **extra})
    connection = await load_aws_connection(conn_id, service="sqs", region_name=None, fallback_region=None)
    with pytest.raises(SharedStreamConfigError, match="aws_refused") as caught:
        await aws_session.create_session(connection)
    assert named in str(caught.value)


def test_default_role_session_name_is_the_providers() -> None:
    factory = BaseSessionFactory(conn=None)
    for conn_id in ("aws_default", "My Conn/with:odd chars", "ünïcode-conn", "a--b"):
        expected = factory._strip_invalid_session_name_characters(f"Airflow_{conn_id}")
        assert aws_session.default_role_session_name(conn_id) == expected, conn_id


# -- secrets in the triggerer's log ----------------------------------------------------------------------
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "registration removed (control)"])
async def test_sts_issued_secret_key_and_token_are_masked_in_the_triggerer_log(
    registered: bool, users: dict[str, tuple[str, str]], sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    The connection's own secret key and token are masked by Airflow when it reads the connection;
    the assumed role's keys come later, from STS, and only our registration masks them (see
    tests/triggerer_logs.py for the triggerer's log path, emulated in process).
    """
    key_id, secret = users["alice"]
    conn_id = set_connection(
        monkeypatch,
        "aws_mask_it",
        login=key_id,
        password=secret,
        extra={"region_name": REGION, "role_arn": ROLE, "service_config": {"sts": {"endpoint_url": sqs_endpoint}}},
    )
    if not registered:
        without_our_registration(monkeypatch)
    with triggerer_logs(monkeypatch) as logs:
        connection = await load_aws_connection(conn_id, service="sqs", region_name=None, fallback_region=REGION)
        session = await aws_session.create_session(connection)
        issued = await (await session.get_credentials()).get_frozen_credentials()
        try:
            raise RuntimeError(f"request signed with {issued.secret_key} / {issued.token} (from {secret}) refused")
        except RuntimeError:
            logs.log_exception("SQS shared stream failed")
    if registered:
        assert_masked(logs, monkeypatch, issued.secret_key, issued.token, secret)
    else:
        assert_leaks(logs, monkeypatch, issued.secret_key)


# -- a role STS refuses ------------------------------------------------------------------------------------
async def test_a_role_sts_refuses_fails_the_group_naming_the_queue_and_the_sts_error(
    adapter: SqsAdapter, sqs_endpoint: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the amazon provider the role is assumed when the session is built; without it, at the first call."""
    conn_id = set_connection(
        monkeypatch,
        "aws_refused_role_it",
        login="testing",
        password="testing",
        extra={
            "region_name": REGION,
            "endpoint_url": sqs_endpoint,
            "role_arn": ROLE,
            "assume_role_kwargs": {"RoleSessionName": "s" * 65},  # STS: at most 64 characters
            "service_config": {"sts": {"endpoint_url": sqs_endpoint}},
        },
    )
    manager = SharedStreamManager(ack_timeout=60)
    async with RunnerSim(manager) as runner:
        runner.add(1, adapter.make_trigger(aws_conn_id=conn_id))
        await wait_until(lambda: 1 in runner.failures, timeout=30, what="the group to fail")
    error = runner.failures[1]
    assert isinstance(error, SharedStreamConfigError), repr(error)
    assert adapter.queue_url in str(error) and conn_id in str(error)
    assert "ValidationError" in str(error) and "roleSessionName" in str(error)
