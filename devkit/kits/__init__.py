"""
One test kit per broker: everything broker-specific that the demo, the kill loops and the
triggerer bench need, written once per broker.

A kit has two halves:

* :class:`BrokerKit`, the broker: :meth:`~BrokerKit.start` the local broker (or use the real one an
  environment variable names, where the kit supports it and ``own`` is false), :meth:`~BrokerKit.stop`
  it, the Airflow :meth:`~BrokerKit.connection` that reaches it, the :meth:`~BrokerKit.env` the
  Airflow components need, and :meth:`~BrokerKit.stream`, a new destination on it;
* :class:`KitStream`, one destination (topic, queue, subscription, stream) and its dead letters:
  the trigger's source arguments (:meth:`~KitStream.trigger_kwargs`), :meth:`~KitStream.publish_bytes`
  (bodies, optional keys, paced), :meth:`~KitStream.dead_letters`, and what the broker still holds
  for the stream (:meth:`~KitStream.unsettled`: not committed / deleted / acked / completed).

The harnesses are thin layers over it: ``devkit.demo_streams`` (``DemoStream``: the example Dags'
side), ``tests/e2e/loop_brokers.py`` (``LoopBroker``: the kill loops) and
``bench/triggerer_bench.py`` (``BenchBroker`` / ``BenchStream``, which ``bench/stream_bench.py``
drives too). A broker's kit class is its
registry entry's ``harness.kit`` (:func:`kit_class`), so a new broker's kit lives in its own module
(``devkit/kits/<name>.py``).
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, TypeVar

from airflow_shared_stream_provider.brokers import broker_spec, load
from devkit.demo_types import OrderMessage

T = TypeVar("T")
# A kit's own class: ``with SomeKit() as kit`` gives that class, not the base.
K = TypeVar("K", bound="BrokerKit")

# (index of the chunk's first item, the chunk's message ids): called as each chunk is accepted.
OnSent = Callable[[int, list[str]], None]
# One message to send: its body and its key (None: no key).
Item = tuple[bytes, bytes | None]
# Sends one chunk of messages in order; returns their envelope message ids.
Sender = Callable[[list[Item]], list[str]]


def paced_chunks(
    items: Iterable[T], *, size: int, rate: float | None, stop: threading.Event | None
) -> Iterator[list[T]]:
    """
    ``items`` in order, in chunks of ``size`` (one at a time when ``rate`` paces them: item i is
    due ``i / rate`` seconds after the start); ends early once ``stop`` is set. Items are taken
    from ``items`` only when their chunk is due, so a generator that stamps the time into each
    body stamps it right before the send.
    """
    if rate:
        size = 1
    iterator = iter(items)
    started = time.monotonic()
    index = 0
    while True:
        if stop is not None and stop.is_set():
            return
        if rate:
            delay = started + index / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        chunk = [item for _, item in zip(range(size), iterator, strict=False)]
        if not chunk:
            return
        yield chunk
        index += len(chunk)


def keyed(bodies: Iterable[bytes], keys: Sequence[bytes] | None) -> Iterator[tuple[bytes, bytes | None]]:
    """``(body, key)`` pairs; key None throughout when there are no keys."""
    if keys is None:
        return ((body, None) for body in bodies)
    return zip(bodies, keys, strict=False)


class KitStream(abc.ABC):
    """One destination of a kit's broker: publish bytes, read its dead letters, say what is unsettled."""

    # Messages per send when unpaced (paced: one at a time).
    chunk_size: int = 1
    # The attribute holding the stream's source, and the trigger argument that names it.
    source_field: ClassVar[str]
    source_arg: ClassVar[str]

    @property
    def source(self) -> str:
        """What the trigger's source argument names (topic, queue URL, subscription, ...)."""
        return str(getattr(self, self.source_field))

    def trigger_kwargs(self) -> dict[str, Any]:
        """The trigger's source arguments, JSON-safe (no connection, no harness options)."""
        return {self.source_arg: self.source}

    def _sender(self, *, paced: bool) -> AbstractContextManager[Sender]:
        """
        The broker's client for one :meth:`publish_bytes` call: sends one chunk, returns its ids.
        By default :meth:`_send`; a kit whose client lives across chunks overrides this instead.
        """
        return contextlib.nullcontext(self._send)

    def _send(self, chunk: list[Item]) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} writes _send or _sender")

    def publish_bytes(
        self,
        bodies: Iterable[bytes],
        *,
        keys: Sequence[bytes] | None = None,
        rate: float | None = None,
        stop: threading.Event | None = None,
        on_sent: OnSent | None = None,
    ) -> list[str]:
        """
        Publish ``bodies`` in order (each with its key, where given: Kafka's record key, Service
        Bus' ``message_id``, a Redis ``key`` field; SQS and Pub/Sub have none), :attr:`chunk_size`
        per send, or one at a time at ``rate`` per second, until done or ``stop`` is set. Returns
        the envelope ``message_id`` of each message sent; ``on_sent`` hears of each accepted chunk.
        """
        ids: list[str] = []
        with self._sender(paced=bool(rate)) as send:
            for chunk in paced_chunks(keyed(bodies, keys), size=self.chunk_size, rate=rate, stop=stop):
                sent = send(chunk)
                if on_sent is not None:
                    on_sent(len(ids), sent)
                ids.extend(sent)
        return ids

    def publish_orders(
        self,
        messages: Sequence[OrderMessage],
        record: Callable[[Sequence[OrderMessage], list[str]], None],
        *,
        rate: float | None,
        stop: threading.Event | None,
        keys: bool = True,
    ) -> None:
        """:meth:`publish_bytes` of the orders (with their keys), ``record(orders, ids)`` as each chunk is accepted."""

        def on_sent(start: int, ids: list[str]) -> None:
            record(messages[start : start + len(ids)], ids)

        values = [m.value for m in messages]
        self.publish_bytes(
            values, keys=[m.key for m in messages] if keys else None, rate=rate, stop=stop, on_sent=on_sent
        )

    @abc.abstractmethod
    def dead_letters(self) -> dict[str, str]:
        """``source message id -> dead-letter reason`` of what the stream's dead-letter destination holds."""

    @abc.abstractmethod
    def unsettled(self) -> int:
        """Messages the broker still holds for the stream (not committed / deleted / acked / completed)."""

    def diagnostics(self) -> str:
        return ""


