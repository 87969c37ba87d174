"""
devkit.latency over constructed metadata-DB rows: the shapes SQLite and PostgreSQL return, one
message per event, batch mode, flush_after markers, redeliveries and stages not reached yet.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from devkit.latency import (
    Hops,
    RunLatency,
    envelopes,
    event_hops_from_rows,
    hop_values,
    hops_from_rows,
    percentile,
    pipeline_summary,
    render_lines,
    summary,
    to_epoch,
)

T0 = datetime(2026, 11, 26, 10, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sqlite_time(seconds: float) -> str:
    """How Airflow's UtcDateTime reads back from SQLite: naive UTC text."""
    return at(seconds).replace(tzinfo=None).isoformat(sep=" ")


def envelope(message_id: str, published: float, attempt: int = 1) -> dict[str, Any]:
    return {
        "broker": "sqs",
        "message_id": message_id,
        "body": {"order_id": message_id},
        "published_at": at(published).isoformat(),
        "delivery_attempt": attempt,
    }


def single(env: dict[str, Any]) -> str:
    """An event's extra as SQLite returns it: JSON text of the trigger's wrapped payload."""
    return json.dumps({"from_trigger": True, "payload": env})


def batch(*envs: dict[str, Any]) -> dict[str, Any]:
    """An event's extra as psycopg2 returns it (decoded), batch mode."""
    return {"from_trigger": True, "payload": {"messages": list(envs)}}


MARKER = json.dumps({"from_trigger": True, "payload": {"marker": "flush", "watcher": "sqs_orders_valid"}})


def test_percentile_and_summary() -> None:
    values = [0.010 * i for i in range(1, 101)]  # 10 ms .. 1000 ms
    assert percentile(values, 0.5) == pytest.approx(0.51)  # nearest rank: index round(49.5) = 50
    assert percentile(values, 0.95) == pytest.approx(0.95)
    assert percentile(list(reversed(values)), 0.0) == pytest.approx(0.01)  # sorts its input
    assert percentile([], 0.5) is None
    assert summary([0.3, 0.1, 0.2]) == {"n": 3, "p50_ms": 200.0, "p95_ms": 300.0, "max_ms": 300.0}
    assert summary([]) == {"n": 0, "p50_ms": None, "p95_ms": None, "max_ms": None}


def test_to_epoch_reads_every_shape_as_utc() -> None:
    expected = at(1.5).timestamp()
    assert to_epoch(at(1.5)) == expected  # PostgreSQL: aware datetime
    assert to_epoch(at(1.5).replace(tzinfo=None)) == expected  # naive = UTC
    assert to_epoch(sqlite_time(1.5)) == expected  # SQLite text
    assert to_epoch("2026-11-26T10:00:01.5Z") == expected  # one fraction digit and Z (Python 3.10 too)
    assert to_epoch("2026-11-26T10:00:01.500000123+00:00") == expected  # nanoseconds
    assert to_epoch("2026-11-26T12:00:01.5+02:00") == expected
    assert to_epoch(None) is None
    assert to_epoch("not a time") is None


def test_one_message_per_event_through_every_stage() -> None:
    rows = [
        (sqlite_time(0.2), single(envelope("m1", 0.0)), sqlite_time(1.0), sqlite_time(3.0), sqlite_time(10.0)),
        (sqlite_time(0.5), single(envelope("m2", 0.1)), sqlite_time(1.0), sqlite_time(3.0), sqlite_time(10.0)),
    ]
    hops = hops_from_rows(rows)
    assert set(hops) == {"m1", "m2"}
    m1 = hops["m1"]
    assert (m1.published, m1.event, m1.queued, m1.started, m1.written) == tuple(
        at(s).timestamp() for s in (0.0, 0.2, 1.0, 3.0, 10.0)
    )
    result = pipeline_summary(hops)
    assert list(result) == [
        "publish->event",
        "event->queued",
        "queued->started",
        "started->written",
        "publish->written",
    ]
    assert result["publish->event"] == {"n": 2, "p50_ms": 200.0, "p95_ms": 400.0, "max_ms": 400.0}
    assert result["event->queued"] == {"n": 2, "p50_ms": 500.0, "p95_ms": 800.0, "max_ms": 800.0}
    assert result["queued->started"]["max_ms"] == 2000.0
    assert result["started->written"]["max_ms"] == 7000.0
    assert result["publish->written"] == {"n": 2, "p50_ms": 9900.0, "p95_ms": 10000.0, "max_ms": 10000.0}


def test_a_redelivery_counts_the_first_copy_to_reach_each_stage() -> None:
    # Copy 1 is stored first but its run is queued late; copy 2 (redelivered) lands in an earlier
    # run that starts first; copy 1's run writes first. Each stage takes its earliest copy.
    rows = [
        (sqlite_time(1.0), single(envelope("m1", 0.0)), sqlite_time(8.0), sqlite_time(9.0), sqlite_time(12.0)),
        (sqlite_time(4.0), single(envelope("m1", 0.0, 2)), sqlite_time(5.0), sqlite_time(6.0), sqlite_time(20.0)),
    ]
    hops = hops_from_rows(rows)
    assert list(hops) == ["m1"]
    assert hops["m1"] == Hops(*(at(s).timestamp() for s in (0.0, 1.0, 5.0, 6.0, 12.0)))
    # Order of the rows does not matter.
    assert hops_from_rows(list(reversed(rows))) == hops
    result = pipeline_summary(hops)
    assert result["publish->event"]["n"] == 1  # one message, not two
    assert result["publish->event"]["max_ms"] == 1000.0
    assert result["publish->written"]["max_ms"] == 12000.0


