"""Request/response nodes: ``$cbs`` and ``ENTITY/$management`` (AMQP management, Service Bus flavour).

Implemented ``$cbs`` operation: ``put-token``: any token is accepted (status-code 202), unless the
broker was started with ``sas_keys`` (key name -> key): then the token must be a shared access
signature made with one of them, else 401.

Implemented ``$management`` operations (also on ``ENTITY/$DeadLetterQueue/$management``):

* ``com.microsoft:renew-lock`` ``{lock-tokens}`` -> ``{expirations}`` or 410 lock lost
* ``com.microsoft:update-disposition`` ``{disposition-status, lock-tokens, deadletter-reason,
  deadletter-description}`` with ``completed | abandoned | suspended | defered``
* ``com.microsoft:peek-message`` ``{from-sequence-number, message-count[, session-id]}``
  -> ``{messages: [{message}]}`` or 204
* ``com.microsoft:receive-by-sequence-number`` (deferred messages)
* ``com.microsoft:renew-session-lock`` (extends the session lock, and so its messages' locks),
  ``get-session-state``, ``set-session-state`` (410 ``session-lock-lost`` when not held)
* on a session-enabled entity a settlement or renewal of a message whose session lock is gone
  answers 410 ``com.microsoft:session-lock-lost``

Anything else answers 501 ``amqp:not-implemented`` (scheduling, rules, session listing ...).
"""

from __future__ import annotations

import hmac
import uuid
from base64 import b64encode
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, quote_plus

from .codec import Array, Described, Int, Symbol, Timestamp, ULong, encode_value
from .entities import Entity, LockLostError, SessionLockLostError
from .message import AMQP_VALUE, APP_PROPERTIES, PROPERTIES, StoredMessage, now_ms

if TYPE_CHECKING:
    from .connection import Connection

OK, ACCEPTED, NO_CONTENT = 200, 202, 204
BAD_REQUEST, NOT_FOUND, GONE, NOT_IMPLEMENTED = 400, 404, 410, 501
LOCK_LOST = "com.microsoft:message-lock-lost"
SESSION_LOCK_LOST = "com.microsoft:session-lock-lost"
MESSAGE_NOT_FOUND = "com.microsoft:message-not-found"


@dataclass
class Response:
    """A management response before encoding."""

    status: int
    description: str = ""
    condition: str | None = None
    body: Any = None
    properties: dict[str, Any] = field(default_factory=dict)


def encode_response(request: StoredMessage, response: Response, *, cbs: bool) -> bytes:
    """Encode the reply message; ``correlation-id`` is the request's ``message-id``."""
    app: dict[Any, Any] = {}
    if cbs:
        app["status-code"] = Int(response.status)
        app["status-description"] = response.description
    else:
        app["statusCode"] = Int(response.status)
        app["statusDescription"] = response.description
        if response.condition is not None:
            app["errorCondition"] = Symbol(response.condition)
    app.update(response.properties)
    return b"".join(
        [
            encode_value(Described(ULong(PROPERTIES), [None, None, None, None, None, request.message_id])),
            encode_value(Described(ULong(APP_PROPERTIES), app)),
            encode_value(Described(ULong(AMQP_VALUE), response.body)),
        ]
    )


def _tokens(value: Any) -> list[uuid.UUID]:
    items = value.items if isinstance(value, Array) else list(value or [])
    return [item if isinstance(item, uuid.UUID) else uuid.UUID(str(item)) for item in items]


def _body(request: StoredMessage) -> dict[str, Any]:
    value = request.body
    if not isinstance(value, dict):
        return {}
    return {str(key): item for key, item in value.items()}


UNAUTHORIZED = 401


def _sas_valid(token: Any, keys: Mapping[str, str]) -> bool:
    """Whether ``token`` is ``SharedAccessSignature sr=..&sig=..&se=..&skn=..`` signed with ``keys[skn]``."""
    text = token.decode("utf-8", "replace") if isinstance(token, bytes) else str(token)
    prefix = "SharedAccessSignature "
    if not text.startswith(prefix):
        return False
    fields = dict(parse_qsl(text[len(prefix) :], keep_blank_values=True))
    key = keys.get(fields.get("skn", ""))
    if key is None:
        return False
    signed = f"{quote_plus(fields.get('sr', ''))}\n{fields.get('se', '')}".encode()
    expected = b64encode(hmac.new(key.encode(), signed, sha256).digest()).decode()
    return hmac.compare_digest(expected, fields.get("sig", ""))


def handle_cbs(request: StoredMessage, sas_keys: Mapping[str, str] | None = None) -> Response:
    operation = str(request.application_properties.get("operation", ""))
    if operation != "put-token":
        return Response(BAD_REQUEST, f"unsupported cbs operation {operation!r}")
    if sas_keys is not None and not _sas_valid(request.body, sas_keys):
        return Response(UNAUTHORIZED, "InvalidSignature: The token has an invalid signature.")
    return Response(ACCEPTED, "Accepted")


