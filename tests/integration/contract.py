"""
The contract every broker's producer passes: one test body, run against each real broker.

A broker's integration package provides an ``adapter`` fixture implementing :class:`BrokerAdapter`
(a fresh stream per test: topic / queue / subscription plus its dead-letter target) and a test
class that inherits :class:`ContractSuite`. What only one broker has (partitions, FIFO groups,
ordering keys, sessions, lease details) is tested next to the adapter, not here.

Each test drives the real ``SharedStreamManager`` through :class:`devkit.runner.RunnerSim` and
asserts broker state through the adapter's independent client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from devkit.kits import KitStream
from devkit.memory import MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until


class BrokerAdapter(Protocol):
    broker: str

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger:
        """A trigger on this test's stream, dead-letter target configured; kwargs pass through."""

    async def publish(self, bodies: Sequence[bytes], *, attributes: Mapping[str, str] | None = None) -> None:
        """Publish ``bodies`` to the stream (in order)."""

    async def unsettled(self) -> int:
        """Messages published and not yet committed / deleted / acked / completed, seen independently."""

    async def dead_lettered(self) -> list[bytes]:
        """Bodies that reached the dead-letter target so far (original bytes)."""


T = TypeVar("T")
StreamT = TypeVar("StreamT", bound=KitStream)
TriggerT = TypeVar("TriggerT", bound=SharedStreamTrigger)