def test_batch_mode_gives_each_message_its_event_and_markers_nothing() -> None:
    rows = [
        (at(2.0), batch(envelope("a", 0.0), envelope("b", 1.0), envelope("c", 1.5)), at(3.0), at(4.0), at(9.0)),
        # The flush_after marker is linked to the same run: it carries no message and no time of its own.
        (at(2.5), MARKER, at(3.0), at(4.0), at(9.0)),
        # A marker at the very start (earlier than everything) must not become any message's event time.
        (at(-5.0), MARKER, at(-4.0), at(-3.0), at(-2.0)),
        # An event not from a watcher (created by hand): no envelope.
        (at(2.2), json.dumps({"note": "manual"}), at(3.0), at(4.0), at(9.0)),
    ]
    hops = hops_from_rows(rows)
    assert sorted(hops) == ["a", "b", "c"]
    assert all(hop.event == at(2.0).timestamp() and hop.written == at(9.0).timestamp() for hop in hops.values())
    values = hop_values(hops.values(), "published", "event")
    assert sorted(round(v, 3) for v in values) == [0.5, 1.0, 2.0]
    assert pipeline_summary(hops)["publish->written"]["n"] == 3


def test_missing_stages_leave_the_message_out_of_those_hops_only() -> None:
    rows = [
        # Consumed and written.
        (at(1.0), single(envelope("done", 0.0)), at(2.0), at(3.0), at(4.0)),
        # Run queued, not started (task_instance has no start_date yet).
        (at(1.0), single(envelope("queued", 0.0)), at(2.0), None, None),
        # Started, still running (no end_date).
        (at(1.0), single(envelope("running", 0.0)), at(2.0), at(3.0), None),
        # Stored, no run yet (LEFT JOINs give None).
        (at(1.0), single(envelope("waiting", 0.0)), None, None, None),
        # No broker publish stamp (e.g. a Kafka record without timestamp).
        (at(1.0), single({**envelope("unstamped", 0.0), "published_at": None}), at(2.0), at(3.0), at(4.0)),
    ]
    result = pipeline_summary(hops_from_rows(rows))
    assert result["publish->event"]["n"] == 4
    assert result["event->queued"]["n"] == 4  # done, queued, running, unstamped
    assert result["queued->started"]["n"] == 3  # done, running, unstamped
    assert result["started->written"]["n"] == 2  # done, unstamped
    assert result["publish->written"]["n"] == 1  # done only
    empty = pipeline_summary({})
    assert all(stats == {"n": 0, "p50_ms": None, "p95_ms": None, "max_ms": None} for stats in empty.values())


def test_watchers_are_measured_separately() -> None:
    rows = [
        ("sqs_orders_eu", at(0.3), single(envelope("m1", 0.0))),
        ("sqs_orders_valid", at(0.9), single(envelope("m1", 0.0))),
        ("sqs_orders_valid", at(0.4), single(envelope("m1", 0.0, 2))),  # a redelivery stored earlier
        ("sqs_orders_valid", at(1.0), MARKER),
        ("sqs_orders_big", at(2.0), batch(envelope("m2", 1.0), envelope("m3", 1.5))),
    ]
    per_watcher = event_hops_from_rows(rows)
    assert sorted(per_watcher) == ["sqs_orders_big", "sqs_orders_eu", "sqs_orders_valid"]
    assert [round(v, 3) for v in hop_values(per_watcher["sqs_orders_eu"].values(), "published", "event")] == [0.3]
    assert [round(v, 3) for v in hop_values(per_watcher["sqs_orders_valid"].values(), "published", "event")] == [0.4]
    assert sorted(round(v, 3) for v in hop_values(per_watcher["sqs_orders_big"].values(), "published", "event")) == [
        0.5,
        1.0,
    ]


def test_render_lines() -> None:
    result = RunLatency(
        dag_id="sqs_orders_spark_pipeline",
        pipeline=pipeline_summary(hops_from_rows([(at(0.25), single(envelope("m1", 0.0)), at(1.0), at(2.0), at(3.5))])),
        watchers={"sqs_orders_eu": summary([0.1, 0.2]), "sqs_orders_big": summary([])},
    )
    lines = render_lines(result)
    assert lines[0] == (
        "latency publish->event   : p50 250.0 ms  p95 250.0 ms  max 250.0 ms  (n=1)  sqs_orders_spark_pipeline"
    )
    assert lines[4].startswith("latency publish->written : p50 3500.0 ms")
    assert lines[5] == "latency publish->event sqs_orders_eu: p50 100.0 ms  p95 200.0 ms  max 200.0 ms  (n=2)"
    assert lines[6] == "latency publish->event sqs_orders_big: p50 -  p95 -  max -  (n=0)"


def test_an_upstream_text_payload_is_one_envelope_only_when_asked() -> None:
    # The upstream Kafka provider's event carries the message's text; bench.production reads both.
    extra = json.dumps({"from_trigger": True, "payload": json.dumps({"order_id": "o-1"})})
    assert envelopes(extra) == []
    assert envelopes(extra, upstream_text=True) == [{"body": {"order_id": "o-1"}}]
    assert envelopes(json.dumps({"from_trigger": True, "payload": "not json"}), upstream_text=True) == []
