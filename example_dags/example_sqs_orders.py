"""
SQS: four AssetWatchers share ONE poller of the ``orders`` queue.

Same shape as ``example_kafka_orders.py``: the watchers pass identical producer settings (queue URL,
connection, DLQ queue, ...), so the triggerer runs one receive loop and broadcasts each message to
the four filters. A message is deleted from the queue only after every watcher's asset event for
it is stored (or it was moved to the DLQ queue); until then its visibility timeout is extended, up
to ``[triggerer] shared_stream_ack_timeout``.

Connection: the Amazon provider's shape, e.g. ``AIRFLOW_CONN_AWS_DEFAULT='{"conn_type": "aws",
"extra": {"region_name": "eu-west-1"}}'`` (add ``"endpoint_url"`` for a local endpoint).

Environment knobs (read when the Dag file is parsed): ``ORDERS_SQS_QUEUE_URL``,
``ORDERS_SQS_DLQ_URL``, ``ORDERS_AWS_CONN_ID`` (default ``aws_default``).
"""

from __future__ import annotations

import os
from typing import Any

from orders_dags import declare_orders_dags

from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

QUEUE_URL = os.environ.get("ORDERS_SQS_QUEUE_URL", "https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
DLQ_URL = os.environ.get("ORDERS_SQS_DLQ_URL", "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq")
AWS_CONN_ID = os.environ.get("ORDERS_AWS_CONN_ID", "aws_default")


def shared_stream_trigger(**options: Any) -> SqsSharedStreamTrigger:
    """One watcher's trigger: the queue, connection and DLQ queue of every watcher, plus its own options."""
    return SqsSharedStreamTrigger(queue_url=QUEUE_URL, aws_conn_id=AWS_CONN_ID, dlq_queue_url=DLQ_URL, **options)


# The four assets and their Dags (orders_dags.py): each watcher has its own filter; all pass the
# same producer settings through shared_stream_trigger, so they share one stream.
assets = declare_orders_dags("sqs", shared_stream_trigger)
