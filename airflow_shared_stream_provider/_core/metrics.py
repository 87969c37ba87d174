"""
Counters every producer keeps, mirrored to Airflow's ``Stats``.

Metric names: ``shared_stream_provider.<broker>.<counter>`` tagged with ``stream`` (the source).
Counters are incremented per batch, not per message, to keep the hot path cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


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
        self._tags = {"stream": self.stream}

    def retag(self, stream: str) -> None:
        """Change the ``stream`` tag once the full stream name is known (e.g. after connecting)."""
        self.stream = stream
        self._tags = {"stream": stream}

    def add(self, name: str, count: int = 1) -> None:
        if count <= 0:
            return
        setattr(self, name, getattr(self, name) + count)
        _stats().incr(f"shared_stream_provider.{self.broker}.{name}", count, tags=self._tags)

    def gauge(self, name: str, value: float, **tags: str) -> None:
        _stats().gauge(f"shared_stream_provider.{self.broker}.{name}", value, tags={**self._tags, **tags})

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}
