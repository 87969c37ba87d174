"""Service Bus entities: queues, topics, subscriptions and their dead-letter sub-queues.

Implemented semantics (mirroring Azure Service Bus):

* FIFO by sequence number; an abandoned / expired / released message keeps its sequence number and
  its place in the order.
* Peek-lock: each delivery gets a fresh lock token (a new token per delivery attempt, so a stale
  token from an earlier attempt is "lock lost"); ``lock_duration`` per entity; renew extends it.
* ``delivery_count`` counts failed deliveries (abandon, lock expiry); it does not count releases.
  When it reaches ``max_delivery_count`` the message is dead-lettered with reason
  ``MaxDeliveryCountExceeded``.
* Dead-lettering moves the message to the entity's ``$DeadLetterQueue`` with application
  properties ``DeadLetterReason`` / ``DeadLetterErrorDescription`` and annotation
  ``x-opt-deadletter-source``; the DLQ keeps the original sequence number.
* Defer: a deferred message is only reachable by sequence number (``receive_deferred``).
* Sessions: on session-enabled entities a receiver locks one session at a time; messages of a
  locked session go only to its owner (session state and session-lock renewal are supported).
* Topics copy every message to each subscription (no rules/filters: every subscription gets all).

Not implemented: scheduled messages, TTL / expiry of messages, duplicate detection, auto-forward,
partitioning, rules/filters, quotas.
"""

from __future__ import annotations

import bisect
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .message import StoredMessage, now_ms

if TYPE_CHECKING:
    from collections.abc import Callable

DLQ_SUFFIX = "/$deadletterqueue"


class LockLostError(Exception):
    """The lock token is unknown or expired (maps to ``com.microsoft:message-lock-lost``)."""


class SessionLockLostError(Exception):
    """The session lock is not held (maps to ``com.microsoft:session-lock-lost``)."""


@dataclass
class SessionState:
    """Broker-side state of one message session."""

    owner: object | None = None
    locked_until_ms: int = 0
    state: bytes | None = None


@dataclass
class EntityStats:
    """Counters per entity (read through ``Broker.entity_stats``)."""

    enqueued: int = 0
    delivered: int = 0
    completed: int = 0
    abandoned: int = 0
    released: int = 0
    deferred: int = 0
    dead_lettered: int = 0
    lock_expired: int = 0
    lock_renewed: int = 0


