"""The shared lease keeper, on a fake clock."""

from __future__ import annotations

from collections.abc import Sequence

from airflow_shared_stream_provider._core.lease import LeaseKeeper


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_leases_are_renewed_in_batches_before_they_expire_and_stop_at_max_hold() -> None:
    clock = Clock()
    calls: list[tuple[list[str], float]] = []

    async def renew(handles: Sequence[str], seconds: float) -> Sequence[str]:
        calls.append((list(handles), seconds))
        return ["lost"] if "lost" in handles else []

    keeper = LeaseKeeper(renew=renew, lease_seconds=30, renew_margin=10, max_hold=65, batch_size=2, now=clock)
    for handle in ("a", "b", "c", "lost"):
        keeper.track(handle)
    assert await keeper.renew_due(clock.now + 5) == 0  # nothing due yet
    clock.now += 21
    assert await keeper.renew_due(clock.now) == 3
    assert [len(handles) for handles, _ in calls] == [2, 2]
    assert keeper.lost == {"lost"} and len(keeper) == 3
    keeper.release("b")
    clock.now += 21
    assert await keeper.renew_due(clock.now) == 2
    clock.now += 30  # 72 s after tracking: past max_hold, the manager has failed them by now
    assert await keeper.renew_due(clock.now) == 0
    assert len(keeper) == 0
