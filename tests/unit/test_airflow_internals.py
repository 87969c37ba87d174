"""
The private Airflow parts the provider relies on (``_core/airflow_internals.py``): each one removed
or renamed in turn makes the stream refuse to start with one ``AirflowInternalsError`` naming the
Airflow version and that part, on the real ``SharedStreamManager`` (devkit.runner.RunnerSim).
Nothing is read from the broker then, so nothing can be settled without its guarantee.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import airflow
import airflow.sdk.execution_time.context as state_store_context
import airflow.triggers.shared_stream as shared_stream
import pytest
from airflow.sdk import Asset
from airflow.sdk.execution_time.context import AssetStateStoreAccessors
from airflow.triggers.shared_stream import SharedStreamManager, _SharedStreamGroup

from airflow_shared_stream_provider._core import airflow_internals
from airflow_shared_stream_provider._core.airflow_internals import (
    INTERNALS,
    TESTED_AIRFLOW,
    checked_internals,
    problems,
    require_airflow_internals,
)
from airflow_shared_stream_provider._core.errors import AirflowInternalsError
from devkit.memory import MemoryBroker, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until

_names = itertools.count()


@pytest.fixture(autouse=True)
def _fresh_check() -> Iterator[None]:
    """Each test checks anew, and leaves no cached result (good or bad) to the tests after it."""
    checked_internals.cache_clear()
    yield
    checked_internals.cache_clear()


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    name = f"internals-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


def _internal(prefix: str) -> airflow_internals.AirflowInternal:
    [internal] = [internal for internal in INTERNALS if internal.name.startswith(prefix)]
    return internal


# -- how each internal disappears (what another Airflow release could do) -------------------------


def _drop_reject_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(shared_stream, "_reject_context")


def _rename_reject_context_field(monkeypatch: pytest.MonkeyPatch) -> None:
    class _RejectContext(NamedTuple):
        group: Any
        trigger_id: int
        raw_event_id: int  # was event_id

    monkeypatch.setattr(shared_stream, "_RejectContext", _RejectContext)


def _drain_without_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ack drain that no longer publishes the window in ``_reject_context``."""

    async def _ack_drain(self: Any, trigger_id: int, queue: Any) -> Any:
        async for raw_event, _event_id in shared_stream._drain(queue):
            yield raw_event

    monkeypatch.setattr(_SharedStreamGroup, "_ack_drain", _ack_drain)


def _rename_outstanding(monkeypatch: pytest.MonkeyPatch) -> None:
    original = _SharedStreamGroup.__init__

    def __init__(self: Any, **kwargs: Any) -> None:
        original(self, **kwargs)
        vars(self)["_pending_entries"] = vars(self).pop("_outstanding")

    monkeypatch.setattr(_SharedStreamGroup, "__init__", __init__)


def _rename_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass
    class _OutstandingEntry:
        pending: set[int]
        created_at: float
        broker_payload: Any
        lane: Any
        subscriber_bindings: dict[int, Any] = dataclasses.field(default_factory=dict)  # was bindings

    monkeypatch.setattr(shared_stream, "_OutstandingEntry", _OutstandingEntry)


