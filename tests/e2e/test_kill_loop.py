"""
Kill loops: ``kill -9`` of a real triggerer, again and again, while a steady stream flows.

Per broker: a real Airflow (``devkit.airflow_env.AirflowEnv``, SQLite, Airflow's default
``[triggerer]`` settings) runs five watchers on ONE shared stream (``dags/e2e_kill_loop_watchers.py``;
each has its own ``match`` and every message matches all five). A publisher thread sends orders
at a steady rate the whole time. The test kills the triggerer's process group with SIGKILL at
random points (seeded RNG): each kill comes 1-6 s after the restarted stream delivered something to
every watcher, so every kill hits a stream that is running and has received, but not necessarily
settled, messages. Then it stops publishing and waits until every watcher has every message id.

Asserted: lost == 0 for every watcher; no watcher got a message id that was never published.
Reported (one ``KILLLOOP`` line per broker): messages, kills, duplicates (asset events beyond the
first for one (watcher, message) pair), duplicates per kill, and the duration (publisher start to
every watcher complete); per kill how long the watchers were without delivery; whether the broker
ended settled (nothing left uncommitted / undeleted / unacked / uncompleted; duplicates are counted
after that, so late redeliveries of a killed triggerer's leases are included). A duplicate is
counted for the kill after which it was stored (a redelivery that outlasts the next kill, e.g.
after an SQS visibility timeout, counts for the later one).

Brokers (``loop_brokers.py``): Kafka (Tansu), SQS (moto server), Pub/Sub (Google's emulator),
Service Bus (the wire-level test broker of ``tests/servicebus_broker``, in this process; the
triggerer reaches it over loopback TCP with an emulator connection string).

The scheduler is killed once the watchers run: the test counts asset events, which the triggerer
writes; no Dag run is needed, and two cores are better spent on the triggerer.

``test_kill_loop_kafka_fast`` (3 kills on Kafka, about 2 minutes) and the long ones
(``test_kill_loop_20_kills[<broker>]``, 20 kills per broker) are marked ``slow`` and run only with
``-m slow`` or ``KILL_LOOP_SLOW=1`` (CI's time budget: its Kafka triggerer kills are in
``test_kafka_e2e.py``, ``test_two_triggerers_e2e.py`` and ``test_production.py``).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest

from airflow_shared_stream_provider.brokers import harness_names
from devkit.airflow_env import AirflowEnv
from devkit.demo import build_dags_folder, make_order
from devkit.demo_types import OrderMessage
from tests.e2e.loop_brokers import CONN_ID, Deliveries, LoopBroker, dag_env, loop_broker
from tests.slow import slow_opt_in

# ``starved_cpus``: STARVE_CPUS=N runs N CPU burners for the whole module (tests/e2e/conftest.py).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("starved_cpus")]

E2E_DAGS = Path(__file__).parent / "dags"
DAG_FILE = E2E_DAGS / "e2e_kill_loop_watchers.py"
DAG_ID = "kill_loop_consumer"
WATCHER_COUNT = 5
WATCHERS = tuple(f"kill_loop_w{index}" for index in range(WATCHER_COUNT))
RATE = 5.0  # messages per second, the whole time (x5 watchers = 25 asset events/s on SQLite)
SEED = 20261125
AT = datetime(2026, 11, 25, tzinfo=timezone.utc)


# -- the loop ---------------------------------------------------------------------------------------
class Publisher(threading.Thread):
    def __init__(self, broker: LoopBroker, messages: Sequence[OrderMessage], rate: float) -> None:
        super().__init__(name=f"kill-loop-publisher-{broker.name}", daemon=True)
        self.broker = broker
        self.messages = messages
        self.rate = rate
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.broker.publish(self.messages, rate=self.rate, stop=self.stop_event)
        except BaseException as exc:
            self.error = exc

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the {self.broker.name} publisher failed: {self.error!r}") from self.error
        if not self.is_alive() and not self.stop_event.is_set():
            raise AssertionError(f"the {self.broker.name} publisher ran out of messages: the stream was not steady")

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=120)
        assert not self.is_alive(), "the publisher did not stop"
        if self.error is not None:
            raise AssertionError(f"the {self.broker.name} publisher failed: {self.error!r}") from self.error


@dataclass
class Kill:
    at: float  # seconds since the stream started
    last_event_before: int  # the last asset event id stored before the kill
    reassigned_after: float = 0.0  # every watcher assigned to the new triggerer
    restored_after: float = 0.0  # every watcher delivered again
    duplicates: int = 0


@dataclass
class KillLoopResult:
    broker: str
    messages: int
    kills: list[Kill]
    lost: dict[str, int]
    duplicates: int
    seconds: float
    unknown_ids: int

    def line(self) -> str:
        lost = sum(self.lost.values())
        per_kill = self.duplicates / len(self.kills) if self.kills else 0.0
        return (
            f"KILLLOOP {self.broker}: messages={self.messages} kills={len(self.kills)} lost={lost} "
            f"dup={self.duplicates} dup/kill={per_kill:.1f} seconds={self.seconds:.0f}"
        )


def kill_loop_airflow(broker: LoopBroker, tmp_path_factory: pytest.TempPathFactory) -> AirflowEnv:
    dags = build_dags_folder(tmp_path_factory.mktemp(f"kill-loop-dags-{broker.name}"), files=(), extra=[DAG_FILE])
    return AirflowEnv(
        dags,
        connections={CONN_ID: json.dumps(broker.connection())},
        env=dag_env(broker, WATCHER_COUNT),
        home=tmp_path_factory.mktemp(f"kill-loop-airflow-home-{broker.name}"),
        parallelism=2,
    )  # [triggerer] left at Airflow's defaults (devkit only shortens heartbeats / the health check)


def run_kill_loop(
    broker_name: str, kills: int, tmp_path_factory: pytest.TempPathFactory, *, rate: float = RATE, seed: int = SEED
) -> KillLoopResult:
    rng = random.Random(f"{seed}-{broker_name}")
    # Enough orders for the slowest loop we allow (about 90 s per kill), all matching every watcher.
    count = int(rate * (300 + 90 * kills))
    messages = [make_order(f"kl{index:07d}", "eu", 10.0 + index % 7, AT) for index in range(count)]
    with loop_broker(broker_name) as broker, kill_loop_airflow(broker, tmp_path_factory) as env:
        env.wait_for_dags([DAG_ID])
        env.unpause([DAG_ID])
        env.wait_for_watchers(WATCHERS, timeout=300)
        env.kill("scheduler")  # not needed to count asset events (see the module doc)
        deliveries = Deliveries(env, WATCHERS)
        publisher = Publisher(broker, messages, rate)
        started = time.monotonic()
        publisher.start()
        done: list[Kill] = []
        try:
            env.wait_until(
                lambda: deliveries.refresh().all_newer_than(0),
                timeout=300,
                what="the first message at every watcher",
                interval=0.5,
            )
            for number in range(1, kills + 1):
                time.sleep(rng.uniform(1.0, 6.0))  # a random point of the running stream
                publisher.check()
                previous_job = env.latest_triggerer_job_id()
                env.kill("triggerer")
                killed_at = time.monotonic()
                kill = Kill(at=killed_at - started, last_event_before=deliveries.refresh().last_event_id)
                env.components["triggerer"].start()
                env.wait_for_watchers(WATCHERS, newer_than_job=previous_job, timeout=300)
                kill.reassigned_after = time.monotonic() - killed_at
                env.wait_until(
                    lambda mark=kill.last_event_before: deliveries.refresh().all_newer_than(mark),  # type: ignore[misc]
                    timeout=300,
                    what=f"every watcher to deliver again after kill #{number}",
                    interval=0.5,
                )
                kill.restored_after = time.monotonic() - killed_at
                done.append(kill)
                print(
                    f"\nKILLLOOP {broker_name} kill #{number} at {kill.at:.0f}s: watchers re-assigned after "
                    f"{kill.reassigned_after:.1f}s, delivering again after {kill.restored_after:.1f}s",
                    flush=True,
                )
            publisher.check()
        finally:
            publisher.finish()
        published = broker.published_ids()
        assert len(set(published)) == len(published), "a broker gave two messages one id"

        def complete() -> bool:
            return not deliveries.refresh().missing(published)

        try:
            env.wait_until(complete, timeout=600, what="every watcher to have every message", interval=2.0)
        except Exception as exc:
            lost = deliveries.refresh().missing(published)
            result = summarize(broker_name, published, done, deliveries, lost, time.monotonic() - started)
            print(f"\n{result.line()}\nlost per watcher: {lost}\nbroker: {broker.diagnostics()}", flush=True)
            raise AssertionError(f"{result.line()}; lost per watcher: {lost}") from exc
        seconds = time.monotonic() - started
        # Redeliveries of what a killed triggerer held (an SQS visibility timeout, a Service Bus
        # lock, a Pub/Sub ack deadline) may come after "complete": count duplicates once the
        # broker holds nothing unsettled for the stream.
        settled_after = wait_settled(broker, timeout=180.0)
        result = summarize(broker_name, published, done, deliveries.refresh(), {}, seconds)
        triggerer_log = env.components["triggerer"].log_text()
        formed = len(re.findall(r"formed with \d+ watcher", triggerer_log))
        print(
            f"\n{result.line()}\n"
            f"KILLLOOP {broker_name} duplicates per kill: {[k.duplicates for k in done]}\n"
            f"KILLLOOP {broker_name} seconds without delivery per kill: {[round(k.restored_after) for k in done]}\n"
            f"KILLLOOP {broker_name} broker: "
            + (f"settled {settled_after:.0f}s after complete" if settled_after is not None else "NOT settled")
            + f" ({broker.diagnostics()}); stream formed {formed} time(s); "
            f"'Traceback' in the triggerer log: {triggerer_log.count('Traceback')}",
            flush=True,
        )
        return result


def wait_settled(broker: LoopBroker, *, timeout: float) -> float | None:
    """Seconds until the broker holds nothing unsettled for the stream, or None after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if broker.unsettled() == 0:
            return time.monotonic() - started
        time.sleep(3.0)
    return None


