"""
Redis Streams: four AssetWatchers share ONE consumer-group reader of the ``orders`` stream.

Same shape as ``example_kafka_orders.py``: the watchers pass identical producer settings (stream,
connection, group, dead-letter stream, ...), so the triggerer runs one ``XREADGROUP`` loop and
broadcasts each entry to the four filters. An entry is acknowledged (``XACK``) only after every
watcher's asset event for it is stored (or it was copied to the dead-letter stream); until then
its idle time is kept below ``claim_idle``, so no other consumer of the group claims it.

Connection: the Redis provider's shape, e.g. ``AIRFLOW_CONN_REDIS_DEFAULT='{"conn_type": "redis",
"host": "localhost", "port": 6379, "extra": {"db": 0}}'``.

Environment knobs (read when the Dag file is parsed): ``ORDERS_REDIS_STREAM`` (default
``orders``), ``ORDERS_REDIS_DEAD_LETTER_STREAM`` (default ``orders:dead-letter``),
``ORDERS_REDIS_CONN_ID`` (default ``redis_default``).
"""

from __future__ import annotations

import os
from typing import Any

from orders_dags import declare_orders_dags

from airflow_shared_stream_provider.triggers.redis import RedisSharedStreamTrigger

STREAM = os.environ.get("ORDERS_REDIS_STREAM", "orders")
DEAD_LETTER_STREAM = os.environ.get("ORDERS_REDIS_DEAD_LETTER_STREAM", f"{STREAM}:dead-letter")
REDIS_CONN_ID = os.environ.get("ORDERS_REDIS_CONN_ID", "redis_default")


def shared_stream_trigger(**options: Any) -> RedisSharedStreamTrigger:
    """One watcher's trigger: the stream, connection and dead-letter stream of every watcher, plus its own options."""
    return RedisSharedStreamTrigger(
        stream=STREAM, redis_conn_id=REDIS_CONN_ID, dead_letter_stream=DEAD_LETTER_STREAM, **options
    )


# The four assets and their Dags (orders_dags.py): each watcher has its own filter; all pass the
# same producer settings through shared_stream_trigger, so they share one stream.
assets = declare_orders_dags("redis", shared_stream_trigger)
