"""
The SQS test kit: moto's server (in a thread, ``devkit.brokers.start_moto``, or a ``moto_server``
subprocess whose CPU stays off the caller's GIL), or the endpoint ``SQS_ENDPOINT_URL`` names, the
``aws`` connection, and :class:`SqsOrders`, one queue and its dead-letter queue (boto3).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from devkit.brokers import BrokerProcess, start_moto, stop_moto
from devkit.demo_types import OrderMessage
from devkit.kits import BrokerKit, Item, OrdersById
from devkit.ports import free_port, wait_for_port

SQS_REGION: Final = "us-east-1"
SQS_QUEUE: Final = "orders"
SQS_DLQ: Final = "orders-dlq"
SQS_CONN_ID: Final = "aws_default"
MOTO_KEY: Final = "testing"  # moto accepts any credentials: this key id and secret everywhere
DEAD_LETTER_REASON: Final = "x-dead-letter-reason"
DEAD_LETTER_MESSAGE_ID: Final = "x-dead-letter-message-id"
ENDPOINT_ENV: Final = "SQS_ENDPOINT_URL"
# The attribute that says a body went as base64 (bytes that are no SQS text), as the producer documents.
TRANSFER_ENCODING: Final = "content-transfer-encoding"


def sqs_connection(endpoint: str, region: str = SQS_REGION, *, moto_key: bool = True) -> dict[str, Any]:
    """
    The Airflow ``aws`` connection that reaches ``endpoint``: with moto's key (moto takes any
    credentials), or (``moto_key=False``) none, for the default AWS credential chain.
    """
    connection: dict[str, Any] = {"conn_type": "aws", "extra": {"endpoint_url": endpoint, "region_name": region}}
    if moto_key:
        connection.update(login=MOTO_KEY, password=MOTO_KEY)
    return connection


def sqs_client_kwargs(endpoint: str, region: str = SQS_REGION, *, moto_key: bool = True) -> dict[str, Any]:
    """A boto3 / aiobotocore ``sqs`` client's arguments for ``endpoint`` (credentials as :func:`sqs_connection`)."""
    kwargs: dict[str, Any] = {"region_name": region, "endpoint_url": endpoint}
    if moto_key:
        kwargs.update(aws_access_key_id=MOTO_KEY, aws_secret_access_key=MOTO_KEY)
    return kwargs


