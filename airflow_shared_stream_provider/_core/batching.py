"""
Batch mode: many broker messages broadcast as **one** raw event, so one asset event carries many.

Why. The triggerer's supervisor persists every TriggerEvent in its own DB session (about 160 events/s
on PostgreSQL, 350 on SQLite, whatever the producer does). With N watchers matching every message,
per-message events cap a stream at ``160 / N`` messages/s. With ``batch_size > 1`` a watcher fires
one event per *batch*, payload ``{"messages": [<envelope>, ...]}``, so the same DB work carries up
to ``batch_size`` messages.

Why the producer batches (``batch_size`` is a producer setting, part of ``shared_stream_key``) and
not each watcher. Airflow binds a TriggerEvent to the raw event its filter was on when it yielded
(the manager's binding window), and advances a raw event only when every watcher moved past it and
the events bound to it are persisted. A watcher that buffered messages across raw events would
yield the event while sitting on the *last* raw event: the earlier ones would already have been
acknowledged (and committed on the broker) without their event being persisted. A crash in between
loses them. A batch broadcast as one raw event keeps the binding exact: the broker advances past
any message of the batch only after every watcher's event for the batch is persisted.

Every guarantee still holds **per message**, because the batch's broker payload keeps each
message's own delivery: watchers record rejections and failures on the message they concern
(:meth:`StreamMessage.reject` / ``fail``), and ``advance`` decides each message on its own (one
rejected message is dead-lettered alone; its neighbours are committed). A batch never mixes lanes
(Kafka partition, FIFO message group, Service Bus session), so lane order holds; the serialized
batch stays under ``max_payload_bytes`` (a batch is cut before the cap).

Flow control counts raw events (what the watchers' queues hold), so in batch mode the gate's
window is a number of batches and ``max_in_flight`` (messages) becomes
``ceil(max_in_flight / batch_size)`` batches, fewer with many watchers (each watcher's event of a
batch is a copy of up to ``max_payload_bytes`` until it is persisted: see ``_core/flow.py``); the
producer's receive loop asks for credit in messages (:meth:`SharedStreamProducerBase.credit`).

How batches form. The broker's receive loop (``_messages``) runs in its own task and hands each
message over here; a batch is broadcast when it is full, when the next message would take it over
the size cap, or ``batch_timeout`` seconds after its first message arrived (a backlog fills batches
at once; a trickle waits at most ``batch_timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from typing import Any, Final

import msgspec

from airflow_shared_stream_provider._core.envelope import DeliveryLike, StreamMessage
from airflow_shared_stream_provider._core.tasks import wait_for

DEFAULT_BATCH_TIMEOUT: Final = 0.5
MAX_BATCH_SIZE: Final = 10_000
# Bytes of ``{"messages":[...]}`` around the envelopes, and of one separating comma.
BATCH_OVERHEAD: Final = 16

_encode = msgspec.json.Encoder().encode


def envelope_size(envelope: dict[str, Any]) -> int:
    """
    Size of one envelope in a batch payload, plus its separating comma, measured as the single
    envelope cap is (``json.dumps``, non-ASCII escaped): msgspec's UTF-8 output when it is ASCII
    (the usual case, fast), else the escaped length.
    """
    try:
        encoded = _encode(envelope)
        if encoded.isascii():
            return len(encoded) + 1
    except (TypeError, msgspec.EncodeError):  # pragma: no cover - envelopes are JSON-safe by construction
        pass
    return len(json.dumps(envelope, separators=(",", ":"), default=str)) + 1


class MessageBatch:
    """
    The raw event of batch mode *and* its broker payload: the messages of one lane, in order.

    ``seq`` is the flow-control sequence number of the batch (one per batch: the gate counts what
    the watchers' queues hold). ``deliveries[i].message is messages[i]``.
    """

    __slots__ = ("deliveries", "lane", "messages", "seq")

    def __init__(self, lane: Hashable, deliveries: list[DeliveryLike], messages: list[StreamMessage]) -> None:
        self.lane = lane
        self.deliveries = deliveries
        self.messages = messages
        self.seq = 0

    def __len__(self) -> int:
        return len(self.messages)

    def __repr__(self) -> str:
        first = self.messages[0].envelope.get("message_id") if self.messages else None
        return f"MessageBatch(seq={self.seq}, lane={self.lane!r}, size={len(self)}, first={first!r})"


class _Forming:
    """A batch being filled for one lane."""

    __slots__ = ("batch", "deadline", "size")

    def __init__(self, lane: Hashable, deadline: float) -> None:
        self.batch = MessageBatch(lane, [], [])
        self.deadline = deadline
        self.size = BATCH_OVERHEAD


class Batcher:
    """
    Groups deliveries into :class:`MessageBatch` es per lane (pure bookkeeping, no I/O, no clock
    of its own: callers pass ``now``), so the cut rules are unit-testable without a broker.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        batch_timeout: float,
        max_payload_bytes: int,
        lane_of: Callable[[Any], Hashable],
    ) -> None:
        self.batch_size = batch_size
        self.batch_timeout = batch_timeout
        self.max_payload_bytes = max_payload_bytes
        self._lane_of = lane_of
        self._forming: dict[Hashable, _Forming] = {}
        self._ready: deque[MessageBatch] = deque()
        self.pending_messages = 0

    def add(self, delivery: DeliveryLike, now: float) -> None:
        """Place one delivery in its lane's batch; a batch that is complete moves to the ready queue."""
        message = delivery.message
        lane = self._lane_of(delivery)
        size = envelope_size(message.envelope)
        forming = self._forming.get(lane)
        if forming is not None and forming.size + size > self.max_payload_bytes:
            self._cut(lane, forming)  # cut *before* the cap: this message starts the next batch
            forming = None
        if forming is None:
            forming = self._forming[lane] = _Forming(lane, now + self.batch_timeout)
        forming.batch.deliveries.append(delivery)
        forming.batch.messages.append(message)
        forming.size += size
        self.pending_messages += 1
        if len(forming.batch) >= self.batch_size:
            self._cut(lane, forming)

    def due(self, now: float) -> None:
        """Move every batch whose first message has waited ``batch_timeout`` to the ready queue."""
        for lane, forming in list(self._forming.items()):
            if forming.deadline <= now:
                self._cut(lane, forming)

    def flush(self) -> None:
        """Move every forming batch to the ready queue (used when the source ends)."""
        for lane, forming in list(self._forming.items()):
            self._cut(lane, forming)

    def next_deadline(self) -> float | None:
        if not self._forming:
            return None
        return min(forming.deadline for forming in self._forming.values())

    def ready(self) -> Iterator[MessageBatch]:
        """Pop the ready batches in the order they were completed (lane order is kept per lane)."""
        ready = self._ready
        while ready:
            batch = ready.popleft()
            self.pending_messages -= len(batch)
            yield batch

    def _cut(self, lane: Hashable, forming: _Forming) -> None:
        del self._forming[lane]
        self._ready.append(forming.batch)


