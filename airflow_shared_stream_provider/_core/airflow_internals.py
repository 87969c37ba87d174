"""
The private parts of Airflow the provider relies on, listed and checked once per process.

Why. Two guarantees of the provider read Airflow state that no public API offers (Airflow 3.3.2):
the graceful-stop check of :mod:`.binding` (was the event a watcher just handed over bound to a
persist seq?) and the cohort, watcher positions and split heartbeats, which need every asset a
watcher's ``asset_state_store`` holds (:func:`.cohort.stores_of`) and the state store of assets
other than the watcher's own (:func:`.split.airflow_accessor`). A private name can vanish or be
renamed in any Airflow release; code that then fell back quietly would lose messages at the next
graceful stop, or forget a cohort, without a word.

Invariant: the use sites assume every part in :data:`INTERNALS` exists, and nothing reaches them
before :func:`require_airflow_internals` passed in this process. The producer calls it first thing
in ``open_stream`` (no raw event, hence no binding window, exists before that) and
:func:`.cohort.stores_of` before it reads a watcher's accessors (a watcher reads them when it
subscribes, before its group's producer opens). If a part is missing, the stream refuses to run
with one :class:`~.errors.AirflowInternalsError` naming the Airflow version and every missing part.

The checks look at names: a module attribute, a dataclass or NamedTuple field, the attribute names
a method's code uses, the attributes a freshly built accessors object has. They do not prove that
Airflow still *behaves* as 3.3.2 does (see docs/development.md, "Airflow internals we rely on", for
the behaviour that only the tests and the ``apache-airflow>=3.3.2,<3.4`` pin cover). Their result
is cached per process: Airflow's code does not change under a running triggerer.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from airflow_shared_stream_provider._core.errors import AirflowInternalsError

TESTED_AIRFLOW: Final = "apache-airflow>=3.3.2,<3.4"
SHARED_STREAM: Final = "airflow.triggers.shared_stream"
STATE_STORE_MODULE: Final = "airflow.sdk.execution_time.context"

# A problem found by a check: what is wrong, in a few words; None when the part is there.
Problem = str | None


@dataclass(frozen=True, slots=True)
class AirflowInternal:
    """One private part of Airflow: where we use it, what breaks without it, how it is checked."""

    name: str
    used_for: str
    breaks_without: str
    check: Callable[[], Problem]


def _shared_stream() -> Any:
    import airflow.triggers.shared_stream as module

    return module


def _state_store_module() -> Any:
    import airflow.sdk.execution_time.context as module

    return module


def _missing_names(wanted: Iterable[str], present: Iterable[str], where: str) -> Problem:
    missing = sorted(set(wanted) - set(present))
    return f"{where} has no {', '.join(missing)}" if missing else None


def _field_names(cls: Any) -> list[str]:
    """A dataclass's or NamedTuple's field names."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "_fields", ()))


def _method_uses(owner: str, method: str, names: Iterable[str]) -> Problem:
    """Whether a method of a class in ``airflow.triggers.shared_stream`` uses ``names`` (attributes or globals)."""
    cls = getattr(_shared_stream(), owner, None)
    if cls is None:
        return f"{SHARED_STREAM}.{owner} is missing"
    function = inspect.getattr_static(cls, method, None)
    code = getattr(function, "__code__", None)
    if code is None:
        return f"{owner}.{method} is missing"
    return _missing_names(names, code.co_names, f"the code of {owner}.{method}")


def _check_reject_context() -> Problem:
    module = _shared_stream()
    context = getattr(module, "_reject_context", None)
    if context is None:
        return "missing"
    if not isinstance(context, contextvars.ContextVar):
        return f"{SHARED_STREAM}._reject_context is a {type(context).__name__}, not a ContextVar"
    return None


def _check_reject_context_fields() -> Problem:
    cls = getattr(_shared_stream(), "_RejectContext", None)
    if cls is None:
        return f"{SHARED_STREAM}._RejectContext is missing"
    return _missing_names(("group", "trigger_id", "event_id"), _field_names(cls), "_RejectContext")


def _check_window_is_set() -> Problem:
    return _method_uses("_SharedStreamGroup", "_ack_drain", ("_reject_context", "_RejectContext"))


