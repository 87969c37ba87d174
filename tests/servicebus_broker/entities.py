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
* Sessions: on session-enabled entities a receiver locks one session at a time (a given session
  id, or the "next available": the session of the oldest available message that no receiver
  holds); messages of a locked session go only to its owner, in sequence order. The session lock
  is the umbrella of its messages' locks: they have no lock timer of their own, renewing the
  session lock (``renew-session-lock``) keeps them locked, and settling one after the session
  lock was lost answers ``com.microsoft:session-lock-lost``. When the session lock expires, its
  locked messages become available again with ``delivery_count + 1`` and the owner's link is
  detached with ``session-lock-lost``; when the owner closes its link in time, they become
  available again without counting a delivery (Service Bus "impact of delivery count" table).
  Session state and ``get`` / ``set`` of it are supported.
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


@dataclass(frozen=True)
class HistoryEntry:
    """One thing that happened to a message of an entity (for ordering assertions in tests)."""

    event: str  # complete | abandon | dead_letter | release | defer | expire
    sequence_number: int
    session_id: str | None
    delivery_count: int  # after the event


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
    sessions_locked: int = 0
    session_locks_expired: int = 0
    session_locks_renewed: int = 0


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
    history: list[HistoryEntry] = field(default_factory=list)
    on_available: Callable[[Entity], None] | None = None
    on_lock: Callable[[Entity, StoredMessage], None] | None = None
    on_session_lost: Callable[[Entity, object, str], None] | None = None

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
        self.locks[token] = message.sequence_number
        session = self._session_of(message)
        if session is not None:
            # The session lock is the umbrella of the message lock: no timer of its own.
            message.locked_until_ms = session.locked_until_ms
            return token
        message.locked_until_ms = now_ms() + int(self.lock_duration * 1000)
        if self.on_lock is not None:
            self.on_lock(self, message)
        return token

    def _session_of(self, message: StoredMessage) -> SessionState | None:
        if not self.requires_session or message.session_id is None:
            return None
        return self.sessions.setdefault(message.session_id, SessionState())

    def locked_message(self, token: uuid.UUID) -> StoredMessage:
        sequence_number = self.locks.get(token)
        if sequence_number is None:
            if self.requires_session:
                # On a session entity a token goes stale only when its session lock was lost
                # (expired, or the session was closed and its messages released).
                raise SessionLockLostError(str(token))
            raise LockLostError(str(token))
        message = self.messages[sequence_number]
        session = self._session_of(message)
        if session is not None:
            if session.owner is None or session.locked_until_ms <= now_ms():
                assert message.session_id is not None
                self.expire_session(message.session_id)
                raise SessionLockLostError(message.session_id)
            return message
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
        self._record("complete", message)

    def abandon(self, token: uuid.UUID, *, count_delivery: bool = True) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        self.stats.abandoned += 1
        self._failed_delivery(message, count_delivery)
        self._record("abandon", message)

    def release(self, token: uuid.UUID) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        self.stats.released += 1
        self._make_available(message)
        self._record("release", message)

    def defer(self, token: uuid.UUID) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        message.state = "deferred"
        self.stats.deferred += 1
        self._record("defer", message)

    def dead_letter(self, token: uuid.UUID, reason: str | None, description: str | None) -> None:
        message = self.locked_message(token)
        self._unlock(message)
        self.move_to_dead_letter(message, reason, description)
        self._record("dead_letter", message)

    def renew(self, token: uuid.UUID) -> int:
        message = self.locked_message(token)
        if self._session_of(message) is not None:
            assert message.session_id is not None
            return self.renew_session(message.session_id)
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
        self._record("expire", message)

    def _record(self, event: str, message: StoredMessage) -> None:
        self.history.append(HistoryEntry(event, message.sequence_number, message.session_id, message.delivery_count))

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
        """
        Lock ``session_id``, or the next available session, for ``owner``; None if it cannot be.

        The next available session is the one of the oldest available message whose session no
        receiver holds: a session is handed out only when it has a message to deliver.
        """
        now = now_ms()
        candidates = [session_id] if session_id is not None else self._sessions_with_messages()
        for candidate in candidates:
            state = self.sessions.setdefault(candidate, SessionState())
            if state.owner is not None and state.owner is not owner and state.locked_until_ms <= now:
                self.expire_session(candidate)  # the previous owner's lock ran out
            if state.owner is None or state.owner is owner:
                state.owner = owner
                state.locked_until_ms = now + int(self.lock_duration * 1000)
                self.stats.sessions_locked += 1
                return candidate
        return None

    def _sessions_with_messages(self) -> list[str]:
        seen: dict[str, None] = {}
        for sequence_number in self.available:
            session_id = self.messages[sequence_number].session_id
            if session_id is not None:
                seen.setdefault(session_id)
        return list(seen)

    def owns_session(self, owner: object, session_id: str) -> bool:
        state = self.sessions.get(session_id)
        return state is not None and state.owner is owner and state.locked_until_ms > now_ms()

    def renew_session(self, session_id: str) -> int:
        """Extend a held session lock (and so its messages' locks); returns the new expiry (ms)."""
        state = self.sessions[session_id]
        state.locked_until_ms = now_ms() + int(self.lock_duration * 1000)
        for message in self._locked_in_session(session_id):
            message.locked_until_ms = state.locked_until_ms
        self.stats.session_locks_renewed += 1
        return state.locked_until_ms

    def _locked_in_session(self, session_id: str) -> list[StoredMessage]:
        return [
            message
            for message in self.messages.values()
            if message.state == "locked" and message.session_id == session_id
        ]

    def expire_session(self, session_id: str) -> None:
        """
        The session lock ran out: free the session, redeliver its locked messages with
        ``delivery_count + 1`` (or dead-letter them at ``max_delivery_count``), and tell the
        broker to detach the former owner's link.
        """
        state = self.sessions.get(session_id)
        if state is None or state.owner is None:
            return
        owner, state.owner, state.locked_until_ms = state.owner, None, 0
        self.stats.session_locks_expired += 1
        for message in sorted(self._locked_in_session(session_id), key=lambda m: m.sequence_number):
            self._expire(message)
        if self.on_session_lost is not None:
            self.on_session_lost(self, owner, session_id)
        self._notify()

    def expire_sessions(self) -> None:
        """Expire every held session whose lock ran out (called by the broker's lock timer)."""
        now = now_ms()
        for session_id, state in list(self.sessions.items()):
            if state.owner is not None and state.locked_until_ms <= now:
                self.expire_session(session_id)

    def session_state(self, owner: object, session_id: str) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None or state.owner is not owner or state.locked_until_ms <= now_ms():
            raise SessionLockLostError(session_id)
        return state

    def unlock_session(self, owner: object, session_id: str) -> None:
        """
        The owner closed its link: its locked messages become available again without counting a
        delivery (or, if the lock had already run out, as an expiry).
        """
        state = self.sessions.get(session_id)
        if state is None or state.owner is not owner:
            return
        if state.locked_until_ms <= now_ms():
            self.expire_session(session_id)
            return
        state.owner, state.locked_until_ms = None, 0
        for message in sorted(self._locked_in_session(session_id), key=lambda m: m.sequence_number):
            self._unlock(message)
            self.stats.released += 1
            self._make_available(message)
            self._record("release", message)
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
