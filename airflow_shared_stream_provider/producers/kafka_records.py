"""
Tolerant record reading for the Kafka producer's consumer: one bad record never stops a partition.

aiokafka decodes every header key as UTF-8 while it unpacks a fetched record batch, but the wire
format only says "bytes" and Go's sarama / franz-go and librdkafka let a producer write any bytes
there. One such record makes aiokafka raise ``UnicodeDecodeError`` out of ``getmany``: the records
fetched with it (of every partition in that call) are dropped, nothing moves, and the same batch
is fetched and fails again, forever. A batch whose CRC does not match or whose records are
malformed does the same with ``CorruptRecordException`` (Kafka brokers refuse such batches on
produce; Kafka-protocol brokers such as Tansu store them as sent).

What this module does instead, for **our consumer only** (never aiokafka itself, which the upstream
Kafka provider may use in the same triggerer process):

* Every batch is read by aiokafka as before (its C reader: the hot path is unchanged). When that
  raises for a batch, the batch is read again from the fetched bytes by :func:`parse_batch`, a
  small reader of the v2 format that never raises for what a producer wrote:

  - a record it can read is delivered; header keys that are not UTF-8 stay ``bytes`` (the envelope
    renders them ``base64:...`` as every non-UTF-8 header, see ``_core/envelope.text_value``);
  - a record it cannot read (malformed inside its length) becomes an :class:`Undecodable` for its
    offset, and the records after it in the batch are read on;
  - when the rest of a batch cannot be delimited, or the batch cannot be trusted at all (CRC
    mismatch, a compressed body that does not decompress, a record format older than v2 that
    failed), one :class:`Undecodable` covers the offsets left in that batch.

  The producer turns each :class:`Undecodable` into a delivery every watcher rejects, so the
  normal dead-letter path writes it (with where it was and why) and commits past it only after
  that, like any other record.
* A batch compressed with a codec whose library is missing raises, as before: that is the
  triggerer's configuration (``pip install cramjam``), not one bad record, and dead-lettering
  every such batch would empty the topic into the DLQ.

How it hooks in, and why it must be per instance: aiokafka builds the batch readers inside its
fetcher (``Fetcher._proc_fetch_request``) with no hook, and keeps no fetched bytes a caller could
read again. :class:`TolerantReader` therefore (1) wraps the ``send`` of *this consumer's* client
(each ``AIOKafkaConsumer`` owns its client) to keep the record bytes of each Fetch response per
partition, and (2) replaces *this consumer's* fetcher's buffer of fetched results with a dict that
swaps each new ``PartitionRecords`` for a :class:`_TolerantPartitionRecords` holding those bytes.
Both are attributes of objects only our consumer owns: no class or module of aiokafka is patched.
Written against aiokafka 0.14's fetcher (0.11 has the same shape); :meth:`TolerantReader.install`
checks every internal it uses and leaves the consumer as it is (with a warning) if one is missing.
"""

from __future__ import annotations

import collections
import inspect
import logging
import struct
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, Final

from aiokafka import TopicPartition
from aiokafka.codec import gzip_decode, has_lz4, has_snappy, has_zstd, lz4_decode, snappy_decode, zstd_decode
from aiokafka.consumer.fetcher import READ_COMMITTED, FetchResult, PartitionRecords
from aiokafka.errors import UnsupportedCodecError
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import ConsumerRecord

_log = logging.getLogger(__name__)

# RecordBatch v2: baseOffset, length, partitionLeaderEpoch, magic, crc, attributes, lastOffsetDelta,
# firstTimestamp, maxTimestamp, producerId, producerEpoch, baseSequence, record count.
_BATCH_HEADER: Final = struct.Struct(">qiibIhiqqqhii")
_LOG_OVERHEAD: Final = struct.Struct(">qi")  # baseOffset, length: every record format starts so
_CRC_FROM: Final = 21  # the CRC covers attributes to the end
_CODEC_MASK: Final = 0x07
_LOG_APPEND_TIME: Final = 0x08
_FETCH_API_KEY: Final = 1


