"""
Filter functions for the ``orders`` stream watchers (``filter_function="order_filters.<name>"``).

The triggerer imports them by dotted path and calls them with the message envelope (a dict: see
``airflow_shared_stream_provider/_core/envelope.py``). The Dags folder is on ``sys.path`` in every
Airflow component, so a module placed next to the Dag files is importable as ``order_filters``.

A filter function returns truthy to fire an asset event for its watcher, falsy to let the message
pass by for this watcher, or raises :class:`~airflow_shared_stream_provider.RejectMessage` to
refuse the message terminally: it is then dead-lettered (Kafka: written to the ``dlq_topic`` with
the reason in the ``x-dead-letter-reason`` header) instead of being redelivered. Keep them fast
and free of I/O: they run on the triggerer's event loop, once per message per watcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_shared_stream_provider import RejectMessage

BIG_ORDER_AMOUNT = 500.0
REGIONS = frozenset({"eu", "us", "apac", "latam"})


def order_problem(envelope: Mapping[str, Any]) -> str | None:
    """Why an envelope is not a well-formed order, or None when it is one."""
    if envelope.get("body_encoding") != "json":
        return f"body is not JSON (body_encoding={envelope.get('body_encoding')!r})"
    body = envelope.get("body")
    if not isinstance(body, dict):
        return f"body is a JSON {type(body).__name__}, not an object"
    order_id = body.get("order_id")
    if not isinstance(order_id, str) or not order_id:
        return "order_id missing or not a string"
    if body.get("region") not in REGIONS:
        return f"unknown region {body.get('region')!r}"
    amount = body.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
        return f"amount {amount!r} is not a non-negative number"
    return None


def require_valid_order(envelope: Mapping[str, Any]) -> bool:
    """Fire for every well-formed order; dead-letter everything else (the data-quality gate)."""
    problem = order_problem(envelope)
    if problem is not None:
        raise RejectMessage(f"malformed order: {problem}")
    return True


def is_big_order(envelope: Mapping[str, Any]) -> bool:
    """Fire for well-formed orders of at least ``BIG_ORDER_AMOUNT``; skip the rest (never rejects)."""
    if order_problem(envelope) is not None:
        return False
    return float(envelope["body"]["amount"]) >= BIG_ORDER_AMOUNT
