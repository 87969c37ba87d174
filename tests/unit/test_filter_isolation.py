"""
Filters cannot freeze the triggerer: the ``filter_function`` is imported once, off the loop, when
the watcher starts; ``filter_mode="thread"`` decides off the loop, in order, with an optional
``filter_timeout``; a filter's exception text is made safe for dead-letter headers at the source.

Real ``SharedStreamManager`` (devkit.runner.RunnerSim) on the in-memory broker. Blocking filters
wait on a ``threading.Event`` the test sets, so no assertion depends on how long anything takes
(the latency numbers live in bench/filter_isolation_bench.py).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider import RejectMessage, SharedStreamConfigError
from airflow_shared_stream_provider._core import filtering
from airflow_shared_stream_provider._core.trigger import MAX_FILTER_ERROR_CHARS, _describe_filter_error
from devkit.memory import MemoryBroker, MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until

_names = itertools.count()
# What the in-memory producer puts before the watchers' reasons in a dead letter.
PREFIX = "rejected by 1 watcher(s): "
# filter_timeout of the timeout tests: what a blocked call waits for, in real time. Long enough that
# the calls that do not block (a thread hop each) never reach it on a loaded 2-core machine.
TIMEOUT = 0.5
# Released by each test's teardown, so no filter thread outlives its test.
_gates: dict[str, threading.Event] = {}
# Which order ids the blocking filters hold (block) and which thread ran each call.
_hold: dict[str, set[int]] = {}
_calls: dict[str, list[tuple[int, int]]] = {}


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    name = f"filters-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


@pytest.fixture
def other_broker() -> Iterator[MemoryBroker]:
    name = f"filters-other-{next(_names)}"
    yield memory_broker(name)
    brokers.pop(name, None)


@pytest.fixture(autouse=True)
def _release_blocked_filters() -> Iterator[None]:
    yield
    for gate in _gates.values():
        gate.set()
    _gates.clear()
    _hold.clear()
    _calls.clear()
    filtering._abandoned.clear()


def trigger(broker: MemoryBroker, **kwargs: Any) -> MemorySharedStreamTrigger:
    return MemorySharedStreamTrigger(broker_name=broker.name, **kwargs)


def publish(broker: MemoryBroker, count: int) -> list[str]:
    return [broker.publish(json.dumps({"order_id": i, "stream": broker.name})) for i in range(count)]


async def persist_until(runner: RunnerSim, predicate: Any, *, what: str, timeout: float = 10.0) -> None:
    def step() -> bool:
        runner.persist()
        return bool(predicate())

    await wait_until(step, timeout=timeout, what=what)


def _blocking(envelope: Mapping[str, Any]) -> bool:
    """Blocks on the gate of its stream for the order ids listed in ``_hold``; records its thread."""
    stream, order_id = envelope["body"]["stream"], envelope["body"]["order_id"]
    _calls.setdefault(stream, []).append((order_id, threading.get_ident()))
    if order_id in _hold.get(stream, ()):
        _gates.setdefault(stream, threading.Event()).wait(timeout=60)
    return True


def blocking_filter(envelope: Mapping[str, Any]) -> bool:
    return _blocking(envelope)


def timeout_raising_filter(envelope: Mapping[str, Any]) -> bool:
    """Raises the builtin TimeoutError itself (as an HTTP client would): not a filter_timeout."""
    raise TimeoutError("upstream lookup timed out")


def hostile_filter(envelope: Mapping[str, Any]) -> bool:
    raise ValueError("bad\r\nX-Injected: yes\x00" + "y" * 10_000)


def reject_all(envelope: Mapping[str, Any]) -> bool:
    raise RejectMessage("not for us")


def hold(broker: MemoryBroker, *order_ids: int) -> threading.Event:
    _hold[broker.name] = set(order_ids)
    return _gates.setdefault(broker.name, threading.Event())


# -- import once, off the loop ---------------------------------------------------------------------
async def test_a_wrong_filter_path_fails_that_watcher_once_and_dead_letters_nothing(
    broker: MemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    ids = publish(broker, 5)
    caplog.set_level(logging.INFO)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function="no_such_pkg_for_filters.keep"))
        runner.add(2, trigger(broker))
        await persist_until(runner, lambda: len(broker.committed) == 5, what="all committed through watcher 2")
        assert runner.alive(2)
    error = runner.failures[1]
    assert isinstance(error, SharedStreamConfigError)
    assert "'no_such_pkg_for_filters.keep'" in str(error) and "No module named 'no_such_pkg_for_filters'" in str(error)
    # The messages watcher 1 never pulled came back (redelivered), none was dead-lettered.
    assert broker.dead_letters == []
    assert sorted(set(runner.message_ids(2))) == sorted(ids)
    assert not [record for record in caplog.records if "Filter raised" in record.getMessage()]


async def test_a_filter_without_the_named_callable_fails_the_watcher_naming_it(broker: MemoryBroker) -> None:
    publish(broker, 1)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function="json.no_such_function"))
        await wait_until(lambda: 1 in runner.failures, timeout=10, what="watcher 1 failed")
    assert isinstance(runner.failures[1], SharedStreamConfigError)
    assert "'json' has no callable 'no_such_function'" in str(runner.failures[1])
    assert broker.dead_letters == []


async def test_the_filter_module_is_imported_off_the_event_loop(
    broker: MemoryBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"filters_import_probe_{uuid.uuid4().hex}"
    (tmp_path / f"{module}.py").write_text(
        "import threading\nIMPORTED_IN = threading.current_thread().name\n\ndef keep(envelope):\n    return True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    publish(broker, 2)
    try:
        async with RunnerSim(SharedStreamManager()) as runner:
            runner.add(1, trigger(broker, filter_function=f"{module}.keep"))
            await persist_until(runner, lambda: len(broker.committed) == 2, what="both committed")
        assert threading.current_thread().name != sys.modules[module].IMPORTED_IN
    finally:
        sys.modules.pop(module, None)


# -- filter_mode="thread" ----------------------------------------------------------------------------
async def test_with_thread_mode_another_stream_is_delivered_while_a_filter_blocks(
    broker: MemoryBroker, other_broker: MemoryBroker
) -> None:
    gate = hold(broker, 0)
    blocked = publish(broker, 3)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.blocking_filter", filter_mode="thread"))
        runner.add(2, trigger(other_broker))
        await wait_until(lambda: bool(_calls.get(broker.name)), timeout=10, what="filter called")
        other = publish(other_broker, 5)
        await persist_until(runner, lambda: runner.count(2) == 5, what="the other stream delivered")
        # Still blocked: the first watcher decided nothing more, and nothing of its stream moved.
        assert not gate.is_set() and runner.count(1) == 0
        assert [order for order, _ in _calls[broker.name]] == [0]
        assert runner.message_ids(2) == other
        gate.set()
        await persist_until(runner, lambda: runner.count(1) == 3, what="the blocked stream resumes")
    # In order, one at a time, off the loop's thread.
    assert runner.message_ids(1) == blocked
    assert [order for order, _ in _calls[broker.name]] == [0, 1, 2]
    assert all(thread != threading.get_ident() for _, thread in _calls[broker.name])


async def test_thread_mode_keeps_order_and_reject_message(broker: MemoryBroker) -> None:
    ids = publish(broker, 30)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.blocking_filter", filter_mode="thread"))
        runner.add(2, trigger(broker, filter_function=f"{__name__}.reject_all", filter_mode="thread"))
        await persist_until(runner, lambda: len(broker.actions) == 30, what="30 advanced")
    assert runner.message_ids(1) == ids
    assert [reason for _, reason in broker.dead_letters] == [f"{PREFIX}not for us"] * 30


async def test_a_filter_past_filter_timeout_follows_on_filter_error_and_the_watcher_goes_on(
    broker: MemoryBroker,
) -> None:
    gate = hold(broker, 1)
    ids = publish(broker, 4)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(
            1,
            trigger(
                broker,
                filter_function=f"{__name__}.blocking_filter",
                filter_mode="thread",
                filter_timeout=TIMEOUT,
                on_filter_error="reject",
            ),
        )
        await persist_until(runner, lambda: len(broker.actions) == 4, what="4 advanced")
        assert runner.alive(1)
        # The stuck call still runs in its own thread; the later messages were served by another.
        assert filtering.abandoned_filter_threads(f"{__name__}.blocking_filter") == 1
        gate.set()
    assert runner.message_ids(1) == [ids[0], ids[2], ids[3]]
    [(dead_id, reason)] = broker.dead_letters
    assert dead_id == ids[1]
    assert (
        reason.startswith(f"{PREFIX}filter raised FilterTimeoutError: filter ")
        and f"filter_timeout={TIMEOUT}s" in reason
    )
    threads = [thread for _, thread in _calls[broker.name]]
    assert threads[0] == threads[1] != threads[2] == threads[3]


async def test_a_timeout_error_raised_by_the_filter_is_not_taken_for_filter_timeout(broker: MemoryBroker) -> None:
    publish(broker, 1)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(
            1,
            trigger(
                broker,
                filter_function=f"{__name__}.timeout_raising_filter",
                filter_mode="thread",
                filter_timeout=30,
            ),
        )
        await persist_until(runner, lambda: len(broker.actions) == 1, what="advanced")
    assert [reason for _, reason in broker.dead_letters] == [
        f"{PREFIX}filter raised TimeoutError: upstream lookup timed out"
    ]


async def test_a_filter_stuck_in_too_many_threads_ends_the_watcher_and_redelivers(
    broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filtering, "MAX_ABANDONED_FILTER_THREADS", 1)
    hold(broker, 0, 1)
    ids = publish(broker, 2)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(
            1,
            trigger(
                broker,
                filter_function=f"{__name__}.blocking_filter",
                filter_mode="thread",
                filter_timeout=TIMEOUT,
                on_filter_error="skip",  # would skip a timeout; a stuck filter ends the watcher anyway
            ),
        )
        runner.add(2, trigger(broker))
        await persist_until(runner, lambda: 1 in runner.failures, what="watcher 1 failed")
        await persist_until(runner, lambda: len(broker.committed) == 2, what="both committed")
    assert isinstance(runner.failures[1], filtering.FilterStuckError)
    assert f"1 of its calls that passed filter_timeout={TIMEOUT}s are still running" in str(runner.failures[1])
    # The first timed out (skipped by watcher 1); the second was never decided by watcher 1: it
    # came back (to watcher 2 again) instead of being settled or dead-lettered.
    assert (ids[1], "redeliver") in broker.actions and (ids[0], "redeliver") not in broker.actions
    assert broker.dead_letters == []
    assert runner.message_ids(2) == [ids[0], ids[1], ids[1]]
    assert len(_calls[broker.name]) == 1, "no thread was started for the second message"


async def test_thread_mode_in_batch_mode_decides_each_message(broker: MemoryBroker) -> None:
    gate = hold(broker, 2)
    ids = publish(broker, 5)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(
            1,
            trigger(
                broker,
                filter_function=f"{__name__}.blocking_filter",
                filter_mode="thread",
                filter_timeout=TIMEOUT,
                batch_size=5,
                batch_timeout=0.05,
            ),
        )
        await persist_until(runner, lambda: len(broker.actions) == 5, what="5 advanced")
        gate.set()
    fired = [envelope["message_id"] for payload in runner.persisted[1] for envelope in payload["messages"]]
    assert fired == [ids[0], ids[1], ids[3], ids[4]]
    assert [dead for dead, _ in broker.dead_letters] == [ids[2]]


# -- options ----------------------------------------------------------------------------------------
def test_filter_mode_and_timeout_serialize_per_watcher_and_keep_the_stream_key(broker: MemoryBroker) -> None:
    threaded = trigger(broker, filter_mode="thread", filter_timeout=2.5)
    plain = trigger(broker)
    _, kwargs = threaded.serialize()
    assert kwargs["filter_mode"] == "thread" and kwargs["filter_timeout"] == 2.5
    assert "filter_mode" not in plain.serialize()[1] and "filter_timeout" not in plain.serialize()[1]
    again = MemorySharedStreamTrigger(**kwargs)
    assert (again.filter_mode, again.filter_timeout) == ("thread", 2.5)
    assert threaded.shared_stream_key() == plain.shared_stream_key() == again.shared_stream_key()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"filter_mode": "process"}, "filter_mode must be one of"),
        ({"filter_timeout": 1.0}, "filter_timeout needs filter_mode='thread'"),
        ({"filter_mode": "thread", "filter_timeout": 0}, "filter_timeout must be a number"),
    ],
)
def test_bad_filter_mode_options_are_refused_at_parse_time(
    broker: MemoryBroker, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(SharedStreamConfigError, match=message):
        trigger(broker, **options)


# -- the reason made from a filter exception ------------------------------------------------------
async def test_a_filter_exception_reason_is_bounded_and_header_safe(broker: MemoryBroker) -> None:
    publish(broker, 1)
    async with RunnerSim(SharedStreamManager()) as runner:
        runner.add(1, trigger(broker, filter_function=f"{__name__}.hostile_filter"))
        await persist_until(runner, lambda: len(broker.actions) == 1, what="advanced")
    [(_, dead_letter_reason)] = broker.dead_letters
    reason = dead_letter_reason.removeprefix(PREFIX)
    assert len(reason) <= MAX_FILTER_ERROR_CHARS
    assert reason.startswith("filter raised ValueError: bad X-Injected: yes yyy") and reason.endswith("...")
    assert not any(char in reason for char in "\r\n\x00")


@pytest.mark.parametrize(
    "text",
    ["a\rb", "a\nb", "a\x00b", "a\tb", "a\x1bb", "a\x85b", "a\u2028b", "a\u2029b", "a\ud800b", "a\uffffb"],
)
def test_every_unsafe_character_of_a_filter_exception_is_replaced(text: str) -> None:
    reason = _describe_filter_error(ValueError(text))
    assert reason == "filter raised ValueError: a b"
    reason.encode("utf-8")  # no lone surrogate left


def test_a_short_clean_reason_is_unchanged_and_a_long_one_is_cut_to_the_bound() -> None:
    assert _describe_filter_error(KeyError("customer")) == "filter raised KeyError: 'customer'"
    cut = _describe_filter_error(ValueError("z" * 100_000))
    assert len(cut) == MAX_FILTER_ERROR_CHARS and cut.endswith("zz...")
