"""
End-to-end latency of a run, read back from the metadata DB: per message, publish -> asset event
stored -> Dag run queued -> first task started -> last task ended ("row written").

* publish time is the envelope's ``published_at`` (the broker's own stamp: Kafka record timestamp,
  SQS SentTimestamp, Pub/Sub publish_time, Redis entry id, Service Bus enqueued time; see
  docs/envelope.md), so every broker is measured the same way and no publisher has to record it;
* the other stages are ``asset_event.timestamp``, ``dag_run.queued_at`` (through
  ``dagrun_asset_event``) and ``task_instance.start_date`` / ``end_date``.

Delivery is at least once: a message may have several events (a redelivery), possibly consumed by
different runs. For each stage the *earliest* time any of its copies reached it counts, which keeps
the stages of one message ordered (the first run to start was queued no earlier than the first run
queued, and so on). Batch mode (``{"messages": [...]}``) gives each message of an event that event's
times; ``flush_after`` markers carry no message and count for nothing.

Everything but :func:`measure` is a pure function over rows (unit-tested without Airflow).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from devkit.airflow_env import AirflowEnv

STAGES: Final = ("published", "event", "queued", "started", "written")
# The hops the demo reports: each consecutive pair of STAGES, then the whole path.
HOPS: Final = (
    ("published", "event"),
    ("event", "queued"),
    ("queued", "started"),
    ("started", "written"),
    ("published", "written"),
)
_SHORT: Final = {
    "published": "publish",
    "event": "event",
    "queued": "queued",
    "started": "started",
    "written": "written",
}
# Python 3.10's fromisoformat takes only 3 or 6 fraction digits; brokers may stamp 0-9.
_FRACTION: Final = re.compile(r"\.(\d+)")


@dataclass
class Hops:
    """One message's times (epoch seconds; None: that stage was not reached, or is unknown)."""

    published: float | None = None
    event: float | None = None
    queued: float | None = None
    started: float | None = None
    written: float | None = None

    def merge(self, other: Hops) -> None:
        """Keep, per stage, the earliest known time (a redelivered copy may reach a stage first)."""
        for spec in fields(self):
            mine, theirs = getattr(self, spec.name), getattr(other, spec.name)
            if theirs is not None and (mine is None or theirs < mine):
                setattr(self, spec.name, theirs)


def hop_name(start: str, end: str) -> str:
    return f"{_SHORT[start]}->{_SHORT[end]}"


# -- parsing --------------------------------------------------------------------------------------
def to_epoch(value: Any) -> float | None:
    """
    Epoch seconds of a DB or envelope time: a datetime (PostgreSQL), ISO text (SQLite, envelopes;
    ``Z`` or an offset, any fraction digits) or a number. Naive times are UTC (Airflow stores UTC).
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime):
        moment = value
    else:
        text = str(value).strip().replace("Z", "+00:00")
        text = _FRACTION.sub(lambda m: "." + (m.group(1) + "000000")[:6], text, count=1)
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()


def _as_mapping(extra: Any) -> Mapping[str, Any] | None:
    if isinstance(extra, str | bytes):
        try:
            extra = json.loads(extra)
        except ValueError:
            return None
    return extra if isinstance(extra, Mapping) else None


def envelopes(extra: Any, *, upstream_text: bool = False) -> list[Mapping[str, Any]]:
    """
    The envelopes an asset event's ``extra`` carries (JSON text from SQLite or a dict from
    PostgreSQL): one, the ``messages`` of a batch, or none for a ``flush_after`` marker or an event
    that did not come from a watcher. Same rules as ``example_dags/order_events.envelopes_of``.
    ``upstream_text``: a text payload (the upstream Kafka provider's event: the message's text) is
    read as one envelope whose ``body`` is that text's JSON.
    """
    mapping = _as_mapping(extra)
    if mapping is None:
        return []
    payload = mapping.get("payload") if mapping.get("from_trigger") else mapping
    if upstream_text and isinstance(payload, str):
        try:
            return [{"body": json.loads(payload)}]
        except ValueError:
            return []
    if not isinstance(payload, Mapping) or payload.get("marker"):
        return []
    messages = payload.get("messages")
    if isinstance(messages, list):
        return [m for m in messages if isinstance(m, Mapping) and m.get("message_id")]
    return [payload] if payload.get("message_id") else []


def message_key(envelope: Mapping[str, Any]) -> str | None:
    """The envelope's ``message_id``: stable across redeliveries of one broker message."""
    value = envelope.get("message_id")
    return str(value) if value else None


# -- rows -> hops ---------------------------------------------------------------------------------
def hops_from_rows(
    rows: Iterable[Sequence[Any]], key: Callable[[Mapping[str, Any]], str | None] = message_key
) -> dict[str, Hops]:
    """
    ``key -> Hops`` from rows ``(event timestamp, event extra, run queued_at, first task
    start_date, last task end_date)``; the run columns are None when no run consumed the event
    (yet). Several rows of one message (a redelivery, or one event joined to several runs) merge
    to the earliest time per stage.
    """
    out: dict[str, Hops] = {}
    for stamp, extra, queued, started, written in rows:
        times = (to_epoch(stamp), to_epoch(queued), to_epoch(started), to_epoch(written))
        for envelope in envelopes(extra):
            name = key(envelope)
            if name is None:
                continue
            candidate = Hops(to_epoch(envelope.get("published_at")), *times)
            out.setdefault(name, Hops()).merge(candidate)
    return out


