"""
What a blocking ``filter_function`` on one stream does to another stream in the same triggerer.

Two in-memory streams on the real ``SharedStreamManager`` (driven by ``devkit.runner.RunnerSim``
with the runner's per-event executor hop and persistence every 50 ms), one event loop, as in one
triggerer process:

* stream **A**: one watcher whose ``filter_function`` (:func:`slow_filter`) blocks for
  ``--block`` seconds (default 5, ``time.sleep``: a synchronous HTTP call, a lock, a slow disk)
  on A's first message, and returns at once for the others (one every 100 ms after it);
* stream **B**: one watcher, no filter, fed at ``--rate`` messages per second (default 100) for
  ``--seconds`` (default 8).

A message's **latency** is the time from when it was due (its scheduled publish time) to when its
watcher fires (``make_event``). A publisher on a frozen loop publishes late, so the lateness
counts: it stands for a broker that received the message on time and a consumer that could not
look at it. Cases: ``baseline`` (nothing blocks: the noise floor of this machine), ``loop`` (the
default ``filter_mode``: the filter runs on the event loop),
``thread`` (``filter_mode="thread"``) and ``thread+timeout`` (``filter_timeout=1``,
``on_filter_error="skip"``).

    .venv/bin/python -m bench.filter_isolation_bench                # all four cases (~40 s)
    .venv/bin/python -m bench.filter_isolation_bench --cases thread --json /tmp/filters.json

Prints p50 / p95 / max of B's latency (the isolation goal: under 100 ms with the filter thread)
and of A's other messages (a watcher keeps its order: behind the blocked message they wait,
until the filter returns or its timeout passes). docs/filters.md has the measured numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow.triggers.base import TriggerEvent
from airflow.triggers.shared_stream import SharedStreamManager

from bench.common import machine_info, markdown_table
from devkit.memory import MemorySharedStreamTrigger, brokers, memory_broker
from devkit.runner import RunnerSim, wait_until

CASES: dict[str, dict[str, Any]] = {
    "baseline": {},  # the same load with nothing blocking: the machine's noise floor
    "loop": {},
    "thread": {"filter_mode": "thread"},
    "thread+timeout": {"filter_mode": "thread", "filter_timeout": 1.0, "on_filter_error": "skip"},
}
# The dotted path the triggerer imports: the module under its package name, not ``__main__``.
SLOW_FILTER = "bench.filter_isolation_bench.slow_filter"
_runs = itertools.count()


def slow_filter(envelope: Mapping[str, Any]) -> bool:
    """Blocks for ``body.block_seconds`` (0 for most messages); stateless, so any import works."""
    seconds = envelope["body"].get("block_seconds", 0)
    if seconds:
        time.sleep(seconds)
    return True


# Fire times, by message id: filled by the watchers of this process (module global: the triggers
# below are instances of this module's class, whichever name the module runs under).
_fired: dict[str, float] = {}


class TimedTrigger(MemorySharedStreamTrigger):
    """Records when it fires for each message (the watcher's decision, before the runner's hop)."""

    def make_event(self, envelope: dict[str, Any]) -> TriggerEvent:
        _fired[envelope["message_id"]] = time.perf_counter()
        return super().make_event(envelope)


@dataclass
class CaseResult:
    case: str
    other_stream_ms: dict[str, float]
    blocked_stream_ms: dict[str, float]
    # When B's slowest message was due, in seconds after A's blocked message was due.
    other_max_at_s: float
    other_messages: int
    blocked_stream_messages: int
    wall_seconds: float
    notes: list[str] = field(default_factory=list)


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    if not ordered:
        return {"p50": float("nan"), "p95": float("nan"), "max": float("nan")}

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000

    return {"p50": pick(0.50), "p95": pick(0.95), "max": ordered[-1] * 1000}


async def _publish_on_schedule(
    name: str, start: float, count: int, interval: float, body: Callable[[int], dict[str, Any]]
) -> dict[str, float]:
    """Publish message ``i`` at ``start + i * interval`` (late if the loop was busy); id -> due time."""
    broker = memory_broker(name)
    due: dict[str, float] = {}
    for index in range(count):
        when = start + index * interval
        delay = when - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        due[broker.publish(json.dumps({"index": index, **body(index)}))] = when
    return due


async def run_case(case: str, *, block: float, rate: float, seconds: float) -> CaseResult:
    run = next(_runs)
    name_a, name_b = f"filters-a-{case}-{run}", f"filters-b-{case}-{run}"
    memory_broker(name_a), memory_broker(name_b)
    _fired.clear()
    other_count = int(rate * seconds)
    blocked_count = int(seconds / 0.1)
    wall = time.perf_counter()
    try:
        async with RunnerSim(SharedStreamManager(), executor_hop=True, confirm_interval=0.05) as runner:
            runner.add(1, TimedTrigger(broker_name=name_a, filter_function=SLOW_FILTER, **CASES[case]))
            runner.add(2, TimedTrigger(broker_name=name_b))
            start = time.perf_counter() + 0.5
            due_b, due_a = await asyncio.gather(
                _publish_on_schedule(name_b, start, other_count, 1 / rate, lambda index: {"stream": "b"}),
                _publish_on_schedule(
                    name_a,
                    start + 0.5,
                    blocked_count,
                    0.1,
                    lambda index: {"stream": "a", "block_seconds": block if index == 0 and case != "baseline" else 0},
                ),
            )
            # A's first message is the blocked one (never fired with thread+timeout: skipped).
            blocked_id = next(iter(due_a))
            behind = {message_id: when for message_id, when in due_a.items() if message_id != blocked_id}
            await wait_until(
                lambda: all(message_id in _fired for message_id in (*due_b, *behind)),
                timeout=block + seconds + 30,
                what="every message fired",
            )
            notes = [f"{type(exc).__name__}: {exc}" for exc in runner.failures.values()]
    finally:
        brokers.pop(name_a, None)
        brokers.pop(name_b, None)
    other = [_fired[m] - when for m, when in due_b.items()]
    slowest = max(due_b, key=lambda m: _fired[m] - due_b[m])
    blocked = [_fired[m] - when for m, when in behind.items()]
    return CaseResult(
        case=case,
        other_stream_ms=_summary(other),
        blocked_stream_ms=_summary(blocked),
        other_max_at_s=round(due_b[slowest] - due_a[blocked_id], 3),
        other_messages=len(other),
        blocked_stream_messages=len(blocked),
        wall_seconds=round(time.perf_counter() - wall, 2),
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--block", type=float, default=5.0, help="seconds the filter blocks on A's first message")
    parser.add_argument("--rate", type=float, default=100.0, help="stream B messages per second")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long stream B is fed")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    results = [asyncio.run(run_case(case, block=args.block, rate=args.rate, seconds=args.seconds)) for case in cases]

    def ms(value: float) -> str:
        return f"{value:.1f}" if value == value else "-"

    rows = [
        [
            r.case,
            ms(r.other_stream_ms["p50"]),
            ms(r.other_stream_ms["p95"]),
            ms(r.other_stream_ms["max"]),
            f"{r.other_max_at_s:+.2f}",
            ms(r.blocked_stream_ms["p50"]),
            ms(r.blocked_stream_ms["max"]),
        ]
        for r in results
    ]
    print(
        f"A filter blocking {args.block:g} s on one message of stream A; stream B at {args.rate:g} msg/s "
        f"for {args.seconds:g} s (latency = due -> watcher fires, ms)"
    )
    print(
        markdown_table(
            ["case", "B p50", "B p95", "B max", "B max due at (s)", "A others p50", "A others max"],
            rows,
        )
    )
    for r in results:
        for note in r.notes:
            print(f"{r.case}: {note}")
    if args.json is not None:
        payload = {
            "args": vars(args) | {"json": str(args.json)},
            "machine": machine_info(),
            "results": [r.__dict__ for r in results],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
