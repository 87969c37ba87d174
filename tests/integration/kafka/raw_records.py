"""
Write Kafka records that the Kafka clients in this repository refuse to write.

aiokafka's producer encodes every header key as UTF-8 (``str``), but the wire format only says
"bytes": Go clients (sarama, franz-go) and librdkafka write any bytes there, and so can this module.
:func:`encode_batch` builds one v2 record batch (CRC-32C over its body, as the protocol defines
it; gzip-compressed if asked); :func:`publish_raw_records` sends it in a Produce request
(acks=all) to the partition's leader and returns the base offset the broker assigned.

A :class:`RawRecord` with ``body`` set is written as those bytes after its length prefix: a
structurally broken record (the fuzz corpus and the "cannot be parsed at all" tests use it).
Reusable by any Kafka-protocol test: it needs nothing but the bootstrap address.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaClient, TopicPartition
from aiokafka.codec import gzip_encode
from aiokafka.errors import for_code
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.util import calc_crc32c

# RecordBatch header after baseOffset/length: leaderEpoch, magic, crc, then the CRC-covered part.
_BATCH_HEAD = struct.Struct(">qiibI")
_BATCH_TAIL = struct.Struct(">hiqqqhii")  # attributes .. record count
_MAGIC = 2
_GZIP = 0x01  # attributes: compression codec


@dataclass(frozen=True)
class RawRecord:
    """One record; ``headers`` keys are bytes (any bytes). ``body`` replaces the encoded record."""

    value: bytes | None = b""
    key: bytes | None = None
    headers: Sequence[tuple[bytes, bytes | None]] = field(default_factory=tuple)
    body: bytes | None = None


def _varint(value: int) -> bytes:
    """Zig-zag varint (Kafka's varint / varlong)."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        byte = zigzag & 0x7F
        zigzag >>= 7
        if zigzag:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _nullable(data: bytes | None) -> bytes:
    return _varint(-1) if data is None else _varint(len(data)) + data


def encode_record(record: RawRecord, offset_delta: int, timestamp_delta: int = 0) -> bytes:
    """One record with its length prefix (``record.body`` verbatim when set)."""
    if record.body is not None:
        body = record.body
    else:
        parts = [b"\x00", _varint(timestamp_delta), _varint(offset_delta), _nullable(record.key)]
        parts.append(_nullable(record.value))
        parts.append(_varint(len(record.headers)))
        for name, header_value in record.headers:
            parts.append(_varint(len(name)) + name)
            parts.append(_nullable(header_value))
        body = b"".join(parts)
    return _varint(len(body)) + body


def encode_batch(
    records: Sequence[RawRecord], *, timestamp_ms: int | None = None, corrupt_crc: bool = False, gzip: bool = False
) -> bytes:
    """A v2 record batch of ``records`` (base offset 0: the broker assigns the real one)."""
    if not records:
        raise ValueError("a record batch needs at least one record")
    stamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    body = b"".join(encode_record(record, delta) for delta, record in enumerate(records))
    if gzip:
        body = gzip_encode(body)
    attributes = _GZIP if gzip else 0
    tail = _BATCH_TAIL.pack(attributes, len(records) - 1, stamp, stamp, -1, -1, -1, len(records)) + body
    crc = calc_crc32c(tail)
    if corrupt_crc:
        crc ^= 0xFFFFFFFF
    head = _BATCH_HEAD.pack(0, 0, -1, _MAGIC, crc)
    # The length field counts everything after itself (leader epoch onwards).
    length = len(head) - 12 + len(tail)
    return struct.pack(">qi", 0, length) + head[12:] + tail


async def publish_raw_batch(bootstrap: str, topic: str, partition: int, batch: bytes) -> int:
    """Produce one encoded batch to ``topic``/``partition`` (acks=all); return its base offset."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client._maybe_wait_metadata()
        client.add_topic(topic)
        await client.force_metadata_update()
        leader = client.cluster.leader_for_partition(TopicPartition(topic, partition))
        if leader is None or leader < 0:
            raise RuntimeError(f"no leader for {topic}/{partition}")
        response = await client.send(leader, ProduceRequest(None, -1, 30_000, [(topic, [(partition, batch)])]))
        [(_, [(_, error_code, base_offset, *_)])] = response.topics
        if error_code:
            raise for_code(error_code)(f"producing a raw batch to {topic}/{partition}")
        return int(base_offset)
    finally:
        await client.close()


async def publish_raw_records(
    bootstrap: str,
    topic: str,
    partition: int,
    records: Sequence[RawRecord],
    *,
    corrupt_crc: bool = False,
    gzip: bool = False,
    timestamp_ms: int | None = None,
) -> int:
    """
    Produce ``records`` as one batch (gzip-compressed if asked; stamped ``timestamp_ms``, default
    now); return the offset of the first one.
    """
    batch = encode_batch(records, timestamp_ms=timestamp_ms, corrupt_crc=corrupt_crc, gzip=gzip)
    return await publish_raw_batch(bootstrap, topic, partition, batch)