def handle_management(entity: Entity, request: StoredMessage, connection: Connection) -> Response:
    """Run one management operation against ``entity``."""
    operation = str(request.application_properties.get("operation", ""))
    body = _body(request)
    handler = _HANDLERS.get(operation)
    if handler is None:
        return Response(NOT_IMPLEMENTED, f"operation {operation!r} is not implemented", "amqp:not-implemented")
    try:
        return handler(entity, body, connection)
    except LockLostError:
        return Response(
            GONE,
            "The lock supplied is invalid. Either the lock expired, or the message has already "
            "been removed from the queue.",
            LOCK_LOST,
        )
    except SessionLockLostError:
        return Response(GONE, "The session lock has expired or was lost.", SESSION_LOCK_LOST)
    except (KeyError, ValueError, TypeError) as exc:
        return Response(BAD_REQUEST, f"bad request: {exc!r}", "com.microsoft:argument-error")


def _renew_lock(entity: Entity, body: dict[str, Any], _: Connection) -> Response:
    expirations = [Timestamp(entity.renew(token)) for token in _tokens(body["lock-tokens"])]
    return Response(OK, "OK", body={"expirations": Array(0x83, expirations)})


def _update_disposition(entity: Entity, body: dict[str, Any], _: Connection) -> Response:
    status = str(body["disposition-status"])
    tokens = _tokens(body["lock-tokens"])
    for token in tokens:
        entity.locked_message(token)  # all-or-nothing: fail before changing anything
    for token in tokens:
        if status == "completed":
            entity.complete(token)
        elif status == "abandoned":
            entity.abandon(token)
        elif status == "defered":
            entity.defer(token)
        elif status == "suspended":
            reason = body.get("deadletter-reason")
            description = body.get("deadletter-description")
            entity.dead_letter(
                token, None if reason is None else str(reason), None if description is None else str(description)
            )
        else:
            raise ValueError(f"unknown disposition-status {status!r}")
    return Response(OK, "OK")


def _peek(entity: Entity, body: dict[str, Any], _: Connection) -> Response:
    start = int(body.get("from-sequence-number", 1))
    count = int(body.get("message-count", 1))
    session_id = body.get("session-id")
    messages = []
    for sequence_number in sorted(entity.messages):
        message = entity.messages[sequence_number]
        if sequence_number < start or (session_id is not None and message.session_id != str(session_id)):
            continue
        messages.append({"message": message.encode()})
        if len(messages) >= count:
            break
    if not messages:
        return Response(NO_CONTENT, "No messages to peek")
    return Response(OK, "OK", body={"messages": messages})


def _receive_deferred(entity: Entity, body: dict[str, Any], _: Connection) -> Response:
    numbers = body["sequence-numbers"]
    items = numbers.items if isinstance(numbers, Array) else list(numbers)
    peek_lock = int(body.get("receiver-settle-mode", 1)) == 1
    messages = []
    for sequence_number in items:
        try:
            message, token = entity.receive_deferred(int(sequence_number), lock=peek_lock)
        except KeyError:
            return Response(NOT_FOUND, f"deferred message {sequence_number} not found", MESSAGE_NOT_FOUND)
        encoded = message.encode(lock_token=token, locked_until_ms=message.locked_until_ms if token else None)
        entry: dict[str, Any] = {"message": encoded}
        if token is not None:
            entry["lock-token"] = token
        messages.append(entry)
    return Response(OK, "OK", body={"messages": messages})


def _owned_session(entity: Entity, body: dict[str, Any], connection: Connection) -> tuple[str, Any]:
    session_id = str(body["session-id"])
    state = entity.sessions.get(session_id)
    owner = getattr(state, "owner", None)
    owner_session = getattr(owner, "session", None)
    if (
        state is None
        or owner_session is None
        or owner_session.connection is not connection
        or state.locked_until_ms <= now_ms()
    ):
        raise _SessionLockLost(session_id)
    return session_id, state


class _SessionLockLost(KeyError):
    pass


Handler = Callable[[Entity, dict[str, Any], "Connection"], Response]


def _session_op(kind: str) -> Handler:
    def run(entity: Entity, body: dict[str, Any], connection: Connection) -> Response:
        try:
            session_id, state = _owned_session(entity, body, connection)
        except _SessionLockLost:
            return Response(GONE, "The session lock has expired or was lost.", SESSION_LOCK_LOST)
        if kind == "renew":
            locked_until_ms = entity.renew_session(session_id)
            return Response(OK, "OK", body={"expiration": Timestamp(locked_until_ms)})
        if kind == "get":
            return Response(OK, "OK", body={"session-state": state.state})
        value = body.get("session-state")
        state.state = None if value is None else bytes(value)
        return Response(OK, "OK", body={})

    return run


_HANDLERS: dict[str, Handler] = {
    "com.microsoft:renew-lock": _renew_lock,
    "com.microsoft:update-disposition": _update_disposition,
    "com.microsoft:peek-message": _peek,
    "com.microsoft:receive-by-sequence-number": _receive_deferred,
    "com.microsoft:renew-session-lock": _session_op("renew"),
    "com.microsoft:get-session-state": _session_op("get"),
    "com.microsoft:set-session-state": _session_op("set"),
}
