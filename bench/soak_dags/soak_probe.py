"""
The soak's probe trigger (``bench/soak.py``): it runs inside the triggerer's event loop and reports
what only that loop can see.

A plain ``BaseEventTrigger`` (no shared stream) behind an ``AssetWatcher`` of its own asset: it
never fires. Every ``interval`` seconds it appends one JSON line to ``path``::

    {"t": <epoch s>, "pid": <trigger runner pid>, "tasks": len(asyncio.all_tasks()), "top": {...}}

``top`` counts the loop's tasks by coroutine name (the ten most common), so a growing count says
what grows. The module imports nothing of the benchmark (no side effects in the triggerer): the
soak puts this folder on the triggerer's ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent


def _task_name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    name = getattr(coro, "__qualname__", None) or type(coro).__name__
    return str(name)


def loop_snapshot() -> dict[str, Any]:
    tasks = asyncio.all_tasks()
    top = Counter(_task_name(task) for task in tasks).most_common(10)
    return {"t": round(time.time(), 3), "pid": os.getpid(), "tasks": len(tasks), "top": dict(top)}


def _append(path: str, line: str) -> None:
    # One ~300-byte local write every 10 s, on the loop: cheaper than a thread hop, and a hop
    # would be one more thing in flight when the tasks are counted.
    with open(path, "a", encoding="utf-8") as out:
        out.write(line)


class LoopProbeTrigger(BaseEventTrigger):
    """Appends the event loop's task count to ``path`` every ``interval`` s; never fires."""

    def __init__(self, *, path: str, interval: float = 10.0) -> None:
        super().__init__()
        self.path = path
        self.interval = interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"path": self.path, "interval": self.interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            _append(self.path, json.dumps(loop_snapshot(), separators=(",", ":")) + "\n")
            await asyncio.sleep(self.interval)
        yield TriggerEvent({})  # pragma: no cover - never reached: an async generator that never fires
