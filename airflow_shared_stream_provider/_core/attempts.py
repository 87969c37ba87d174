"""
Counts a producer remembers per message across its deliveries, by message id, bounded.

**Collateral failures.** The manager force-fails a *watcher* (an ack timeout, a full queue), and
with it every message that watcher still had outstanding. Only one of them is a suspect: the
message the watcher stood on when it was failed (``StreamMessage.suspect``, marked by the watcher,
``_core/trigger.py``); a watcher that failed *on* a message (``culprit``) names it outright. The
others were queued behind and did nothing. Brokers count a delivery for each of them all the same
(SQS's receive count, Redis's times-delivered, Service Bus's delivery count), so a triggerer that
falls behind its metadata DB for several ack timeouts in a row used to dead-letter valid messages
as poison after ``max_delivery_attempts`` rounds (seen in the overloaded 30-minute production
run, docs/production.md). The base producer now forgives those deliveries: it remembers per
message how many of its failures were collateral (:data:`FORGIVEN_MEMORY` messages at most) and
the poison cap counts the broker's number less those. A message that keeps coming back without
ever being a suspect is still dead-lettered once the broker has delivered it
:data:`COLLATERAL_CEILING` times ``max_delivery_attempts`` (a loop no suspect explains must end).
A forgotten message counts from the broker's number again: its cap comes sooner, never later.
The memory is the producer's: a restarted triggerer counts from the broker's number again, except
where the broker's count can be set back (Redis: ``XCLAIM ... RETRYCOUNT`` on the give-back,
``forgiveness_is_durable``), which makes the forgiveness part of the broker's own count.

SQS remembers how often it *held* a message (a hold is not a delivery attempt, but SQS's receive
count grows with it); Pub/Sub counts deliveries itself when the subscription does not. Either way
the memory is bounded: the least recently seen message is forgotten first (it then counts from
the broker's number again, which can only make the poison cap later, never lose a message).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

KeyT = TypeVar("KeyT", bound=Hashable)

# Deliveries a message may take without being a suspect, in units of max_delivery_attempts.
COLLATERAL_CEILING: Final = 4
# Messages whose forgiven deliveries the producer remembers at once (about 100 bytes each).
FORGIVEN_MEMORY: Final = 20_000


class MessageCounts(Generic[KeyT]):
    """A count per message id, at most ``limit`` ids (least recently counted forgotten first)."""

    __slots__ = ("_counts", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._counts: OrderedDict[KeyT, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, key: KeyT) -> int:
        return self._counts.get(key, 0)

    def increment(self, key: KeyT) -> int:
        """Count one more for ``key``; return its new count."""
        counts = self._counts
        count = counts.get(key, 0) + 1
        counts[key] = count
        counts.move_to_end(key)
        while len(counts) > self.limit:
            counts.popitem(last=False)
        return count

    def decrement(self, key: KeyT) -> None:
        """Take one back (a delivery that did not count after all); at zero ``key`` is forgotten."""
        count = self._counts.get(key)
        if count is None:
            return
        if count <= 1:
            del self._counts[key]
        else:
            self._counts[key] = count - 1

    def forget(self, key: KeyT) -> None:
        """The message is settled for good: nothing to remember about it."""
        self._counts.pop(key, None)