class OrdersById(KitStream):
    """A kit stream that keeps what it published as ``published``: ``message id -> order``."""

    published: dict[str, OrderMessage]
    _lock: threading.Lock

    def publish(
        self, messages: Sequence[OrderMessage], *, rate: float | None = None, stop: threading.Event | None = None
    ) -> dict[str, OrderMessage]:
        """Publish the orders in order (with their keys), paced at ``rate``; return ``message id -> order``."""
        sent: dict[str, OrderMessage] = {}

        def record(orders: Sequence[OrderMessage], ids: list[str]) -> None:
            batch = dict(zip(ids, orders, strict=True))
            sent.update(batch)
            with self._lock:
                self.published.update(batch)

        self.publish_orders(messages, record, rate=rate, stop=stop)
        return sent


class BrokerKit(abc.ABC):
    """One broker of a test or benchmark: the local broker (or a real one), its connection, its streams."""

    name: ClassVar[str]
    # Whether the kit starts a broker of its own by default (True) or uses the one its
    # environment variable names when set (False).
    own_by_default: ClassVar[bool] = True

    def __init__(self, *, own: bool | None = None) -> None:
        self.own = self.own_by_default if own is None else own

    # The environment variable that names a real broker (None: the kit starts its own, always),
    # and where the started or named broker is.
    address_env: ClassVar[str | None] = None
    address: str = ""

    def start(self) -> str:
        """Start the local broker (or reach the configured one); return a line describing it."""
        configured = os.environ.get(self.address_env) if self.address_env and not self.own else None
        if configured:
            self.address = configured
            return f"{self.name} broker {configured} ({self.address_env})"
        return self._start_own()

    def _start_own(self) -> str:
        """Start the kit's own broker, set :attr:`address`; return a line describing it."""
        raise NotImplementedError(f"{type(self).__name__} writes start or _start_own")

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what :meth:`start` started (idempotent)."""

    @abc.abstractmethod
    def connection(self) -> dict[str, Any]:
        """The Airflow connection (``AIRFLOW_CONN_*`` JSON) of the broker's connection type."""

    def env(self) -> dict[str, str]:
        """Environment the Airflow components need to reach the broker."""
        return {}

    # ``stream(name, **options)``: a new destination ``name`` (and its dead-letter destination) on
    # the started broker, with the broker's own keyword options. Declared as a callable, not an
    # abstract method: each kit's options are its own.
    stream: Callable[..., KitStream]

    def __enter__(self: K) -> K:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def harness_class(name: str, kind: str, base: type) -> type[Any]:
    """The ``base`` subclass that registry broker ``name``'s ``harness.<kind>`` names."""
    path = getattr(broker_spec(name).harness, kind)
    if path is None:
        raise KeyError(f"broker {name!r} has no {kind} harness (harness.{kind} in its registry entry)")
    loaded = load(path)
    if not (isinstance(loaded, type) and issubclass(loaded, base)):
        raise TypeError(f"harness.{kind} of {name!r}: {path} is not a {base.__name__}")
    return loaded


def kit_class(name: str) -> type[BrokerKit]:
    """The :class:`BrokerKit` of registry broker ``name`` (its ``harness.kit``)."""
    kit: type[BrokerKit] = harness_class(name, "kit", BrokerKit)
    return kit
