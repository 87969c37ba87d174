"""
An in-memory broker with a real producer and trigger on the provider's core.

Two uses: unit tests of the core (dispositions, poison cap, flow control, filters) against the
real ``SharedStreamManager`` without a broker process, and the benchmarks' framework ceiling (a
producer that yields pre-built messages as fast as the manager takes them).

The broker has queue semantics: a message is *available*, *in flight* (handed to the producer)
or gone (committed / dead-lettered). REDELIVER and HOLD make it available again, REDELIVER with
``delivery_attempt + 1``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from airflow_shared_stream_provider._core.dispositions import Disposition
from airflow_shared_stream_provider._core.envelope import StreamMessage
from airflow_shared_stream_provider._core.producer import UNSENT, Decided, Delivery, SharedStreamProducerBase
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.tasks import wait_for
from airflow_shared_stream_provider._core.trigger import SharedStreamOptions, SharedStreamTrigger
from airflow_shared_stream_provider.brokers import BrokerName


@dataclass
class MemoryMessage:
    message_id: str
    body: bytes
    attributes: dict[str, str] = field(default_factory=dict)
    lane: str = ""
    attempts: int = 0


@dataclass
class MemoryBroker:
    """The broker side: available messages, commit log, dead letters, and every action taken."""

    name: str
    available: deque[MemoryMessage] = field(default_factory=deque)
    in_flight: dict[str, MemoryMessage] = field(default_factory=dict)
    committed: list[str] = field(default_factory=list)
    dead_letters: list[tuple[str, str]] = field(default_factory=list)
    actions: list[tuple[str, str]] = field(default_factory=list)
    producers: list[Any] = field(default_factory=list)  # every producer opened on this broker
    close_delay: float = 0.0  # seconds a producer's close takes (a broker slow to shut down)
    _arrived: asyncio.Event | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def publish(self, body: bytes | str, *, attributes: dict[str, str] | None = None, lane: str = "") -> str:
        message_id = f"{self.name}-{next(self._ids)}"
        raw = body.encode() if isinstance(body, str) else body
        self.available.append(MemoryMessage(message_id, raw, attributes or {}, lane))
        if self._arrived is not None:
            self._arrived.set()
        return message_id

    def requeue(self, message: MemoryMessage) -> None:
        self.available.append(message)
        if self._arrived is not None:
            self._arrived.set()

    async def wait_for_messages(self, timeout: float | None = None) -> bool:
        """Wait until a message is available; False if ``timeout`` passed first (an empty receive)."""
        if self.available:
            return True  # no suspension, as on a broker whose client buffer holds messages
        if self._arrived is None:
            self._arrived = asyncio.Event()
        arrived = self._arrived

        async def until_available() -> None:
            while not self.available:
                arrived.clear()
                await arrived.wait()

        try:
            await wait_for(until_available(), timeout)  # cancel-safe (see _core/tasks.py)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return False
        return True


brokers: dict[str, MemoryBroker] = {}


def memory_broker(name: str) -> MemoryBroker:
    broker = brokers.get(name)
    if broker is None:
        broker = brokers[name] = MemoryBroker(name)
    return broker


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryStreamSettings(StreamSettings):
    # A test broker's own name: in no registry list (airflow_shared_stream_provider.brokers), so
    # nothing offers it to users; envelopes and metrics say "memory".
    broker: ClassVar[BrokerName] = BrokerName("memory")
    broker_name: str
    lanes: bool = False


@dataclass(slots=True)
class MemoryDelivery(Delivery):
    raw: MemoryMessage


# How long the producer waits for a message before it counts as an empty receive.
QUIET_POLL = 0.2


class MemorySharedStreamProducer(SharedStreamProducerBase[MemoryStreamSettings, MemoryDelivery]):
    max_message_bytes = 1024 * 1024  # as Kafka's: the byte budget's first receive sizes as with Kafka

    # The most bytes the stream's gate held at once while this producer ran (_core/flow.py).
    peak_held_bytes = 0

    def source_label(self) -> str:
        return f"memory://{self.settings.broker_name}"

    # The receive loop is the base's; this broker hands out one message a receive, so the byte
    # budget holds from the first message on, before the size estimate has seen one (a real
    # receive call is sized once, see _core/flow.py): the loop checks the credit, which includes
    # the byte credit, before every message.
    async def _connect_broker(self) -> None:
        memory_broker(self.settings.broker_name).producers.append(self)

    async def _receive(self, count: int) -> list[MemoryMessage]:
        broker = memory_broker(self.settings.broker_name)
        if not await broker.wait_for_messages(timeout=QUIET_POLL):
            return []  # an empty receive, as on a real broker
        raw = broker.available.popleft()
        raw.attempts += 1
        broker.in_flight[raw.message_id] = raw
        return [raw]

    def _to_delivery(
        self, raw: MemoryMessage, received: list[Any]
    ) -> tuple[MemoryDelivery, dict[str, Any], str | None, object]:
        envelope, forced = self.envelope(
            source=self.source_label(),
            message_id=raw.message_id,
            body=raw.body,
            attributes=raw.attributes,
            published_at=None,
            delivery_attempt=raw.attempts,
            metadata={"lane": raw.lane},
        )
        return MemoryDelivery(UNSENT, raw.attempts, raw), envelope, forced, raw.body

    def hold(self, message: StreamMessage, body: object) -> StreamMessage:
        held = super().hold(message, body)
        # Held bytes only grow here: their peak is what the byte budget bounds.
        self.peak_held_bytes = max(self.peak_held_bytes, self.gate.held_bytes)
        return held

    def lane_of(self, broker_payload: Any) -> Hashable:
        return broker_payload.raw.lane if self.settings.lanes else None

    async def _apply(self, decided: Sequence[Decided[MemoryDelivery]]) -> None:
        broker = memory_broker(self.settings.broker_name)
        for entry in decided:
            raw = entry.delivery.raw
            broker.in_flight.pop(raw.message_id, None)
            broker.actions.append((raw.message_id, entry.disposition.value))
            if entry.disposition is Disposition.COMMIT:
                broker.committed.append(raw.message_id)
            elif entry.disposition is Disposition.DEAD_LETTER:
                broker.dead_letters.append((raw.message_id, entry.decision.reason))
            elif entry.disposition is Disposition.HOLD:
                raw.attempts -= 1  # nobody saw it: not a delivery attempt
                # Back off like a real broker's hold, instead of spinning while nobody listens.
                asyncio.get_running_loop().call_later(0.05, broker.requeue, raw)
            else:
                broker.requeue(raw)

    async def _close(self) -> None:
        broker = memory_broker(self.settings.broker_name)
        if broker.close_delay:
            await asyncio.sleep(broker.close_delay)
        # Abandoned in-flight messages come back, as a broker's lease expiry would bring them.
        for raw in list(broker.in_flight.values()):
            broker.requeue(raw)
        broker.in_flight.clear()


class MemorySharedStreamTrigger(SharedStreamTrigger):
    settings_class = MemoryStreamSettings
    producer_class_path = "devkit.memory.MemorySharedStreamProducer"
    settings: MemoryStreamSettings

    def __init__(self, *, broker_name: str, lanes: bool = False, **options: Unpack[SharedStreamOptions]) -> None:
        super().__init__(broker_name=broker_name, lanes=lanes, **options)
