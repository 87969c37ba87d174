"""One AMQP 1.0 connection of the test broker: handshake, sessions, links, deliveries.

Implemented: SASL ANONYMOUS / PLAIN (any credentials), open/close (heartbeats when the peer asks
for an idle timeout), begin/end with session flow control in both directions, attach/detach of
sender and receiver links (refused with ``amqp:not-found`` for unknown entities), link credit,
drain and echo, multi-frame transfers in both directions (aborted transfers are discarded),
batches, settlement of broker deliveries (peek-lock two-step echo, pre-settled, release) and the
``$cbs`` / ``$management`` request-response links.

Session receivers (on session-enabled entities only; refused elsewhere, as a plain receiver is
refused on a session-enabled entity, with the service's texts): the ``com.microsoft:session-filter``
source filter names a session or, when null, asks for the next available one, waiting up to the
link's ``com.microsoft:timeout`` property before refusing with ``com.microsoft:timeout``; the attach
reply carries the session id in the filter and ``com.microsoft:locked-until-utc``. A settlement
after the session lock was lost is answered ``com.microsoft:session-lock-lost``; when the lock runs
out the broker detaches the link with that error.

Not implemented: link resumption, transactions, several messages per delivery on a receiver link.
Transfers on ``$management`` request links may reuse a delivery-id (an SDK 7.15 quirk): incoming
deliveries are tracked per link, not by delivery-id, so this is tolerated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from . import frames as f
from .codec import (
    DecodeError,
    Described,
    UByte,
    UInt,
    ULong,
    UShort,
    symbol_array,
)
from .entities import Entity, LockLostError, SessionLockLostError, Topic

if TYPE_CHECKING:
    import uuid

    from .broker import Broker

_LOGGER = logging.getLogger(__name__)

MAX_FRAME_SIZE = 65536
SESSION_WINDOW = 5000
LINK_CREDIT = 1000
DOTNET_EPOCH_TICKS = 621355968000000000

DEAD_LETTER_CONDITION = "com.microsoft:dead-letter"
LOCK_LOST_CONDITION = "com.microsoft:message-lock-lost"
SESSION_LOCK_LOST_CONDITION = "com.microsoft:session-lock-lost"
SESSION_FILTER = "com.microsoft:session-filter"


def session_filter_key(attach: f.Attach) -> Any:
    """The key of the session filter in the attach's source filters (a receiver asking for a session)."""
    if attach.source is None:
        return None
    return next((k for k in attach.source.filters if str(k) == SESSION_FILTER), None)


def address_path(address: str) -> str:
    """``amqps://host:port/queue/$management`` -> ``queue/$management``."""
    parsed = urlparse(address)
    path = parsed.path if parsed.scheme else address
    return path.strip("/")


def accepted() -> Described:
    return Described(ULong(f.ACCEPTED), [])


def rejected(error: Described | None = None) -> Described:
    return Described(ULong(f.REJECTED), [] if error is None else [error])


def modified(delivery_failed: bool, undeliverable_here: bool) -> Described:
    return Described(ULong(f.MODIFIED), [delivery_failed, undeliverable_here])


def released() -> Described:
    return Described(ULong(f.RELEASED), [])


