"""
Counts a producer remembers per message across its deliveries, by message id, bounded.

SQS remembers how often it *held* a message (a hold is not a delivery attempt, but SQS's receive
count grows with it); Pub/Sub counts deliveries itself when the subscription does not. Either way
the memory is bounded: the least recently seen message is forgotten first (it then counts from
the broker's number again, which can only make the poison cap later, never lose a message).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

KeyT = TypeVar("KeyT", bound=Hashable)


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
