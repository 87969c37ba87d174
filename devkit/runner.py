"""
Drive the real ``SharedStreamManager`` the way the triggerer's ``TriggerRunner`` does.

The runner (``airflow/jobs/triggerer_job_runner.py``) does, per trigger: ``manager.subscribe``,
then ``async for event in trigger.filter_shared_stream(stream)``: ``await log.ainfo(...)`` (a
structlog call that runs in a thread executor), ``manager.bind_pending_event`` and queueing the
event; the supervisor persists queued events and confirms their seqs on the next state sync
(``manager.confirm_persisted``). :class:`RunnerSim` reproduces exactly that, with:

* ``executor_hop=True`` to reproduce the per-event thread-executor hop of ``log.ainfo``, and
  ``hop_seconds`` to make it last (a stop then cancels triggers between yield and binding);
* persistence either automatic every ``confirm_interval`` seconds (benchmarks, integration tests)
  or manual through :meth:`RunnerSim.persist` (unit tests: no timing involved);
* ``crash()`` to drop every unconfirmed event, as a triggerer killed before persisting would;
* ``withhold`` to never persist one watcher's events (its persist confirmations never arrive).

:class:`FakeClock` is the manager's clock for tests that decide when ack timeouts fall
(``SharedStreamManager(ack_timeout=..., _now=clock)``, then ``clock.now += ...``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import SharedStreamManager

ProducerT = TypeVar("ProducerT")
# How long RunnerSim.remove waits for a cancelled trigger task before it reports where it hangs.
REMOVE_TIMEOUT = 60.0


class FakeClock:
    """A clock that moves only when the test moves it (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_AWAITS = ("cr_await", "ag_await", "gi_yieldfrom")  # what a coroutine, async generator, generator awaits


def await_chain(task: asyncio.Task[Any]) -> str:
    """
    Where a suspended task waits, outermost first: its coroutine and every coroutine, async
    generator or generator it awaits (``Task.get_stack`` gives only the outermost frame).
    """
    lines: list[str] = []
    last_locals: dict[str, Any] = {}
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        frame = frame or getattr(awaited, "gi_frame", None)
        if frame is None:
            # An async generator's asend/athrow has no frame: the generator it drives is the
            # running one among the previous frame's locals (``async for item in source``).
            running = [value for value in last_locals.values() if getattr(value, "ag_running", False)]
            if len(running) == 1 and running[0] is not awaited:
                awaited = running[0]
                continue
            lines.append(f"  (awaits {awaited!r:.200})\n")
            break
        last_locals = frame.f_locals
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}\n")
        awaited = next((getattr(awaited, name) for name in _AWAITS if getattr(awaited, name, None)), None)
    return "".join(lines)


def _executor_noop() -> None:
    return None


@dataclass
class _Pending:
    trigger_id: int
    event: TriggerEvent
    seq: int | None