@dataclass(frozen=True, slots=True)
class Undecodable:
    """
    Offsets ``offset`` to ``last_offset`` of one partition that cannot be read as records (one
    record, or the rest of a batch): ``reason`` says why, ``raw`` holds the bytes (for the DLQ).
    """

    topic: str
    partition: int
    offset: int
    last_offset: int
    reason: str
    raw: bytes

    def location(self) -> str:
        """``topic/partition/offset``, or ``topic/partition/first-last`` for a range."""
        where = f"{self.topic}/{self.partition}/{self.offset}"
        return where if self.last_offset == self.offset else f"{where}-{self.last_offset}"

    def __repr__(self) -> str:
        return f"Undecodable({self.location()}: {self.reason})"


class _MalformedError(ValueError):
    """A record (or batch) that does not follow the format; the message says where."""


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """Kafka's zig-zag varint/varlong at ``pos`` (never reading at or past ``end``)."""
    shift = result = 0
    while True:
        if pos >= end:
            raise _MalformedError("varint runs past the end")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise _MalformedError("varint longer than 10 bytes")


def _bytes(data: bytes, pos: int, end: int, what: str) -> tuple[bytes | None, int]:
    length, pos = _varint(data, pos, end)
    if length < 0:
        return None, pos
    if pos + length > end:
        raise _MalformedError(f"{what} of {length} bytes runs past the end of the record")
    return data[pos : pos + length], pos + length


def _decompress(codec: int, payload: bytes) -> bytes:
    if codec == 1:
        return bytes(gzip_decode(payload))
    checks: dict[int, tuple[str, Callable[[], bool], Callable[[bytes], bytes]]] = {
        2: ("snappy", has_snappy, snappy_decode),
        3: ("lz4", has_lz4, lz4_decode),
        4: ("zstd", has_zstd, zstd_decode),
    }
    if codec not in checks:
        raise _MalformedError(f"unknown compression codec {codec}")
    name, available, decode = checks[codec]
    if not available():
        # Configuration, not data: the caller lets it end the stream (see the module docstring).
        raise UnsupportedCodecError(f"Libraries for {name} compression codec not found")
    return decode(payload)


def _record(
    data: bytes, pos: int, end: int, *, topic: str, partition: int, offset: int, timestamp: int, timestamp_type: int
) -> ConsumerRecord[bytes, bytes]:
    """The record body after its offset delta: key, value, headers; it must end exactly at ``end``."""
    key, pos = _bytes(data, pos, end, "key")
    value, pos = _bytes(data, pos, end, "value")
    count, pos = _varint(data, pos, end)
    if count < 0:
        raise _MalformedError(f"negative header count {count}")
    headers: list[tuple[str | bytes, bytes | None]] = []
    for index in range(count):
        name, pos = _bytes(data, pos, end, f"header {index} key")
        if name is None:
            raise _MalformedError(f"header {index} has a null key")
        header_value, pos = _bytes(data, pos, end, f"header {index} value")
        try:
            headers.append((name.decode("utf-8"), header_value))
        except UnicodeDecodeError:
            headers.append((name, header_value))  # rendered base64:... by the envelope
    if pos != end:
        raise _MalformedError(f"{end - pos} bytes left after the headers")
    return ConsumerRecord(
        topic,
        partition,
        offset,
        timestamp,
        timestamp_type,
        key,
        value,
        None,
        len(key) if key is not None else -1,
        len(value) if value is not None else -1,
        tuple(headers),
    )


