"""
Counters every producer keeps, mirrored to Airflow's ``Stats``.

Metric names: ``shared_stream_provider.<broker>.<counter>`` tagged with ``stream`` (the source).
Counters are incremented per batch, not per message, to keep the hot path cheap. docs/metrics.md
lists every metric and what each Airflow metrics backend shows of it.

Tag values go through :func:`metric_tag_value`: Airflow's StatsD logger with
``statsd_influxdb_enabled`` appends tags to the metric *name* and then validates that name (letters,
digits, ``_ . - /``, and ``, =`` for the tags; at most 250 characters). A queue URL
(``https://sqs...:443/123/q``) or a long subscription path would make it drop every metric of the
stream with a logged traceback each time, so every backend gets the same safe, bounded value.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, fields
from typing import Any, Final

_UNSAFE_TAG_CHARS: Final = re.compile(r"[^A-Za-z0-9_.\-/]")
# Room for the metric name (``shared_stream_provider.servicebus.sessions_released``, 51), the
# prefix Airflow adds (``[metrics] statsd_prefix``) and a second tag, under Airflow's 250 limit.
MAX_TAG_VALUE_LENGTH: Final = 120
_DIGEST_LENGTH: Final = 10


def metric_tag_value(value: str) -> str:
    """
    A tag value every Airflow metrics backend accepts: characters outside ``[A-Za-z0-9_.-/]``
    become ``_`` and a value longer than :data:`MAX_TAG_VALUE_LENGTH` keeps its tail (the queue or
    subscription name) behind a short digest of the whole, so two long sources never share a series.
    """
    safe = _UNSAFE_TAG_CHARS.sub("_", value)
    if len(safe) <= MAX_TAG_VALUE_LENGTH:
        return safe
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_LENGTH]
    return f"{digest}-{safe[-(MAX_TAG_VALUE_LENGTH - _DIGEST_LENGTH - 1) :]}"


def _stats() -> Any:
    from airflow.sdk.observability.stats import Stats

    return Stats


@dataclass
class StreamCounters:
    """What one producer did since it opened the stream."""

    broker: str
    stream: str
    received: int = 0
    fired: int = 0
    advanced: int = 0
    committed: int = 0
    dead_lettered: int = 0
    redelivered: int = 0
    held: int = 0
    rejected: int = 0
    poison: int = 0
    leases_renewed: int = 0
    leases_lost: int = 0
    api_calls: int = 0
    stale_skipped: int = 0
    batches: int = 0  # batch mode: raw events broadcast, each carrying up to batch_size messages
    rewinds: int = 0  # watcher positions: lanes re-read for a watcher that joined behind them
    _tags: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._tags = {"stream": metric_tag_value(self.stream)}

    def retag(self, stream: str) -> None:
        """Change the ``stream`` tag once the full stream name is known (e.g. after connecting)."""
        self.stream = stream
        self._tags = {"stream": metric_tag_value(stream)}

    def add(self, name: str, count: int = 1) -> None:
        if count <= 0:
            return
        setattr(self, name, getattr(self, name) + count)
        _stats().incr(f"shared_stream_provider.{self.broker}.{name}", count, tags=self._tags)

    def gauge(self, name: str, value: float, **tags: str) -> None:
        extra = {key: metric_tag_value(tag) for key, tag in tags.items()}
        _stats().gauge(f"shared_stream_provider.{self.broker}.{name}", value, tags={**self._tags, **extra})

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}