@dataclass
class Entity:
    """A queue, a subscription, or a dead-letter sub-queue: a message store with locks."""

    path: str
    lock_duration: float = 30.0
    max_delivery_count: int = 10
    requires_session: bool = False
    dead_letter_queue: Entity | None = None
    messages: dict[int, StoredMessage] = field(default_factory=dict)
    available: list[int] = field(default_factory=list)
    locks: dict[uuid.UUID, int] = field(default_factory=dict)
    sessions: dict[str, SessionState] = field(default_factory=dict)
    stats: EntityStats = field(default_factory=EntityStats)
    next_sequence_number: int = 1
    on_available: Callable[[Entity], None] | None = None
    on_lock: Callable[[Entity, StoredMessage], None] | None = None

    @property
    def is_dead_letter_queue(self) -> bool:
        return self.path.lower().endswith(DLQ_SUFFIX)

    # -- enqueue ---------------------------------------------------------------------------
    def enqueue(self, message: StoredMessage, *, keep_sequence: bool = False) -> None:
        if not keep_sequence:
            message.sequence_number = self.next_sequence_number
            message.enqueued_time_ms = now_ms()
        self.next_sequence_number = max(self.next_sequence_number, message.sequence_number) + 1
        message.state = "available"
        message.lock_token = None
        self.messages[message.sequence_number] = message
        bisect.insort(self.available, message.sequence_number)
        self.stats.enqueued += 1
        self._notify()

    def _notify(self) -> None:
        if self.on_available is not None:
            self.on_available(self)

    def _make_available(self, message: StoredMessage) -> None:
        message.state = "available"
        message.lock_token = None
        bisect.insort(self.available, message.sequence_number)
        self._notify()

    # -- acquisition -----------------------------------------------------------------------
    def peek_available(self, session_id: str | None = None) -> StoredMessage | None:
        for sequence_number in self.available:
            message = self.messages[sequence_number]
            if session_id is None or message.session_id == session_id:
                return message
        return None

    def take(self, message: StoredMessage, *, lock: bool) -> uuid.UUID | None:
        """Remove ``message`` from the available list; lock it (peek-lock) or delete it."""
        self.available.remove(message.sequence_number)
        self.stats.delivered += 1
        if not lock:
            del self.messages[message.sequence_number]
            message.state = "deleted"
            return None
        token = uuid.uuid4()
        message.state = "locked"
        message.lock_token = token
        message.locked_until_ms = now_ms() + int(self.lock_duration * 1000)
        self.locks[token] = message.sequence_number
        if self.on_lock is not None:
            self.on_lock(self, message)
        return token

    def locked_message(self, token: uuid.UUID) -> StoredMessage:
        sequence_number = self.locks.get(token)
        if sequence_number is None:
            raise LockLostError(str(token))
        message = self.messages[sequence_number]
        if message.locked_until_ms <= now_ms():
            self._expire(message)
            raise LockLostError(str(token))
        return message

    def _unlock(self, message: StoredMessage) -> None:
        if message.lock_token is not None:
            self.locks.pop(message.lock_token, None)
        message.lock_token = None

    # -- settlement ------------------------------------------------------------------------
    def complete(self, token: uuid.UUID) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        del self.messages[message.sequence_number]
        self.stats.completed += 1

    def abandon(self, token: uuid.UUID, *, count_delivery: bool = True) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        self.stats.abandoned += 1
        self._failed_delivery(message, count_delivery)

    def release(self, token: uuid.UUID) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        self.stats.released += 1
        self._make_available(message)

    def defer(self, token: uuid.UUID) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        message.state = "deferred"
        self.stats.deferred += 1

    def dead_letter(self, token: uuid.UUID, reason: str | None, description: str | None) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        self.move_to_dead_letter(message, reason, description)

    def renew(self, token: uuid.UUID) -> int:
        message = self.locked_message(token)
        message.locked_until_ms = now_ms() + int(self.lock_duration * 1000)
        self.stats.lock_renewed += 1
        if self.on_lock is not None:
            self.on_lock(self, message)
        return message.locked_until_ms

    def _failed_delivery(self, message: StoredMessage, count_delivery: bool) -> None:
        if count_delivery:
            message.delivery_count += 1
        if message.delivery_count >= self.max_delivery_count and not self.is_dead_letter_queue:
            self.move_to_dead_letter(
                message,
                "MaxDeliveryCountExceeded",
                f"Message could not be consumed after {self.max_delivery_count} delivery attempts.",
            )
        else:
            self._make_available(message)

    def move_to_dead_letter(self, message: StoredMessage, reason: str | None, description: str | None) -> None:
        """Move a message (already unlocked, not in ``available``) to the dead-letter queue."""
        self.messages.pop(message.sequence_number, None)
        if self.dead_letter_queue is None:  # a DLQ has no DLQ: the service just deletes it
            return
        if reason is not None:
            message.set_app_property("DeadLetterReason", reason)
        if description is not None:
            message.set_app_property("DeadLetterErrorDescription", description)
        message.set_annotation("x-opt-deadletter-source", self.path)
        message.dead_letter_source = self.path
        self.stats.dead_lettered += 1
        self.dead_letter_queue.enqueue(message, keep_sequence=True)

    def expire_lock(self, sequence_number: int, token: uuid.UUID) -> bool:
        """Called by the broker's lock timer; returns ``True`` if the lock really expired."""
        message = self.messages.get(sequence_number)
        if message is None or message.lock_token != token or message.locked_until_ms > now_ms():
            return False
        self._expire(message)
        return True

    def _expire(self, message: StoredMessage) -> None:
        self._unlock(message)
        self.stats.lock_expired += 1
        self._failed_delivery(message, True)

    # -- deferred messages -----------------------------------------------------------------
    def receive_deferred(self, sequence_number: int, *, lock: bool) -> tuple[StoredMessage, uuid.UUID | None]:
        message = self.messages.get(sequence_number)
        if message is None or message.state != "deferred":
            raise KeyError(sequence_number)
        message.state = "available"
        self.available.append(sequence_number)  # ``take`` removes it again
        return message, self.take(message, lock=lock)

    # -- sessions --------------------------------------------------------------------------
    def lock_session(self, owner: object, session_id: str | None) -> str | None:
        """Lock ``session_id`` (or the first unlocked session with messages) for ``owner``."""
        now = now_ms()
        candidates = [session_id] if session_id is not None else self._sessions_with_messages()
        for candidate in candidates:
            if candidate is None:
                continue
            state = self.sessions.setdefault(candidate, SessionState())
            if state.owner is None or state.owner is owner or state.locked_until_ms <= now:
                state.owner = owner
                state.locked_until_ms = now + int(self.lock_duration * 1000)
                return candidate
        return None

    def _sessions_with_messages(self) -> list[str | None]:
        seen: list[str | None] = []
        for sequence_number in self.available:
            session_id = self.messages[sequence_number].session_id
            if session_id not in seen:
                seen.append(session_id)
        return seen

    def session_state(self, owner: object, session_id: str) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None or state.owner is not owner or state.locked_until_ms <= now_ms():
            raise SessionLockLostError(session_id)
        return state

    def unlock_session(self, owner: object, session_id: str) -> None:
        state = self.sessions.get(session_id)
        if state is not None and state.owner is owner:
            state.owner = None
            state.locked_until_ms = 0
            self._notify()

    # -- inspection ------------------------------------------------------------------------
    def count(self, state: str) -> int:
        return sum(1 for message in self.messages.values() if message.state == state)


@dataclass
class Topic:
    """A topic: fans every message out to all of its subscriptions."""

    path: str
    subscriptions: dict[str, Entity] = field(default_factory=dict)
    stats: EntityStats = field(default_factory=EntityStats)

    def enqueue(self, message: StoredMessage) -> None:
        self.stats.enqueued += 1
        for subscription in self.subscriptions.values():
            subscription.enqueue(message.copy_for())