def parse_batch(
    data: bytes, *, topic: str, partition: int, from_offset: int, next_offset: int, check_crc: bool
) -> list[ConsumerRecord[bytes, bytes] | Undecodable]:
    """
    Every record of one batch at or above ``from_offset`` (what was already read is skipped), in
    offset order; what cannot be read becomes :class:`Undecodable`. ``next_offset`` is the offset
    after the batch (aiokafka read it from the batch header). Raises only
    ``UnsupportedCodecError`` (a codec library is missing).
    """
    out: list[ConsumerRecord[bytes, bytes] | Undecodable] = []
    last = next_offset - 1
    base = _LOG_OVERHEAD.unpack_from(data)[0] if len(data) >= _LOG_OVERHEAD.size else from_offset

    def rest(first: int, reason: str, raw: bytes) -> list[ConsumerRecord[bytes, bytes] | Undecodable]:
        start = max(first, from_offset)
        if start <= last:
            out.append(Undecodable(topic, partition, start, last, reason, raw))
        return out

    if len(data) < _BATCH_HEADER.size:
        return rest(base, f"record batch of {len(data)} bytes is shorter than its header", data)
    header = _BATCH_HEADER.unpack_from(data)
    magic, crc, attributes, count = header[3], header[4], header[5], header[12]
    if magic != 2:
        return rest(base, f"record batch (format v{magic}) could not be read", data)
    if check_crc:
        computed = calc_crc32c(data[_CRC_FROM:])
        if computed != crc:
            return rest(base, f"record batch CRC mismatch: stored {crc:#010x}, computed {computed:#010x}", data)
    codec = attributes & _CODEC_MASK
    if codec:
        try:
            body = _decompress(codec, data[_BATCH_HEADER.size :])
        except UnsupportedCodecError:
            raise
        except Exception as exc:  # any codec library error: the bytes are not what they claim
            return rest(base, f"record batch does not decompress (codec {codec}): {exc!r}", data)
    else:
        body = data[_BATCH_HEADER.size :]
    first_timestamp, max_timestamp = header[7], header[8]
    log_append = bool(attributes & _LOG_APPEND_TIME)
    size = len(body)
    pos = 0
    previous = base - 1
    for index in range(count):
        start = pos
        try:
            length, pos = _varint(body, pos, size)
            if length < 0 or pos + length > size:
                raise _MalformedError(f"length {length} runs past the end of the batch")
            end = pos + length
            pos += 1  # attributes (int8, unused)
            timestamp_delta, pos = _varint(body, pos, end)
            offset_delta, pos = _varint(body, pos, end)
            offset = base + offset_delta
            if not previous < offset <= last:
                raise _MalformedError(f"offset delta {offset_delta} is out of order")
        except _MalformedError as exc:
            return rest(previous + 1, f"record {index} of {count} cannot be delimited: {exc}", body[start:])
        previous = offset
        if offset < from_offset:
            pos = end
            continue
        try:
            record: ConsumerRecord[bytes, bytes] | Undecodable = _record(
                body,
                pos,
                end,
                topic=topic,
                partition=partition,
                offset=offset,
                timestamp=max_timestamp if log_append else first_timestamp + timestamp_delta,
                timestamp_type=1 if log_append else 0,
            )
        except _MalformedError as exc:
            record = Undecodable(topic, partition, offset, offset, f"malformed record: {exc}", body[start:end])
        out.append(record)
        pos = end
    return out


def find_batch(fetched: bytes, base_offset: int) -> bytes | None:
    """The batch starting at ``base_offset`` in one partition's fetched bytes (None: not there)."""
    pos = 0
    total = len(fetched)
    while pos + _LOG_OVERHEAD.size <= total:
        base, length = _LOG_OVERHEAD.unpack_from(fetched, pos)
        end = pos + _LOG_OVERHEAD.size + length
        if length < 0 or end > total:
            return None
        if base == base_offset:
            return fetched[pos:end]
        pos = end
    return None