def sqs_body(body: bytes) -> tuple[str, dict[str, Any]]:
    """SQS bodies are text: bytes that are not valid SQS text go as base64 + a transfer-encoding attribute."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c in "\t\n\r" or " " <= c <= "\ud7ff" or c >= "\ue000" for c in text):
        return text, {}
    encoded = base64.b64encode(body).decode("ascii")
    return encoded, {TRANSFER_ENCODING: {"DataType": "String", "StringValue": "base64"}}


def original_bytes(message: Mapping[str, Any]) -> bytes:
    """The bytes a received message was sent as (a base64 body decoded, see :func:`sqs_body`)."""
    attributes = message.get("MessageAttributes") or {}
    if attributes.get(TRANSFER_ENCODING, {}).get("StringValue") == "base64":
        return base64.b64decode(message["Body"])
    return str(message["Body"]).encode("utf-8")


@dataclass
class SqsOrders(OrdersById):
    """
    A queue and its dead-letter queue on an SQS endpoint, created, read and written with boto3
    (sync; the integration tests call it from a worker thread). ``fifo``: FIFO queues (the names
    get ``.fifo``); ``visibility``: both queues' VisibilityTimeout (None: the service's default);
    ``redrive``: the queue's RedrivePolicy moves a message to the dead-letter queue after that
    many receives; ``moto_key`` False: the default AWS credential chain instead of moto's key.
    """

    source_field = "queue_url"
    source_arg = "queue_url"

    endpoint: str
    queue: str = SQS_QUEUE
    dlq: str = SQS_DLQ
    region: str = SQS_REGION
    fifo: bool = False
    visibility: int | None = None
    redrive: int | None = None
    moto_key: bool = True
    client: Any = field(init=False)
    queue_url: str = field(init=False)
    dlq_url: str = field(init=False)
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)
    dead: dict[str, str] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        import boto3

        self.client = boto3.client("sqs", **sqs_client_kwargs(self.endpoint, self.region, moto_key=self.moto_key))
        suffix = ".fifo" if self.fifo else ""
        self.queue, self.dlq = (name if name.endswith(suffix) else name + suffix for name in (self.queue, self.dlq))
        attributes = {"FifoQueue": "true"} if self.fifo else {}
        if self.visibility is not None:
            attributes["VisibilityTimeout"] = str(self.visibility)
        self.dlq_url = str(self.client.create_queue(QueueName=self.dlq, Attributes=attributes)["QueueUrl"])
        if self.redrive is not None:
            arn = self.client.get_queue_attributes(QueueUrl=self.dlq_url, AttributeNames=["QueueArn"])
            policy = {"deadLetterTargetArn": arn["Attributes"]["QueueArn"], "maxReceiveCount": self.redrive}
            attributes = {**attributes, "RedrivePolicy": json.dumps(policy)}
        self.queue_url = str(self.client.create_queue(QueueName=self.queue, Attributes=attributes)["QueueUrl"])

    def airflow_connection(self) -> dict[str, Any]:
        """The Airflow ``aws`` connection that reaches this endpoint (with the credentials of the kit's client)."""
        return sqs_connection(self.endpoint, self.region, moto_key=self.moto_key)

    chunk_size = 10  # SendMessageBatch's limit

    def _send(self, chunk: list[Item]) -> list[str]:
        """One SendMessageBatch (SQS has no key); the MessageIds in the chunk's order."""
        return self.send_batch([self.entry(body) for body, _ in chunk])

    def entry(
        self,
        body: bytes,
        *,
        message_attributes: Mapping[str, Mapping[str, Any]] | None = None,
        group_id: str | None = None,
    ) -> dict[str, Any]:
        """
        One SendMessageBatch entry (its ``Id`` set by :meth:`send_batch`): ``body`` as SQS text
        (:func:`sqs_body`), ``message_attributes`` in SQS's own shape (any DataType), and, with
        ``group_id``, a MessageGroupId and a fresh deduplication id (FIFO).
        """
        text, encoding = sqs_body(body)
        attributes = {name: dict(value) for name, value in (message_attributes or {}).items()}
        attributes.update(encoding)
        entry: dict[str, Any] = {"MessageBody": text}
        if attributes:
            entry["MessageAttributes"] = attributes
        if group_id is not None:
            entry["MessageGroupId"] = group_id
            entry["MessageDeduplicationId"] = uuid.uuid4().hex
        return entry

    def send_batch(self, entries: Sequence[Mapping[str, Any]]) -> list[str]:
        """Send the entries in order, one SendMessageBatch of up to 10 after another; the MessageIds in order."""
        ids: list[str] = []
        for start in range(0, len(entries), self.chunk_size):
            chunk = [{**e, "Id": str(i)} for i, e in enumerate(entries[start : start + self.chunk_size])]
            response = self.client.send_message_batch(QueueUrl=self.queue_url, Entries=chunk)
            if response.get("Failed"):
                raise RuntimeError(f"SQS refused messages: {response['Failed']}")
            by_entry = {int(ok["Id"]): str(ok["MessageId"]) for ok in response["Successful"]}
            ids += [by_entry[i] for i in sorted(by_entry)]
        return ids

    def counts(self, queue_url: str | None = None) -> tuple[int, int]:
        """(visible, in flight) of a queue (this stream's by default), as SQS reports them."""
        attributes = self.client.get_queue_attributes(
            QueueUrl=queue_url or self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]), int(attributes["ApproximateNumberOfMessagesNotVisible"])

    def backlog(self, queue_url: str) -> int:
        """Visible + in-flight messages of a queue."""
        return sum(self.counts(queue_url))

    def _receive_dead(self, visibility: int) -> list[dict[str, Any]]:
        response = self.client.receive_message(
            QueueUrl=self.dlq_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=0,
            VisibilityTimeout=visibility,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["All"],
        )
        return list(response.get("Messages") or [])

    def dead_letter_messages(self) -> list[dict[str, Any]]:
        """Every message of the DLQ queue (body and attributes), left there: hidden while listed, then released."""
        seen: dict[str, dict[str, Any]] = {}
        while messages := self._receive_dead(30):
            seen.update((message["MessageId"], message) for message in messages)
        handles = [m["ReceiptHandle"] for m in seen.values()]
        for start in range(0, len(handles), 10):
            self.client.change_message_visibility_batch(
                QueueUrl=self.dlq_url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": h, "VisibilityTimeout": 0}
                    for i, h in enumerate(handles[start : start + 10])
                ],
            )
        return list(seen.values())

    def take_dead_letter_messages(self) -> list[dict[str, Any]]:
        """
        Receive and delete every message the DLQ queue shows now (a FIFO queue hides the rest of a
        message group while one of its messages is in flight, so a read that releases them misses
        some); what was taken, in the order received.
        """
        taken: list[dict[str, Any]] = []
        while received := self._receive_dead(60):
            taken += received
            entries = [{"Id": str(i), "ReceiptHandle": raw["ReceiptHandle"]} for i, raw in enumerate(received)]
            deleted = self.client.delete_message_batch(QueueUrl=self.dlq_url, Entries=entries)
            if deleted.get("Failed"):
                raise RuntimeError(f"SQS did not delete dead letters: {deleted['Failed']}")
        return taken

    def delete(self) -> None:
        """Delete the queue and its dead-letter queue, and close the client."""
        for url in (self.queue_url, self.dlq_url):
            self.client.delete_queue(QueueUrl=url)
        self.client.close()

    def dead_letters(self) -> dict[str, str]:
        """``source MessageId -> x-dead-letter-reason``, accumulated over every read of the DLQ queue."""
        while batch := self._receive_dead(600):
            for message in batch:
                attributes = message.get("MessageAttributes", {})
                source = attributes.get(DEAD_LETTER_MESSAGE_ID, {}).get("StringValue")
                reason = attributes.get(DEAD_LETTER_REASON, {}).get("StringValue", "")
                self.dead[str(source)] = str(reason)
        return dict(self.dead)

    def unsettled(self) -> int:
        return self.backlog(self.queue_url)

    def diagnostics(self) -> str:
        return f"{self.backlog(self.queue_url)} message(s) still in the queue (visible or in flight)"