def event_hops_from_rows(
    rows: Iterable[Sequence[Any]], key: Callable[[Mapping[str, Any]], str | None] = message_key
) -> dict[str, dict[str, Hops]]:
    """``watcher -> key -> Hops`` (published and event only) from rows ``(asset name, timestamp, extra)``."""
    grouped: dict[str, list[tuple[Any, Any, None, None, None]]] = {}
    for name, stamp, extra in rows:
        grouped.setdefault(str(name), []).append((stamp, extra, None, None, None))
    return {name: hops_from_rows(group, key) for name, group in grouped.items()}


def hop_values(hops: Iterable[Hops], start: str, end: str) -> list[float]:
    """Seconds from ``start`` to ``end`` of every message that has both stages."""
    values: list[float] = []
    for hop in hops:
        begin, finish = getattr(hop, start), getattr(hop, end)
        if begin is not None and finish is not None:
            values.append(finish - begin)
    return values


# -- statistics -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..1) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{"n", "p50_ms", "p95_ms", "max_ms"}`` of ``values`` in seconds (ms rounded to 0.1; None when empty)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000.0, 1)

    return {
        "n": len(values),
        "p50_ms": ms(percentile(values, 0.50)),
        "p95_ms": ms(percentile(values, 0.95)),
        "max_ms": ms(max(values) if values else None),
    }


def pipeline_summary(hops: Mapping[str, Hops]) -> dict[str, dict[str, float | int | None]]:
    """``"publish->event" -> summary`` for every hop of :data:`HOPS`."""
    return {hop_name(start, end): summary(hop_values(hops.values(), start, end)) for start, end in HOPS}


@dataclass
class RunLatency:
    dag_id: str
    pipeline: dict[str, dict[str, float | int | None]]
    watchers: dict[str, dict[str, float | int | None]]


def render_lines(result: RunLatency) -> list[str]:
    """The demo summary's latency lines (ms; ``-`` where no message reached both stages)."""

    def fmt(stats: Mapping[str, float | int | None]) -> str:
        def one(value: float | int | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        return f"p50 {one(stats['p50_ms'])}  p95 {one(stats['p95_ms'])}  max {one(stats['max_ms'])}  (n={stats['n']})"

    lines = [f"latency {name:<17}: {fmt(stats)}  {result.dag_id}" for name, stats in result.pipeline.items()]
    lines += [f"latency publish->event {name}: {fmt(stats)}" for name, stats in result.watchers.items()]
    return lines


# -- the metadata DB ------------------------------------------------------------------------------
def pipeline_rows(env: AirflowEnv, asset: str, dag_id: str, first_task: str, last_task: str) -> list[tuple[Any, ...]]:
    """Rows for :func:`hops_from_rows`: every event of ``asset`` with the run of ``dag_id`` it fed (if any)."""
    return env.query_db(
        "SELECT e.timestamp, e.extra, dr.queued_at, tf.start_date, tl.end_date "
        "FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        "LEFT JOIN dagrun_asset_event d ON d.event_id = e.id "
        "LEFT JOIN dag_run dr ON dr.id = d.dag_run_id AND dr.dag_id = ? "
        "LEFT JOIN task_instance tf ON tf.dag_id = dr.dag_id AND tf.run_id = dr.run_id AND tf.task_id = ? "
        "LEFT JOIN task_instance tl ON tl.dag_id = dr.dag_id AND tl.run_id = dr.run_id AND tl.task_id = ? "
        "WHERE a.name = ? ORDER BY e.id",
        (dag_id, first_task, last_task, asset),
    )


def watcher_rows(env: AirflowEnv, watchers: Sequence[str]) -> list[tuple[Any, ...]]:
    """Rows for :func:`event_hops_from_rows`: ``(asset name, timestamp, extra)`` of the watchers' events."""
    if not watchers:
        return []
    marks = ", ".join("?" for _ in watchers)
    return env.query_db(
        "SELECT a.name, e.timestamp, e.extra FROM asset_event e JOIN asset a ON a.id = e.asset_id "
        f"WHERE a.name IN ({marks}) ORDER BY e.id",
        tuple(watchers),
    )


def measure(
    env: AirflowEnv,
    *,
    asset: str,
    dag_id: str,
    watchers: Sequence[str],
    first_task: str = "extract",
    last_task: str = "aggregate",
) -> RunLatency:
    """
    The latency of a run: :data:`HOPS` for the messages of ``asset`` through ``dag_id`` (from
    ``first_task`` started to ``last_task`` ended), and publish -> event for every watcher.
    """
    hops = hops_from_rows(pipeline_rows(env, asset, dag_id, first_task, last_task))
    per_watcher = event_hops_from_rows(watcher_rows(env, watchers))
    return RunLatency(
        dag_id=dag_id,
        pipeline=pipeline_summary(hops),
        watchers={
            name: summary(hop_values(per_watcher.get(name, {}).values(), "published", "event")) for name in watchers
        },
    )
