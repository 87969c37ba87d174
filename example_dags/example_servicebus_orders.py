"""
Azure Service Bus: four AssetWatchers share ONE receiver of the ``orders`` queue.

The watchers pass identical producer settings, so the triggerer receives once (peek-lock) and
broadcasts each message to the four filters. A message is completed only after every watcher's
asset event for it is stored; a rejected one (``RejectMessage``, oversize, poison) is moved to the
entity's own dead-letter sub-queue. Locks are renewed up to ``[triggerer] shared_stream_ack_timeout``.

Connection: the Microsoft Azure provider's ``azure_service_bus_default`` (connection string or
fully-qualified namespace + credential).

Environment knobs (read when the Dag file is parsed): ``ORDERS_SERVICEBUS_QUEUE``,
``ORDERS_SERVICEBUS_CONN_ID``.
"""

from __future__ import annotations

import os
from typing import Any

from orders_dags import declare_orders_dags

from airflow_shared_stream_provider.triggers.servicebus import ServiceBusSharedStreamTrigger

QUEUE = os.environ.get("ORDERS_SERVICEBUS_QUEUE", "orders")
CONN_ID = os.environ.get("ORDERS_SERVICEBUS_CONN_ID", "azure_service_bus_default")


def shared_stream_trigger(**options: Any) -> ServiceBusSharedStreamTrigger:
    """One watcher's trigger: the queue and connection of all, plus its own options (the DLQ is the queue's)."""
    return ServiceBusSharedStreamTrigger(queue_name=QUEUE, azure_service_bus_conn_id=CONN_ID, **options)


# The four assets and their Dags (orders_dags.py): each watcher has its own filter; all pass the
# same producer settings through shared_stream_trigger, so they share one stream.
assets = declare_orders_dags("servicebus", shared_stream_trigger)
