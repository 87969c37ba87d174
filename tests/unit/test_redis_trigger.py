"""Redis Streams: the connection and the entry wire format (parse-time errors: test_config_errors_every_broker.py)."""

from __future__ import annotations


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
