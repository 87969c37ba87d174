"""
Deferred release of advanced messages: free them one at a time as new messages arrive.

Why. CPython's cyclic GC runs a young collection after every 700 *net* container allocations
(allocations minus deallocations; the counter stops at zero), a middle one after every 11 young
ones, and a full one, which walks the whole triggerer heap (150-200k objects, 100-200 ms on the
2-core benchmark machine), after every 11 middle ones. A message allocates its containers one at
a time while it is read (message object, envelope, body, metadata; the manager's bookkeeping and
trigger events besides), but they all used to die at once: when the manager dropped an advanced
batch, a thousand messages' objects were freed in one burst, and a burst can pay back only what
the counter still holds (a few hundred), not the thousands the batch allocated. So nearly every
allocation counted, as if the heap kept growing.

Holding the advanced batch here and freeing it one message per new message spreads those frees
between the allocations they offset. Measured with Kafka at N=1 (20k messages): young collections
~400 -> ~290 and full collections 3 -> 2, about 0.13 s less CPU per 20k messages
(docs/performance.md, Kafka).

Bounds: at most :attr:`DeferredRelease.limit` held entries (``held_release_limit``: at most
``min(max_in_flight, 2 flow windows)`` messages, about what may be in flight anyway), and
everything is released when the stream goes quiet (:meth:`release_all`, called by every producer
when a receive comes back empty), so an idle stream holds nothing for longer than one poll.

Holding only delays ``free``: nothing here is read again, and a message's outcome is settled on
the broker before its batch is held.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Final

# Entries one message leaves behind after its advance: the manager's ``AdvanceItem`` (which holds
# the outcome and the broker payload, i.e. the message, its envelope and body) and our ``Decided``.
ENTRIES_PER_MESSAGE: Final = 2


class DeferredRelease:
    """Advanced batches held for release, one message's entries per message read."""

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int) -> None:
        self._held: deque[object] = deque()
        self.limit = limit

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, entries: Iterable[object]) -> None:
        """Keep ``entries`` for gradual release; over :attr:`limit`, the oldest go at once."""
        held = self._held
        held.extend(entries)
        excess = len(held) - self.limit
        while excess > 0:
            held.popleft()
            excess -= 1

    def release_some(self) -> None:
        """
        Free one message's worth, :data:`ENTRIES_PER_MESSAGE` entries (unrolled: this runs once per
        message read, in every producer's hot loop).
        """
        held = self._held
        if held:
            held.popleft()
            if held:
                held.popleft()

    def release_all(self) -> None:
        self._held.clear()
