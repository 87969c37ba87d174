"""Best-effort state-store calls: errors are logged and reported, cancellation propagates, writes overlap."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from airflow_shared_stream_provider._core.state_store import read_quietly, write_all, write_quietly


class SlowStore:
    """A store whose calls take ``delay`` seconds (like a request answered in the supervisor's loop)."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.data: dict[str, Any] = {}
        self.active = 0
        self.most_active = 0

    async def aget(self, key: str, default: Any = None) -> Any:
        await self._call()
        return self.data.get(key, default)

    async def aset(self, key: str, value: Any) -> None:
        await self._call()
        self.data[key] = value

    async def _call(self) -> None:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise RuntimeError("supervisor said no")
        finally:
            self.active -= 1


def test_a_failing_store_is_logged_and_reported_never_raised(caplog: pytest.LogCaptureFixture) -> None:
    store = SlowStore(fail=True)
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(write_quietly(store, "k", 1, "the thing of watcher w")) is False
        assert asyncio.run(read_quietly(store, "k", "the other thing")) is None
    assert "Could not write the thing of watcher w" in caplog.text
    assert "Could not read the other thing" in caplog.text


def test_a_working_store_round_trips() -> None:
    store = SlowStore()

    async def main() -> Any:
        assert await write_quietly(store, "k", {"v": 1}, "x")
        return await read_quietly(store, "k", "x")

    assert asyncio.run(main()) == {"v": 1}


def test_cancellation_propagates() -> None:
    store = SlowStore(delay=10)

    async def main() -> None:
        task = asyncio.ensure_future(write_quietly(store, "k", 1, "x"))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_write_all_sends_the_writes_together_and_reports_each() -> None:
    good, bad = SlowStore(delay=0.05), SlowStore(delay=0.05, fail=True)
    writes = [(good, f"k{i}", i, f"write {i}") for i in range(20)] + [(bad, "k", 0, "bad write")]
    results = asyncio.run(write_all(writes))
    assert results == [True] * 20 + [False]
    assert good.most_active == 20  # all at once, not one after the other
    assert good.data == {f"k{i}": i for i in range(20)}
