"""
Redis Streams shared-stream trigger: many AssetWatchers, one consumer-group reader per stream.

Imports no Redis client: Dag files import this module. The receive loop lives in
:mod:`airflow_shared_stream_provider.producers.redis`, loaded only in the triggerer.

Example, two watchers and one reader in the consumer group (the triggers share their stream settings)::

    from airflow.sdk import Asset, AssetWatcher
    from airflow_shared_stream_provider.triggers.redis import RedisSharedStreamTrigger

    def orders_of(region: str) -> Asset:
        trigger = RedisSharedStreamTrigger(
            stream="orders", dead_letter_stream="orders:dead-letter", match={"body.region": region}
        )
        return Asset(f"{region}_orders", watchers=[AssetWatcher(name=f"{region}_orders", trigger=trigger)])

    eu_orders, us_orders = orders_of("eu"), orders_of("us")
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, ClassVar, Final
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack is Python 3.11+

from airflow_shared_stream_provider._core.errors import SharedStreamConfigError
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamOptions, SharedStreamTrigger, settings_arguments
from airflow_shared_stream_provider.brokers import BrokerName
from airflow_shared_stream_provider.queues import SharedStreamQueueProvider, path_segments

DEFAULT_GROUP: Final = "airflow-shared-stream"
MAX_CLAIM_IDLE: Final = 86_400.0
MAX_BLOCK: Final = 60.0
MAX_READ_COUNT: Final = 10_000
# XGROUP CREATE's start: "$" (only entries added from now on), "0" (the whole stream) or an entry id.
_START_ID: Final = re.compile(r"^(\$|\d{1,20}(-\d{1,20})?)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RedisStreamSettings(StreamSettings):
    """Everything :class:`~airflow_shared_stream_provider.producers.redis.RedisSharedStreamProducer` reads."""

    broker: ClassVar[BrokerName] = BrokerName("redis")

    stream: str
    redis_conn_id: str = "redis_default"
    group: str = DEFAULT_GROUP
    dead_letter_stream: str | None = None
    dead_letter_maxlen: int | None = None
    body_field: str = "body"
    create_group: bool = True
    group_start_id: str = "0"
    claim_idle: float = 30.0
    block: float = 2.0
    read_count: int = 100
    hold_backoff: float = 1.0

    def check(self) -> None:
        if self.dead_letter_stream == self.stream:
            raise SharedStreamConfigError(
                f"dead_letter_stream must differ from stream ({self.stream!r}): every rejected entry would be "
                "added back to the stream it came from"
            )
        if self.dead_letter_maxlen is not None:
            if isinstance(self.dead_letter_maxlen, bool) or not isinstance(self.dead_letter_maxlen, int):
                raise SharedStreamConfigError(f"dead_letter_maxlen must be an int, got {self.dead_letter_maxlen!r}")
            self.require_number("dead_letter_maxlen", self.dead_letter_maxlen, minimum=1)
        if not isinstance(self.create_group, bool):
            raise SharedStreamConfigError(f"create_group must be True or False, got {self.create_group!r}")
        if not isinstance(self.group_start_id, str) or not _START_ID.match(self.group_start_id):
            raise SharedStreamConfigError(
                f"group_start_id must be '$', '0' or an entry id like '1700000000000-0', got {self.group_start_id!r}"
            )
        self.require_number("claim_idle", self.claim_idle, minimum=1, maximum=MAX_CLAIM_IDLE)
        self.require_number("block", self.block, minimum=0.01, maximum=MAX_BLOCK)
        if isinstance(self.read_count, bool) or not isinstance(self.read_count, int):
            raise SharedStreamConfigError(f"read_count must be an int, got {self.read_count!r}")
        self.require_number("read_count", self.read_count, minimum=1, maximum=MAX_READ_COUNT)
        # A held entry is made claimable again after hold_backoff by setting its idle time to
        # claim_idle - hold_backoff: more than claim_idle cannot be expressed.
        self.require_number("hold_backoff", self.hold_backoff, minimum=0, maximum=self.claim_idle)


class RedisSharedStreamTrigger(SharedStreamTrigger):
    """
    Fire asset events from a Redis stream through one shared consumer-group reader per stream.

    Watchers whose producer settings are equal share one Redis client and one ``XREADGROUP`` loop
    in the triggerer; each applies its own ``match`` / ``filter_function``. An entry is
    acknowledged (``XACK``) only after every watcher's events for it are persisted in the
    metadata DB; while watchers work on it, its idle time is reset so that no other consumer
    claims it. See ``docs/redis.md`` for the guarantees, the failure matrix and why siblings must
    not run on several triggerers.

    :param stream: the stream's key.
    :param redis_conn_id: Airflow connection of the upstream ``redis`` shape (host, port, login =
        username, password, extra ``db`` or a numeric schema, extras ``ssl``, ``ssl_cert_reqs``,
        ``ssl_ca_certs``, ``ssl_keyfile``, ``ssl_certfile``, ``ssl_check_hostname``).
    :param group: the consumer group (default ``airflow-shared-stream``).
    :param dead_letter_stream: stream that receives rejected and poison entries (their fields in
        order, a sender's ``x-dead-letter-*`` fields renamed ``x-original-*``, plus
        ``x-dead-letter-reason`` / ``-source`` / ``-message-id`` / ``-group``), which are then
        acknowledged. Without it they are acknowledged and logged at ERROR with their id (the entry
        stays in the stream until it is trimmed).
    :param dead_letter_maxlen: ``XADD ... MAXLEN ~ n`` on the dead-letter stream (None: no trim).
    :param body_field: the entry field that is the message body (default ``body``); every other
        field is an attribute. An entry without it has ``body`` None.
    :param create_group: create the group (and the stream, ``MKSTREAM``) when missing (default);
        False: a missing group fails the stream with ``SharedStreamConfigError``.
    :param group_start_id: where a group created here starts: ``"0"`` (default: the entries already
        in the stream too), ``"$"`` (only new ones) or an entry id.

    Also takes the options every shared-stream trigger takes (``match``, ``filter_function``,
    ``on_filter_error``, ``flush_after``, ``max_payload_bytes``, ``oversize_policy``,
    ``max_in_flight``, ``max_in_flight_bytes``, ``batch_size``, ``batch_timeout``; see
    :class:`~airflow_shared_stream_provider._core.trigger.SharedStreamOptions`) and:

    :param max_delivery_attempts: poison cap on the entry's delivery count (``XPENDING``'s
        times-delivered; default 5, None = off).
    :param claim_idle: the lease, seconds: a pending entry idle this long (its consumer died, or
        gave it back) is claimed (``XAUTOCLAIM``) and delivered again (default 30). The stream
        keeps its own entries' idle time below it while watchers work on them.
    :param block: seconds one ``XREADGROUP`` waits for new entries (default 2).
    :param read_count: most entries one ``XREADGROUP`` / ``XAUTOCLAIM`` returns (default 100).
    :param hold_backoff: seconds before an entry broadcast to no watcher is delivered again
        (default 1); the hold is not counted as a delivery attempt.
    """

    settings_class = RedisStreamSettings
    producer_class_path = "airflow_shared_stream_provider.producers.redis.RedisSharedStreamProducer"
    settings: RedisStreamSettings

    def __init__(
        self,
        *,
        stream: str,
        redis_conn_id: str = "redis_default",
        group: str = DEFAULT_GROUP,
        dead_letter_stream: str | None = None,
        dead_letter_maxlen: int | None = None,
        body_field: str = "body",
        create_group: bool = True,
        group_start_id: str = "0",
        claim_idle: float = 30.0,
        block: float = 2.0,
        read_count: int = 100,
        hold_backoff: float = 1.0,
        **options: Unpack[SharedStreamOptions],
    ) -> None:
        super().__init__(**settings_arguments(self.settings_class, locals()))


class RedisSharedStreamQueueProvider(SharedStreamQueueProvider):
    """
    ``scheme="shared+redis"`` -> :class:`RedisSharedStreamTrigger`; the deprecated ``queue=`` form
    is ``shared+redis://[<redis_conn_id>]/<stream>`` (an empty connection part keeps the default).
    """

    broker = "redis"
    queue_prefixes = ("shared+redis://",)

    def parse_queue(self, queue: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        parts = urlsplit(queue)
        segments = path_segments(queue, parts.path)
        if len(segments) != 1 or parts.query or parts.fragment:
            raise SharedStreamConfigError(f"queue URI {queue!r} is not shared+redis://[<redis_conn_id>]/<stream>")
        result: dict[str, Any] = {"stream": segments[0]}
        if parts.netloc:
            result["redis_conn_id"] = unquote(parts.netloc)
        return result
