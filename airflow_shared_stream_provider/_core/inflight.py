"""
The messages a producer handed to its watchers and has not settled yet, and the keeping of their
leases: the bookkeeping SQS (receipt handles), Pub/Sub (ack ids) and Service Bus (lock tokens)
share. No broker SDK: the producer says what renewing a lease and giving a message back mean.

Invariants:

* a handle is in :class:`InFlight` from the moment its message is broadcast until the producer
  settled it (:meth:`InFlight.settled`) or gave it back on close (:meth:`InFlight.drain`); while it
  is there its lease is kept (when a :class:`~._core.lease.LeaseKeeper` runs) and never after;
* a lease the keeper found lost is counted once: it is remembered until its handle is settled, so
  the settlement that then fails the same way is not counted again (:meth:`InFlight.lost_at_renewal`).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterator
from typing import Generic, TypeVar

from airflow_shared_stream_provider._core.lease import LeaseKeeper
from airflow_shared_stream_provider._core.metrics import StreamCounters

HandleT = TypeVar("HandleT", bound=Hashable)
ItemT = TypeVar("ItemT")


class InFlight(Generic[HandleT, ItemT]):
    """Unsettled messages by broker handle (with what the producer needs to give each back), and their leases."""

    __slots__ = ("_items", "_lost", "counters", "keeper")

    def __init__(self, counters: StreamCounters) -> None:
        self.counters = counters
        self.keeper: LeaseKeeper[HandleT] | None = None
        self._items: dict[HandleT, ItemT] = {}
        self._lost: set[HandleT] = set()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, handle: object) -> bool:
        return handle in self._items

    def __iter__(self) -> Iterator[HandleT]:
        return iter(self._items)

    def get(self, handle: HandleT) -> ItemT | None:
        return self._items.get(handle)

    def items(self) -> list[ItemT]:
        return list(self._items.values())

    # -- leases --------------------------------------------------------------------------------
    def keep_leases(self, keeper: LeaseKeeper[HandleT]) -> LeaseKeeper[HandleT]:
        """Start ``keeper``: from now on every added handle's lease is renewed until it is settled."""
        self.keeper = keeper
        keeper.start()
        return keeper

    def count_renewals(self, renewed: int, lost: Collection[HandleT] = ()) -> None:
        """A renewal pass renewed ``renewed`` leases and found ``lost`` gone (counted here, once)."""
        self.counters.add("leases_renewed", renewed)
        self.counters.add("leases_lost", len(lost))
        self._lost.update(lost)

    def lost_at_renewal(self, handle: HandleT) -> bool:
        """Whether a renewal already found (and counted) this handle's lease lost."""
        return handle in self._lost

    # -- the messages --------------------------------------------------------------------------
    def add(self, handle: HandleT, item: ItemT, *, lease_expires_at: float | None = None) -> None:
        """A message is broadcast now; its lease (ending at ``lease_expires_at``, monotonic) is kept."""
        self._items[handle] = item
        if self.keeper is not None:
            self.keeper.track(handle, lease_expires_at=lease_expires_at)

    def settled(self, handle: HandleT) -> ItemT | None:
        """The producer is done with ``handle`` (settled, or given back): forget it, stop its lease."""
        self._lost.discard(handle)
        if self.keeper is not None:
            self.keeper.release(handle)
        return self._items.pop(handle, None)

    def drain(self) -> dict[HandleT, ItemT]:
        """Everything still unsettled, forgotten here (closing: the producer gives it back)."""
        items, self._items = self._items, {}
        if self.keeper is not None:
            for handle in items:
                self.keeper.release(handle)
        self._lost.clear()
        return items

    async def stop(self) -> None:
        """Stop keeping leases (``aclose``): what is still unsettled lapses or is given back."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            await keeper.stop()
