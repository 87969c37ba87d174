"""
Reading shared-stream asset events in a Dag, idempotently (imported by the example Dag files).

An asset event fired by a watcher carries the trigger's payload, the message **envelope**, under
``extra["payload"]`` (Airflow stores trigger events as ``{"from_trigger": true, "payload": ...}``);
in batch mode the payload is ``{"messages": [<envelope>, ...]}`` (see :func:`envelopes_of`)::

    {"broker": "kafka", "source": "orders", "message_id": "orders/2/17", "body": {...},
     "body_encoding": "json", "attributes": {...}, "published_at": "...", "delivery_attempt": 1,
     "metadata": {"partition": 2, "offset": 17, ...}}

Delivery is **at least once**: a triggerer crash between "event stored" and "offset committed"
redelivers the message, and the watcher fires again. So a consumer Dag deduplicates on
``message_id`` (stable across redeliveries) inside its batch and makes its side effects idempotent
across runs (here: one receipt file per message, created atomically, never overwritten).
:func:`consumer_dag` is the example Dags' consumer: it does both for the batch of its run.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow.sdk import DAG, Asset

OUTPUT_DIR_ENV = "ORDERS_OUTPUT_DIR"
BATCH_SIZE_ENV = "ORDERS_BATCH_SIZE"
BATCH_TIMEOUT_ENV = "ORDERS_BATCH_TIMEOUT"
MAX_PAYLOAD_BYTES_ENV = "ORDERS_MAX_PAYLOAD_BYTES"
FLUSH_AFTER_ENV = "ORDERS_FLUSH_AFTER"


def stream_options() -> dict[str, Any]:
    """
    Producer settings every example watcher of a stream shares (so they share one consumer):
    ``batch_size`` from ``$ORDERS_BATCH_SIZE`` (default 1, one envelope per asset event; the demo's
    ``--batch-size``) and, when set, ``batch_timeout`` from ``$ORDERS_BATCH_TIMEOUT`` (seconds) and
    ``max_payload_bytes`` from ``$ORDERS_MAX_PAYLOAD_BYTES`` (the trigger's defaults otherwise).
    """
    options: dict[str, Any] = {"batch_size": int(os.environ.get(BATCH_SIZE_ENV) or 1)}
    if os.environ.get(BATCH_TIMEOUT_ENV):
        options["batch_timeout"] = float(os.environ[BATCH_TIMEOUT_ENV])
    if os.environ.get(MAX_PAYLOAD_BYTES_ENV):
        options["max_payload_bytes"] = int(os.environ[MAX_PAYLOAD_BYTES_ENV])
    return options


def pipeline_flush_after() -> float:
    """
    ``flush_after`` of the watcher feeding the PySpark pipeline (``$ORDERS_FLUSH_AFTER``, default
    30 s): about one pipeline run long. The watcher's markers (after 30, 90 and 210 s of quiet)
    queue the run that takes the tail of a burst; one that arrives while the previous run still
    waits to be created is stranded with the tail, and the next one is not (Airflow 3.3; see
    docs/envelope.md).
    """
    return float(os.environ.get(FLUSH_AFTER_ENV) or 30)


def output_dir() -> Path:
    """Where the example Dags write (``$ORDERS_OUTPUT_DIR``, default ``<tmp>/airflow-shared-stream-orders``)."""
    configured = os.environ.get(OUTPUT_DIR_ENV)
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / "airflow-shared-stream-orders"
    path.mkdir(parents=True, exist_ok=True)
    return path


def envelopes_of(extra: Any) -> list[dict[str, Any]]:
    """
    The envelopes in an asset event's ``extra``, in both shapes a watcher fires:

    * one message per event (``batch_size=1``, the default): the payload *is* the envelope;
    * batch mode (``batch_size > 1``): the payload is ``{"messages": [<envelope>, ...]}``.

    A ``flush_after`` marker (``{"marker": "flush", ...}``) carries no message: it only makes
    Airflow queue a run for events stranded after the last one (Airflow 3.3), so it gives ``[]``,
    as does an event that did not come from a watcher (e.g. created by hand in the UI).
    """
    if not isinstance(extra, Mapping):
        return []
    payload = extra.get("payload") if extra.get("from_trigger") else extra
    if not isinstance(payload, Mapping) or payload.get("marker"):
        return []
    messages = payload.get("messages")
    if isinstance(messages, list):
        return [dict(m) for m in messages if isinstance(m, Mapping) and m.get("message_id")]
    return [dict(payload)] if payload.get("message_id") else []


def unique_envelopes(triggering_asset_events: Mapping[Any, Iterable[Any]] | None) -> list[dict[str, Any]]:
    """
    The envelopes of a run's triggering asset events, deduplicated on ``message_id``.

    ``triggering_asset_events`` maps each asset to its events (objects with ``.extra``); a run
    created by several events of the same asset gets them all. Batched events are unpacked;
    markers and events that are not envelopes are skipped.
    """
    seen: dict[str, dict[str, Any]] = {}
    for events in (triggering_asset_events or {}).values():
        for event in events:
            extra = event.get("extra") if isinstance(event, Mapping) else getattr(event, "extra", None)
            for envelope in envelopes_of(extra):
                seen.setdefault(str(envelope["message_id"]), envelope)
    return sorted(seen.values(), key=_message_order)


def _message_order(envelope: Mapping[str, Any]) -> tuple[str, int, int, str]:
    metadata = envelope.get("metadata") or {}
    partition = metadata.get("partition", -1) if isinstance(metadata, Mapping) else -1
    offset = metadata.get("offset", -1) if isinstance(metadata, Mapping) else -1
    return str(envelope.get("source")), int(partition), int(offset), str(envelope.get("message_id"))


def safe_name(message_id: str) -> str:
    """A file name for a message id (``orders/2/17`` -> ``orders_2_17``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", message_id)


def record_receipts(envelopes: Iterable[Mapping[str, Any]], sink: str) -> dict[str, int]:
    """
    Idempotent side effect: write one receipt per message under ``<output>/receipts/<sink>/``.

    ``open(..., "x")`` creates the file only if it does not exist, so a re-run of the task or a
    redelivered message never produces a second receipt. Returns ``{"new": n, "duplicates": d}``.
    """
    directory = output_dir() / "receipts" / sink
    directory.mkdir(parents=True, exist_ok=True)
    counts = {"new": 0, "duplicates": 0}
    for envelope in envelopes:
        path = directory / f"{safe_name(str(envelope['message_id']))}.json"
        try:
            with path.open("x") as handle:
                json.dump({"message_id": envelope["message_id"], "body": envelope.get("body")}, handle)
        except FileExistsError:
            counts["duplicates"] += 1
        else:
            counts["new"] += 1
    return counts


def consumer_dag(dag_id: str, *, schedule: Sequence[Asset], sink: str, broker: str) -> DAG:
    """
    The example consumer Dag: a run each time an asset of ``schedule`` gets events, whose task
    ``handle_orders`` records every order of the run's batch once (receipts under
    ``<output>/receipts/<sink>/``, :func:`record_receipts`). Tagged ``shared-stream`` and ``broker``.

    ``max_active_runs=1``: events that arrive while a run is going queue up and land in the next
    run's batch. A batch may hold a redelivered message (same ``message_id``):
    :func:`unique_envelopes` keeps one, and the receipts make the side effect idempotent across runs.
    """
    # Imported here: this module is also read where only the envelope helpers are wanted.
    from airflow.sdk import dag, task

    @dag(dag_id=dag_id, schedule=list(schedule), max_active_runs=1, catchup=False, tags=["shared-stream", broker])
    def consumer() -> None:
        @task
        def handle_orders(triggering_asset_events: Any = None) -> dict[str, int]:
            envelopes = unique_envelopes(triggering_asset_events)
            for envelope in envelopes:
                print(f"{envelope['message_id']} attempt={envelope['delivery_attempt']}: {envelope['body']}")
            return {"events": len(envelopes), **record_receipts(envelopes, sink)}

        handle_orders()

    return consumer()
