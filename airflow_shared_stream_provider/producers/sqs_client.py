"""
The AWS side of the SQS producer (:mod:`.sqs`): the aiobotocore client, its calls, what its errors
mean, and the wire format of SQS messages. What each outcome does on the queue (dispositions,
leases, FIFO order) stays in :mod:`.sqs`.

* **Credentials**: the session of :mod:`.aws_session`, the same identity the amazon provider's hook
  gets for the connection: built by that provider's own session factory when it is installed
  (every ``assume_role_method``, ``profile_name``, ``session_kwargs``, ``service_config.sts``),
  else from the connection's access key, profile or default chain, with ``role_arn`` assumed
  through STS (``assume_role``, or web identity from a token file) as refreshable credentials.
* **Client config**: the connection's ``config_kwargs`` (unsupported keys are an error naming
  them), with defaults sized for the producer: standard retries, a connection pool for every
  concurrent receive plus the lease keeper, deletes and releases, and a read timeout a long poll
  never reaches.
* **Queue checks**: the queue (and the DLQ) must exist and be FIFO exactly when the URL says so; the
  DLQ must not resolve to the queue itself (same ``QueueArn``); a queue with neither
  ``dlq_queue_url`` nor a RedrivePolicy is logged (rejected messages stay).
* **Calls**: the long-polling ``ReceiveMessage``; batch calls (:meth:`SqsApi.batch`) retry the
  entries that failed on the server side (3 attempts, backoff) and raise
  :class:`SqsAdvanceError` when some still fail.
* **Errors**: configuration mistakes become :class:`SharedStreamConfigError` naming the queue, the
  connection and where it points (never a secret); :func:`is_transient` tells throttling and
  network blips (retried) from mistakes (raised). A transient failure that outlasts the retries
  (the endpoint unreachable at start, or for longer than the receive loop's error streak) is a
  :class:`BrokerUnavailableError` with the same context: a broker outage, not a setting.
* **Wire format**: message attributes as text, ``content-transfer-encoding: base64`` bodies
  decoded, system attributes as envelope metadata, and the ``SendMessageBatch`` entry that
  re-sends a message to a DLQ within SQS's 10-attribute limit.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

from airflow_shared_stream_provider._core.connections import config_error
from airflow_shared_stream_provider._core.dead_letter import add_within_limit
from airflow_shared_stream_provider._core.envelope import iso_timestamp, text_value
from airflow_shared_stream_provider._core.errors import (
    BrokerUnavailableError,
    SharedStreamConfigError,
    broker_sdk,
)
from airflow_shared_stream_provider._core.metrics import StreamCounters
from airflow_shared_stream_provider._core.retry import Backoff, Retry, retry_entries
from airflow_shared_stream_provider.producers import aws_connection, aws_session
from airflow_shared_stream_provider.triggers.sqs import SqsStreamSettings, region_from_queue_url

with broker_sdk("sqs"):
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession
    from botocore import exceptions as boto

SQS_BATCH: Final = 10  # entries per batch call, SQS's limit
MAX_MESSAGE_ATTRIBUTES: Final = 10
MAX_ATTRIBUTE_NAME: Final = 256  # characters (names are ASCII)
TRANSFER_ENCODING_ATTRIBUTE: Final = "content-transfer-encoding"
AWS_ERRORS: Final[tuple[type[Exception], ...]] = (boto.BotoCoreError, boto.ClientError)
"""What an SQS call raises when AWS (or reaching it) failed: see :meth:`SqsApi.explain`."""
_ENTRY_RETRIES: Final = 3
_ENTRY_BACKOFF: Final = Backoff(0.2)
# Per-entry error codes meaning "this receipt handle no longer holds the message": retrying cannot
# help, and the message is (or will be) visible again, so it is redelivered, not lost.
LEASE_GONE_CODES: Final = frozenset(
    {
        "ReceiptHandleIsInvalid",
        "InvalidParameterValue",
        "MessageNotInflight",
        "AWS.SimpleQueueService.MessageNotInflight",
    }
)
_MISSING_QUEUE_CODES: Final = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "NonExistentQueue"}
)


def is_transient(exc: BaseException) -> bool:
    """Throttling or a network / service blip (retry the call), not a configuration mistake."""
    if isinstance(exc, boto.ClientError):
        return str(exc.response.get("Error", {}).get("Code", "")) in aws_connection.AWS_THROTTLE_CODES
    return isinstance(exc, boto.BotoCoreError) and not isinstance(
        exc, boto.NoCredentialsError | boto.PartialCredentialsError | boto.NoRegionError
    )


class SqsAdvanceError(RuntimeError):
    """
    A delete, dead-letter send or other advance step still failed after retries.

    Raised from ``advance``: the manager terminates the group (every watcher fails through the
    trigger-failure path) and the messages that were not deleted come back after their visibility
    timeout. Nothing is counted as committed that was not deleted.
    """


class SqsApi:
    """
    The aiobotocore SQS client of one queue: built by :meth:`connect`, closed by :meth:`aclose`;
    its batch calls retried (:meth:`batch`) and its errors explained. See the module docstring.
    """

    def __init__(self, settings: SqsStreamSettings, counters: StreamCounters, log: logging.Logger) -> None:
        self.settings = settings
        self.counters = counters
        self.log = log
        self.client_settings: aws_connection.AwsConnection | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    def config_error(self, cause: str, exc: BaseException | None = None) -> SharedStreamConfigError:
        where = self.client_settings.describe() if self.client_settings else ""
        conn = self.settings.aws_conn_id
        return config_error(f"SQS queue {self.settings.queue_url!r}", f"{cause} (aws_conn_id={conn!r}; {where})", exc)

    def unavailable_error(self, cause: str, exc: BaseException | None = None) -> BrokerUnavailableError:
        """A transient failure that outlasted the retries (same context as :meth:`config_error`)."""
        where = self.client_settings.describe() if self.client_settings else ""
        conn = self.settings.aws_conn_id
        error = BrokerUnavailableError(
            f"SQS queue {self.settings.queue_url!r}: {cause} (aws_conn_id={conn!r}; {where}); the stream "
            "resumes when the trigger is re-created and SQS answers again (unsettled messages come back "
            "after their visibility timeout)"
        )
        error.__cause__ = exc
        return error

    def explain(self, exc: BaseException, queue_url: str) -> str:
        """What a botocore error means, for a configuration error or an advance error."""
        if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
            return f"no usable AWS credentials ({exc})"
        if isinstance(exc, boto.EndpointConnectionError):
            return f"cannot reach the SQS endpoint ({exc})"
        if isinstance(exc, boto.ClientError):
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            text = str(error.get("Message", ""))
            if code in _MISSING_QUEUE_CODES:
                region = self.client_settings.region_name if self.client_settings else None
                return (
                    f"the queue does not exist in region {region!r} for these credentials "
                    f"(wrong region or account, or deleted) [{code}]"
                )
            return aws_connection.aws_error_cause(code, text, resource=queue_url)
        return f"{type(exc).__name__}: {exc}"

    # -- connecting ----------------------------------------------------------------------------
    async def _session(self, client_settings: aws_connection.AwsConnection) -> AioSession:
        if bool(client_settings.access_key_id) != bool(client_settings.secret_access_key):
            raise self.config_error("the connection has only one of login (access key id) and password (secret)")
        try:
            return await aws_session.create_session(
                client_settings,
                config=self._client_config(client_settings),
                on_sts_call=lambda: self.counters.add("api_calls"),
            )
        except AWS_ERRORS as exc:
            # The amazon provider's session factory assumes the role at once (STS).
            cause = self.explain(exc, self.settings.queue_url)
            if is_transient(exc):
                raise self.unavailable_error(cause, exc) from exc
            raise self.config_error(cause, exc) from exc

    def _client_config(self, client_settings: aws_connection.AwsConnection) -> AioConfig:
        kwargs, unsupported = aws_connection.aws_config_kwargs(client_settings)
        if unsupported:
            raise self.config_error(f"unsupported config_kwargs key(s) {unsupported}")
        kwargs.setdefault("retries", {"mode": "standard", "max_attempts": 3})
        # Receives, the lease keeper, deletes and releases may all be in flight at once.
        kwargs.setdefault("max_pool_connections", max(10, self.settings.concurrent_receives + 4))
        # A long poll must never hit the read timeout.
        kwargs.setdefault("read_timeout", self.settings.wait_time_seconds + 40)
        return AioConfig(**kwargs)

    async def connect(self) -> Any:
        """The SQS client, open until :meth:`aclose`."""
        settings = self.settings
        client_settings = await aws_connection.load_aws_connection(
            settings.aws_conn_id,
            service="sqs",
            region_name=settings.region_name,
            fallback_region=region_from_queue_url(settings.queue_url),
        )
        self.client_settings = client_settings
        session = await self._session(client_settings)
        stack = contextlib.AsyncExitStack()
        try:
            client = await stack.enter_async_context(
                session.create_client(
                    "sqs",
                    region_name=client_settings.region_name,
                    endpoint_url=client_settings.endpoint_url,
                    verify=client_settings.verify,
                    config=self._client_config(client_settings),
                )
            )
        except boto.NoRegionError as exc:
            await stack.aclose()
            raise self.config_error(
                "no AWS region: set region_name on the trigger or the connection, or use a regional queue URL", exc
            ) from exc
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self.log.info("SQS shared stream connecting to %s (%s)", settings.queue_url, client_settings.describe())
        return client

    async def aclose(self) -> None:
        """Close the client :meth:`connect` opened (if any)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # -- calls ---------------------------------------------------------------------------------
    async def receive(self, client: Any, count: int) -> tuple[float, list[dict[str, Any]]]:
        """One long-polling ``ReceiveMessage`` of up to ``count`` messages: ``(monotonic start, raw messages)``."""
        started = time.monotonic()
        self.counters.add("api_calls")
        response = await client.receive_message(
            QueueUrl=self.settings.queue_url,
            MaxNumberOfMessages=count,
            WaitTimeSeconds=self.settings.wait_time_seconds,
            VisibilityTimeout=self.settings.visibility_timeout,
            MessageSystemAttributeNames=["All"],
            MessageAttributeNames=["All"],
        )
        return started, list(response.get("Messages") or [])

    async def batch(
        self,
        what: str,
        call: Callable[..., Awaitable[dict[str, Any]]],
        queue_url: str,
        entries: Sequence[dict[str, Any]],
    ) -> dict[int, dict[str, Any]]:
        """
        One SQS batch call over ``entries`` (<= 10; their ``Id`` is added here), retrying the
        entries that failed on the server side and calls that failed as a whole.

        Returns the per-entry client errors (``SenderFault``: a retry cannot fix them) by index.
        Raises :class:`SqsAdvanceError` when server-side failures or call errors remain after the
        retries.
        """
        faults: dict[int, dict[str, Any]] = {}

        async def send(pending: list[int]) -> Retry[int]:
            self.counters.add("api_calls")
            try:
                response = await call(
                    QueueUrl=queue_url, Entries=[{"Id": str(i), **entries[index]} for i, index in enumerate(pending)]
                )
            except AWS_ERRORS as exc:
                return pending, self.explain(exc, self.settings.queue_url)
            retry: list[int] = []
            error = ""
            for failure in response.get("Failed") or []:
                index = pending[int(failure["Id"])]
                if failure.get("SenderFault"):
                    faults[index] = failure
                else:
                    retry.append(index)
                    error = f"{failure.get('Code')}: {failure.get('Message')}"
            return retry, error

        left, error = await retry_entries(range(len(entries)), send, attempts=_ENTRY_RETRIES, backoff=_ENTRY_BACKOFF)
        if left:
            raise SqsAdvanceError(
                f"SQS {what} on {self.settings.queue_url} still failing for {len(left)} message(s) "
                f"after {_ENTRY_RETRIES} attempts ({error}); not advanced, they come back after their "
                "visibility timeout"
            )
        return faults

    # -- queue checks --------------------------------------------------------------------------
    async def _queue_attributes(self, client: Any, queue_url: str, *, role: str) -> dict[str, str]:
        try:
            self.counters.add("api_calls")
            response = await client.get_queue_attributes(
                QueueUrl=queue_url,
                AttributeNames=["FifoQueue", "VisibilityTimeout", "RedrivePolicy", "QueueArn"],
            )
        except AWS_ERRORS as exc:
            cause = self.explain(exc, queue_url)
            if role == "dlq":
                cause = f"dlq_queue_url {queue_url!r}: {cause}"
            if is_transient(exc):  # botocore's retries are spent: an outage, not a setting
                raise self.unavailable_error(cause, exc) from exc
            raise self.config_error(cause, exc) from exc
        return dict(response.get("Attributes", {}))

    async def check_queues(self, client: Any, *, fifo: bool) -> bool:
        """Check the queue (FIFO as its URL says) and the DLQ exist; return whether the DLQ is FIFO."""
        settings = self.settings
        attributes = await self._queue_attributes(client, settings.queue_url, role="source")
        is_fifo = attributes.get("FifoQueue", "false").lower() == "true"
        if is_fifo != fifo:
            raise self.config_error(
                f"the queue reports FifoQueue={is_fifo} but its URL says {'FIFO' if fifo else 'standard'}"
            )
        if settings.dlq_queue_url is not None:
            dlq_attributes = await self._queue_attributes(client, settings.dlq_queue_url, role="dlq")
            # The settings compare account and queue name; SQS itself says which queue each URL
            # resolves to (an alias endpoint, a proxy): one queue would dead-letter into itself.
            arn = attributes.get("QueueArn")
            if arn and arn == dlq_attributes.get("QueueArn"):
                raise self.config_error(
                    f"dlq_queue_url {settings.dlq_queue_url!r} resolves to the queue itself ({arn}): every "
                    "rejected message would be sent back to the queue it came from"
                )
            return dlq_attributes.get("FifoQueue", "false").lower() == "true"
        if not attributes.get("RedrivePolicy"):
            self.log.warning(
                "SQS queue %s has no dlq_queue_url and no RedrivePolicy: rejected and poison messages stay "
                "in the queue and come back every %s s (never deleted)",
                settings.queue_url,
                settings.reject_backoff,
            )
        return False