class _TolerantPartitionRecords(PartitionRecords):  # type: ignore[misc]
    """
    aiokafka's ``PartitionRecords`` (the iterator over one partition's fetched batches) with the
    same skipping of aborted transactions and control batches, where a batch aiokafka cannot read
    is read again by :func:`parse_batch` from ``fetched`` (the partition's bytes of that fetch).
    """

    next_fetch_offset: int
    _tp: Any

    def __init__(self, original: Any, fetched: bytes | None) -> None:
        self._fetched = fetched  # before super(): it creates the (lazy) record generator
        super().__init__(
            original._tp,
            original._records,
            original._aborted_transactions,
            original.next_fetch_offset,
            original._key_deserializer,
            original._value_deserializer,
            original._check_crcs,
            original._isolation_level,
        )

    def _unpack_records(self) -> Iterator[Any]:
        # Mirrors aiokafka 0.14's PartitionRecords._unpack_records except where marked "differs".
        tp = self._tp
        records = self._records
        while records.has_next():
            try:
                batch = records.next_batch()
            except Exception as exc:  # differs: a slice too short to be a batch at all
                yield from self._skip_unreadable(exc)
                return
            if self._check_crcs and not batch.validate_crc():
                # differs: aiokafka raises CorruptRecordException here, forever (the batch is refetched)
                if not (yield from self._reread(batch, "CRC mismatch")):
                    return
                self.next_fetch_offset = max(self.next_fetch_offset, batch.next_offset)
                continue
            if self._isolation_level == READ_COMMITTED and batch.producer_id is not None:
                self._consume_aborted_up_to(batch.base_offset)
                if batch.is_control_batch and self._contains_abort_marker(batch):
                    self._aborted_producers.discard(batch.producer_id)
                if batch.is_transactional and batch.producer_id in self._aborted_producers:
                    self.next_fetch_offset = batch.next_offset
                    continue
            if batch.is_control_batch:
                self.next_fetch_offset = batch.next_offset
                continue
            # differs: whatever aiokafka raises for this batch (UnicodeDecodeError, CorruptRecordException,
            # a codec error) sends it to _reread. parse_batch raises only for a missing codec library.
            iterator: Iterator[Any] = iter(())
            failed: Exception | None = None
            try:
                iterator = iter(batch)  # decompresses
            except Exception as exc:
                failed = exc
            while failed is None:
                try:
                    record = next(iterator)
                except StopIteration:
                    break
                except Exception as exc:
                    failed = exc
                    break
                if record.offset < self.next_fetch_offset:
                    continue
                consumer_record = self._consumer_record(tp, record)
                self.next_fetch_offset = record.offset + 1
                yield consumer_record
            if failed is not None and not (yield from self._reread(batch, repr(failed))):
                return
            self.next_fetch_offset = max(self.next_fetch_offset, batch.next_offset)

    def _reread(self, batch: Any, error: str) -> Generator[Any, None, bool]:
        """
        Yield the rest of ``batch`` as :func:`parse_batch` reads it; return False when its bytes are
        not at hand (then the iteration ends at the unread record, and aiokafka fetches from there:
        through the capture this time, see :class:`TolerantReader`).
        """
        tp = self._tp
        data = find_batch(self._fetched, batch.base_offset) if self._fetched is not None else None
        if data is None:
            _log.warning(
                "Kafka record batch at %s/%d/%d could not be read (%s) and its bytes were not kept; "
                "fetching it again from offset %d",
                tp.topic,
                tp.partition,
                batch.base_offset,
                error,
                self.next_fetch_offset,
            )
            return False
        _log.info(
            "aiokafka could not read the record batch at %s/%d/%d (%s): reading it with the tolerant reader",
            tp.topic,
            tp.partition,
            batch.base_offset,
            error,
        )
        for item in parse_batch(
            data,
            topic=tp.topic,
            partition=tp.partition,
            from_offset=self.next_fetch_offset,
            next_offset=batch.next_offset,
            check_crc=self._check_crcs,
        ):
            self.next_fetch_offset = (item.last_offset if isinstance(item, Undecodable) else item.offset) + 1
            yield item
        return True

    def _skip_unreadable(self, error: Exception) -> Iterator[Any]:
        """A fetched slice shorter than any batch header: one offset, then a fresh fetch from the next."""
        tp = self._tp
        offset = self.next_fetch_offset
        self.next_fetch_offset = offset + 1
        yield Undecodable(tp.topic, tp.partition, offset, offset, f"unreadable record batch: {error!r}", b"")


