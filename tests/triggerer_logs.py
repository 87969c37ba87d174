"""
The triggerer's log path for secrets, in process: what reaches the log file of a trigger.

In a real triggerer (Airflow 3.3.2, ``airflow/jobs/triggerer_job_runner.py``) trigger code runs in
the TriggerRunner subprocess. Its log lines are sent to the supervisor process *unmasked*
(``configure_logging(sending_to_supervisor=True)``), and the supervisor decodes each JSON line and
writes it through ``airflow.sdk.log.logging_processors(json_output=True)``, whose ``mask_logs``
redacts with the supervisor's own masker (``_process_log_messages_from_subprocess``). That masker
knows a secret only when the subprocess sent it a ``MaskSecret`` message through
``SUPERVISOR_COMMS``: ``amask_secret`` does (``asend``); ``mask_secret`` calls ``send``, which raises
in a task without a greenback portal (``TriggerCommsDecoder.send``; a shared-stream producer's task
has none), an error ``mask_secret`` swallows.

:class:`TriggerRunnerLogs` reproduces that with Airflow's own pieces and no triggerer process: a
``SUPERVISOR_COMMS`` whose ``asend`` records ``MaskSecret`` and whose ``send`` raises as
``TriggerCommsDecoder.send`` does; the runner side's processors (``sending_to_supervisor=True``, no
masking) to write the exception's JSON line; and the supervisor's code (decode, ``exception`` ->
``error_detail``, re-log) with a masker that knows only the recorded messages, configured like
``airflow.settings._configure_secrets_masker``. What is emulated: the two processes (one here) and
the socket between them (a list here).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import airflow.sdk.log as sdk_log
import msgspec
import pytest
import structlog
from airflow.sdk._shared.secrets_masker import DEFAULT_SENSITIVE_FIELDS, SecretsMasker
from airflow.sdk._shared.secrets_masker import secrets_masker as masker_module
from airflow.sdk.execution_time import task_runner
from airflow.sdk.execution_time.comms import MaskSecret


def configured_masker() -> SecretsMasker:
    """A fresh masker configured as ``airflow.settings._configure_secrets_masker`` does by default."""
    masker = SecretsMasker()
    masker.min_length_to_mask = 5
    masker.sensitive_variables_fields = list(DEFAULT_SENSITIVE_FIELDS)
    masker.hide_sensitive_var_conn_fields = True
    return masker


@dataclass
class _SupervisorComms:
    """``SUPERVISOR_COMMS`` as a shared-stream producer's task sees it in the TriggerRunner."""

    sent: list[MaskSecret] = field(default_factory=list)

    def send(self, msg: Any) -> Any:
        # TriggerCommsDecoder.send on the event loop thread outside a greenback portal.
        raise RuntimeError("Sync SDK methods (e.g. get_connection(), get_variable()) cannot be called ...")

    async def asend(self, msg: Any) -> Any:
        assert isinstance(msg, MaskSecret), f"unexpected message to the supervisor: {type(msg).__name__}"
        self.sent.append(msg)
        return None


@dataclass
class TriggerRunnerLogs:
    """See the module docstring. Use :func:`triggerer_logs` (a context manager)."""

    comms: _SupervisorComms
    lines: list[bytes] = field(default_factory=list)

    def log_exception(self, event: str) -> None:
        """``log.exception(event)`` in the TriggerRunner: one JSON line to the supervisor (unmasked)."""
        buffer = io.BytesIO()
        processors = sdk_log.logging_processors(json_output=True, sending_to_supervisor=True)
        structlog.wrap_logger(structlog.BytesLogger(buffer), processors=processors).exception(event, trigger_id=1)
        self.lines.extend(line for line in buffer.getvalue().splitlines() if line)

    def runner_output(self) -> str:
        """What the TriggerRunner sent (unmasked): the control that the secret was logged at all."""
        return b"\n".join(self.lines).decode()

    def written_log(self, monkeypatch: pytest.MonkeyPatch) -> str:
        """
        The trigger's log file as the supervisor writes it: each line decoded and re-logged as in
        ``TriggerRunnerSupervisor._process_log_messages_from_subprocess``, masked with what the
        supervisor was sent.
        """
        supervisor = configured_masker()
        for message in self.comms.sent:
            supervisor.add_mask(message.value, message.name)  # request_handlers.handle_mask_secret
        monkeypatch.setattr(masker_module, "_secrets_masker", lambda: supervisor)
        output = io.BytesIO()
        log = structlog.wrap_logger(
            structlog.BytesLogger(output), processors=sdk_log.logging_processors(json_output=True)
        )
        for line in self.lines:
            event: dict[str, Any] = msgspec.json.decode(line)
            event.pop("trigger_id", None)
            if exc := event.pop("exception", None):
                event["error_detail"] = exc
            log.log(int(logging.getLevelName(event.pop("level").upper())), event.pop("event", None), **event)
        return output.getvalue().decode()


@contextlib.contextmanager
def triggerer_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[TriggerRunnerLogs]:
    """Inside: the TriggerRunner side (reads register with a runner-local masker and the comms)."""
    comms = _SupervisorComms()
    runner_masker = configured_masker()
    with monkeypatch.context() as patch:
        patch.setattr(task_runner, "SUPERVISOR_COMMS", comms, raising=False)
        # mask_secret / amask_secret add to the runner process's masker, which masks nothing the
        # supervisor writes; a fresh one keeps this test's masks out of the test process's masker.
        patch.setattr(sdk_log, "_secrets_masker", lambda: runner_masker)
        yield TriggerRunnerLogs(comms)


def without_our_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the provider's own registration removed (Airflow's own masking stays)."""
    # The readers the masking tests cover; each imports register_secrets by name, so it is
    # patched where it is looked up.
    from airflow_shared_stream_provider.producers import (
        aws_connection,
        kafka_config,
        pubsub_connection,
        servicebus_connection,
    )

    async def nothing(*values: Any) -> None:
        return None

    for module in (aws_connection, kafka_config, pubsub_connection, servicebus_connection):
        monkeypatch.setattr(module, "register_secrets", nothing)
    with contextlib.suppress(ImportError):
        from airflow_shared_stream_provider.producers import aws_session

        monkeypatch.setattr(aws_session, "register_secrets", nothing)


def assert_masked(logs: TriggerRunnerLogs, monkeypatch: pytest.MonkeyPatch, *secrets: str) -> str:
    """Every secret was logged by the runner and none is in the written log (returned)."""
    sent = logs.runner_output()
    for secret in secrets:
        assert _logged(secret, sent), "the forced traceback does not carry the secret: the test proves nothing"
    written = logs.written_log(monkeypatch)
    assert "***" in written and "RuntimeError" in written, written[:2000]
    leaked = [secret[:6] + "..." for secret in secrets if _logged(secret, written)]
    assert not leaked, f"secrets in the triggerer log: {leaked}"
    return written


def assert_leaks(logs: TriggerRunnerLogs, monkeypatch: pytest.MonkeyPatch, secret: str) -> None:
    """The control: without the provider's registration the secret is in the written log."""
    assert _logged(secret, logs.written_log(monkeypatch))


def _logged(secret: str, text: str) -> bool:
    # JSON lines: a secret with newlines or quotes (a PEM key) is there JSON-escaped.
    return secret in text or msgspec.json.encode(secret).decode()[1:-1] in text
