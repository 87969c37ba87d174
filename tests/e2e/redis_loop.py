"""
The Redis Streams :class:`~tests.e2e.loop_brokers.LoopBroker` of the kill loops, over the Redis
test kit (``devkit.kits.redis``): a real ``redis-server`` of the loop's own (or ``REDIS_URL``), a
stream of its own (deleted at the end from an external server) and its consumer group, a paced
publisher (``XADD``, one order per entry in the ``body`` field) and the group's state (pending
plus not yet delivered) as "unsettled".
"""

from __future__ import annotations

import uuid
from typing import Any

from tests.e2e.loop_brokers import LoopBroker


class RedisLoop(LoopBroker):
    name = "redis"
    stream_options = {"temporary": True}
    send_keys = False  # the body field only

    def source_name(self) -> str:
        # Unique per loop: REDIS_URL may name a server other runs use too.
        return f"kill-loop-{uuid.uuid4().hex[:8]}"

    def trigger_kwargs(self) -> dict[str, Any]:
        # claim_idle at the SQS / Service Bus loops' lease (30 s, the default): a killed
        # triggerer's entries come back after it.
        return {**super().trigger_kwargs(), "dead_letter_stream": f"{self.source}:dead-letter", "block": 1.0}
