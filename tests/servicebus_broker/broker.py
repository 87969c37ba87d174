"""The broker: entity registry, routing, dispatch, lock timers, statistics, and its thread.

``start_broker()`` runs a ``Broker`` on its own asyncio loop in a daemon thread, listening on
127.0.0.1 (a free port), and returns a ``BrokerHandle``. Every public method of the handle is
thread-safe: it runs the work on the broker loop and waits for the result, so tests may call it
from their own event loop or thread.

The lock timer expires message locks and, on session-enabled entities, session locks.
``handle.history(path)`` is the entity's record of what happened to each message (complete,
abandon, dead_letter, release, defer, expire), in order, for ordering assertions.

Errors raised while serving a connection (bugs in the broker, protocol violations by the peer,
undecodable messages) never stop the broker silently: they are recorded in ``handle.errors``
(and logged); ``handle.raise_errors()`` / the pytest fixture turn them into a test failure.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from . import frames as f
from .codec import DecodeError, Described, Long, Symbol
from .connection import (
    SESSION_FILTER,
    Connection,
    IncomingLink,
    OutgoingDelivery,
    OutgoingLink,
    Session,
    accepted,
    address_path,
    rejected,
    session_filter_key,
    session_lock_lost_error,
    settle_outcome,
)
from .entities import DLQ_SUFFIX, Entity, HistoryEntry, Topic
from .management import encode_response, handle_cbs, handle_management
from .message import BATCH_FORMAT, StoredMessage, now_ms, parse_message, split_batch

if TYPE_CHECKING:
    from collections.abc import Callable

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")

DOTNET_EPOCH_TICKS = 621355968000000000
LOCK_TIMER_INTERVAL = 0.02


@dataclass
class BrokerError:
    """An exception the broker hit while serving a peer."""

    where: str
    error: BaseException
    traceback: str

    def __str__(self) -> str:
        return f"{self.where}: {self.error!r}\n{self.traceback}"


@dataclass
class MessageSnapshot:
    """A copy of one stored message, for assertions in tests."""

    sequence_number: int
    message_id: Any
    session_id: str | None
    body: Any
    application_properties: dict[Any, Any]
    delivery_count: int
    state: str
    dead_letter_reason: str | None
    dead_letter_description: str | None
    dead_letter_source: str | None


@dataclass
class EntityCounts:
    """Message counts of one entity (``dead_lettered`` = messages in its dead-letter queue)."""

    active: int
    locked: int
    deferred: int
    dead_lettered: int


@dataclass
class OperationStats:
    """Frames by performative, received from / sent to clients, plus management operations."""

    received: dict[str, int]
    sent: dict[str, int]
    management: dict[str, int]
    per_connection: dict[int, dict[str, int]]
    connections: int
    messages_enqueued: int

    @property
    def total_received(self) -> int:
        return sum(self.received.values())


@dataclass
class _ConnectionRecord:
    container_id: str
    received: Counter[str] = field(default_factory=Counter)


class Broker:
    """All broker state; lives on (and must only be touched from) the broker loop."""

    def __init__(self, *, max_message_size: int = 4 * 1024 * 1024, sas_keys: dict[str, str] | None = None) -> None:
        self.max_message_size = max_message_size
        self.sas_keys = sas_keys  # None: any token is accepted
        self.entities: dict[str, Entity] = {}  # receivable: queues, subscriptions, DLQs
        self.topics: dict[str, Topic] = {}
        self.errors: list[BrokerError] = []
        self.received: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.management_calls: Counter[str] = Counter()
        self.messages_enqueued = 0
        self.connections: dict[int, _ConnectionRecord] = {}
        self._live: dict[int, Connection] = {}
        self._consumers: dict[str, list[OutgoingLink]] = {}
        self._rotation: dict[str, int] = {}
        self._dispatch_scheduled: set[str] = set()
        self._lock_heap: list[tuple[int, int, str, int, uuid.UUID]] = []
        self._heap_seq = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- entities ----------------------------------------------------------------------------
    def _new_entity(self, path: str, **options: Any) -> Entity:
        entity = Entity(path, **options)
        entity.dead_letter_queue = Entity(
            path + "/$DeadLetterQueue",
            lock_duration=entity.lock_duration,
            max_delivery_count=entity.max_delivery_count,
        )
        for item in (entity, entity.dead_letter_queue):
            item.on_available = self._schedule_dispatch
            item.on_lock = self._on_lock
            item.on_session_lost = self._on_session_lost
            self.entities[item.path.lower()] = item
        return entity

    def create_queue(self, name: str, **options: Any) -> None:
        if name.lower() in self.entities or name.lower() in self.topics:
            raise ValueError(f"entity {name!r} already exists")
        self._new_entity(name, **options)

    def create_topic(self, name: str) -> None:
        if name.lower() in self.entities or name.lower() in self.topics:
            raise ValueError(f"entity {name!r} already exists")
        self.topics[name.lower()] = Topic(name)

    def create_subscription(self, topic: str, name: str, **options: Any) -> None:
        owner = self.topics.get(topic.lower())
        if owner is None:
            raise ValueError(f"topic {topic!r} does not exist")
        if name.lower() in owner.subscriptions:
            raise ValueError(f"subscription {topic}/{name} already exists")
        owner.subscriptions[name.lower()] = self._new_entity(f"{owner.path}/Subscriptions/{name}", **options)

    def entity(self, path: str) -> Entity:
        entity = self.entities.get(path.strip("/").lower())
        if entity is None:
            raise KeyError(f"no queue/subscription {path!r}")
        return entity

    def resolve(self, path: str, *, for_sending: bool) -> tuple[str, Entity | None, Topic | None, Described | None]:
        """Map a link address to ``(kind, entity, topic, refusal error)``."""
        lowered = path.lower()
        if lowered == "$cbs":
            return "cbs", None, None, None
        if lowered.endswith("/$management"):
            entity = self.entities.get(lowered[: -len("/$management")])
            if entity is not None:
                return "management", entity, None, None
        elif for_sending:
            if lowered in self.topics:
                return "topic", None, self.topics[lowered], None
            entity = self.entities.get(lowered)
            if entity is not None and "/subscriptions/" not in lowered and not lowered.endswith(DLQ_SUFFIX):
                return "entity", entity, None, None
        else:
            entity = self.entities.get(lowered)
            if entity is not None:
                return "entity", entity, None, None
        error = f.amqp_error("amqp:not-found", f"The messaging entity '{path}' could not be found.")
        return "entity", None, None, error

    # -- statistics / errors -----------------------------------------------------------------
    def count_frame(self, direction: str, code: int) -> None:
        name = f.PERFORMATIVE_NAMES.get(code, hex(code))
        (self.received if direction == "received" else self.sent)[name] += 1

    def record_error(self, error: BaseException, where: str) -> None:
        text = "".join(traceback.format_exception(error))
        _LOGGER.error("servicebus test broker error in %s: %s", where, text)
        self.errors.append(BrokerError(where, error, text))

    def connection_opened(self, connection: Connection) -> None:
        self._live[connection.id] = connection
        self.connections[connection.id] = _ConnectionRecord("", connection.received)

    def connection_closed(self, connection: Connection) -> None:
        self._live.pop(connection.id, None)
        record = self.connections.get(connection.id)
        if record is not None:
            record.container_id = connection.container_id

    # -- incoming deliveries -----------------------------------------------------------------
    def on_incoming_delivery(self, link: IncomingLink, message_format: int, body: bytes) -> Described:
        if link.kind in ("cbs", "management"):
            self._handle_request(link, body)
            return accepted()
        try:
            payloads = split_batch(body) if message_format == BATCH_FORMAT else [body]
            messages = [parse_message(payload) for payload in payloads]
        except (DecodeError, IndexError) as exc:
            self.record_error(exc, f"decoding a message sent to {link.address}")
            return rejected(f.amqp_error("amqp:decode-error", str(exc)))
        target: Entity | Topic | None = link.topic if link.topic is not None else link.entity
        if target is None:
            return rejected(f.amqp_error("amqp:not-found", link.address))
        if (
            isinstance(target, Entity)
            and target.requires_session
            and any(message.session_id is None for message in messages)
        ):
            return rejected(
                f.amqp_error(
                    "amqp:not-allowed",
                    "The SessionId was not set on a message, and it cannot be sent to the entity.",
                )
            )
        for message in messages:
            target.enqueue(message)
            self.messages_enqueued += 1
        return accepted()

    def _handle_request(self, link: IncomingLink, body: bytes) -> None:
        try:
            request = parse_message(body)
        except (DecodeError, IndexError) as exc:
            self.record_error(exc, f"decoding a request on {link.address}")
            return
        if link.kind == "cbs":
            self.management_calls["put-token"] += 1
            response = handle_cbs(request, self.sas_keys)
        else:
            assert link.entity is not None
            operation = str(request.application_properties.get("operation", "?"))
            self.management_calls[operation] += 1
            response = handle_management(link.entity, request, link.session.connection)
        payload = encode_response(request, response, cbs=link.kind == "cbs")
        reply_to = request.properties[4] if len(request.properties) > 4 else None
        reply_link = self._reply_link(link, None if reply_to is None else str(reply_to))
        if reply_link is None:
            raise RuntimeError(f"no reply link for a request on {link.address} (reply_to={reply_to!r})")
        reply_link.pending_replies.append(payload)
        self.flush_replies(reply_link)

    @staticmethod
    def _reply_link(link: IncomingLink, reply_to: str | None) -> OutgoingLink | None:
        node = address_path(link.address).lower()
        wanted = address_path(reply_to).lower() if reply_to else node
        candidates = [
            other
            for other in link.session.links.values()
            if isinstance(other, OutgoingLink) and other.kind == link.kind and not other.detached
        ]
        for other in candidates:
            if address_path(other.target_address or "").lower() == wanted:
                return other
        for other in candidates:
            if address_path(other.address).lower() == node:
                return other
        return None

    def flush_replies(self, link: OutgoingLink) -> None:
        session = link.session
        while link.pending_replies and session.can_send(link):
            payload = link.pending_replies.pop(0)
            session.send_delivery(link, next(self._heap_seq).to_bytes(8, "big"), payload, settled=True)

    # -- settlement --------------------------------------------------------------------------
    def settle(self, entity: Entity, token: uuid.UUID, state: Described | None) -> Described:
        return settle_outcome(entity, token, state)

    # -- dispatch ----------------------------------------------------------------------------
    def add_consumer(self, link: OutgoingLink) -> None:
        assert link.entity is not None
        self._consumers.setdefault(link.entity.path.lower(), []).append(link)
        self._schedule_dispatch(link.entity)

    def remove_consumer(self, link: OutgoingLink) -> None:
        if link.entity is None:
            return
        consumers = self._consumers.get(link.entity.path.lower(), [])
        if link in consumers:
            consumers.remove(link)
        if link.session_id is not None:
            link.entity.unlock_session(link, link.session_id)

    def _schedule_dispatch(self, entity: Entity) -> None:
        key = entity.path.lower()
        if key in self._dispatch_scheduled or self.loop is None:
            return
        self._dispatch_scheduled.add(key)
        self.loop.call_soon(self._run_dispatch, entity)

    def _run_dispatch(self, entity: Entity) -> None:
        self._dispatch_scheduled.discard(entity.path.lower())
        try:
            self.dispatch(entity)
        except Exception as exc:
            self.record_error(exc, f"dispatching {entity.path}")

    def dispatch_all(self) -> None:
        for link in [link for links in self._consumers.values() for link in links]:
            if link.entity is not None:
                self._schedule_dispatch(link.entity)
        for connection in self._live.values():
            for session in connection.sessions.values():
                for other in session.links.values():
                    if isinstance(other, OutgoingLink) and other.pending_replies:
                        self.flush_replies(other)

    def dispatch(self, entity: Entity) -> None:
        """Hand available messages to the entity's receivers, one each in turn."""
        consumers = self._consumers.get(entity.path.lower(), [])
        if not consumers:
            return
        start = self._rotation.get(entity.path.lower(), 0)
        progress = True
        while progress:
            progress = False
            for offset in range(len(consumers)):
                link = consumers[(start + offset) % len(consumers)]
                if not link.session.can_send(link):
                    continue
                if link.session_id is not None and not entity.owns_session(link, link.session_id):
                    continue  # its session lock ran out: the lock timer detaches it
                message = entity.peek_available(link.session_id)
                if message is None:
                    continue
                self._deliver(entity, link, message)
                progress = True
            start += 1
        self._rotation[entity.path.lower()] = start
        for link in list(consumers):
            if link.drain and entity.peek_available(link.session_id) is None:
                link.session.answer_drain(link)

    def _deliver(self, entity: Entity, link: OutgoingLink, message: StoredMessage) -> None:
        session: Session = link.session
        token = entity.take(message, lock=not link.presettled)
        if token is None:
            session.send_delivery(link, uuid.uuid4().bytes_le, message.encode(), settled=True)
            return
        payload = message.encode(lock_token=token, locked_until_ms=message.locked_until_ms)
        delivery_id = session.send_delivery(link, token.bytes_le, payload, settled=False)
        session.unsettled[delivery_id] = OutgoingDelivery(link, entity, token)

    # -- sessions ----------------------------------------------------------------------------
    def start_session_receiver(self, link: OutgoingLink, attach: f.Attach) -> None:
        """Attach a receiver on a session-enabled entity: lock its session, or refuse."""
        assert link.entity is not None and attach.source is not None
        key = session_filter_key(attach)
        if key is None:
            link.session.refuse(
                attach,
                link,
                f.amqp_error(
                    "amqp:not-allowed",
                    "It is not possible for an entity that requires sessions to create a non-sessionful "
                    "message receiver.",
                ),
            )
            return
        requested = attach.source.filters[key]
        if isinstance(requested, Described):
            requested = requested.value
        # The SDK sends its wait for a session (max_wait_time) as the link's server timeout.
        timeout_ms = next((int(v) for k, v in attach.properties.items() if str(k) == "com.microsoft:timeout"), 60000)
        deadline = time.monotonic() + timeout_ms / 1000
        self._try_lock_session(link, attach, None if requested is None else str(requested), deadline)

    def _try_lock_session(self, link: OutgoingLink, attach: f.Attach, requested: str | None, deadline: float) -> None:
        entity = link.entity
        assert entity is not None and attach.source is not None and self.loop is not None
        if link.session.ended or link.detached:
            return
        session_id = entity.lock_session(link, requested)
        if session_id is None and requested is not None:
            link.session.refuse(
                attach,
                link,
                f.amqp_error("com.microsoft:session-cannot-be-locked", f"The session {requested} is locked."),
            )
            return
        if session_id is None:
            # Next available session: wait (polling) until one has a message and is free, or answer
            # the service's timeout, which the SDK raises as OperationTimeoutError.
            if time.monotonic() >= deadline:
                link.session.refuse(attach, link, f.amqp_error("com.microsoft:timeout", "No session available."))
            else:
                self.loop.call_later(0.05, self._try_lock_session, link, attach, requested, deadline)
            return
        link.session_id = session_id
        source_fields = list(attach.source.raw.value) + [None] * max(0, 8 - len(attach.source.raw.value))
        source_fields[7] = {Symbol(SESSION_FILTER): session_id}
        locked_until = entity.sessions[session_id].locked_until_ms
        ticks = DOTNET_EPOCH_TICKS + locked_until * 10000
        link.session.send_attach_reply(
            attach,
            link,
            source=Described(attach.source.raw.descriptor, source_fields),
            target=attach.target.raw if attach.target else None,
            properties={Symbol("com.microsoft:locked-until-utc"): Long(ticks)},
        )
        link.session.complete_attach(link, attach)

    def _on_session_lost(self, entity: Entity, owner: object, session_id: str) -> None:
        """A session lock ran out: detach its former owner's link with ``session-lock-lost``.

        Deferred to the next loop turn: expiry may be noticed in the middle of handling one of
        that link's frames (a settlement), which must finish first."""
        if isinstance(owner, OutgoingLink) and self.loop is not None:
            self.loop.call_soon(self._detach_lost_session_link, owner, session_id)

    @staticmethod
    def _detach_lost_session_link(link: OutgoingLink, session_id: str) -> None:
        if not link.detached and not link.session.ended:
            link.session.close_link(link, session_lock_lost_error(session_id))

    # -- lock timers -------------------------------------------------------------------------
    def _on_lock(self, entity: Entity, message: StoredMessage) -> None:
        assert message.lock_token is not None
        heapq.heappush(
            self._lock_heap,
            (
                message.locked_until_ms,
                next(self._heap_seq),
                entity.path.lower(),
                message.sequence_number,
                message.lock_token,
            ),
        )

    async def lock_timer(self) -> None:
        while True:
            await asyncio.sleep(LOCK_TIMER_INTERVAL)
            try:
                now = now_ms()
                while self._lock_heap and self._lock_heap[0][0] <= now:
                    _, _, path, sequence_number, token = heapq.heappop(self._lock_heap)
                    entity = self.entities.get(path)
                    if entity is not None:
                        entity.expire_lock(sequence_number, token)
                for entity in list(self.entities.values()):
                    if entity.requires_session:
                        entity.expire_sessions()
            except Exception as exc:
                self.record_error(exc, "lock timer")

    # -- inspection (loop side) --------------------------------------------------------------
    def snapshot(self, path: str) -> list[MessageSnapshot]:
        entity = self.entity(path)
        return [_snapshot(entity.messages[n]) for n in sorted(entity.messages)]

    def history(self, path: str) -> list[HistoryEntry]:
        return list(self.entity(path).history)

    def session_owned(self, path: str, session_id: str) -> bool:
        state = self.entity(path).sessions.get(session_id)
        return state is not None and state.owner is not None and state.locked_until_ms > now_ms()

    def counts(self, path: str) -> EntityCounts:
        entity = self.entity(path)
        dlq = entity.dead_letter_queue
        return EntityCounts(
            active=entity.count("available"),
            locked=entity.count("locked"),
            deferred=entity.count("deferred"),
            dead_lettered=len(dlq.messages) if dlq is not None else 0,
        )

    def operation_stats(self) -> OperationStats:
        return OperationStats(
            received=dict(self.received),
            sent=dict(self.sent),
            management=dict(self.management_calls),
            per_connection={cid: dict(record.received) for cid, record in self.connections.items()},
            connections=len(self.connections),
            messages_enqueued=self.messages_enqueued,
        )


