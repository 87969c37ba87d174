"""
Per-watcher, serializable message filters.

Trigger kwargs live in the metadata DB, so filters are data, not callables:

* ``match``: ``{"body.region": "eu", "attributes.type": ["order", "refund"]}``. Keys are dotted
  paths into the envelope (an integer segment indexes a list); a scalar value means equality, a
  list means "any of". All keys must match. A missing path never matches.
* ``filter_function``: ``"package.module.function"``, imported in the triggerer, called with the
  envelope; returns truthy to fire, falsy to skip, or raises
  :class:`~airflow_shared_stream_provider.RejectMessage` to dead-letter the message.

``match`` runs first (it is cheap), the function only on messages that matched.

Where the function runs (``filter_mode``, per watcher):

* ``"loop"`` (default): on the triggerer's event loop, inline. Every trigger of the triggerer
  (every stream, every task deferral) waits while it runs: it must be fast and never block
  (no network, no disk, no ``time.sleep``). bench/filter_isolation_bench.py measures the cost.
* ``"thread"``: in a daemon thread of this watcher (:class:`ThreadedDecider`), one message at a
  time, so the watcher still decides its messages in order; the loop serves the other streams
  meanwhile. ``filter_timeout`` bounds one call: past it the message is handled per
  ``on_filter_error`` (:class:`FilterTimeoutError`). A Python thread cannot be killed: the call
  runs on until it returns, its result discarded, and the watcher goes on in a new thread. When
  :data:`MAX_ABANDONED_FILTER_THREADS` such calls of one filter are still running, a watcher
  that needs a new thread fails (:class:`FilterStuckError`) instead of starting one.

The function is imported once, when the watcher starts, in a worker thread (``import_string``):
a wrong path fails that watcher with one error naming the path, never each message.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

# Airflow 3.3's home of import_string (airflow.utils.module_loading is gone); the module
# re-exports it without __all__, hence the ignore.
from airflow.sdk.module_loading import import_string  # type: ignore[attr-defined]

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError

FilterErrorPolicy = Literal["reject", "skip", "fail"]
FILTER_ERROR_POLICIES: Final = ("reject", "skip", "fail")
FilterMode = Literal["loop", "thread"]
FILTER_MODES: Final = ("loop", "thread")
# Filter threads past their timeout that may still run, per filter, in one process (see the module
# docstring): bounds the threads a filter that hangs on every message can pile up.
MAX_ABANDONED_FILTER_THREADS: Final = 4
_SCALARS = (str, int, float, bool, type(None))
_MISSING: Final = object()

EnvelopePredicate = Callable[[Mapping[str, Any]], Any]


class _Clause:
    """One compiled ``match`` entry: a path split once, and the allowed values as a set or list."""

    __slots__ = ("allowed", "allowed_list", "path", "segments")

    def __init__(self, path: str, expected: Any) -> None:
        self.path = path
        self.segments: tuple[str | int, ...] = tuple(int(part) if part.isdigit() else part for part in path.split("."))
        values = list(expected) if isinstance(expected, list | tuple) else [expected]
        # Hashable values go in a set for O(1) membership; 1 == True in Python, so bools are kept
        # apart from ints by pairing each value with its type.
        self.allowed: frozenset[tuple[type, Any]] = frozenset((type(v), v) for v in values)
        self.allowed_list = values

    def matches(self, envelope: Mapping[str, Any]) -> bool:
        node: Any = envelope
        for segment in self.segments:
            if isinstance(segment, int) and isinstance(node, list):
                if segment >= len(node):
                    return False
                node = node[segment]
            elif isinstance(node, Mapping):
                node = node.get(segment if isinstance(segment, str) else str(segment), _MISSING)
                if node is _MISSING:
                    return False
            else:
                return False
        if isinstance(node, _SCALARS):
            kind = float if isinstance(node, int) and not isinstance(node, bool) else type(node)
            if (type(node), node) in self.allowed:
                return True
            # 3 == 3.0 for JSON numbers: compare ints and floats by value.
            return kind is float and any(
                isinstance(v, int | float) and not isinstance(v, bool) and v == node for v in self.allowed_list
            )
        return False


def validate_match(match: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Check a ``match`` spec at Dag parse time and return it as a plain JSON-safe dict."""
    if match is None:
        return None
    if not isinstance(match, Mapping):
        raise SharedStreamConfigError(f"match must be a dict of dotted path -> value(s), got {type(match).__name__}")
    cleaned: dict[str, Any] = {}
    for path, expected in match.items():
        if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
            raise SharedStreamConfigError(f"match key {path!r} must be a dotted path like 'body.region'")
        values = expected if isinstance(expected, list | tuple) else [expected]
        for value in values:
            if not isinstance(value, _SCALARS):
                raise SharedStreamConfigError(
                    f"match[{path!r}] values must be str/int/float/bool/None (or a list of them), "
                    f"got {type(value).__name__}"
                )
        if isinstance(expected, list | tuple) and not expected:
            raise SharedStreamConfigError(f"match[{path!r}] is an empty list: it could never match")
        cleaned[path] = list(expected) if isinstance(expected, list | tuple) else expected
    return cleaned