class KitAdapter(Generic[StreamT, TriggerT]):
    """
    The part of a :class:`BrokerAdapter` its broker's test kit (``devkit/kits/<broker>.py``) already
    has: the trigger's source arguments and the count of what is unsettled come from the kit's
    stream ``kit``; a broker's adapter adds the trigger's other options (:meth:`trigger_options`),
    publishing and dead letters.

    The kits are sync, the tests async: a kit call runs in a worker thread (:meth:`in_thread`), so
    the event loop the watchers under test run on is never blocked by an observer's round trip (and
    a kit that runs an event loop of its own, as Kafka's does, is not started inside this one).
    """

    broker: str
    # The broker's trigger class (set on the subclass).
    trigger_class: type[TriggerT]
    # The broker's short polls and timeouts every test trigger gets, so the tests run quickly.
    quick: ClassVar[dict[str, Any]] = {}

    def __init__(self, kit: StreamT, conn_id: str) -> None:
        self.kit = kit
        self.conn_id = conn_id
        # Options every trigger of this adapter gets (before make_trigger's own keyword arguments).
        self.trigger_defaults: dict[str, Any] = {}

    def trigger_options(self) -> dict[str, Any]:
        """The trigger's options besides its source and :attr:`quick`: connection, dead-letter target."""
        raise NotImplementedError

    def make_trigger(self, **kwargs: Any) -> TriggerT:
        """A trigger on the kit's stream, dead-letter target configured; ``kwargs`` win over every default."""
        options = {
            **self.kit.trigger_kwargs(),
            **self.trigger_options(),
            **self.quick,
            **self.trigger_defaults,
            **kwargs,
        }
        return self.trigger_class(**options)

    async def in_thread(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)`` (a sync kit call) in a worker thread."""
        return await asyncio.to_thread(call, *args, **kwargs)

    async def unsettled(self) -> int:
        """What the broker still holds for the stream, as the kit counts it."""
        return await self.in_thread(self.kit.unsettled)

    async def cleanup(self) -> None:
        """Remove what the adapter made on the broker (nothing, unless the broker's adapter says so)."""


AdapterT = TypeVar("AdapterT", bound=KitAdapter[Any, Any])


@contextlib.asynccontextmanager
async def cleaned_up(make: Callable[..., Awaitable[AdapterT]]) -> AsyncIterator[Callable[..., Awaitable[AdapterT]]]:
    """``make`` (an adapter factory) as a factory whose adapters are cleaned up on exit, in order."""
    made: list[AdapterT] = []

    async def tracked(*args: Any, **kwargs: Any) -> AdapterT:
        made.append(await make(*args, **kwargs))
        return made[-1]

    try:
        yield tracked
    finally:
        for adapter in made:
            await adapter.cleanup()


def orders(count: int, *, regions: Sequence[str] = ("eu", "us", "apac")) -> list[bytes]:
    return [
        json.dumps({"order_id": i, "region": regions[i % len(regions)], "amount": i * 1.5}).encode()
        for i in range(count)
    ]


def reject_flagged(envelope: Mapping[str, Any]) -> bool:
    """A filter_function used by the contract: rejects orders flagged ``bad``."""
    from airflow_shared_stream_provider import RejectMessage

    body = envelope["body"]
    if isinstance(body, dict) and body.get("bad"):
        raise RejectMessage(f"order {body.get('order_id')} is flagged bad")
    return True


class ContractSuite:
    """Inherit in a broker's integration package next to an ``adapter`` fixture."""

    settle_timeout: float = 60.0

    async def test_every_watcher_sees_every_message_and_the_broker_settles(self, adapter: BrokerAdapter) -> None:
        bodies = orders(30)
        await adapter.publish(bodies)
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger())
            runner.add(2, adapter.make_trigger(match={"body.region": "eu"}))
            runner.add(3, adapter.make_trigger(match={"body.region": ["us", "apac"]}))
            await wait_until(lambda: runner.count(1) >= 30, timeout=self.settle_timeout, what="30 events")
            await wait_until_settled(adapter, timeout=self.settle_timeout)
            assert not runner.failures
        seen = sorted(p["body"]["order_id"] for p in runner.persisted[1])
        assert seen == list(range(30))
        assert runner.count(2) == 10
        assert runner.count(3) == 20
        assert {p["body"]["region"] for p in runner.persisted[2]} == {"eu"}
        envelope = runner.persisted[1][0]
        assert envelope["broker"] == adapter.broker
        assert envelope["body_encoding"] == "json"
        assert envelope["delivery_attempt"] >= 1
        assert len({p["message_id"] for p in runner.persisted[1]}) == 30

    async def test_a_stop_while_the_runner_hands_an_event_over_redelivers_it(self, adapter: BrokerAdapter) -> None:
        """
        A graceful triggerer stop cancels every trigger; one cancelled between yielding an event
        and the runner binding it (the runner logs the event first, a thread hop) drops the event,
        and the manager resolves the message as accepted for that watcher. It must come back.
        (Found by the soak: SQS and Pub/Sub lost what fired in the seconds after a SIGTERM.)
        """
        await adapter.publish(orders(4))
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05, hop_seconds=30) as runner:
            runner.add(1, adapter.make_trigger())
            runner.add(2, adapter.make_trigger())
            await asyncio.sleep(2.0)  # each watcher yielded its first event and sits in the hop
            assert not runner.persisted
        # The stop (leaving the block) cancelled both in the hop: nothing was persisted.
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger())
            runner.add(2, adapter.make_trigger())
            await wait_until(
                lambda: all({p["body"]["order_id"] for p in runner.persisted[t]} == set(range(4)) for t in (1, 2)),
                timeout=self.settle_timeout,
                what="all 4 orders at both watchers after the stop",
            )
            await wait_until_settled(adapter, timeout=self.settle_timeout)

    async def test_a_graceful_stop_in_airflows_order_redelivers_what_was_not_persisted(
        self, adapter: BrokerAdapter
    ) -> None:
        """
        Airflow 3.3.2's runner on SIGTERM stops syncing with its supervisor (nothing fired from then
        on is persisted), calls ``stop_all()``, which empties the manager's group map and stops the
        groups one after the other, and only then cancels the triggers. Here a slow-closing memory
        stream is stopped first; meanwhile this broker's stream keeps delivering, and its watchers'
        events bind to nothing. Every message must still reach both watchers, none dead-lettered.
        (Found by the soak: SQS, Pub/Sub and Service Bus lost what fired during a graceful stop.)
        """
        slow = memory_broker(f"contract-slow-close-{id(adapter)}")
        slow.close_delay = 1.5
        count = 40
        all_orders = orders(count)
        published: list[int] = []

        async def publisher() -> None:
            for index in range(count):
                await adapter.publish([all_orders[index]])
                published.append(index)
                await asyncio.sleep(0.05)

        try:
            manager = SharedStreamManager(ack_timeout=60)
            runner = RunnerSim(manager, confirm_interval=0.05)
            await runner.__aenter__()
            runner.add(9, MemorySharedStreamTrigger(broker_name=slow.name))  # first in stop_all's order
            runner.add(1, adapter.make_trigger())
            runner.add(2, adapter.make_trigger())
            sending = asyncio.create_task(publisher())
            await wait_until(lambda: len(published) >= 15, timeout=self.settle_timeout, what="15 published")
            await runner.stop_persisting()  # SIGTERM: no more syncs, nothing more is persisted
            await asyncio.sleep(0.3)
            await runner.stop_in_airflow_order()
            fired_unbound = sum(1 for item in runner.pending if item.seq is None)
            await sending
        finally:
            brokers.pop(slow.name, None)
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as second:
            second.add(1, adapter.make_trigger())
            second.add(2, adapter.make_trigger())

            def seen(trigger_id: int) -> set[int]:
                return {p["body"]["order_id"] for p in runner.persisted[trigger_id] + second.persisted[trigger_id]}

            await wait_until(
                lambda: all(seen(t) >= set(range(count)) for t in (1, 2)),
                timeout=max(self.settle_timeout, 90),
                what=f"every order at both watchers after the stop ({fired_unbound} events bound to nothing)",
            )
            await wait_until_settled(adapter, timeout=self.settle_timeout)
        assert fired_unbound, "nothing fired during the stop: no case made"
        assert not await adapter.dead_lettered()

    async def test_nothing_is_settled_before_persistence_and_a_crash_redelivers(self, adapter: BrokerAdapter) -> None:
        await adapter.publish(orders(12))
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager) as runner:  # manual persistence: nothing confirmed
            runner.add(1, adapter.make_trigger())
            runner.add(2, adapter.make_trigger())
            await wait_until(lambda: len(runner.pending) >= 24, timeout=self.settle_timeout, what="24 fired events")
            assert await adapter.unsettled() == 12, "settled before the events were persisted"
            runner.crash()  # the triggerer dies: events never reach the DB
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger())
            runner.add(2, adapter.make_trigger())
            await wait_until_settled(adapter, timeout=self.settle_timeout)
        for trigger_id in (1, 2):
            assert sorted({p["body"]["order_id"] for p in runner.persisted[trigger_id]}) == list(range(12))

    async def test_rejected_messages_are_dead_lettered_intact(self, adapter: BrokerAdapter) -> None:
        good = orders(6)
        bad = [json.dumps({"order_id": 100 + i, "bad": True}).encode() for i in range(3)]
        await adapter.publish(good[:3] + bad + good[3:])
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged"))
            runner.add(2, adapter.make_trigger())
            await wait_until_settled(adapter, timeout=self.settle_timeout)
            await wait_until_async(lambda: dead_lettered_at_least(adapter, 3), timeout=self.settle_timeout)
        assert sorted(await adapter.dead_lettered()) == sorted(bad)
        assert sorted(p["body"]["order_id"] for p in runner.persisted[1]) == list(range(6))
        assert runner.count(2) == 9  # the other watcher fired on every message before the reject won

    async def test_oversize_message_is_dead_lettered_not_stored(self, adapter: BrokerAdapter) -> None:
        huge = json.dumps({"order_id": 1, "blob": "x" * 5000}).encode()
        await adapter.publish([huge, orders(1)[0]])
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger(max_payload_bytes=2048))
            await wait_until_settled(adapter, timeout=self.settle_timeout)
            await wait_until_async(lambda: dead_lettered_at_least(adapter, 1), timeout=self.settle_timeout)
        assert await adapter.dead_lettered() == [huge]
        assert runner.count(1) == 1

    async def test_undecodable_bytes_fire_as_base64(self, adapter: BrokerAdapter) -> None:
        await adapter.publish([b"\xff\xfe\x00binary", b"plain text"])
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger())
            await wait_until_settled(adapter, timeout=self.settle_timeout)
        encodings = sorted(p["body_encoding"] for p in runner.persisted[1])
        assert encodings == ["base64", "text"]

    # -- batch mode (batch_size > 1): one event per batch, every guarantee per message ----------
    async def test_batch_mode_delivers_every_message_in_batches_and_settles(self, adapter: BrokerAdapter) -> None:
        bodies = orders(40)
        await adapter.publish(bodies)
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger(batch_size=25, batch_timeout=0.3))
            runner.add(2, adapter.make_trigger(batch_size=25, batch_timeout=0.3, match={"body.region": "eu"}))
            await wait_until(lambda: len(batched(runner, 1)) >= 40, timeout=self.settle_timeout, what="40 messages")
            await wait_until_settled(adapter, timeout=self.settle_timeout)
            assert not runner.failures
        assert sorted(e["body"]["order_id"] for e in batched(runner, 1)) == list(range(40))
        assert sorted(e["body"]["order_id"] for e in batched(runner, 2)) == [i for i in range(40) if i % 3 == 0]
        assert all(set(payload) == {"messages"} for payload in runner.persisted[1])
        assert runner.count(1) < 40, "a backlog must fill batches: fewer events than messages"
        assert all(len(payload["messages"]) <= 25 for payload in runner.persisted[1])
        assert all(e["broker"] == adapter.broker for e in batched(runner, 1))

    async def test_batch_mode_dead_letters_a_rejected_message_alone(self, adapter: BrokerAdapter) -> None:
        good = orders(6)
        bad = [json.dumps({"order_id": 100 + i, "bad": True}).encode() for i in range(2)]
        await adapter.publish(good[:3] + bad + good[3:])
        manager = SharedStreamManager(ack_timeout=60)
        async with RunnerSim(manager, confirm_interval=0.05) as runner:
            options = {"batch_size": 50, "batch_timeout": 0.5}
            runner.add(1, adapter.make_trigger(filter_function="tests.integration.contract.reject_flagged", **options))
            runner.add(2, adapter.make_trigger(**options))
            await wait_until_settled(adapter, timeout=self.settle_timeout)
            await wait_until_async(lambda: dead_lettered_at_least(adapter, 2), timeout=self.settle_timeout)
        assert sorted(await adapter.dead_lettered()) == sorted(bad)
        assert sorted(e["body"]["order_id"] for e in batched(runner, 1)) == list(range(6))
        assert len(batched(runner, 2)) == 8

    async def test_batch_mode_crash_before_persistence_redelivers_the_batch(self, adapter: BrokerAdapter) -> None:
        await adapter.publish(orders(10))
        options = {"batch_size": 50, "batch_timeout": 0.3}
        async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:  # nothing confirmed
            runner.add(1, adapter.make_trigger(**options))
            await wait_until(lambda: pending_messages(runner) >= 10, timeout=self.settle_timeout, what="10 pending")
            assert await adapter.unsettled() == 10, "settled before the batch event was persisted"
            runner.crash()
        async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
            runner.add(1, adapter.make_trigger(**options))
            await wait_until_settled(adapter, timeout=self.settle_timeout)
        assert sorted({e["body"]["order_id"] for e in batched(runner, 1)}) == list(range(10))


