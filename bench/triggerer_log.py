"""
What the triggerers' logs say each watcher fired: the evidence for a paused watcher's misses.

Airflow 3.3.2 names a trigger only by its id in its log lines (``Trigger fired event ...
name='ID 21' result="TriggerEvent<sqs message '...'>"``); our trigger logs which watcher runs as
which trigger id when it joins its stream (``Watcher sqs_orders_eu#... runs as trigger 21 on a
sqs shared stream``). Together they say which messages a watcher *fired*, and when. A message
that a watcher fired but that has no asset event for it was dropped by Airflow after the fire,
not by the stream: that is finding 11 of docs/production.md (a paused Dag's trigger row deleted
while its watcher still runs, its events "persisted" for no asset).

Only single-message events name their message; a batch event names its first and last only, so
batch mode gives no evidence here (the bench's other rules still apply).

The logs grow for the whole run and the drain polls the checks every 10 s: :class:`TriggererLogs`
reads each file from where it stopped.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Final

# "Watcher sqs_orders_eu#0f3a... runs as trigger 21 on a sqs shared stream" (_core/trigger.py)
_JOIN = re.compile(r"Watcher (?P<watcher>[^\s#]+)#\S* runs as trigger (?P<trigger>\d+) on a")
# 2026-11-28T05:54:22.160648Z [info ] Trigger fired event [...] ... name='ID 4'
#   result="TriggerEvent<kafka message 'orders/0/0'>" (_core/events.py's repr)
_FIRED = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z) .*Trigger fired event.*"
    r"name='ID (?P<trigger>\d+)' result=\"TriggerEvent<\w+ message '(?P<message>[^']*)'>\""
)


def _epoch(stamp: str) -> float:
    """``2026-11-28T05:54:22.160648Z`` as epoch seconds (by hand: 3.10's ``fromisoformat`` takes no ``Z``)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


# Lines that tell a stream's story (its watchers joining and leaving, placements and rewinds, what
# failed): what a failed run prints, so a loss seen once (in CI, say) comes with its evidence.
_STORY_MARKS: Final = (
    "runs as trigger",
    "comes back as trigger",
    "leaves the stream",
    "placed",
    "formed with",
    "cancelled by user action",
    "Ack timeout",
    "overflowed",
    "poll failed",
    "[error",
)
STORY_LINES: Final = 400
_STRUCTLOG_TAIL = re.compile(r" dag_id=None .*$")


@dataclass
class TriggererLogs:
    """The triggerers' process logs under ``directory`` (``triggerer*.log``), read incrementally."""

    directory: Path
    watcher_of: dict[int, str] = field(default_factory=dict)
    # The last STORY_LINES lines with a _STORY_MARKS mark, "<file>: <line>" (see story()).
    _story: deque[str] = field(default_factory=lambda: deque(maxlen=STORY_LINES))
    # trigger id -> message id -> first time (epoch) it fired an event for it
    _fired_by_trigger: dict[int, dict[str, float]] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def refresh(self) -> None:
        """Read what the logs gained since the last call (whole lines only)."""
        for path in sorted(self.directory.glob("triggerer*.log")):
            start = self._offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = start + end
            for line in data[:end].decode("utf-8", "replace").splitlines():
                self._read(line)
                if any(mark in line for mark in _STORY_MARKS):
                    self._story.append(f"{path.stem}: {_STRUCTLOG_TAIL.sub('', line)[:600]}")

    def story(self) -> list[str]:
        """The stream's story so far (the last STORY_LINES marked lines, in the order read)."""
        self.refresh()
        return list(self._story)

    def _read(self, line: str) -> None:
        if "runs as trigger" in line:
            joined = _JOIN.search(line)
            if joined:
                self.watcher_of[int(joined["trigger"])] = joined["watcher"]
        elif "Trigger fired event" in line:
            fired = _FIRED.search(line)
            if fired:
                messages = self._fired_by_trigger.setdefault(int(fired["trigger"]), {})
                messages.setdefault(fired["message"], _epoch(fired["at"]))

    def fired(self, watcher: str, *, replaced_triggers_only: bool = False) -> dict[str, float]:
        """
        ``message id -> first fire time`` of every single-message event ``watcher`` fired, under
        any of its trigger ids, or (``replaced_triggers_only``) under those it no longer runs as:
        a trigger id comes once (Airflow never reuses one), so every id but the newest belonged to
        a trigger row that was deleted while the watcher ran under it, as a paused Dag's is.
        Events of the newest id were fired by a trigger Airflow still references.
        """
        mine = sorted(trigger for trigger, name in self.watcher_of.items() if name == watcher)
        if replaced_triggers_only:
            mine = mine[:-1]
        out: dict[str, float] = {}
        for trigger in mine:
            for message, at in self._fired_by_trigger.get(trigger, {}).items():
                out[message] = min(at, out.get(message, at))
        return out
