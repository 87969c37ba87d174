"""
The broker-fault scenario shared by every broker (tests/integration/test_broker_faults*.py).

A broker target (:class:`FaultTarget`) puts its producer's connection behind a
:class:`~tests.faultproxy.FaultProxy` and knows how to publish, what the broker holds and whether it
settled. :func:`run_fault` runs a steady stream (20 msgs/s) into the real ``SharedStreamManager``
(driven by :class:`~devkit.runner.RunnerSim`, persistence confirmed every 50 ms) with three
watchers of one stream, injects one fault mid-stream, heals, and measures:

* ``reset``: every open connection is reset at once (RST);
* ``stall``: no byte flows either way for ``seconds``, connections kept;
* ``refuse``: every connection is reset and reconnects are refused for ``seconds``;
* ``restart``: the broker itself is stopped and started again on the same port
  (:meth:`FaultTarget.restart`), keeping its data where the broker can.

The report (:class:`FaultReport`, one ``FAULT broker/fault: ...`` line) says whether delivery
resumed by itself or only after the failed watchers were re-created (the triggerer's part,
simulated), what was lost per watcher, the duplicates per watcher, whether the broker settled, and
how many connections the proxy saw. :func:`assert_one_clear_error` checks that a stream that
cannot connect fails with one error and a bounded number of connection attempts.

What the broker modules share lives here too, so that each keeps only what is its own: a
:class:`FaultTargetBase` subclass (how it publishes, what it expects, how it restarts), its
fixtures, and tests decorated with :func:`fault_variants` or :func:`long_fault_variants`. A module
imports the ``_slow_opt_in`` and ``print_fault_reports`` fixtures from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import pytest
from airflow.triggers.shared_stream import SharedStreamManager

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from devkit.runner import RunnerSim, wait_until
from tests.faultproxy import FaultProxy
from tests.slow import slow_opt_in

FAULT_SECONDS = 5.0
"""How long a stall or a refusal lasts."""
PUBLISH_INTERVAL = 0.05
"""A steady stream: one message every 50 ms (20/s)."""
BEFORE_FAULT = 1.0
"""Seconds of stream flowing before the fault (after the first deliveries)."""
AFTER_HEAL = 1.0
"""Seconds the publisher keeps going after the proxy healed."""
RECREATE_AFTER = 1.0
"""A failed trigger is re-created about one triggerer loop later."""
RESUME_TIMEOUT = 60.0
WATCHERS = 3
REGIONS = ("eu", "us", "apac")
CONNECT_WINDOW = 5.0
"""A stream that cannot connect has its connection attempts counted over at least this long."""
ERROR_TIMEOUT = 30.0
"""How long a stream that cannot connect may take to say so (SQS: botocore's jittered retries)."""
MAX_CONNECT_ATTEMPTS = 6
"""A bounded number of attempts: a hot retry loop makes hundreds in CONNECT_WINDOW."""
PUBLISH_RETRY_PAUSE = 0.2
"""A publish that failed through a fault is tried again this much later."""
LONG_FAULT_TIMEOUT = 240
"""Seconds for a long variant's test (the module default of 120 s is for the fast ones)."""

T = TypeVar("T")
TestT = TypeVar("TestT", bound=Callable[..., Any])


@dataclass(frozen=True)
class Fault:
    """One fault plan: ``kind`` applied ``repeat`` times (random gaps between), each lasting ``seconds``."""

    name: str
    kind: Literal["reset", "stall", "refuse", "restart"]
    seconds: float = 0.0
    repeat: int = 1

    def __str__(self) -> str:
        return self.name


RESTART = Fault("restart", "restart", 2.0)
"""The broker stopped, down for 2 s, started again on the same port (its data kept where it can)."""


FAULTS = (
    Fault("reset", "reset"),
    Fault("stall", "stall", FAULT_SECONDS),
    Fault("refuse", "refuse", FAULT_SECONDS),
)
"""The fast variants, run by default: one fault each, 5 s for a stall or a refusal."""
SLOW_FAULTS = (
    Fault("reset-x8", "reset", repeat=8),
    Fault("stall-45s", "stall", 45.0),
    Fault("refuse-40s", "refuse", 40.0),
)
"""
The long variants (marked ``slow``; they run when asked for with ``-m slow`` or BROKER_FAULTS_SLOW=1,
and are skipped otherwise so the default run stays short): eight resets 0.3-1.5 s apart; a stall
longer than aiokafka's request timeout (40 s), Kafka's session timeout (10 s here) and the SQS
visibility timeout (10 s here); a refusal longer than the SQS receive loop's error streak (5
failures, 1+2+4+8 s apart), so that one fails its group loudly and is re-created.
"""


_slow_opt_in = slow_opt_in("BROKER_FAULTS_SLOW", "long fault variant")


def fault_variants(test: TestT) -> TestT:
    """One test per fast fault plan (:data:`FAULTS`), given as its ``fault`` argument."""
    return pytest.mark.parametrize("fault", FAULTS, ids=str)(test)


def long_fault_variants(test: TestT) -> TestT:
    """
    One test per long fault plan (:data:`SLOW_FAULTS`), given as its ``fault`` argument: marked
    ``slow``, skipped unless asked for (the module imports ``_slow_opt_in``), with a longer timeout.
    """
    test = pytest.mark.parametrize("fault", SLOW_FAULTS, ids=str)(test)
    test = pytest.mark.timeout(LONG_FAULT_TIMEOUT)(test)
    test = pytest.mark.usefixtures("_slow_opt_in")(test)
    return pytest.mark.slow(test)


def set_connection(monkeypatch: pytest.MonkeyPatch, conn_id: str, connection: dict[str, Any]) -> str:
    """Airflow's ``AIRFLOW_CONN_<ID>`` for this test only; returns ``conn_id`` for the trigger's options."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))
    return conn_id


def order(index: int) -> bytes:
    return json.dumps({"order_id": index, "region": REGIONS[index % len(REGIONS)]}).encode()


# -- what a broker provides to the scenario -----------------------------------------------------
class FaultTarget(Protocol):
    broker: str
    proxy: FaultProxy
    publish_retries: int
    broker_forgot: int
    """Messages published before a restart of a broker that keeps no data (not expected): 0 otherwise."""

    def make_trigger(self, **kwargs: Any) -> SharedStreamTrigger: ...

    async def publish(self, index: int) -> None:
        """Publish order ``index`` (retrying through faults until the broker acknowledged it)."""

    async def expected_ids(self) -> set[str]:
        """Every message id the broker holds for this stream (each watcher must have them all)."""

    async def unsettled(self) -> int: ...

    def identity(self, payload: dict[str, Any]) -> str:
        """What identifies one message in a persisted envelope (the same ids as :meth:`expected_ids`)."""

    async def restart(self, down: float) -> None:
        """Stop the broker, wait ``down`` seconds, start it again on the same port."""

    def note(self) -> str:
        """Anything the report line should say about this run (for instance what the broker kept)."""

    async def close(self) -> None: ...


class FaultTargetBase:
    """
    A :class:`FaultTarget` less what only its broker knows (how it publishes and restarts, its
    triggers, what it holds and whether it settled): the counters the report reads, the ids the
    broker acknowledged, publishing retried through a fault, the usual message identity and the
    report's note on what a restart kept.
    """

    broker: str
    kept_on_restart = ""
    """What the report line says the broker kept through a restart (said only after one)."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.publish_retries = 0
        self.broker_forgot = 0
        self.restarts = 0
        self.sent: set[str] = set()
        """The ids of the messages the broker acknowledged, as :meth:`identity` gives them."""

    async def publish_retrying(
        self,
        send: Callable[[], Awaitable[T]],
        retry_on: tuple[type[BaseException], ...],
        *,
        before_retry: Callable[[], Awaitable[None]] | None = None,
    ) -> T:
        """
        ``send()`` until the broker acknowledges it: through a fault (or a restart) it fails with
        one of ``retry_on``, is counted in ``publish_retries``, and is tried again a moment later,
        after ``before_retry`` (dropping a client the fault broke). The scenario needs every
        message published: what is lost must be the consumer's doing.
        """
        while True:
            try:
                return await send()
            except retry_on:
                self.publish_retries += 1
                if before_retry is not None:
                    await before_retry()
                await asyncio.sleep(PUBLISH_RETRY_PAUSE)

    async def expected_ids(self) -> set[str]:
        return set(self.sent)

    def identity(self, payload: dict[str, Any]) -> str:
        return str(payload["message_id"])

    def note(self) -> str:
        return self.kept_on_restart if self.restarts else ""

    async def close(self) -> None:
        """Nothing to release unless the publisher keeps a connection open."""


@dataclass
class FaultReport:
    broker: str
    fault: str
    published: int = 0
    publish_retries: int = 0
    group_failures: list[str] = field(default_factory=list)
    recreations: int = 0
    lost: dict[int, int] = field(default_factory=dict)
    duplicates: dict[int, int] = field(default_factory=dict)
    unsettled: int = -1
    dropped: int = 0
    delivered_during_fault: int = 0
    refused_during_fault: int = 0
    resumed_after: float = -1.0
    connections: int = 0
    elapsed: float = 0.0
    note: str = ""
    duplicated: list[str] = field(default_factory=list)
    """Which messages came twice (the first watcher's, a sample), to tell where duplicates come from."""

    @property
    def outcome(self) -> str:
        if not self.group_failures:
            return "resumed by itself"
        return f"group failed loudly ({len(self.group_failures)} watcher failures), resumed after re-creation"

    def line(self) -> str:
        kinds = Counter(failure.split(": ", 2)[1] for failure in self.group_failures)
        first_error = f"{dict(kinds)}, first: {self.group_failures[0][:200]}" if self.group_failures else ""
        return (
            f"FAULT {self.broker}/{self.fault}: {self.outcome}; published {self.published} "
            f"(publisher retries {self.publish_retries}); lost {sum(self.lost.values())} {self.lost}; "
            f"duplicates {sum(self.duplicates.values())} {self.duplicates}; unsettled {self.unsettled}; "
            f"all delivered {self.resumed_after:.1f}s after heal; re-created {self.recreations}; "
            f"fault: {self.dropped} connections reset, {self.refused_during_fault} refused, "
            f"{self.delivered_during_fault} events persisted meanwhile; "
            f"proxy connections {self.connections}; {self.elapsed:.1f}s"
            + (f"; {self.note}" if self.note else "")
            + (f"; duplicated e.g. {self.duplicated[:3]}..{self.duplicated[-3:]}" if self.duplicated else "")
            + (f"; errors {first_error}" if first_error else "")
        )

    def error_types(self) -> set[str]:
        """The class names of the errors the failed watchers saw."""
        return {failure.split(": ", 2)[1] for failure in self.group_failures}


REPORTS: list[FaultReport] = []


@pytest.fixture(scope="module", autouse=True)
def print_fault_reports() -> Iterator[None]:
    """Autouse in a test module that imports it: the module's report lines again at its end."""
    yield
    if REPORTS:
        print("\nBroker faults:")
        for report in REPORTS:
            print("  " + report.line())
        REPORTS.clear()


# -- the scenario, the same for every broker ---------------------------------------------------
async def inject(target: FaultTarget, fault: Fault, rng: random.Random) -> int:
    """Apply ``fault`` (the scenario waits for its duration), then heal; return the connections reset."""
    proxy = target.proxy
    dropped = 0
    for round_ in range(fault.repeat):
        if round_:
            await asyncio.sleep(rng.uniform(0.3, 1.5))
        if fault.kind == "reset":
            dropped += proxy.drop()
        elif fault.kind == "stall":
            proxy.stall(fault.seconds)
            await asyncio.sleep(fault.seconds)
        elif fault.kind == "refuse":
            proxy.refuse(fault.seconds)
            dropped += proxy.drop()
            await asyncio.sleep(fault.seconds)
        else:
            await target.restart(fault.seconds)
    proxy.heal()
    return dropped


def watcher_triggers(target: FaultTarget) -> dict[int, Callable[[], SharedStreamTrigger]]:
    """Several watchers of one stream: two take everything, one filters (and still matches all)."""
    return {
        1: target.make_trigger,
        2: target.make_trigger,
        3: lambda: target.make_trigger(match={"body.region": list(REGIONS)}),
    }


async def run_fault(target: FaultTarget, fault: Fault) -> FaultReport:
    report = FaultReport(target.broker, fault.name)
    started = time.monotonic()
    target.proxy.heal()
    connections_before = target.proxy.accepted
    triggers = watcher_triggers(target)
    runner = RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05)
    stop_publishing = asyncio.Event()

    async def publish_steadily() -> None:
        index = 0
        while not stop_publishing.is_set():
            await target.publish(index)
            index += 1
            report.published = index
            await asyncio.sleep(PUBLISH_INTERVAL)

    failed_at: dict[int, float] = {}

    async def recreate_failed() -> None:
        """The triggerer's part: a failed trigger is created again about one loop later, for as long as it fails."""
        while True:
            now = time.monotonic()
            for trigger_id, make in triggers.items():
                if runner.alive(trigger_id) or trigger_id not in runner.failures:
                    continue
                if trigger_id not in failed_at:
                    error = runner.failures[trigger_id]
                    report.group_failures.append(f"watcher {trigger_id}: {type(error).__name__}: {error}")
                    failed_at[trigger_id] = now
                elif now - failed_at[trigger_id] >= RECREATE_AFTER:
                    del runner.failures[trigger_id], failed_at[trigger_id]
                    runner.add(trigger_id, make())
                    report.recreations += 1
            await asyncio.sleep(0.05)

    def flowing() -> bool:
        if publisher.done() and not stop_publishing.is_set():
            publisher.result()  # the publisher died: raise its error instead of waiting for the flow
            raise AssertionError("the publisher stopped by itself")
        return all(runner.count(t) >= 5 for t in triggers)

    async with runner:
        for trigger_id, make in triggers.items():
            runner.add(trigger_id, make())
        publisher = asyncio.create_task(publish_steadily(), name="fault-publisher")
        triggerer = asyncio.create_task(recreate_failed(), name="fault-triggerer")
        try:
            await wait_until(flowing, timeout=30, what="the stream to flow")
            await asyncio.sleep(BEFORE_FAULT)
            events_before = sum(runner.count(t) for t in triggers)
            refused_before = target.proxy.refused
            report.dropped = await inject(target, fault, random.Random(fault.name))
            healed = time.monotonic()
            report.delivered_during_fault = sum(runner.count(t) for t in triggers) - events_before
            report.refused_during_fault = target.proxy.refused - refused_before
            await asyncio.sleep(AFTER_HEAL)
            stop_publishing.set()
            await asyncio.wait_for(publisher, timeout=RESUME_TIMEOUT)
            expected = await target.expected_ids()
            kept = report.published - target.broker_forgot
            assert len(expected) >= kept, "the broker holds fewer messages than were acknowledged"

            def delivered(trigger_id: int) -> list[str]:
                return [target.identity(payload) for payload in runner.persisted.get(trigger_id, [])]

            def missing(trigger_id: int) -> int:
                return len(expected - set(delivered(trigger_id)))

            resume_deadline = time.monotonic() + RESUME_TIMEOUT
            while time.monotonic() < resume_deadline:
                if all(missing(t) == 0 for t in triggers) and await target.unsettled() == 0:
                    break
                await asyncio.sleep(0.25)
            report.resumed_after = time.monotonic() - healed
            report.unsettled = await target.unsettled()
            for trigger_id in triggers:
                report.lost[trigger_id] = missing(trigger_id)
                ids = delivered(trigger_id)
                counts = Counter(ids)
                report.duplicates[trigger_id] = sum(n - 1 for n in counts.values())
                if not report.duplicated:
                    report.duplicated = sorted((i for i, n in counts.items() if n > 1), key=_natural)
        finally:
            stop_publishing.set()
            for task in (publisher, triggerer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            target.proxy.heal()  # whatever failed: the test's cleanup and the next test get a passing proxy
    report.publish_retries = target.publish_retries
    report.note = target.note()
    report.connections = target.proxy.accepted - connections_before
    report.elapsed = time.monotonic() - started
    REPORTS.append(report)
    print(report.line())
    return report


def _natural(identity: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key: the numbers in an id as numbers (``"9:9" < "10:10"``), any id shape comparable."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", identity))


