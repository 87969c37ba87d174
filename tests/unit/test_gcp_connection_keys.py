"""
The ``google_cloud_platform`` reader against the google provider's ``GoogleBaseHook``: what the hook
refuses (two key sources at once) is refused, and what the hook would honour but this reader cannot
(the client-credentials grant through an IdP) is refused by name instead of silently falling back to
Application Default Credentials, which would be another identity.
"""

from __future__ import annotations

import json

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.producers.pubsub_connection import load_gcp_connection

REFUSED = {
    "keyfile_dict and key_path": ({"keyfile_dict": "{}", "key_path": "/k.json"}, "['keyfile_dict', 'key_path']"),
    "key_path and credential_config_file (legacy prefix)": (
        {"extra__google_cloud_platform__key_path": "/k.json", "credential_config_file": "/c.json"},
        "['key_path', 'credential_config_file']",
    ),
    "key_secret_name": ({"key_secret_name": "sa-key"}, "'key_secret_name'"),
    "idp_issuer_url": (
        {"idp_issuer_url": "https://idp.example/token", "client_id": "c", "client_secret": "client-secret-0f3a"},
        "['idp_issuer_url', 'client_id', 'client_secret']",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
async def test_settings_the_reader_cannot_honour_are_refused_by_name(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra, named = REFUSED[case]
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_REFUSED_UNIT", json.dumps({"conn_type": "google_cloud_platform", "extra": extra})
    )
    with pytest.raises(SharedStreamConfigError, match="gcp_refused_unit") as caught:
        await load_gcp_connection("gcp_refused_unit")
    assert named in str(caught.value)
    assert "client-secret-0f3a" not in str(caught.value)


async def test_one_key_source_with_the_emulator_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", "127.0.0.1:1")
    monkeypatch.setenv(
        "AIRFLOW_CONN_GCP_ONE_UNIT",
        json.dumps({"conn_type": "google_cloud_platform", "extra": {"key_path": "/k.json", "project": "p1"}}),
    )
    connection = await load_gcp_connection("gcp_one_unit")
    assert (connection.project, connection.credentials) == ("p1", None)
