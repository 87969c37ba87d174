"""Errors raised by the provider, each saying which failure path it travels."""

from __future__ import annotations


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


def missing_dependency(extra: str, package: str, exc: ImportError) -> ImportError:
    """Turn an ImportError of a broker SDK into one that says which extra to install."""
    error = ImportError(
        f"{package} is required for this shared stream: pip install 'airflow-shared-stream-provider[{extra}]' ({exc})"
    )
    error.__cause__ = exc
    return error
