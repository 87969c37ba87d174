"""Errors raised by the provider, each saying which failure path it travels."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from airflow.exceptions import AirflowOptionalProviderFeatureException

from airflow_shared_stream_provider.brokers import broker_spec


class RejectMessage(Exception):  # noqa: N818 - the name reads as an instruction in filter code
    """
    Raised by a ``filter_function`` to terminally refuse the message it is looking at.

    The watcher calls :func:`airflow.triggers.shared_stream.reject_shared_stream_event`, so the
    message resolves as *rejected* for this watcher and the producer dead-letters it (with this
    exception's text as the reason) instead of redelivering it. Other watchers are unaffected.
    """

    def __init__(self, reason: str = "rejected by filter_function") -> None:
        super().__init__(reason)
        self.reason = reason


class SharedStreamConfigError(ValueError):
    """
    Bad trigger or connection configuration.

    Raised at Dag parse time for trigger arguments, or when the producer opens the stream for
    connection settings; in the second case the shared-stream group fails and every watcher in it
    sees this error (the manager's terminal path). The message always names the setting.
    """


class BrokerUnavailableError(RuntimeError):
    """
    The broker could not be reached, or kept failing, for longer than the producer retries a call:
    a transient failure of the broker or the network, not a configuration mistake.

    Fails the group (every watcher sees it, through the manager's terminal path); the triggerer
    re-creates the failed triggers, and the stream resumes once the broker answers again. Nothing
    unsettled is lost: the broker redelivers it. The message names the endpoint and the connection,
    so a wrong endpoint that never answers is still recognisable.
    """


class PartialAssignmentError(RuntimeError):
    """
    The broker gave this stream only part of what it must read (for example some of a topic's
    partitions), usually because siblings with the same consumer group run on two triggerers.

    Fails the group (every watcher sees it) when ``on_partial_assignment="fail"``.
    """


class BrokerHandleClosedError(RuntimeError):
    """``advance`` was called after the broker connection was closed; the batch is not advanced."""


class AirflowInternalsError(RuntimeError):
    """
    The installed Airflow lacks a private part of its triggerer that the provider relies on
    (:mod:`._core.airflow_internals`; docs/development.md, "Airflow internals we rely on").

    Raised when a stream starts (the producer's ``open_stream``, or a watcher reading its asset
    state stores as it subscribes), before any message is read: the group fails and every watcher
    sees this error (the manager's terminal path); the triggerer re-creates the triggers, and they
    fail the same way until Airflow is a version the provider was tested with. Nothing is read,
    so nothing is settled or lost. The message names the Airflow version and every missing part.
    """

    def __init__(self, airflow_version: str, missing: list[str], *, tested: str) -> None:
        self.airflow_version = airflow_version
        self.missing = list(missing)
        self.tested = tested
        lines = "\n".join(f"  - {part}" for part in self.missing)
        super().__init__(
            f"airflow-shared-stream-provider cannot run shared streams on Airflow {airflow_version}: "
            f"{len(self.missing)} private part(s) of Airflow it relies on are missing or changed:\n{lines}\n"
            f"The provider is tested with {tested}; install such a version (the stream refuses to run "
            "rather than run without these guarantees)."
        )


class MissingBrokerSDKError(AirflowOptionalProviderFeatureException, ImportError):
    """
    A broker SDK (an optional extra) is not installed; raised when a producer module is imported.

    Airflow's convention for an optional provider feature: ``ProvidersManager`` logs a class whose
    import raises it as an optional feature that is disabled, not as a broken provider. It is also
    an :class:`ImportError`, so code guarding the import with ``except ImportError`` keeps working.
    The message names the extra to install (``pip install 'airflow-shared-stream-provider[kafka]'``).
    """


@contextlib.contextmanager
def broker_sdk(broker: str) -> Iterator[None]:
    """
    Guard a producer module's broker SDK imports (``with broker_sdk("kafka"): from aiokafka import
    ...``): an ImportError inside becomes a :class:`MissingBrokerSDKError` that names the missing
    module and the registry entry's extra to install. The extra comes from the registry, so a
    module cannot name another broker's extra or one that ``pyproject.toml`` does not declare.
    """
    try:
        yield
    except ImportError as exc:
        extra = broker_spec(broker).extra
        missing = exc.name or "its SDK"
        error = MissingBrokerSDKError(
            f"the {broker} shared stream needs {missing}: pip install 'airflow-shared-stream-provider[{extra}]' ({exc})"
        )
        raise error from exc