def _check_outstanding() -> Problem:
    return _method_uses("_SharedStreamGroup", "__init__", ("_outstanding",))


def _check_entry_bindings() -> Problem:
    cls = getattr(_shared_stream(), "_OutstandingEntry", None)
    if cls is None:
        return f"{SHARED_STREAM}._OutstandingEntry is missing"
    return _missing_names(("bindings",), _field_names(cls), "_OutstandingEntry")


def _check_unconfirmed_seqs() -> Problem:
    cls = getattr(_shared_stream(), "_SubscriberBinding", None)
    if cls is None:
        return f"{SHARED_STREAM}._SubscriberBinding is missing"
    return _missing_names(("unconfirmed_seqs",), _field_names(cls), "_SubscriberBinding")


def _check_seqs_bound_there() -> Problem:
    return _method_uses("_SharedStreamGroup", "bind_pending_event", ("_outstanding", "bindings", "unconfirmed_seqs"))


def _check_accessor_maps() -> Problem:
    from airflow.sdk import Asset

    cls = getattr(_state_store_module(), "AssetStateStoreAccessors", None)
    if cls is None:
        return f"{STATE_STORE_MODULE}.AssetStateStoreAccessors is missing"
    # Built the way the triggerer builds a watcher's (triggerer_job_runner.create_triggers): one
    # inlet per watched asset. A named Asset touches no supervisor channel.
    try:
        probe = cls(inlets=[Asset(name="shared-stream-probe", uri="shared-stream-probe://asset")])
    except Exception as exc:
        return f"AssetStateStoreAccessors(inlets=[Asset(...)]) raised {type(exc).__name__}: {exc}"
    missing = [name for name in ("_by_name", "_by_uri") if not isinstance(getattr(probe, name, None), dict)]
    if missing:
        return f"AssetStateStoreAccessors has no dict {', '.join(missing)}"
    if "shared-stream-probe" not in probe._by_name:
        return "AssetStateStoreAccessors._by_name does not hold its inlet by asset name"
    return None


def _check_accessor_by_name() -> Problem:
    cls = getattr(_state_store_module(), "AssetStateStoreAccessor", None)
    if cls is None:
        return f"{STATE_STORE_MODULE}.AssetStateStoreAccessor is missing"
    try:
        cls(name="shared-stream-probe")
    except Exception as exc:
        return f"AssetStateStoreAccessor(name=...) raised {type(exc).__name__}: {exc}"
    not_async = [name for name in ("aget", "aset") if not inspect.iscoroutinefunction(getattr(cls, name, None))]
    return f"AssetStateStoreAccessor has no coroutine {', '.join(not_async)}" if not_async else None


def _check_overflow_failure() -> Problem:
    cls = getattr(_shared_stream(), "_SubscriberOverflow", None)
    if cls is None:
        return f"{SHARED_STREAM}._SubscriberOverflow is missing"
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return f"{SHARED_STREAM}._SubscriberOverflow is not an exception class"
    return None


def force_failures() -> tuple[type[BaseException], ...]:
    """
    The exceptions the manager fails a watcher with (ack timeout, queue overflow): what a watcher's
    subscription raises when the manager gave up on it, as opposed to anything its own code raised.

    Evaluated by an ``except`` clause, so for every exception that passes it, this one among them:
    it must not raise. A missing class is left out; the stream never runs without it anyway
    (:func:`require_airflow_internals`, the ``_SubscriberOverflow`` entry of :data:`INTERNALS`).
    """
    module = _shared_stream()
    found = (getattr(module, "AckTimeout", None), getattr(module, "_SubscriberOverflow", None))
    return tuple(cls for cls in found if isinstance(cls, type) and issubclass(cls, BaseException))


_BINDING_CHECK = "the graceful-stop check of _core/binding.py"
_GRACEFUL_LOSS = (
    "a watcher can no longer tell whether the event it handed over was bound; messages fired while "
    "the triggerer stops gracefully would be settled although their events were never persisted "
    "(docs/reliability.md, Soak)"
)

