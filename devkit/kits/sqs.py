"""
The SQS test kit: moto's server (in a thread, ``devkit.brokers.start_moto``, or a ``moto_server``
subprocess whose CPU stays off the caller's GIL), or the endpoint ``SQS_ENDPOINT_URL`` names, the
``aws`` connection, and :class:`SqsOrders`, one queue and its dead-letter queue (boto3).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
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


def sqs_connection(endpoint: str, region: str = SQS_REGION) -> dict[str, Any]:
    """The Airflow ``aws`` connection that reaches ``endpoint`` (moto takes any credentials)."""
    return {
        "conn_type": "aws",
        "login": MOTO_KEY,
        "password": MOTO_KEY,
        "extra": {"endpoint_url": endpoint, "region_name": region},
    }


@dataclass
class SqsOrders(OrdersById):
    """A queue and its dead-letter queue on an SQS endpoint, read and written with boto3."""

    source_field = "queue_url"
    source_arg = "queue_url"

    endpoint: str
    queue: str = SQS_QUEUE
    dlq: str = SQS_DLQ
    region: str = SQS_REGION
    client: Any = field(init=False)
    queue_url: str = field(init=False)
    dlq_url: str = field(init=False)
    published: dict[str, OrderMessage] = field(default_factory=dict, init=False)
    dead: dict[str, str] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        import boto3

        credentials = {"aws_access_key_id": MOTO_KEY, "aws_secret_access_key": MOTO_KEY}
        self.client = boto3.client("sqs", region_name=self.region, endpoint_url=self.endpoint, **credentials)
        self.queue_url = str(self.client.create_queue(QueueName=self.queue)["QueueUrl"])
        self.dlq_url = str(self.client.create_queue(QueueName=self.dlq)["QueueUrl"])

    def airflow_connection(self) -> dict[str, Any]:
        """The Airflow ``aws`` connection that reaches this endpoint (moto takes any credentials)."""
        return sqs_connection(self.endpoint, self.region)

    chunk_size = 10  # SendMessageBatch's limit

    def _send(self, chunk: list[Item]) -> list[str]:
        """One SendMessageBatch (SQS has no key); the MessageIds in the chunk's order."""
        entries = [{"Id": str(i), "MessageBody": body.decode("utf-8")} for i, (body, _) in enumerate(chunk)]
        response = self.client.send_message_batch(QueueUrl=self.queue_url, Entries=entries)
        if response.get("Failed"):
            raise RuntimeError(f"SQS refused messages: {response['Failed']}")
        by_entry = {int(ok["Id"]): str(ok["MessageId"]) for ok in response["Successful"]}
        return [by_entry[i] for i in sorted(by_entry)]

    def backlog(self, queue_url: str) -> int:
        """Visible + in-flight messages of a queue."""
        attributes = self.client.get_queue_attributes(
            QueueUrl=queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])

    def dead_letters(self) -> dict[str, str]:
        """``source MessageId -> x-dead-letter-reason``, accumulated over every read of the DLQ queue."""
        while True:
            response = self.client.receive_message(
                QueueUrl=self.dlq_url,
                MaxNumberOfMessages=10,
                MessageAttributeNames=["All"],
                VisibilityTimeout=600,
                WaitTimeSeconds=0,
            )
            batch = response.get("Messages", [])
            if not batch:
                return dict(self.dead)
            for message in batch:
                attributes = message.get("MessageAttributes", {})
                source = attributes.get(DEAD_LETTER_MESSAGE_ID, {}).get("StringValue")
                reason = attributes.get(DEAD_LETTER_REASON, {}).get("StringValue", "")
                self.dead[str(source)] = str(reason)

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
    process), or ``SQS_ENDPOINT_URL`` when not ``own``.
    """

    name = "sqs"
    address_env = ENDPOINT_ENV

    def __init__(self, *, own: bool | None = None, in_subprocess: bool = False, region: str = SQS_REGION) -> None:
        super().__init__(own=own)
        self.in_subprocess = in_subprocess
        self.region = region
        self.handle: BrokerProcess | None = None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return self.address

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
        return sqs_connection(self.endpoint, self.region)

    def stream(self, name: str, *, dlq: str | None = None) -> SqsOrders:
        """Queue ``name`` and its dead-letter queue (``<name>-dlq`` by default), created."""
        return SqsOrders(self.endpoint, name, f"{name}-dlq" if dlq is None else dlq, self.region)


def _popen(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