def validate_filter_function(path: str | None) -> str | None:
    """Check the shape of a ``filter_function`` dotted path (importing happens in the triggerer)."""
    if path is None:
        return None
    if not isinstance(path, str) or "." not in path or any(not part.isidentifier() for part in path.split(".")):
        raise SharedStreamConfigError(f"filter_function must be a dotted path 'package.module.function', got {path!r}")
    return path


def import_callable(path: str) -> EnvelopePredicate:
    """
    Import ``package.module.function`` with Airflow's ``import_string``; the error names the path
    and what went wrong. Blocking (it may import a module): call it off the event loop.
    """
    module_name, _, attr = path.rpartition(".")
    try:
        func = import_string(path)
    except Exception as exc:  # any error of the module's own import too (SyntaxError, NameError, ...)
        module = sys.modules.get(module_name)
        if isinstance(exc, ImportError) and module is not None and not hasattr(module, attr):
            # import_string's "does not define" case: the module imported, the name is missing.
            raise SharedStreamConfigError(
                f"filter_function {path!r}: {module_name!r} has no callable {attr!r}"
            ) from None
        raise SharedStreamConfigError(
            f"filter_function {path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(func):
        raise SharedStreamConfigError(f"filter_function {path!r}: {module_name!r} has no callable {attr!r}")
    return func  # type: ignore[no-any-return]


class MessageFilter:
    """A compiled ``match`` + ``filter_function`` pair. ``decide`` may raise what the function raises."""

    __slots__ = ("_clauses", "_function", "_function_path")

    def __init__(self, match: Mapping[str, Any] | None, filter_function: str | None) -> None:
        spec = validate_match(match) or {}
        self._clauses: Sequence[_Clause] = tuple(_Clause(path, expected) for path, expected in spec.items())
        self._function_path = validate_filter_function(filter_function)
        self._function: EnvelopePredicate | None = None

    @property
    def has_clauses(self) -> bool:
        return bool(self._clauses)

    @property
    def needs_import(self) -> bool:
        """True while a ``filter_function`` is named but not imported yet (see :meth:`resolve`)."""
        return self._function_path is not None and self._function is None

    def resolve(self) -> EnvelopePredicate | None:
        """
        Import the ``filter_function`` now (idempotent); None when there is none. Blocking: the
        watcher calls it in a worker thread when it starts, so no import ever runs on the loop and
        a wrong path fails the watcher once instead of every message.
        """
        if self._function is None and self._function_path is not None:
            self._function = import_callable(self._function_path)
        return self._function

    def matches(self, envelope: Mapping[str, Any]) -> bool:
        # A plain loop, not all(<generator>): this runs per message per watcher.
        for clause in self._clauses:  # noqa: SIM110
            if not clause.matches(envelope):
                return False
        return True

    def decide(self, envelope: Mapping[str, Any]) -> bool:
        """True to fire. Raises whatever ``filter_function`` raises (RejectMessage included)."""
        if self._clauses and not self.matches(envelope):
            return False
        if self._function_path is None:
            return True
        # Already resolved when a watcher calls this; the import here serves direct callers only.
        function = self._function if self._function is not None else self.resolve()
        return bool(function(envelope))  # type: ignore[misc]


class FilterTimeoutError(TimeoutError):
    """
    A filter running in ``filter_mode="thread"`` did not return within ``filter_timeout``.

    Travels ``on_filter_error`` like any filter exception: ``reject`` dead-letters the message with
    this as the reason, ``skip`` skips it, ``fail`` ends the watcher (the message is redelivered).
    The call itself runs on in its thread until it returns; its result is discarded.
    """


class FilterStuckError(RuntimeError):
    """
    A watcher needs a new filter thread while :data:`MAX_ABANDONED_FILTER_THREADS` timed-out calls
    of its filter are still running. Ends the watcher whatever ``on_filter_error`` says (the
    message is redelivered): another thread for a filter that does not return would only pile
    threads up. The triggerer re-creates the watcher; once the stuck calls return it works again.
    """


class _FilterThread:
    """
    One daemon thread serving one watcher's filter calls, one at a time, in submission order.

    Daemon, and not a ``ThreadPoolExecutor`` worker: those are joined at interpreter exit, so a
    filter that never returns would hang the triggerer's shutdown. Results come back through
    ``call_soon_threadsafe``; a call whose future is already done (timed out, cancelled) is dropped.
    """

    __slots__ = ("_calls", "thread")

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[EnvelopePredicate, Any, asyncio.Future[bool]] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, decide: EnvelopePredicate, envelope: Mapping[str, Any]) -> asyncio.Future[bool]:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._calls.put((decide, envelope, future))
        return future

    def close(self) -> None:
        """The thread exits after the call it is running, if any (it cannot be interrupted)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            decide, envelope, future = call
            try:
                outcome: tuple[bool | None, BaseException | None] = (bool(decide(envelope)), None)
            except BaseException as exc:  # handed to the watcher, which applies on_filter_error
                outcome = (None, exc)
            try:
                future.get_loop().call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop is closed: nobody waits for this result any more
                return
            del call, decide, envelope, future, outcome  # hold no envelope while idle


def _settle(future: asyncio.Future[bool], result: bool | None, error: BaseException | None) -> None:
    if future.done():  # timed out or cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(bool(result))


# Timed-out filter threads that may still be running, per filter label (one triggerer process).
_abandoned: dict[str, list[threading.Thread]] = {}
_abandoned_lock = threading.Lock()


def abandoned_filter_threads(label: str) -> int:
    """How many timed-out calls of this filter are still running (pruning those that returned)."""
    with _abandoned_lock:
        alive = [thread for thread in _abandoned.get(label, ()) if thread.is_alive()]
        if alive:
            _abandoned[label] = alive
        else:
            _abandoned.pop(label, None)
        return len(alive)


class ThreadedDecider:
    """
    ``filter_mode="thread"``: a watcher's decision made in its own daemon thread.

    ``prefilter`` (the ``match`` clauses, cheap) runs on the loop first, so only messages that pass
    it pay the thread hop. ``decide`` runs in the thread. One call at a time: the watcher awaits
    each message's decision before it pulls the next, which keeps its order. ``label`` names the
    filter in thread names, errors and the abandoned-thread count.
    """

    __slots__ = ("_decide", "_prefilter", "_timeout", "_worker", "label")

    def __init__(
        self,
        decide: EnvelopePredicate,
        *,
        label: str,
        prefilter: Callable[[Mapping[str, Any]], bool] | None = None,
        timeout: float | None = None,
    ) -> None:
        self._decide = decide
        self._prefilter = prefilter
        self._timeout = timeout
        self._worker: _FilterThread | None = None
        self.label = label

    async def __call__(self, envelope: Mapping[str, Any]) -> bool:
        if self._prefilter is not None and not self._prefilter(envelope):
            return False
        worker = self._worker
        if worker is None:
            # Checked before a thread is started, so a filter that hangs on every message costs
            # at most MAX_ABANDONED_FILTER_THREADS threads (plus one per live watcher), however
            # often the triggerer re-creates the failing watcher.
            stuck = abandoned_filter_threads(self.label)
            if stuck >= MAX_ABANDONED_FILTER_THREADS:
                raise FilterStuckError(
                    f"filter {self.label}: {stuck} of its calls that passed filter_timeout={self._timeout}s are "
                    "still running; the watcher stops instead of starting another thread"
                )
            worker = self._worker = _FilterThread(f"shared-stream-filter {self.label}")
        future = worker.submit(self._decide, envelope)
        try:
            done, _ = await asyncio.wait({future}, timeout=self._timeout)
        except BaseException:  # the watcher is cancelled: nobody will read the result
            future.cancel()
            raise
        if done:
            return future.result()
        # Timed out. asyncio.wait (not wait_for) keeps a TimeoutError raised *by the filter* apart
        # from this one. The thread cannot be stopped: leave it to finish alone; the next message
        # gets a new thread.
        future.cancel()
        worker.close()
        self._worker = None
        with _abandoned_lock:
            _abandoned.setdefault(self.label, []).append(worker.thread)
        raise FilterTimeoutError(f"filter {self.label} did not return within filter_timeout={self._timeout}s")

    def close(self) -> None:
        """The watcher ends: its thread exits once its current call (if any) returns."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