INTERNALS: Final[tuple[AirflowInternal, ...]] = (
    AirflowInternal(
        f"{SHARED_STREAM}._reject_context",
        f"{_BINDING_CHECK}: the binding window of the raw event a watcher holds (current_window)",
        _GRACEFUL_LOSS,
        _check_reject_context,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._RejectContext.group / .trigger_id / .event_id",
        f"{_BINDING_CHECK}: which group, watcher and raw event the window is (was_bound)",
        _GRACEFUL_LOSS,
        _check_reject_context_fields,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._SharedStreamGroup._ack_drain sets _reject_context",
        f"{_BINDING_CHECK}: the window is set while a watcher holds a raw event",
        f"the window would always be empty and every event taken as bound: {_GRACEFUL_LOSS}",
        _check_window_is_set,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._SharedStreamGroup._outstanding",
        f"{_BINDING_CHECK}: the group's outstanding raw events by event id (was_bound)",
        _GRACEFUL_LOSS,
        _check_outstanding,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._OutstandingEntry.bindings",
        f"{_BINDING_CHECK}: each watcher's binding of an outstanding raw event (was_bound)",
        _GRACEFUL_LOSS,
        _check_entry_bindings,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._SubscriberBinding.unconfirmed_seqs",
        f"{_BINDING_CHECK}: the persist seqs bound to a watcher's share of a raw event (was_bound)",
        _GRACEFUL_LOSS,
        _check_unconfirmed_seqs,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._SharedStreamGroup.bind_pending_event binds into "
        "_outstanding[...].bindings[...].unconfirmed_seqs",
        f"{_BINDING_CHECK}: an empty unconfirmed_seqs means the runner bound nothing",
        f"an empty set would no longer mean 'not bound': {_GRACEFUL_LOSS}",
        _check_seqs_bound_there,
    ),
    AirflowInternal(
        f"{STATE_STORE_MODULE}.AssetStateStoreAccessors._by_name / ._by_uri",
        "_core/cohort.py stores_of: every asset a watcher watches and its state store (no public listing)",
        "no cohort record (late siblings miss a backlog after a restart unless cohort_settle covers "
        "them), no Kafka watcher positions, no split heartbeats",
        _check_accessor_maps,
    ),
    AirflowInternal(
        f"{STATE_STORE_MODULE}.AssetStateStoreAccessor(name=...).aget / .aset",
        "_core/split.py airflow_accessor: the state store of an asset that is not the watcher's own "
        "(heartbeats of cohort members running elsewhere)",
        "split detection: a stream split across triggerers would no longer be reported",
        _check_accessor_by_name,
    ),
    AirflowInternal(
        f"{SHARED_STREAM}._SubscriberOverflow",
        "_core/trigger.py: telling a watcher force-failed for a full queue from one whose own code "
        "raised (force_failures), to mark the message it stood on as the suspect (_core/attempts.py)",
        "failures of a watcher whose queue overflowed would not count toward any message's poison "
        "cap until the collateral ceiling (max_delivery_attempts x 4 deliveries)",
        _check_overflow_failure,
    ),
)


def airflow_version() -> str:
    import airflow

    return str(airflow.__version__)


def problems(internals: Iterable[AirflowInternal] = INTERNALS) -> list[tuple[AirflowInternal, str]]:
    """Each internal whose check fails, with what is wrong (not cached; a check that raises counts)."""
    found: list[tuple[AirflowInternal, str]] = []
    for internal in internals:
        try:
            problem = internal.check()
        except Exception as exc:  # an import or attribute error is exactly what we look for
            problem = f"its check raised {type(exc).__name__}: {exc}"
        if problem is not None:
            found.append((internal, problem))
    return found


@functools.cache
def checked_internals() -> AirflowInternalsError | None:
    """The process-wide result of checking :data:`INTERNALS`: the error to raise, or None."""
    found = problems()
    if not found:
        return None
    return AirflowInternalsError(
        airflow_version(),
        [f"{internal.name} ({problem}; without it: {internal.breaks_without})" for internal, problem in found],
        tested=TESTED_AIRFLOW,
    )


def require_airflow_internals() -> None:
    """Raise :class:`~.errors.AirflowInternalsError` if a part in :data:`INTERNALS` is missing (checked once)."""
    error = checked_internals()
    if error is not None:
        # A fresh instance each time: one exception object raised in several tasks would chain
        # their tracebacks into each other.
        raise AirflowInternalsError(error.airflow_version, error.missing, tested=error.tested)
