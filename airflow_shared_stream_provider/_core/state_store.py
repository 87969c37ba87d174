"""
The asset state store as our watchers use it (Airflow 3.3's ``AssetStateStoreAccessor``): the cohort
record, watcher positions and split heartbeats all live there.

Invariant: the store is a help, never a reason to fail a watcher. Every read and write here is best
effort: an error is logged (with what it was for) and the caller gets ``None`` / ``False``; only
cancellation propagates. What a failed call costs is the caller's to document (a missing cohort
record: a shorter wait; a lost position: duplicates; a lost heartbeat: a split seen later).

In a triggerer each call is a request to the supervisor, answered in its loop: many calls go out
together (:func:`write_all`), never one after the other (10 sequential position writes took seconds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)


class StateStore(Protocol):
    """What we need of an asset's state store."""

    async def aget(self, key: str, default: Any = None) -> Any: ...

    async def aset(self, key: str, value: Any) -> None: ...


async def read_quietly(store: StateStore, key: str, what: str, *, level: int = logging.WARNING) -> Any:
    """``store[key]``, or None when absent or unreadable (logged at ``level`` as ``what``)."""
    try:
        return await store.aget(key, None)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.log(level, "Could not read %s", what, exc_info=True)
        return None


async def write_quietly(store: StateStore, key: str, value: Any, what: str) -> bool:
    """Set ``store[key] = value``; False (logged as ``what``) when the store refused."""
    try:
        await store.aset(key, value)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.warning("Could not write %s", what, exc_info=True)
        return False
    return True


async def write_all(writes: Iterable[tuple[StateStore, str, Any, str]]) -> list[bool]:
    """Several :func:`write_quietly` calls at once, ``(store, key, value, what)`` each; their results in order."""
    return list(await asyncio.gather(*(write_quietly(*write) for write in writes)))