def assert_nothing_lost(report: FaultReport) -> None:
    assert report.published > 0
    assert sum(report.lost.values()) == 0, f"messages lost: {report.line()}"
    assert report.unsettled == 0, f"the broker did not settle: {report.line()}"


async def assert_fault_loses_nothing(target: FaultTarget, fault: Fault) -> FaultReport:
    """
    The property every broker's fault test checks (:func:`run_fault`, then :func:`assert_nothing_lost`);
    the report, for the checks of the broker's own.
    """
    report = await run_fault(target, fault)
    assert_nothing_lost(report)
    return report


@contextlib.contextmanager
def unreachable(port: int) -> Iterator[FaultProxy]:
    """An endpoint that is down: a proxy (to ``port``) refusing every connection, counting the attempts."""
    with FaultProxy(port) as dead:
        dead.refuse(float("inf"))
        yield dead


async def assert_one_clear_error(
    name: str,
    proxy: FaultProxy,
    make_trigger: Callable[[], SharedStreamTrigger],
    *,
    mentions: tuple[str, ...],
    error_type: type[BaseException] | None = None,
    error_timeout: float = ERROR_TIMEOUT,
    max_attempts: int = MAX_CONNECT_ATTEMPTS,
) -> None:
    """
    Watchers of a stream that cannot connect all fail with one error, within ERROR_TIMEOUT; the
    connection attempts, counted until then and for at least CONNECT_WINDOW, stay bounded. Prints
    the ``FAULT <name>: ...`` line (attempts, seconds until the error, the error).
    """
    before = proxy.accepted
    started = time.monotonic()
    watchers = range(1, WATCHERS + 1)
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        for trigger_id in watchers:
            runner.add(trigger_id, make_trigger())
        with contextlib.suppress(TimeoutError):
            await wait_until(lambda: not any(runner.alive(t) for t in watchers), timeout=error_timeout)
        failed_after = time.monotonic() - started
        await asyncio.sleep(max(0.0, CONNECT_WINDOW - failed_after))  # and nothing retries after the error
        attempts = proxy.accepted - before
        errors = {f"{type(e).__name__}: {e}" for e in runner.failures.values()}
        types = {type(e) for e in runner.failures.values()}
        alive = [t for t in watchers if runner.alive(t)]
    assert not alive, f"watchers {alive} still waiting after {error_timeout}s ({attempts} attempts): no error surfaced"
    assert len(runner.failures) == WATCHERS
    assert len(errors) == 1, f"expected one error for the group, got {errors}"
    error = errors.pop()
    if error_type is not None:
        assert types == {error_type}, f"expected a {error_type.__name__}, got {error}"
    for text in mentions:
        assert text in error, f"the error does not say {text!r}: {error}"
    assert 1 <= attempts <= max_attempts, f"{attempts} connection attempts in {failed_after:.1f}s"
    print(f"FAULT {name}: one error after {failed_after:.1f}s and {attempts} connection attempt(s): {error}")