def _rename_unconfirmed_seqs(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(slots=True)
    class _SubscriberBinding:
        window_closed: bool = False
        pending_seqs: set[int] = dataclasses.field(default_factory=set)  # was unconfirmed_seqs

    monkeypatch.setattr(shared_stream, "_SubscriberBinding", _SubscriberBinding)


def _bind_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bind_pending_event`` keeping its seqs somewhere else than the binding we read."""

    def bind_pending_event(self: Any, *, trigger_id: int, seq_counter: Iterator[int]) -> int | None:
        seq = next(seq_counter)
        vars(self).setdefault("_persist_gates", {})[seq] = trigger_id
        return seq

    monkeypatch.setattr(_SharedStreamGroup, "bind_pending_event", bind_pending_event)


def _rename_accessor_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    def __init__(self: Any, inlets: list[Any], outlets: list[Any] | None = None) -> None:
        self._accessors = {inlet.name: state_store_context.AssetStateStoreAccessor(name=inlet.name) for inlet in inlets}
        self._total = len(self._accessors)

    monkeypatch.setattr(AssetStateStoreAccessors, "__init__", __init__)


def _drop_accessor_aset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(state_store_context.AssetStateStoreAccessor, "aset")


def _drop_subscriber_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(shared_stream, "_SubscriberOverflow")


REMOVALS: list[tuple[str, Callable[[pytest.MonkeyPatch], None]]] = [
    ("airflow.triggers.shared_stream._reject_context", _drop_reject_context),
    ("airflow.triggers.shared_stream._RejectContext.", _rename_reject_context_field),
    ("airflow.triggers.shared_stream._SharedStreamGroup._ack_drain", _drain_without_window),
    ("airflow.triggers.shared_stream._SharedStreamGroup._outstanding", _rename_outstanding),
    ("airflow.triggers.shared_stream._OutstandingEntry.bindings", _rename_bindings),
    ("airflow.triggers.shared_stream._SubscriberBinding.unconfirmed_seqs", _rename_unconfirmed_seqs),
    ("airflow.triggers.shared_stream._SharedStreamGroup.bind_pending_event", _bind_elsewhere),
    ("airflow.sdk.execution_time.context.AssetStateStoreAccessors.", _rename_accessor_maps),
    ("airflow.sdk.execution_time.context.AssetStateStoreAccessor(", _drop_accessor_aset),
    ("airflow.triggers.shared_stream._SubscriberOverflow", _drop_subscriber_overflow),
]


def test_every_listed_internal_has_a_removal_test() -> None:
    assert sorted(_internal(prefix).name for prefix, _ in REMOVALS) == sorted(internal.name for internal in INTERNALS)


def test_the_installed_airflow_has_every_internal(broker: MemoryBroker) -> None:
    assert problems() == []
    assert checked_internals() is None
    require_airflow_internals()  # does not raise


async def test_a_stream_runs_on_the_installed_airflow(broker: MemoryBroker) -> None:
    [message_id] = [broker.publish(json.dumps({"order_id": 1}))]
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        runner.add(1, MemorySharedStreamTrigger(broker_name=broker.name))
        await wait_until(lambda: broker.committed == [message_id], timeout=10, what="the message committed")
    assert not runner.failures


@pytest.mark.parametrize(("prefix", "remove"), REMOVALS, ids=[remove.__name__.lstrip("_") for _, remove in REMOVALS])
async def test_a_missing_internal_stops_the_stream_before_it_reads(
    broker: MemoryBroker,
    monkeypatch: pytest.MonkeyPatch,
    prefix: str,
    remove: Callable[[pytest.MonkeyPatch], None],
) -> None:
    internal = _internal(prefix)
    broker.publish(json.dumps({"order_id": 1}))
    remove(monkeypatch)
    async with RunnerSim(SharedStreamManager(), confirm_interval=0.01) as runner:
        runner.add(1, MemorySharedStreamTrigger(broker_name=broker.name))
        runner.add(2, MemorySharedStreamTrigger(broker_name=broker.name, match={"body.order_id": 1}))
        await wait_until(lambda: len(runner.failures) == 2, timeout=10, what="both watchers failed")
    # Every watcher of the group gets the one error, through the manager's terminal path.
    for error in runner.failures.values():
        assert isinstance(error, AirflowInternalsError), repr(error)
        assert error.airflow_version == airflow.__version__
        assert len(error.missing) == 1, error.missing  # exactly the part that went missing
        assert error.missing[0].startswith(internal.name)
        message = str(error)
        assert f"Airflow {airflow.__version__}" in message
        assert internal.name in message
        assert TESTED_AIRFLOW in message
    # Refused before the broker was touched: nothing read, nothing settled.
    assert broker.producers == []
    assert len(broker.available) == 1
    assert broker.committed == [] and broker.actions == []


def test_the_check_runs_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    require_airflow_internals()
    _drop_reject_context(monkeypatch)
    require_airflow_internals()  # cached: the installed Airflow does not change under a triggerer
    checked_internals.cache_clear()
    with pytest.raises(AirflowInternalsError, match="_reject_context"):
        require_airflow_internals()


def test_every_missing_part_is_named_in_one_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _drop_reject_context(monkeypatch)
    _rename_accessor_maps(monkeypatch)
    with pytest.raises(AirflowInternalsError) as raised:
        require_airflow_internals()
    assert [part.split(" (")[0] for part in raised.value.missing] == [
        _internal("airflow.triggers.shared_stream._reject_context").name,
        _internal("airflow.sdk.execution_time.context.AssetStateStoreAccessors.").name,
    ]


async def test_a_watcher_with_state_stores_refuses_before_reading_them(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """
    In a triggerer a watcher reads its accessors' private maps as it subscribes, before the
    producer opens: it fails with the same error, and gives back what it took (its flow gate).
    """
    _rename_accessor_maps(monkeypatch)
    trigger = MemorySharedStreamTrigger(broker_name=broker.name)
    trigger.asset_state_store = AssetStateStoreAccessors(inlets=[Asset(name="orders", uri="memory://orders")])
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger)
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="the watcher failed")
    error = runner.failures[1]
    assert isinstance(error, AirflowInternalsError), repr(error)
    assert "AssetStateStoreAccessors._by_name / ._by_uri" in str(error)
    # (tests/conftest.py fails the test if the watcher's flow gate leaked)