def _snapshot(message: StoredMessage) -> MessageSnapshot:
    properties = message.application_properties
    reason = properties.get("DeadLetterReason")
    description = properties.get("DeadLetterErrorDescription")
    return MessageSnapshot(
        sequence_number=message.sequence_number,
        message_id=message.message_id,
        session_id=message.session_id,
        body=message.body,
        application_properties=properties,
        delivery_count=message.delivery_count,
        state=message.state,
        dead_letter_reason=None if reason is None else str(reason),
        dead_letter_description=None if description is None else str(description),
        dead_letter_source=message.dead_letter_source,
    )


class BrokerHandle:
    """Thread-safe front of a running broker (see ``start_broker``)."""

    def __init__(self, broker: Broker, loop: asyncio.AbstractEventLoop, thread: threading.Thread, port: int) -> None:
        self._broker = broker
        self._loop = loop
        self._thread = thread
        self.port = port
        self.host = "127.0.0.1"
        self.connection_string = (
            f"Endpoint=sb://{self.host}:{port};SharedAccessKeyName=RootManageSharedAccessKey;"
            "SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true;"
        )
        self._stopped = False

    def call(self, fn: Callable[[Broker], T], timeout: float = 10.0) -> T:
        """Run ``fn(broker)`` on the broker loop and return its result."""
        if self._stopped:
            raise RuntimeError("broker is stopped")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(self._broker))
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout)

    # -- entities ----------------------------------------------------------------------------
    def create_queue(
        self,
        name: str,
        *,
        lock_duration: float = 30.0,
        max_delivery_count: int = 10,
        requires_session: bool = False,
    ) -> None:
        self.call(
            lambda b: b.create_queue(
                name,
                lock_duration=lock_duration,
                max_delivery_count=max_delivery_count,
                requires_session=requires_session,
            )
        )

    def create_topic(self, name: str) -> None:
        self.call(lambda b: b.create_topic(name))

    def create_subscription(
        self,
        topic: str,
        name: str,
        *,
        lock_duration: float = 30.0,
        max_delivery_count: int = 10,
        requires_session: bool = False,
    ) -> None:
        self.call(
            lambda b: b.create_subscription(
                topic,
                name,
                lock_duration=lock_duration,
                max_delivery_count=max_delivery_count,
                requires_session=requires_session,
            )
        )

    # -- inspection --------------------------------------------------------------------------
    def counts(self, path: str) -> EntityCounts:
        """Counts for a queue (``"q"``) or subscription (``"t/Subscriptions/s"``)."""
        return self.call(lambda b: b.counts(path))

    def messages(self, path: str) -> list[MessageSnapshot]:
        """Every message of an entity (any state), by sequence number; ``path`` may end in
        ``/$DeadLetterQueue``."""
        return self.call(lambda b: b.snapshot(path))

    def dead_letters(self, path: str) -> list[MessageSnapshot]:
        """The messages in the dead-letter queue of ``path``."""
        return self.call(lambda b: b.snapshot(path.rstrip("/") + "/$DeadLetterQueue"))

    def entity_stats(self, path: str) -> dict[str, int]:
        return self.call(lambda b: asdict(b.entity(path).stats))

    def history(self, path: str) -> list[HistoryEntry]:
        """What happened to the entity's messages, in order: complete / abandon / dead_letter /
        release / defer / expire, each with the sequence number, session id and delivery count."""
        return self.call(lambda b: b.history(path))

    def session_locked(self, path: str, session_id: str) -> bool:
        """Whether some receiver holds ``session_id``'s lock (and it has not run out)."""
        return self.call(lambda b: b.session_owned(path, session_id))

    def operations(self) -> OperationStats:
        """AMQP frames by performative (total and per connection) and management calls."""
        return self.call(lambda b: b.operation_stats())

    def wait_until(self, predicate: Callable[[BrokerHandle], bool], timeout: float = 10.0) -> None:
        """Poll ``predicate(handle)`` until true (raises ``TimeoutError``); blocks the caller."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError("broker condition not reached")
            time.sleep(0.02)

    async def async_wait_until(self, predicate: Callable[[BrokerHandle], bool], timeout: float = 10.0) -> None:
        """Like ``wait_until`` but yields to the caller's event loop while waiting."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            if time.monotonic() > deadline:
                raise TimeoutError("broker condition not reached")
            await asyncio.sleep(0.02)

    # -- errors / lifecycle ------------------------------------------------------------------
    @property
    def errors(self) -> list[BrokerError]:
        if self._stopped:
            return list(self._broker.errors)
        return self.call(lambda b: list(b.errors))

    def clear_errors(self) -> list[BrokerError]:
        """Return and forget the recorded errors (for tests that provoke errors on purpose)."""

        def take(broker: Broker) -> list[BrokerError]:
            errors, broker.errors = broker.errors, []
            return errors

        return self.call(take)

    def raise_errors(self) -> None:
        """Raise ``AssertionError`` listing every error the broker recorded."""
        errors = self.errors
        if errors:
            raise AssertionError("servicebus test broker errors:\n" + "\n".join(str(e) for e in errors))

    def restart_listener(self, down: float = 0.0, timeout: float = 10.0) -> None:
        """
        A broker restart that keeps its data: close the listener and every connection (clients see
        their connection end and reconnects refused), wait ``down`` seconds, listen again on the same
        port. Entities, messages and their locks are kept, as the service keeps them across a restart
        (a lock still runs out after its lock duration).
        """
        asyncio.run_coroutine_threadsafe(_close_listener(self._broker), self._loop).result(timeout)
        time.sleep(down)
        asyncio.run_coroutine_threadsafe(_listen(self._broker, self.port), self._loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and all connections, stop the loop and join the thread."""
        if self._stopped:
            return
        future = asyncio.run_coroutine_threadsafe(_shutdown(self._broker), self._loop)
        try:
            future.result(timeout)
        finally:
            self._stopped = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)


_SERVERS: dict[int, asyncio.base_events.Server] = {}


async def _shutdown(broker: Broker) -> None:
    server = _SERVERS.pop(id(broker), None)
    if server is not None:
        server.close()
    for connection in list(broker._live.values()):
        connection.closed = True
        connection.writer.close()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if server is not None:
        await server.wait_closed()


async def _close_listener(broker: Broker) -> None:
    """Stop listening and close every connection; the broker's state stays."""
    server = _SERVERS.pop(id(broker), None)
    if server is not None:
        server.close()
    for connection in list(broker._live.values()):
        connection.closed = True
        connection.writer.close()
    if server is not None:
        await server.wait_closed()


async def _listen(broker: Broker, port: int) -> int:
    """Listen on 127.0.0.1:``port`` (0: a free one); return the port."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(broker, reader, writer)
        broker.connection_opened(connection)
        await connection.run()

    server = await asyncio.start_server(serve, "127.0.0.1", port, reuse_address=True)
    _SERVERS[id(broker)] = server
    return int(server.sockets[0].getsockname()[1])


def start_broker(*, max_message_size: int = 4 * 1024 * 1024, sas_keys: dict[str, str] | None = None) -> BrokerHandle:
    """
    Start a broker on 127.0.0.1 (free port) in a daemon thread and return its handle. With
    ``sas_keys`` (key name -> key) it checks the SAS token of every ``$cbs`` put-token (else 401).
    """
    broker = Broker(max_message_size=max_message_size, sas_keys=sas_keys)
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def main() -> None:
        broker.loop = asyncio.get_running_loop()
        port = await _listen(broker, 0)
        broker.loop.create_task(broker.lock_timer())
        ready.set_result(port)

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as exc:
            ready.set_exception(exc)
            return
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="servicebus-test-broker", daemon=True)
    thread.start()
    port = ready.result(10)
    return BrokerHandle(broker, loop, thread, port)