def batched(runner: RunnerSim, trigger_id: int) -> list[dict[str, Any]]:
    """The envelopes a watcher's persisted batch events carried, in order."""
    return [envelope for payload in runner.persisted.get(trigger_id, []) for envelope in payload["messages"]]


def pending_messages(runner: RunnerSim) -> int:
    return sum(len(item.event.payload["messages"]) for item in runner.pending)


async def dead_lettered_at_least(adapter: BrokerAdapter, count: int) -> bool:
    """Whether ``adapter``'s dead-letter destination holds ``count`` messages or more (a wait's predicate)."""
    return len(await adapter.dead_lettered()) >= count


async def wait_until_async(predicate: Any, *, timeout: float, interval: float = 0.1) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        if loop.time() >= deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def wait_until_settled(adapter: BrokerAdapter, *, timeout: float) -> None:
    async def settled() -> bool:
        return await adapter.unsettled() == 0

    await wait_until_async(settled, timeout=timeout)


async def held_under_lease(
    adapter: BrokerAdapter,
    trigger: SharedStreamTrigger,
    *,
    hold_for: float,
    nobody_else_has_it: Callable[[], Awaitable[None]],
) -> None:
    """
    The lease a broker gives one watcher's message is kept for as long as the watcher works on it.

    One message is published and fired to ``trigger``'s watcher; its event is not persisted for
    ``hold_for`` seconds (several of the broker's lease periods), during which
    ``nobody_else_has_it`` asserts, every 0.5 s, that the broker has not let anyone else take it.
    Then the event is persisted: the broker settles, and the message was delivered once.
    """
    await adapter.publish(orders(1))
    async with RunnerSim(SharedStreamManager(ack_timeout=60)) as runner:
        runner.add(1, trigger)
        await wait_until(lambda: len(runner.pending) == 1, timeout=20, what="the event")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold_for
        while loop.time() < deadline:
            await nobody_else_has_it()
            await asyncio.sleep(0.5)
        assert len(runner.pending) == 1  # delivered once, not again
        runner.persist()
        await wait_until_settled(adapter, timeout=20)
    assert runner.persisted[1][0]["delivery_attempt"] == 1