def stop_process_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (it was started in its own session), SIGKILL after 10 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class SqsKit(BrokerKit):
    """
    moto's server on a free loopback port (in a thread; ``in_subprocess=True``: a ``moto_server``
    process), or ``SQS_ENDPOINT_URL`` when not ``own``. ``credential_chain``: a configured endpoint
    (LocalStack, ElasticMQ, real SQS) is reached with the default AWS credential chain, not moto's key.
    """

    name = "sqs"
    address_env = ENDPOINT_ENV

    def __init__(
        self,
        *,
        own: bool | None = None,
        in_subprocess: bool = False,
        region: str = SQS_REGION,
        credential_chain: bool = False,
    ) -> None:
        super().__init__(own=own)
        self.in_subprocess = in_subprocess
        self.region = region
        self.credential_chain = credential_chain
        self.handle: BrokerProcess | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return self.address

    @property
    def configured(self) -> bool:
        """Whether the endpoint is the one ``SQS_ENDPOINT_URL`` names (the kit started none)."""
        return bool(self.address) and self.handle is None and self.process is None

    @property
    def moto_key(self) -> bool:
        """Whether clients and connections carry moto's key (else: the default AWS credential chain)."""
        return not (self.credential_chain and self.configured)

    def client_kwargs(self) -> dict[str, Any]:
        """A boto3 / aiobotocore ``sqs`` client's arguments for the endpoint."""
        return sqs_client_kwargs(self.endpoint, self.region, moto_key=self.moto_key)

    def _start_own(self) -> str:
        import logging

        if self.in_subprocess:
            port = free_port()
            binary = Path(sys.executable).parent / "moto_server"
            self.process = _popen([str(binary), "-H", "127.0.0.1", "-p", str(port)])
            wait_for_port(port, timeout=60)
            self.address = f"http://127.0.0.1:{port}"
            return f"moto_server {self.address}"
        # moto's HTTP server logs every request through werkzeug: noise in the progress display.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self.handle = start_moto()
        self.address = self.handle.address
        return f"SQS endpoint (moto server) {self.address}"

    def stop(self) -> None:
        if self.handle is not None:
            stop_moto(self.handle)
            self.handle = None
        if self.process is not None:
            stop_process_group(self.process)
            self.process = None

    def connection(self) -> dict[str, Any]:
        return sqs_connection(self.endpoint, self.region, moto_key=self.moto_key)

    def stream(
        self,
        name: str,
        *,
        dlq: str | None = None,
        fifo: bool = False,
        visibility: int | None = None,
        redrive: int | None = None,
    ) -> SqsOrders:
        """
        Queue ``name`` and its dead-letter queue (``<name>-dlq`` by default), created (options:
        :class:`SqsOrders`'s).
        """
        dlq = f"{name}-dlq" if dlq is None else dlq
        queues: dict[str, Any] = {"fifo": fifo, "visibility": visibility, "redrive": redrive}
        return SqsOrders(self.endpoint, name, dlq, self.region, moto_key=self.moto_key, **queues)


def _popen(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