_SOURCE_ENDED: Final = object()


class _Pump:
    """Runs the broker's receive loop in its own task, so batches can be cut on a timer."""

    def __init__(self, source: AsyncIterator[tuple[Any, Any]]) -> None:
        self.source = source
        self.buffer: deque[Any] = deque()
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.ended = False
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            async for _event, payload in self.source:
                self.buffer.append(payload)
                self.wake.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.error = exc
        self.ended = True
        self.wake.set()

    async def wait(self, timeout: float | None) -> None:
        """Wait for a message, the end of the source, or ``timeout`` seconds."""
        if self.buffer or self.ended:
            return
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(self.wake.wait(), timeout)

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        aclose = getattr(self.source, "aclose", None)
        if aclose is not None:
            # Best-effort: the group is ending anyway (the source normally ended with its task).
            with contextlib.suppress(Exception):
                await aclose()


async def batched_stream(
    source: AsyncIterator[tuple[Any, Any]],
    batcher: Batcher,
    *,
    on_batch: Callable[[MessageBatch], None],
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[tuple[MessageBatch, MessageBatch]]:
    """
    Broadcast ``source``'s messages as batches. ``on_batch`` is called immediately before each
    yield (no await in between): it takes the batch's flow-control seq, which must reach the
    watchers' queues in the same step.

    Ends as the source does: when it raises, the error propagates at once and the manager fails the
    group; what was received but not broadcast goes back to the broker like everything in flight.
    """
    pump = _Pump(source)
    try:
        while True:
            if pump.ended and pump.error is not None:
                # Messages received but not broadcast are abandoned like those in flight: the
                # manager fails the group and the broker redelivers them (the producer's close
                # releases what it holds).
                raise pump.error
            while pump.buffer:
                batcher.add(pump.buffer.popleft(), clock())
            if pump.ended:
                batcher.flush()
            else:
                batcher.due(clock())
            for batch in batcher.ready():
                on_batch(batch)
                yield batch, batch
            if pump.ended:
                return  # the source returned: the manager treats the end of open_stream as a failure
            deadline = batcher.next_deadline()
            await pump.wait(None if deadline is None else max(0.0, deadline - clock()))
    finally:
        await pump.close()
