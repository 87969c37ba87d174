"""RedisSharedStreamTrigger: identity (key, serialize), parse-time validation, import hygiene, the connection."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from airflow_shared_stream_provider import SharedStreamConfigError
from airflow_shared_stream_provider.triggers.redis import RedisSharedStreamTrigger, RedisStreamSettings

BASE: dict[str, Any] = {"stream": "orders", "redis_conn_id": "redis_prod"}


def test_the_key_covers_every_field_the_producer_reads() -> None:
    """Every ``settings.<name>`` the producer modules read is a settings field (so it is in the key)."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "airflow_shared_stream_provider" / "producers"
    read = set()
    for module in ("redis.py", "redis_client.py"):
        read |= set(re.findall(r"settings\.([a-z_]+)", (package / module).read_text()))
    fields = {f.name for f in dataclasses.fields(RedisStreamSettings)}
    assert read, "the producer reads no settings?"
    assert read <= fields, f"read by the producer but not in the key: {sorted(read - fields)}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stream": ""}, "stream must be a non-empty string"),
        ({"dead_letter_stream": "orders"}, "dead_letter_stream must differ from stream"),
        ({"group": " "}, "group must be a non-empty string"),
        ({"group_start_id": "latest"}, "group_start_id must be"),
        ({"claim_idle": 0.5}, "claim_idle must be a number >= 1"),
        ({"hold_backoff": 40}, "hold_backoff must be <= 30"),
        ({"read_count": 0}, "read_count must be a number >= 1"),
        ({"read_count": 1.5}, "read_count must be an int"),
        ({"block": 0}, "block must be a number >= 0.01"),
        ({"dead_letter_maxlen": 0}, "dead_letter_maxlen must be a number >= 1"),
        ({"create_group": "yes"}, "create_group must be True or False"),
    ],
)
def test_config_errors_name_the_setting(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SharedStreamConfigError, match=message):
        RedisSharedStreamTrigger(**{**BASE, **kwargs})


# -- the connection and the wire format (no server needed) ---------------------------------------------------
def test_the_upstream_redis_connection_is_read_like_redishook() -> None:
    from airflow_shared_stream_provider.producers.redis_client import connection_from_fields

    conn = connection_from_fields(
        "r",
        host="redis.internal",
        port="6380",
        login="svc",
        password="s3cret",
        schema=None,
        extras={"db": "3", "ssl": "true", "ssl_cert_reqs": "NONE", "ssl_check_hostname": "false", "other": 1},
    )
    assert (conn.host, conn.port, conn.db, conn.username, conn.password) == ("redis.internal", 6380, 3, "svc", "s3cret")
    assert conn.ssl == {"ssl": True, "ssl_cert_reqs": "none", "ssl_check_hostname": False}
    assert "s3cret" not in repr(conn) and "s3cret" not in str(conn) and "s3cret" not in conn.describe()
    # Upstream: a password of "none" / "false" / "" is no password; the schema may carry the db number.
    plain = connection_from_fields("r", host=None, port=None, login=None, password="None", schema="5", extras={})
    assert (plain.host, plain.port, plain.db, plain.password) == ("localhost", 6379, 5, None)
    with pytest.raises(SharedStreamConfigError, match="two different databases"):
        connection_from_fields("r", host="h", port=1, login=None, password=None, schema="1", extras={"db": 2})
    with pytest.raises(SharedStreamConfigError, match="ssl_cert_reqs"):
        connection_from_fields(
            "r", host="h", port=1, login=None, password="pw", schema=None, extras={"ssl_cert_reqs": "x"}
        )


def test_entry_fields_split_into_body_and_attributes_and_a_dead_letter_copy() -> None:
    from airflow_shared_stream_provider.producers.redis_client import dead_letter_fields, published_at, split_fields

    fields = [b"a", b"1", b"body", b"{}", b"a", b"2", b"body", b"again", b"\xff", b"\x00"]
    body, attributes = split_fields(fields, b"body")
    assert body == b"{}"
    assert attributes == {"a": "1", "body": "again", "base64:/w==": "\x00"}
    assert split_fields([b"k", b"v"], b"body") == (None, {"k": "v"})
    copy = dead_letter_fields(
        [b"X-Dead-Letter-Reason", b"forged", b"x-original-X-Dead-Letter-Reason", b"taken", b"body", b"b"],
        reason="why",
        source="orders",
        entry_id="1-0",
        group="g",
    )
    assert copy[:6] == [
        b"x-original-x-original-X-Dead-Letter-Reason",
        b"forged",
        b"x-original-X-Dead-Letter-Reason",
        b"taken",
        b"body",
        b"b",
    ]
    assert copy[6:] == [
        b"x-dead-letter-reason",
        b"why",
        b"x-dead-letter-source",
        b"orders",
        b"x-dead-letter-message-id",
        b"1-0",
        b"x-dead-letter-group",
        b"g",
    ]
    assert published_at("1700000000123-4") == "2023-11-14T22:13:20.123000+00:00"
    assert published_at("18446744073709551615-0") is None  # the largest id Redis takes: no date
    assert published_at("garbage") is None