# -- the wire format of messages -------------------------------------------------------------------
def envelope_fields(
    raw: Mapping[str, Any],
    *,
    queue_url: str,
    message_id: str,
    body: str,
    message_attributes: Mapping[str, dict[str, Any]],
    group_id: str | None,
) -> dict[str, Any]:
    """
    The envelope arguments of one received message but its delivery attempt: attributes as text, a
    ``content-transfer-encoding: base64`` body decoded, system attributes as metadata.
    """
    system = raw.get("Attributes") or {}
    attributes = {name: _attribute_text(value) for name, value in message_attributes.items()}
    decoded: str | bytes = body
    if attributes.get(TRANSFER_ENCODING_ATTRIBUTE, "").lower() == "base64":
        try:
            decoded = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            decoded = body  # not base64 after all: show it as it is
    metadata: dict[str, Any] = {"queue_url": queue_url}
    if group_id is not None:
        metadata["message_group_id"] = group_id
    for key, name in (("SequenceNumber", "sequence_number"), ("MessageDeduplicationId", "deduplication_id")):
        if key in system:
            metadata[name] = system[key]
    first = system.get("ApproximateFirstReceiveTimestamp")
    if first is not None:
        metadata["first_received_at"] = iso_timestamp(int(first), unit="ms")
    sent = system.get("SentTimestamp")
    return {
        "source": queue_url,
        "message_id": message_id,
        "body": decoded,
        "attributes": attributes,
        "published_at": iso_timestamp(int(sent), unit="ms") if sent is not None else None,
        "metadata": metadata,
    }


