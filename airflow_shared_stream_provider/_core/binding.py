"""
Did the runner bind the event a watcher just handed over? (Airflow 3.3's manager internals, read-only.)

Why a watcher needs to know: the manager resolves a watcher's raw event as *accepted* when the
watcher moves past it with no unconfirmed persist seq bound to it, and the producer then settles
the message. A seq is bound by the runner right after it takes the event
(``manager.bind_pending_event``), which returns ``None``, binding nothing, once the group is no
longer in the manager's map. ``SharedStreamManager.stop_all()`` (the runner's shutdown, Airflow
3.3.2) clears that map first and then stops the groups one after the other; a group still waiting
for its turn keeps polling and its watchers keep firing events that bind to nothing and are never
persisted (the runner no longer syncs with the supervisor). Measured in the soak: SQS, Pub/Sub and
Service Bus settled the messages fired during a graceful stop, which were lost
(docs/reliability.md, "Soak"). The watcher therefore keeps its ``UNRECORDED`` mark on a message
whose event did not bind, and the producer redelivers it: at worst a duplicate.

Everything here reads private state of ``airflow.triggers.shared_stream`` (the reject context the
manager sets while a raw event is in a watcher's hands, the outstanding entry and its binding).
Those parts are listed and checked in :mod:`.airflow_internals`; a stream does not start without
them (the producer's ``open_stream`` checks first, and a watcher holds a raw event only after
that), so nothing here falls back: a part missing here would be a bug of that check, and raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The module, not its private names: importing this file (Dag parsing imports the trigger modules)
# must not fail on another Airflow; the check at stream start is the one place that reports it.
from airflow.triggers import shared_stream as _shared_stream

if TYPE_CHECKING:
    from airflow.triggers.shared_stream import _RejectContext


def current_window() -> _RejectContext | None:
    """
    The manager's binding window of the raw event this watcher holds now; None outside one (the
    filter driven without a manager, as some unit tests do).
    """
    return _shared_stream._reject_context.get()


def was_bound(window: _RejectContext | None) -> bool:
    """
    After the runner took the event yielded in ``window`` (it asks for the next item only after
    binding): True if a persist seq is bound to it, or if there is nothing left to protect (the
    watcher's share of the raw event already resolved, or no manager window at all); False only
    when the binding is there, open, and empty: the manager would take the event as persisted.
    """
    if window is None:
        return True  # no manager window: no ack accounting the event could escape
    entry = window.group._outstanding.get(window.event_id)
    if entry is None:
        return True  # no longer outstanding (advanced, or its group stopped): nothing left to protect
    binding = entry.bindings.get(window.trigger_id)
    if binding is None:
        return True  # resolved already (failed or rejected): the mark changes nothing
    return bool(binding.unconfirmed_seqs)
