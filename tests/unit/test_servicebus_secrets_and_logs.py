"""Service Bus: no connection secret in a log line or a repr, whatever the separators; sender ids made safe for logs."""

from __future__ import annotations

import json
import logging

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider._core.logsafe import log_safe
from airflow_shared_stream_provider.producers.servicebus import ServiceBusSharedStreamProducer
from airflow_shared_stream_provider.producers.servicebus_connection import ServiceBusConnectionInfo, connection_info
from airflow_shared_stream_provider.triggers.servicebus import ServiceBusStreamSettings

SECRET = "c2VjcmV0LWtleS12YWx1ZQ=="
NAMESPACE = "sb://ns.servicebus.windows.net"
SEPARATED = {
    "semicolons": f"Endpoint={NAMESPACE}/;SharedAccessKeyName=root;SharedAccessKey={SECRET}",
    "commas": f"Endpoint={NAMESPACE}/,SharedAccessKeyName=root,SharedAccessKey={SECRET}",
    "newlines": f"Endpoint={NAMESPACE}/\nSharedAccessKeyName=root\nSharedAccessKey={SECRET}",
    "crlf and spaces": f"Endpoint = {NAMESPACE}/ \r\n SharedAccessKeyName=root \r\n SharedAccessKey={SECRET}",
    "key first, comma after": f"SharedAccessKey={SECRET},Endpoint={NAMESPACE}/,SharedAccessKeyName=root",
    "no separator at all": f"Endpoint={NAMESPACE}/SharedAccessKey={SECRET}",
    "key glued to the host": f"Endpoint=sb://{SECRET}.example/;SharedAccessKeyName=root",
}


@pytest.mark.parametrize("connection_string", SEPARATED.values(), ids=SEPARATED.keys())
def test_describe_and_repr_never_show_the_key(connection_string: str) -> None:
    info = connection_info("sb", schema=connection_string, host=None, extras={})
    for text in (info.describe(), repr(info), str(info), repr([info]), f"{info!r}"):
        assert "SharedAccessKey" not in text
        assert SECRET not in text


@pytest.mark.parametrize("connection_string", list(SEPARATED.values())[:4])
def test_describe_still_names_the_namespace(connection_string: str) -> None:
    assert ServiceBusConnectionInfo("sb", connection_string=connection_string).describe().startswith(NAMESPACE)


def test_namespace_that_is_not_a_host_name_is_not_echoed() -> None:
    pasted = f"Endpoint={NAMESPACE}/,SharedAccessKey={SECRET}"
    info = connection_info("sb", schema=None, host=None, extras={"fully_qualified_namespace": pasted})
    assert SECRET not in info.describe() and SECRET not in repr(info)
    plain = connection_info("sb", schema=None, host=None, extras={"fully_qualified_namespace": "ns.example.net"})
    assert "ns.example.net" in plain.describe()


@pytest.mark.parametrize("separator", [",", "\n"])
async def test_opening_a_stream_logs_no_key(
    separator: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The INFO line the producer writes when it opens (the connection is read through the task SDK)."""
    connection_string = separator.join(
        ["Endpoint=sb://127.0.0.1:5672/", "SharedAccessKeyName=root", f"SharedAccessKey={SECRET}"]
    )
    monkeypatch.setenv(
        "AIRFLOW_CONN_SB_SEPARATORS", json.dumps({"conn_type": "azure_service_bus", "schema": connection_string})
    )
    settings = ServiceBusStreamSettings(queue_name="q", azure_service_bus_conn_id="sb_separators")
    producer = ServiceBusSharedStreamProducer(settings, stream_key="k")
    caplog.set_level(logging.DEBUG)
    try:
        await producer._connect()
    except SharedStreamConfigError as exc:  # the SDK refuses the string: its error must not quote it either
        assert SECRET not in str(exc)
    finally:
        await producer.aclose()
    lines = [record.getMessage() for record in caplog.records]
    assert any("Opening shared stream on" in line for line in lines)
    assert not [line for line in lines if SECRET in line or "SharedAccessKey" in line]


# -- log_safe ------------------------------------------------------------------------------------------
def test_log_safe_keeps_a_forged_line_on_one_line() -> None:
    forged = "m-1\r\n2026-01-01 00:00:00 INFO completed message m-2"
    safe = log_safe(forged)
    assert "\n" not in safe and "\r" not in safe
    assert safe == "m-1\\r\\n2026-01-01 00:00:00 INFO completed message m-2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plain-id", "plain-id"),
        ("tab\there", "tab\\there"),
        ("esc\x1b[31mred", "esc\\x1b[31mred"),
        ("nul\x00", "nul\\x00"),
        ("c1\x85next-line", "c1\\x85next-line"),
        ("sep\u2028arator", "sep\\u2028arator"),
        ("bidi\u202eevil", "bidi\\u202eevil"),
        ("typed\\nescape", "typed\\\\nescape"),  # a backslash the sender typed is doubled
        ("ünïcode ok", "ünïcode ok"),
        (12345, "12345"),
        (None, "None"),
    ],
)
def test_log_safe_escapes_what_breaks_or_hides_a_line(text: object, expected: str) -> None:
    assert log_safe(text) == expected


def test_log_safe_cuts_long_text_and_says_how_much() -> None:
    safe = log_safe("x" * 10_000, 50)
    assert safe == "x" * 50 + "...(+9950 chars)"
    assert log_safe("x" * 50, 50) == "x" * 50
