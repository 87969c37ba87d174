"""
AWS SQS shared-stream trigger: many AssetWatchers, one aiobotocore receive loop per queue.

Imports no AWS client: Dag files import this module. The receive loop lives in
:mod:`airflow_shared_stream_provider.producers.sqs`, loaded only in the triggerer.

Example, two watchers and one receive loop on the queue for both (the triggers share their stream settings)::

    from airflow.sdk import Asset, AssetWatcher
    from airflow_shared_stream_provider.triggers.sqs import SqsSharedStreamTrigger

    QUEUE = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"

    def orders_of(region: str) -> Asset:
        trigger = SqsSharedStreamTrigger(queue_url=QUEUE, dlq_queue_url=QUEUE + "-dlq", match={"body.region": region})
        return Asset(f"{region}_orders", watchers=[AssetWatcher(name=f"{region}_orders", trigger=trigger)])

    eu_orders, us_orders = orders_of("eu"), orders_of("us")
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, ClassVar, Final

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+
from urllib.parse import urlsplit

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamOptions, SharedStreamTrigger, settings_arguments
from airflow_shared_stream_provider.brokers import BrokerName

MAX_VISIBILITY_TIMEOUT: Final = 43_200  # SQS: 12 hours
MAX_WAIT_TIME_SECONDS: Final = 20  # SQS long polling limit
MAX_CONCURRENT_RECEIVES: Final = 10

# https://sqs.<region>.amazonaws.com/<account>/<name>, https://<region>.queue.amazonaws.com/...,
# https://sqs.<region>.amazonaws.com.cn/..., VPC endpoints https://vpce-...sqs.<region>.vpce.amazonaws.com/...
_REGION_IN_URL: Final = re.compile(
    r"^https?://(?:[^/]*\.)?(?:sqs\.(?P<a>[a-z]{2}(?:-[a-z]+)+-\d)|(?P<b>[a-z]{2}(?:-[a-z]+)+-\d)\.queue)\.amazonaws\.com"
)
_QUEUE_URL: Final = re.compile(r"^https?://[^/\s]+/[^/\s]+/[A-Za-z0-9_-]{1,80}(?:\.fifo)?/?$")


# The legacy global endpoints, both in us-east-1.
_LEGACY_HOSTS: Final = frozenset({"queue.amazonaws.com", "sqs.amazonaws.com"})


def region_from_queue_url(queue_url: str) -> str | None:
    """The AWS region named in an SQS queue URL, or None (LocalStack, moto, custom endpoints)."""
    lowered = queue_url.lower()  # host names are case-insensitive
    found = _REGION_IN_URL.match(lowered)
    if found is not None:
        return found.group("a") or found.group("b")
    host = urlsplit(lowered).hostname
    return "us-east-1" if host in _LEGACY_HOSTS else None


def queue_identity(queue_url: str) -> tuple[str, str, str | None]:
    """
    ``(account id, queue name, region or None)`` of a queue URL: what names the queue, whatever the
    scheme, host spelling, trailing slash or endpoint form (``sqs.<region>``, ``<region>.queue``,
    the legacy ``queue.amazonaws.com``, a VPC endpoint, a local emulator).
    """
    account, name = urlsplit(queue_url).path.strip("/").split("/")[-2:]
    return account, name, region_from_queue_url(queue_url)


def same_queue(first_url: str, second_url: str) -> bool:
    """
    Whether two queue URLs name the same queue: same account and name (both case-sensitive on SQS),
    and not two different regions. A URL that names no region (an emulator, a custom endpoint) is
    read with the client's region, so it matches a regional URL of the same account and name.
    """
    account_a, name_a, region_a = queue_identity(first_url)
    account_b, name_b, region_b = queue_identity(second_url)
    if (account_a, name_a) != (account_b, name_b):
        return False
    return region_a is None or region_b is None or region_a == region_b


def is_fifo_url(queue_url: str) -> bool:
    """FIFO queue names end in ``.fifo`` (SQS enforces it), so the URL tells the queue type."""
    return queue_url.rstrip("/").endswith(".fifo")


def queue_name_of(queue_url: str) -> str:
    return queue_url.rstrip("/").rsplit("/", 1)[-1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SqsStreamSettings(StreamSettings):
    """Everything :class:`~airflow_shared_stream_provider.producers.sqs.SqsSharedStreamProducer` reads."""

    broker: ClassVar[BrokerName] = BrokerName("sqs")

    queue_url: str
    aws_conn_id: str | None = "aws_default"
    region_name: str | None = None
    dlq_queue_url: str | None = None
    wait_time_seconds: int = 20
    visibility_timeout: int = 30
    concurrent_receives: int = 1
    hold_backoff: int = 1
    reject_backoff: int = 300

    def check(self) -> None:
        if not _QUEUE_URL.match(self.queue_url):
            raise SharedStreamConfigError(
                f"queue_url must be a full SQS queue URL like "
                f"'https://sqs.<region>.amazonaws.com/<account>/<queue>', got {self.queue_url!r}"
            )
        if self.dlq_queue_url is not None:
            if not _QUEUE_URL.match(self.dlq_queue_url):
                raise SharedStreamConfigError(f"dlq_queue_url must be a full SQS queue URL, got {self.dlq_queue_url!r}")
            # Compared as queues, not strings: http/https, host case, a trailing slash or another
            # endpoint form of the same queue would dead-letter every reject back into the queue.
            if same_queue(self.dlq_queue_url, self.queue_url):
                raise SharedStreamConfigError(
                    f"dlq_queue_url must differ from queue_url: {self.dlq_queue_url!r} names the same queue as "
                    f"{self.queue_url!r}, so every rejected message would be sent back to the queue it came from"
                )
        url_region = region_from_queue_url(self.queue_url)
        if self.region_name is not None and url_region is not None and url_region != self.region_name:
            raise SharedStreamConfigError(
                f"queue_url {self.queue_url!r} is in region {url_region!r} but region_name is {self.region_name!r}"
            )
        for name in (
            "wait_time_seconds",
            "visibility_timeout",
            "concurrent_receives",
            "hold_backoff",
            "reject_backoff",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SharedStreamConfigError(f"{name} must be an int (SQS takes whole seconds), got {value!r}")
        self.require_number("wait_time_seconds", self.wait_time_seconds, minimum=0, maximum=MAX_WAIT_TIME_SECONDS)
        self.require_number("visibility_timeout", self.visibility_timeout, minimum=1, maximum=MAX_VISIBILITY_TIMEOUT)
        self.require_number("concurrent_receives", self.concurrent_receives, minimum=1, maximum=MAX_CONCURRENT_RECEIVES)
        self.require_number("hold_backoff", self.hold_backoff, minimum=0, maximum=MAX_VISIBILITY_TIMEOUT)
        self.require_number("reject_backoff", self.reject_backoff, minimum=0, maximum=MAX_VISIBILITY_TIMEOUT)

    @property
    def fifo(self) -> bool:
        return is_fifo_url(self.queue_url)

    @property
    def queue_name(self) -> str:
        return queue_name_of(self.queue_url)


class SqsSharedStreamTrigger(SharedStreamTrigger):
    """
    Fire asset events from an SQS queue through one shared receive loop per queue.

    Watchers whose producer settings are equal share one aiobotocore client and one long-polling
    receive loop in the triggerer; each applies its own ``match`` / ``filter_function``. A message
    is deleted only after every watcher's events for it are persisted in the metadata DB; while
    watchers work on it, its visibility timeout is extended. See ``docs/sqs.md`` for the guarantees,
    the failure matrix and why siblings must not run on several triggerers.

    :param queue_url: the queue's URL (a ``.fifo`` URL is read as a FIFO queue).
    :param aws_conn_id: Airflow connection of the upstream ``aws`` shape (login/password = access
        key id/secret; extras ``region_name``, ``endpoint_url``, ``aws_session_token``,
        ``role_arn``, ``config_kwargs``). ``None``, or a connection that does not exist, means the
        default AWS credential chain.
    :param region_name: overrides the connection's region; default: the connection's, else the
        region in the queue URL, else the credential chain's.
    :param dlq_queue_url: queue that receives rejected and poison messages (original body and
        message attributes plus ``x-dead-letter-reason``), which are then deleted. Without it they
        stay in the queue, invisible for ``reject_backoff`` seconds at a time (never deleted, never
        lost; a RedrivePolicy on the queue moves them to its own DLQ).

    Also takes the options every shared-stream trigger takes (``match``, ``filter_function``,
    ``on_filter_error``, ``flush_after``, ``max_payload_bytes``, ``oversize_policy``,
    ``max_in_flight``, ``max_in_flight_bytes``, ``batch_size``, ``batch_timeout``; see
    :class:`~airflow_shared_stream_provider._core.trigger.SharedStreamOptions`) and:

    :param max_delivery_attempts: poison cap on ``ApproximateReceiveCount`` (default 5, None = off).
    :param wait_time_seconds: long-polling wait of one receive call, 0-20 (default 20).
    :param visibility_timeout: lease requested on receive and on each extension, seconds
        (default 30). Also how long after a triggerer crash its messages come back.
    :param concurrent_receives: receive calls in flight at once, 1-10 (default 1); more helps
        throughput against real SQS (each call returns at most 10 messages).
    :param hold_backoff: seconds a message broadcast to no watcher stays invisible (default 1).
    :param reject_backoff: without ``dlq_queue_url``, seconds a rejected / poison message stays
        invisible before it is received again (default 300).
    """

    settings_class = SqsStreamSettings
    producer_class_path = "airflow_shared_stream_provider.producers.sqs.SqsSharedStreamProducer"
    settings: SqsStreamSettings

    def __init__(
        self,
        *,
        queue_url: str,
        aws_conn_id: str | None = "aws_default",
        region_name: str | None = None,
        dlq_queue_url: str | None = None,
        wait_time_seconds: int = 20,
        visibility_timeout: int = 30,
        concurrent_receives: int = 1,
        hold_backoff: int = 1,
        reject_backoff: int = 300,
        **options: Unpack[SharedStreamOptions],
    ) -> None:
        super().__init__(**settings_arguments(self.settings_class, locals()))