def summarize(
    broker: str,
    published: Sequence[str],
    kills: list[Kill],
    deliveries: Deliveries,
    lost: dict[str, int],
    seconds: float,
) -> KillLoopResult:
    mine = set(published)
    duplicates = sum(n - 1 for (_, message_id), n in deliveries.counts.items() if message_id in mine and n > 1)
    for index, kill in enumerate(kills):
        upper = kills[index + 1].last_event_before if index + 1 < len(kills) else float("inf")
        kill.duplicates = sum(1 for e in deliveries.duplicate_event_ids if kill.last_event_before < e <= upper)
    unknown = {message_id for _, message_id in deliveries.counts} - mine
    return KillLoopResult(broker, len(published), kills, lost, duplicates, seconds, len(unknown))


def check(result: KillLoopResult, kills: int) -> None:
    assert len(result.kills) == kills
    assert result.messages >= 20 * kills, result.line()  # a steady stream, not one burst
    assert not result.lost, f"{result.line()}; lost per watcher: {result.lost}"
    assert result.unknown_ids == 0, f"{result.unknown_ids} delivered message id(s) were never published"
    # Every kill hit a stream that had delivered to every watcher since the restart before it.
    assert all(k.restored_after > 0 for k in result.kills)


# -- the tests --------------------------------------------------------------------------------------
_slow_opt_in = slow_opt_in("KILL_LOOP_SLOW", "kill loop")


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
@pytest.mark.timeout(900)
def test_kill_loop_kafka_fast(tmp_path_factory: pytest.TempPathFactory) -> None:
    """
    3 kills of the triggerer during a steady Kafka stream, 5 watchers (about 2 minutes). Behind the
    slow opt-in for CI's time budget: CI's triggerer kills on Kafka are test_kafka_e2e's kill -9 at
    random points, the two-triggerer hand-over and the production chaos run.
    """
    result = run_kill_loop("kafka", 3, tmp_path_factory)
    check(result, 3)


@pytest.mark.slow
@pytest.mark.usefixtures("_slow_opt_in")
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    # Every registry broker with a kill-loop harness, marked with its name (as its integration suite).
    "broker",
    [pytest.param(name, marks=getattr(pytest.mark, name)) for name in harness_names("kill_loop")],
)
def test_kill_loop_20_kills(broker: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """20 kills of the triggerer per broker during a steady stream, 5 watchers."""
    kills = int(os.environ.get("KILL_LOOP_KILLS", "20"))
    result = run_kill_loop(broker, kills, tmp_path_factory)
    check(result, kills)