class ProtocolError(Exception):
    """A protocol violation by the peer that the broker answers by closing the connection."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(f"{condition}: {description}")
        self.condition = condition
        self.description = description


@dataclass(eq=False)
class Link:
    """Common state of both link directions."""

    session: Session
    name: str
    remote_handle: int
    local_handle: int
    address: str
    kind: str  # "entity" | "topic" | "cbs" | "management"
    entity: Entity | None = None
    topic: Topic | None = None
    detached: bool = False


@dataclass(eq=False)
class IncomingLink(Link):
    """The peer sends on this link (an SDK sender, or a cbs/management request link)."""

    credit: int = 0
    delivery_count: int = 0
    first: f.Transfer | None = None
    partial: bytearray = field(default_factory=bytearray)


@dataclass(eq=False)
class OutgoingLink(Link):
    """The broker sends on this link (an SDK receiver, or a cbs/management reply link)."""

    credit: int = 0
    delivery_count: int = 0
    drain: bool = False
    presettled: bool = False
    session_id: str | None = None
    target_address: str | None = None
    pending_replies: list[bytes] = field(default_factory=list)


@dataclass
class OutgoingDelivery:
    """A broker delivery the peer has not settled yet."""

    link: OutgoingLink
    entity: Entity
    lock_token: uuid.UUID


class Session:
    """One AMQP session (channel pair) of a connection."""

    def __init__(self, connection: Connection, local_channel: int, remote_channel: int, begin: f.Begin) -> None:
        self.connection = connection
        self.local_channel = local_channel
        self.remote_channel = remote_channel
        self.links: dict[int, Link] = {}  # by remote handle
        self.local_handles: set[int] = set()
        self.next_outgoing_id = 0  # transfer-id, one per frame
        self.next_delivery_id = 0
        self.next_incoming_id = begin.next_outgoing_id
        self.frames_since_flow = 0
        self.peer_next_incoming_id = 0
        self.peer_incoming_window = begin.incoming_window
        self.unsettled: dict[int, OutgoingDelivery] = {}
        self.ended = False

    # -- helpers ---------------------------------------------------------------------------
    @property
    def broker(self) -> Broker:
        return self.connection.broker

    def send(self, code: int, fields: list[Any], payload: bytes = b"") -> None:
        self.connection.send(self.local_channel, code, fields, payload)

    def remote_window(self) -> int:
        return self.peer_next_incoming_id + self.peer_incoming_window - self.next_outgoing_id

    def session_flow_fields(self) -> list[Any]:
        return [
            UInt(self.next_incoming_id & 0xFFFFFFFF),
            UInt(SESSION_WINDOW),
            UInt(self.next_outgoing_id & 0xFFFFFFFF),
            UInt(SESSION_WINDOW),
        ]

    def send_link_flow(self, link: Link, *, credit: int, delivery_count: int, drain: bool = False) -> None:
        self.send(
            f.FLOW,
            [
                *self.session_flow_fields(),
                UInt(link.local_handle),
                UInt(delivery_count & 0xFFFFFFFF),
                UInt(credit),
                None,
                drain,
            ],
        )

    def _allocate_handle(self) -> int:
        handle = next(h for h in itertools.count() if h not in self.local_handles)
        self.local_handles.add(handle)
        return handle

    # -- attach / detach -------------------------------------------------------------------
    def on_attach(self, attach: f.Attach) -> None:
        if attach.handle in self.links:
            raise ProtocolError("amqp:session:handle-in-use", f"handle {attach.handle} is in use")
        peer_is_sender = attach.role == f.ROLE_SENDER
        terminus = attach.target if peer_is_sender else attach.source
        address = terminus.address if terminus is not None and terminus.address else ""
        path = address_path(address)
        local_handle = self._allocate_handle()
        kind, entity, topic, error = self.broker.resolve(path, for_sending=peer_is_sender)
        link: Link
        if peer_is_sender:
            link = IncomingLink(self, attach.name, attach.handle, local_handle, address, kind, entity, topic)
        else:
            link = OutgoingLink(self, attach.name, attach.handle, local_handle, address, kind, entity, topic)
            link.presettled = attach.snd_settle_mode == f.SND_SETTLED
            link.target_address = attach.target.address if attach.target is not None else None
        self.links[attach.handle] = link
        if error is not None:
            # The service's refusal: attach with no terminus, then a closing detach with the error.
            self._send_attach(attach, link, source=None, target=None)
            self._detach(link, closed=True, error=error)
            return
        if isinstance(link, OutgoingLink) and link.kind == "entity" and link.entity is not None:
            if link.entity.requires_session:
                self.broker.start_session_receiver(link, attach)
                return
            if session_filter_key(attach) is not None:
                self.refuse(
                    attach,
                    link,
                    f.amqp_error(
                        "amqp:not-allowed",
                        "A sessionful message receiver cannot be created on an entity that does not require "
                        "sessions. Ensure RequiresSession is set to true when creating a Queue or Subscription "
                        "to enable sessionful behavior.",
                    ),
                )
                return
        self._send_attach(
            attach,
            link,
            source=attach.source.raw if attach.source else None,
            target=attach.target.raw if attach.target else None,
        )
        self.complete_attach(link, attach)

    def complete_attach(self, link: Link, attach: f.Attach) -> None:
        if isinstance(link, IncomingLink):
            link.delivery_count = int(attach.initial_delivery_count or 0)
            link.credit = LINK_CREDIT
            self.send_link_flow(link, credit=link.credit, delivery_count=link.delivery_count)
        elif isinstance(link, OutgoingLink) and link.kind == "entity" and link.entity is not None:
            self.broker.add_consumer(link)

    def _send_attach(
        self, attach: f.Attach, link: Link, *, source: Any, target: Any, properties: dict[Any, Any] | None = None
    ) -> None:
        we_send = isinstance(link, OutgoingLink)
        self.send(
            f.ATTACH,
            [
                attach.name,
                UInt(link.local_handle),
                we_send,  # role: True = receiver; we are the receiver when the peer sends
                UByte(attach.snd_settle_mode),
                UByte(attach.rcv_settle_mode),
                source,
                target,
                None,
                None,
                UInt(0) if we_send else None,
                ULong(self.broker.max_message_size),
                None,
                None,
                properties,
            ],
        )

    def send_attach_reply(
        self, attach: f.Attach, link: Link, *, source: Any, target: Any, properties: dict[Any, Any] | None = None
    ) -> None:
        self._send_attach(attach, link, source=source, target=target, properties=properties)

    def refuse(self, attach: f.Attach, link: Link, error: Described) -> None:
        self._send_attach(attach, link, source=None, target=None)
        self._detach(link, closed=True, error=error)

    def close_link(self, link: Link, error: Described) -> None:
        """Detach (close) one of our links with an error, as the service does on a lost session lock."""
        self._detach(link, closed=True, error=error)

    def _detach(self, link: Link, *, closed: bool, error: Described | None = None) -> None:
        if link.detached:
            return
        link.detached = True
        self.send(f.DETACH, [UInt(link.local_handle), closed, error])
        self._forget(link)

    def _forget(self, link: Link) -> None:
        link.detached = True
        self.links.pop(link.remote_handle, None)
        self.local_handles.discard(link.local_handle)
        if isinstance(link, OutgoingLink):
            self.broker.remove_consumer(link)
            for delivery_id in [d for d, o in self.unsettled.items() if o.link is link]:
                del self.unsettled[delivery_id]

    def on_detach(self, detach: f.Detach) -> None:
        link = self.links.get(detach.handle)
        if link is None:
            return  # we detached first (refusal); this is the peer's answer
        if not link.detached:
            link.detached = True
            self.send(f.DETACH, [UInt(link.local_handle), detach.closed])
        self._forget(link)

    def end(self) -> None:
        for link in list(self.links.values()):
            self._forget(link)
        self.ended = True

    # -- flow ------------------------------------------------------------------------------
    def on_flow(self, flow: f.Flow) -> None:
        self.peer_next_incoming_id = flow.next_incoming_id if flow.next_incoming_id is not None else 0
        self.peer_incoming_window = flow.incoming_window
        if flow.handle is None:
            if flow.echo:
                self.send(f.FLOW, self.session_flow_fields())
            self.broker.dispatch_all()
            return
        link = self.links.get(flow.handle)
        if link is None:
            raise ProtocolError("amqp:session:unattached-handle", f"flow for unknown handle {flow.handle}")
        if isinstance(link, OutgoingLink):
            peer_count = link.delivery_count if flow.delivery_count is None else flow.delivery_count
            link.credit = max(0, peer_count + (flow.link_credit or 0) - link.delivery_count)
            link.drain = flow.drain
            if link.kind == "entity" and link.entity is not None:
                self.broker.dispatch(link.entity)
            else:
                self.broker.flush_replies(link)
            if flow.echo and not link.drain:
                self.send_link_flow(link, credit=link.credit, delivery_count=link.delivery_count)
        elif flow.echo and isinstance(link, IncomingLink):
            self.send_link_flow(link, credit=link.credit, delivery_count=link.delivery_count)

    # -- incoming transfers ----------------------------------------------------------------
    def on_transfer(self, transfer: f.Transfer, payload: bytes) -> None:
        self.next_incoming_id += 1
        self.frames_since_flow += 1
        if self.frames_since_flow >= SESSION_WINDOW // 2:
            self.frames_since_flow = 0
            self.send(f.FLOW, self.session_flow_fields())
        link = self.links.get(transfer.handle)
        if not isinstance(link, IncomingLink):
            raise ProtocolError("amqp:session:unattached-handle", f"transfer on unknown handle {transfer.handle}")
        if link.first is None:
            if transfer.delivery_id is None or transfer.delivery_tag is None:
                raise ProtocolError("amqp:not-allowed", "first transfer of a delivery lacks id or tag")
            link.first = transfer
            link.partial = bytearray()
        link.partial += payload
        if transfer.aborted:
            link.first, link.partial = None, bytearray()
            return
        if transfer.more:
            return
        first, body = link.first, bytes(link.partial)
        link.first, link.partial = None, bytearray()
        settled = bool(first.settled) or bool(transfer.settled)
        link.delivery_count += 1
        link.credit -= 1
        if link.credit <= LINK_CREDIT // 2:
            link.credit = LINK_CREDIT
            self.send_link_flow(link, credit=link.credit, delivery_count=link.delivery_count)
        outcome = self.broker.on_incoming_delivery(link, first.message_format or 0, body)
        if not settled and first.delivery_id is not None:
            self.send(f.DISPOSITION, [True, UInt(first.delivery_id), None, True, outcome])

    # -- outgoing deliveries ---------------------------------------------------------------
    def frames_needed(self, size: int) -> int:
        per_frame = self.connection.peer_max_frame_size - 64
        return max(1, -(-size // per_frame))

    def can_send(self, link: OutgoingLink) -> bool:
        return not link.detached and not self.ended and link.credit > 0 and self.remote_window() > 0

    def send_delivery(self, link: OutgoingLink, tag: bytes, payload: bytes, *, settled: bool) -> int:
        """Send one delivery (split into frames as needed); returns its delivery-id."""
        delivery_id = self.next_delivery_id
        self.next_delivery_id = (self.next_delivery_id + 1) & 0xFFFFFFFF
        first_fields: list[Any] = [UInt(link.local_handle), UInt(delivery_id), tag, UInt(0), settled, True]
        overhead = f.transfer_overhead(first_fields) + 8
        chunk = max(1, self.connection.peer_max_frame_size - overhead)
        pieces = [payload[i : i + chunk] for i in range(0, len(payload), chunk)] or [b""]
        for index, piece in enumerate(pieces):
            more = index < len(pieces) - 1
            if index == 0:
                fields = [*first_fields[:5], more]
            else:
                fields = [UInt(link.local_handle), None, None, None, None, more]
            self.send(f.TRANSFER, fields, piece)
            self.next_outgoing_id += 1
        link.delivery_count += 1
        link.credit -= 1
        return delivery_id

    def answer_drain(self, link: OutgoingLink) -> None:
        if link.drain:
            link.delivery_count += link.credit
            link.credit = 0
            link.drain = False
            self.send_link_flow(link, credit=0, delivery_count=link.delivery_count, drain=True)

    # -- dispositions ----------------------------------------------------------------------
    def on_disposition(self, disposition: f.Disposition) -> None:
        if disposition.role != f.ROLE_RECEIVER:
            return  # the peer settles its own transfers; we settled them when they arrived
        ids = sorted(d for d in self.unsettled if disposition.first <= d <= disposition.last)
        for delivery_id in ids:
            delivery = self.unsettled.pop(delivery_id, None)
            if delivery is None:
                continue  # its link was detached meanwhile (a lost session lock)
            echo = self.broker.settle(delivery.entity, delivery.lock_token, disposition.state)
            if not disposition.settled:
                self.send(f.DISPOSITION, [False, UInt(delivery_id), None, True, echo])


class Connection:
    """Serves one TCP connection until the peer closes it."""

    _ids = itertools.count(1)

    def __init__(self, broker: Broker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.broker = broker
        self.reader = reader
        self.writer = writer
        self.id = next(self._ids)
        self.received: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.sessions: dict[int, Session] = {}  # by remote channel
        self.ended_channels: set[int] = set()
        self.peer_max_frame_size = 512
        self.container_id = ""
        self.opened = False
        self.closed = False
        self._heartbeat: asyncio.Task[None] | None = None

    # -- output ----------------------------------------------------------------------------
    def send(self, channel: int, code: int, fields: list[Any], payload: bytes = b"") -> None:
        if self.closed and code != f.CLOSE:
            return
        self.sent[f.PERFORMATIVE_NAMES.get(code, hex(code))] += 1
        self.broker.count_frame("sent", code)
        self.writer.write(f.encode_frame(channel, code, fields, payload))

    def _send_sasl(self, code: int, fields: list[Any]) -> None:
        self.sent[f.PERFORMATIVE_NAMES.get(code, hex(code))] += 1
        self.writer.write(f.encode_frame(0, code, fields, frame_type=f.FRAME_TYPE_SASL))

    # -- main loop -------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._handshake()
            while not self.closed:
                frame = await f.read_frame(self.reader, MAX_FRAME_SIZE)
                self._handle(frame)
                await self.writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer went away; normal for SDK clients that drop the socket
        except ProtocolError as exc:
            self.broker.record_error(exc, f"connection {self.id} ({self.container_id})")
            self._close_with(exc.condition, exc.description)
        except (f.FramingError, DecodeError) as exc:
            self.broker.record_error(exc, f"connection {self.id} ({self.container_id})")
            self._close_with("amqp:connection:framing-error", str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.broker.record_error(exc, f"connection {self.id} ({self.container_id})")
            self._close_with("amqp:internal-error", repr(exc))
        finally:
            self._cleanup()

    async def _handshake(self) -> None:
        header = await self.reader.readexactly(8)
        if header == f.SASL_HEADER:
            self.writer.write(f.SASL_HEADER)
            self._send_sasl(f.SASL_MECHANISMS, [symbol_array("ANONYMOUS", "PLAIN")])
            frame = await f.read_frame(self.reader, MAX_FRAME_SIZE)
            self.received[f.PERFORMATIVE_NAMES.get(frame.code or 0, "?")] += 1
            mechanism = str(f.get(frame.fields, 0, ""))
            if frame.code != f.SASL_INIT or mechanism not in ("ANONYMOUS", "PLAIN"):
                self._send_sasl(f.SASL_OUTCOME, [UByte(1)])
                raise f.FramingError(f"unsupported SASL exchange {frame.code!r} {mechanism!r}")
            self._send_sasl(f.SASL_OUTCOME, [UByte(0)])
            header = await self.reader.readexactly(8)
        self.writer.write(f.AMQP_HEADER)
        if header != f.AMQP_HEADER:
            self.closed = True
            raise f.FramingError(f"unsupported protocol header {header!r}")

    def _handle(self, frame: f.RawFrame) -> None:
        if frame.code is None:
            return  # heartbeat
        name = f.PERFORMATIVE_NAMES.get(frame.code, hex(frame.code))
        self.received[name] += 1
        self.broker.count_frame("received", frame.code)
        if frame.frame_type != f.FRAME_TYPE_AMQP:
            raise ProtocolError("amqp:connection:framing-error", "SASL frame after SASL completed")
        if frame.code == f.OPEN:
            self._on_open(f.Open.from_fields(frame.fields))
            return
        if not self.opened:
            raise ProtocolError("amqp:illegal-state", f"{name} before open")
        if frame.code == f.CLOSE:
            self.send(0, f.CLOSE, [])
            self.closed = True
            return
        if frame.code == f.BEGIN:
            self._on_begin(frame.channel, f.Begin.from_fields(frame.fields))
            return
        session = self.sessions.get(frame.channel)
        if session is None and frame.channel in self.ended_channels:
            return  # SDK 7.15 may still detach links of a session it has already ended
        if session is None:
            raise ProtocolError("amqp:connection:framing-error", f"{name} on unmapped channel {frame.channel}")
        if frame.code == f.ATTACH:
            session.on_attach(f.Attach.from_fields(frame.fields))
        elif frame.code == f.FLOW:
            session.on_flow(f.Flow.from_fields(frame.fields))
        elif frame.code == f.TRANSFER:
            session.on_transfer(f.Transfer.from_fields(frame.fields), frame.payload)
        elif frame.code == f.DISPOSITION:
            session.on_disposition(f.Disposition.from_fields(frame.fields))
        elif frame.code == f.DETACH:
            session.on_detach(f.Detach.from_fields(frame.fields))
        elif frame.code == f.END:
            session.end()
            del self.sessions[frame.channel]
            self.ended_channels.add(frame.channel)
            session.send(f.END, [])
        else:
            raise ProtocolError("amqp:not-implemented", f"unexpected performative {name}")

    def _on_open(self, open_: f.Open) -> None:
        if self.opened:
            raise ProtocolError("amqp:illegal-state", "second open")
        self.opened = True
        self.container_id = open_.container_id
        self.peer_max_frame_size = max(512, min(open_.max_frame_size, 16 * 1024 * 1024))
        self.send(
            0,
            f.OPEN,
            ["servicebus-test-broker", None, UInt(MAX_FRAME_SIZE), UShort(255)],
        )
        if open_.idle_timeout_ms:
            interval = max(0.05, open_.idle_timeout_ms / 2000)
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(interval))

    async def _beat(self, interval: float) -> None:
        while not self.closed:
            await asyncio.sleep(interval)
            if not self.closed:
                self.writer.write(f.empty_frame())

    def _on_begin(self, channel: int, begin: f.Begin) -> None:
        if channel in self.sessions:
            raise ProtocolError("amqp:session:window-violation", f"channel {channel} already has a session")
        self.ended_channels.discard(channel)
        used = {s.local_channel for s in self.sessions.values()}
        local = next(c for c in itertools.count() if c not in used)
        session = Session(self, local, channel, begin)
        self.sessions[channel] = session
        session.send(
            f.BEGIN,
            [UShort(channel), UInt(0), UInt(SESSION_WINDOW), UInt(SESSION_WINDOW), UInt(1023)],
        )

    def _close_with(self, condition: str, description: str) -> None:
        if self.closed:
            return
        try:
            self.send(0, f.CLOSE, [f.amqp_error(condition, description)])
        except Exception:
            _LOGGER.debug("could not send close", exc_info=True)
        self.closed = True

    def _cleanup(self) -> None:
        self.closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for session in list(self.sessions.values()):
            session.end()
        self.sessions.clear()
        self.broker.connection_closed(self)
        try:
            self.writer.close()
        except Exception:
            _LOGGER.debug("close failed", exc_info=True)


def lock_lost_error() -> Described:
    return f.amqp_error(
        LOCK_LOST_CONDITION,
        "The lock supplied is invalid. Either the lock expired, or the message "
        "has already been removed from the queue.",
    )


def session_lock_lost_error(session_id: str | None = None) -> Described:
    which = f" of session {session_id}" if session_id else ""
    return f.amqp_error(
        SESSION_LOCK_LOST_CONDITION,
        f"The session lock{which} has expired on the MessageSession. Accept a new MessageSession.",
    )


def settle_outcome(entity: Entity, token: uuid.UUID, state: Described | None) -> Described:
    """Apply a peer's outcome to a locked message; return the state to echo."""
    code = f.outcome_code(state)
    fields: list[Any] = state.value if state is not None and isinstance(state.value, list) else []
    try:
        if code == f.ACCEPTED:
            entity.complete(token)
            return accepted()
        if code == f.REJECTED:
            error = f.ErrorInfo.from_value(f.get(fields, 0))
            reason: str | None = None
            description: str | None = None
            if error is not None:
                info = {str(k): v for k, v in error.info.items()}
                reason = info.get("DeadLetterReason")
                description = info.get("DeadLetterErrorDescription", error.description)
            entity.dead_letter(token, reason, description)
            return rejected()
        if code == f.MODIFIED:
            delivery_failed = bool(f.get(fields, 0, False))
            undeliverable_here = bool(f.get(fields, 1, False))
            annotations = f.get(fields, 2, {})
            if isinstance(annotations, dict) and annotations:
                message = entity.locked_message(token)
                for key, value in annotations.items():
                    message.set_annotation(str(key), value)
            if undeliverable_here:
                entity.defer(token)
            else:
                entity.abandon(token, count_delivery=True)
            return modified(delivery_failed, undeliverable_here)
        entity.release(token)  # released, received, or no outcome at all
        return released()
    except LockLostError:
        return rejected(lock_lost_error())
    except SessionLockLostError:
        return rejected(session_lock_lost_error())