class _WrappingResults(collections.OrderedDict[Any, Any]):
    """The fetcher's ``_records`` (partition -> fetched result), wrapping each result as it is stored."""

    def __init__(self, reader: TolerantReader, existing: dict[Any, Any]) -> None:
        super().__init__()
        self._reader = reader
        for tp, result in existing.items():
            self[tp] = result

    def __setitem__(self, tp: Any, result: Any) -> None:
        if type(result) is FetchResult:
            self._reader.wrap(tp, result)
        super().__setitem__(tp, result)


class TolerantReader:
    """
    Makes one ``AIOKafkaConsumer`` read undecodable records as :class:`Undecodable` items instead
    of raising. :meth:`install` before ``consumer.start()``, :meth:`attach` right after it.
    """

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        # Record bytes of the latest Fetch response per partition, until the fetcher stores its
        # result (in the same event-loop step: _proc_fetch_request does not await in between).
        self._fetched: dict[TopicPartition, bytes] = {}
        self.active = False

    @classmethod
    def install(cls, consumer: Any) -> TolerantReader:
        reader = cls(consumer)
        client: Any = getattr(consumer, "_client", None)
        missing = [
            name
            for name, present in (
                ("AIOKafkaConsumer._client.send", callable(getattr(client, "send", None))),
                ("PartitionRecords._unpack_records", hasattr(PartitionRecords, "_unpack_records")),
                ("PartitionRecords._consumer_record", hasattr(PartitionRecords, "_consumer_record")),
                ("FetchResult", isinstance(FetchResult, type)),
            )
            if not present
        ]
        if missing:
            _log.warning(
                "This aiokafka has no %s: undecodable Kafka records will stop the stream instead of "
                "being dead-lettered",
                ", ".join(missing),
            )
            return reader
        send = client.send

        async def send_and_keep(node_id: Any, request: Any, **kwargs: Any) -> Any:
            response = await send(node_id, request, **kwargs)
            if getattr(request, "API_KEY", None) == _FETCH_API_KEY:
                reader._keep(response)
            return response

        # An attribute of this consumer's own client: no other aiokafka client sees it.
        client.send = send_and_keep
        reader.active = True
        return reader

    def _keep(self, response: Any) -> None:
        for topic, partitions in getattr(response, "topics", ()):
            for partition, error_code, _highwater, *part_data in partitions:
                data = part_data[-1] if part_data else None
                if error_code == 0 and data:
                    self._fetched[TopicPartition(topic, partition)] = data

    def attach(self) -> None:
        """Swap the fetcher's result buffer (after ``start()``: the fetcher is created there)."""
        if not self.active:
            return
        fetcher: Any = getattr(self._consumer, "_fetcher", None)
        existing = getattr(fetcher, "_records", None)
        if not isinstance(existing, dict):
            _log.warning("aiokafka's fetcher has no _records buffer: undecodable records will stop the stream")
            self.active = False
            return
        # Results stored during start() (a group join fetches before start returns) are wrapped too.
        fetcher._records = _WrappingResults(self, existing)

    def wrap(self, tp: Any, result: Any) -> None:
        original = getattr(result, "_partition_records", None)
        fetched = self._fetched.pop(tp, None)
        if type(original) is not PartitionRecords:
            return  # already wrapped, or consumed
        generator = getattr(original, "_records_iterator", None)
        if generator is None or inspect.getgeneratorstate(generator) != inspect.GEN_CREATED:
            return  # partly read already: leave it to aiokafka
        result._partition_records = _TolerantPartitionRecords(original, fetched)