@dataclass
class RunnerSim:
    manager: SharedStreamManager
    executor_hop: bool = False
    # Seconds each event spends between the trigger's yield and its binding (the real runner's
    # ``await log.ainfo(...)``): a stop during that time cancels the trigger mid-hand-over.
    hop_seconds: float = 0.0
    confirm_interval: float | None = None
    on_persist: Callable[[int, TriggerEvent], None] | None = None
    # Trigger ids whose events are never persisted (a watcher stuck behind a broken DB write).
    withhold: set[int] = field(default_factory=set)
    # Trigger ids whose trigger row is gone (its Dag was paused: the dag-processor dropped the
    # asset's reference and the triggerer deleted the row, but has not cancelled it yet). Airflow
    # 3.3's ``Trigger.submit_event`` stores their events for no asset and raises nothing, so they
    # are confirmed persisted and kept nowhere; counted in ``dropped``.
    deleted: set[int] = field(default_factory=set)
    dropped: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    # Seconds after which a failed trigger is created again from its ``serialize()``, as the
    # triggerer does with a failed asset watcher (None: it stays failed).
    recreate_failed: float | None = None
    persisted: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    failures: dict[int, BaseException] = field(default_factory=dict)
    pending: list[_Pending] = field(default_factory=list)
    _tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    _keys: dict[int, Hashable] = field(default_factory=dict)
    _persister: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RunnerSim:
        if self.confirm_interval is not None:
            self._persister = asyncio.create_task(self._persist_loop(), name="runner-sim-persister")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- triggers --------------------------------------------------------------------------------
    def add(self, trigger_id: int, trigger: BaseEventTrigger) -> None:
        key = trigger.shared_stream_key()
        if key is None:
            raise ValueError("RunnerSim drives shared-stream triggers only")
        self._keys[trigger_id] = key
        trigger.trigger_id = trigger_id  # as the triggerer's runner does before running it
        self._tasks[trigger_id] = asyncio.create_task(self._run_trigger(trigger_id, trigger, key))

    async def _run_trigger(self, trigger_id: int, trigger: BaseEventTrigger, key: Hashable) -> None:
        loop = asyncio.get_running_loop()
        try:
            stream = self.manager.subscribe(trigger_id=trigger_id, trigger=trigger, key=key)
            async for event in trigger.filter_shared_stream(stream):
                if self.executor_hop:
                    await loop.run_in_executor(None, _executor_noop)
                if self.hop_seconds:
                    await asyncio.sleep(self.hop_seconds)
                seq = self.manager.bind_pending_event(trigger_id=trigger_id, key=key)
                self.pending.append(_Pending(trigger_id, event, seq))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.failures[trigger_id] = exc
        finally:
            with contextlib.suppress(Exception):
                await self.manager.unsubscribe(trigger_id, key)
        if self.recreate_failed is not None and trigger_id in self.failures:
            await asyncio.sleep(self.recreate_failed)
            if self._tasks.get(trigger_id) is asyncio.current_task():  # not removed meanwhile
                _, kwargs = trigger.serialize()
                self.add(trigger_id, type(trigger)(**kwargs))

    async def remove(self, trigger_id: int) -> None:
        task = self._tasks.pop(trigger_id, None)
        if task is not None and not task.done():
            task.cancel()
            # Bounded: a task that swallows its cancellation (a client library that catches it in a
            # blocking read, say) would hang the test until pytest-timeout, hiding where it stuck.
            done, _ = await asyncio.wait({task}, timeout=REMOVE_TIMEOUT)
            if not done:
                others = "".join(
                    f"task {other.get_name()}:\n{await_chain(other)}"
                    for other in asyncio.all_tasks()
                    if other is not task and other is not asyncio.current_task()
                )
                raise RuntimeError(
                    f"trigger {trigger_id}'s task did not end within {REMOVE_TIMEOUT:.0f} s of its "
                    f"cancellation (a cancellation swallowed below it?); it waits in:\n{await_chain(task)}"
                    f"the other tasks:\n{others}"
                )
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def alive(self, trigger_id: int) -> bool:
        task = self._tasks.get(trigger_id)
        return task is not None and not task.done()

    # -- persistence ----------------------------------------------------------------------------
    def persist(self) -> int:
        """Persist every queued event and confirm its seq (one supervisor sync round)."""
        return self.persist_matching(None)

    def persist_matching(self, where: Callable[[int, TriggerEvent], bool] | None) -> int:
        """
        Like :meth:`persist`, for the queued events ``where(trigger_id, event)`` picks (all when
        None); the others stay queued (a delayed DB write for those events only).
        """

        def chosen(item: _Pending) -> bool:
            return item.trigger_id not in self.withhold and (where is None or where(item.trigger_id, item.event))

        batch = [item for item in self.pending if chosen(item)]
        self.pending = [item for item in self.pending if not chosen(item)]
        seqs = []
        for item in batch:
            if item.trigger_id in self.deleted:
                self.dropped[item.trigger_id] += 1
            else:
                self.persisted[item.trigger_id].append(item.event.payload)
                if self.on_persist is not None:
                    self.on_persist(item.trigger_id, item.event)
            if item.seq is not None:
                seqs.append(item.seq)
        if seqs:
            self.manager.confirm_persisted(seqs)
        return len(batch)

    def crash(self) -> int:
        """Drop every queued, unconfirmed event (the triggerer died before persisting them)."""
        dropped = len(self.pending)
        self.pending = []
        return dropped

    async def _persist_loop(self) -> None:
        assert self.confirm_interval is not None
        while True:
            await asyncio.sleep(self.confirm_interval)
            self.persist()

    async def stop_persisting(self) -> None:
        """The supervisor syncs no more (a SIGTERM): nothing queued from now on is persisted."""
        if self._persister is not None:
            self._persister.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._persister
            self._persister = None

    async def stop_in_airflow_order(self) -> None:
        """
        Airflow 3.3.2's runner shutdown: no more persistence, ``manager.stop_all()`` (which empties
        its group map, then stops the groups one by one), and only then the trigger tasks cancelled.
        :meth:`stop` cancels the triggers first, which stops each group as its last watcher leaves.
        """
        await self.stop_persisting()
        await self.manager.stop_all()
        for trigger_id in list(self._tasks):
            await self.remove(trigger_id)

    async def stop(self) -> None:
        await self.stop_persisting()
        for trigger_id in list(self._tasks):
            await self.remove(trigger_id)
        await self.manager.stop_all()

    # -- helpers --------------------------------------------------------------------------------
    def count(self, trigger_id: int) -> int:
        return len(self.persisted.get(trigger_id, []))

    def message_ids(self, trigger_id: int) -> list[str]:
        return [payload["message_id"] for payload in self.persisted.get(trigger_id, [])]


async def wait_until(predicate: Callable[[], bool], *, timeout: float, interval: float = 0.01, what: str = "") -> None:
    """Poll ``predicate`` until it is true; raise TimeoutError naming ``what`` otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate!r}")
        await asyncio.sleep(interval)


def record_producers(monkeypatch: Any, producer_class: type[ProducerT]) -> list[ProducerT]:
    """
    Every ``producer_class`` the manager builds from now on, in order (to read its counters and
    bookkeeping): ``__init__`` is wrapped through ``monkeypatch`` (a pytest MonkeyPatch), so the
    wrapping ends with the test.
    """
    made: list[ProducerT] = []
    original = producer_class.__init__

    def record(self: ProducerT, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)  # type: ignore[misc]
        made.append(self)

    monkeypatch.setattr(producer_class, "__init__", record)
    return made


async def settle(rounds: int = 50) -> None:
    """Let every ready task run (no wall-clock wait): ``rounds`` passes of the event loop."""
    for _ in range(rounds):
        await asyncio.sleep(0)
