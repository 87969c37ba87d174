"""
Google Cloud Pub/Sub: four AssetWatchers share ONE streaming pull of the ``orders`` subscription.

The watchers pass identical producer settings, so the triggerer pulls once and broadcasts each
message to the four filters. A message is acknowledged only after every watcher's asset event for
it is stored (or it was published to ``dead_letter_topic``); until then its ack deadline is
extended, up to ``[triggerer] shared_stream_ack_timeout``.

Connection: the Google provider's ``google_cloud_default`` (or any ``gcp_conn_id``).

Environment knobs (read when the Dag file is parsed): ``ORDERS_PUBSUB_SUBSCRIPTION``
(``projects/<p>/subscriptions/<s>``), ``ORDERS_PUBSUB_DLQ_TOPIC`` (``projects/<p>/topics/<t>``),
``ORDERS_GCP_CONN_ID``.
"""

from __future__ import annotations

import os
from typing import Any

from orders_dags import declare_orders_dags

from airflow_shared_stream_provider.triggers.pubsub import PubSubSharedStreamTrigger

SUBSCRIPTION = os.environ.get("ORDERS_PUBSUB_SUBSCRIPTION", "projects/my-project/subscriptions/orders-airflow")
DLQ_TOPIC = os.environ.get("ORDERS_PUBSUB_DLQ_TOPIC", "projects/my-project/topics/orders-dlq")
GCP_CONN_ID = os.environ.get("ORDERS_GCP_CONN_ID", "google_cloud_default")


def shared_stream_trigger(**options: Any) -> PubSubSharedStreamTrigger:
    """One watcher's trigger: the subscription, connection and dead-letter topic of all, plus its own options."""
    return PubSubSharedStreamTrigger(
        subscription=SUBSCRIPTION, gcp_conn_id=GCP_CONN_ID, dead_letter_topic=DLQ_TOPIC, **options
    )


# The four assets and their Dags (orders_dags.py): each watcher has its own filter; all pass the
# same producer settings through shared_stream_trigger, so they share one stream.
assets = declare_orders_dags("pubsub", shared_stream_trigger)