def _attribute_text(value: dict[str, Any]) -> str:
    if "StringValue" in value:
        return str(value["StringValue"])
    if "BinaryValue" in value:
        return text_value(value["BinaryValue"])
    return ""


def send_entry(
    body: str,
    message_attributes: Mapping[str, dict[str, Any]],
    extra: Mapping[str, str],
    *,
    group_id: str | None,
    deduplication_id: str,
) -> dict[str, Any]:
    """
    A ``SendMessageBatch`` entry re-sending ``body`` and ``message_attributes`` as received, plus
    ``extra`` as String attributes while SQS's 10-attribute limit allows; for a FIFO queue
    (``group_id`` set) with that group and ``deduplication_id``.
    """
    attributes: dict[str, Any] = {
        name: {k: v for k, v in value.items() if k in ("DataType", "StringValue", "BinaryValue")}
        for name, value in message_attributes.items()
    }
    added = {name: {"DataType": "String", "StringValue": text} for name, text in extra.items()}
    add_within_limit(attributes, added, limit=MAX_MESSAGE_ATTRIBUTES, overwrite=False)
    record: dict[str, Any] = {"MessageBody": body}
    if attributes:
        record["MessageAttributes"] = attributes
    if group_id is not None:
        record["MessageGroupId"] = group_id
        record["MessageDeduplicationId"] = deduplication_id
    return record
