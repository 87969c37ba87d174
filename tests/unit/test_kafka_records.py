"""
The tolerant Kafka batch reader (producers/kafka_records.py) over batches encoded byte by byte,
and through aiokafka's own fetched-records iterator; the dead-letter header rules (kafka.py).
"""

from __future__ import annotations

import struct
from typing import Any

import aiokafka.codec as codecs
import pytest
from aiokafka import TopicPartition
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.errors import UnsupportedCodecError
from aiokafka.record.memory_records import MemoryRecords
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_shared_stream_provider.producers.kafka import original_headers
from airflow_shared_stream_provider.producers.kafka_records import (
    Undecodable,
    _TolerantPartitionRecords,
    find_batch,
    parse_batch,
)
from tests.integration.kafka.raw_records import RawRecord, encode_batch

BAD_KEY = b"\xff\xfe"
# attributes, timestamp delta 0, offset delta 1, null key, a value of 3 bytes where 2 follow.
MALFORMED_AT_DELTA_1 = b"\x00\x00\x02\x01\x06ab"
MISSING_CODECS = {
    codec for codec, available in ((2, codecs.has_snappy), (3, codecs.has_lz4), (4, codecs.has_zstd)) if not available()
}


def at(batch: bytes, base_offset: int) -> bytes:
    """``batch`` as the broker stores it: at ``base_offset`` (not in the CRC, no re-sum needed)."""
    return struct.pack(">q", base_offset) + batch[8:]


def parse(data: bytes, *, from_offset: int = 0, check_crc: bool = True) -> list[Any]:
    base = struct.unpack_from(">q", data)[0]
    last_delta = struct.unpack_from(">i", data, 23)[0]
    return parse_batch(
        data, topic="t", partition=0, from_offset=from_offset, next_offset=base + last_delta + 1, check_crc=check_crc
    )


def values(items: list[Any]) -> list[Any]:
    return [item if isinstance(item, Undecodable) else (item.offset, item.value) for item in items]


def test_a_non_utf8_header_key_stays_bytes_and_its_batch_mates_are_read() -> None:
    batch = encode_batch([RawRecord(b"a"), RawRecord(b"b", key=b"k", headers=[(BAD_KEY, b"v"), (b"ok", None)])])
    first, second = parse(at(batch, 10))
    assert (first.offset, first.value, first.headers) == (10, b"a", ())
    assert (second.offset, second.key, second.value) == (11, b"k", b"b")
    assert second.headers == ((BAD_KEY, b"v"), ("ok", None))


def test_what_was_read_before_is_skipped() -> None:
    batch = at(encode_batch([RawRecord(b"a"), RawRecord(b"b"), RawRecord(b"c")]), 5)
    assert values(parse(batch, from_offset=6)) == [(6, b"b"), (7, b"c")]


def test_a_malformed_record_is_one_undecodable_offset_and_the_next_ones_are_read() -> None:
    batch = encode_batch([RawRecord(b"a"), RawRecord(body=MALFORMED_AT_DELTA_1), RawRecord(b"c")])
    a, bad, c = parse(at(batch, 3))
    assert (a.offset, c.offset, c.value) == (3, 5, b"c")
    assert isinstance(bad, Undecodable)
    assert (bad.location(), bad.raw) == ("t/0/4", b"\x0e" + MALFORMED_AT_DELTA_1)  # with its length
    assert bad.reason == "malformed record: value of 3 bytes runs past the end of the record"


def test_a_record_that_cannot_be_delimited_takes_the_rest_of_its_batch() -> None:
    # Offset delta 7 in a batch of three: the records after it cannot be placed.
    batch = encode_batch([RawRecord(b"a"), RawRecord(body=b"\x00\x00\x0e\x01\x01\x00"), RawRecord(b"c")])
    a, rest = parse(at(batch, 0))
    assert a.offset == 0
    assert isinstance(rest, Undecodable)
    assert (rest.location(), rest.reason) == (
        "t/0/1-2",
        "record 1 of 3 cannot be delimited: offset delta 7 is out of order",
    )


def test_a_crc_mismatch_makes_the_whole_batch_one_undecodable_unless_crcs_are_not_checked() -> None:
    batch = at(encode_batch([RawRecord(b"a"), RawRecord(b"b")], corrupt_crc=True), 8)
    [whole] = parse(batch)
    assert isinstance(whole, Undecodable)
    assert whole.location() == "t/0/8-9"
    assert whole.reason.startswith("record batch CRC mismatch: stored 0x")
    assert whole.raw == batch
    [rest] = parse(batch, from_offset=9)
    assert rest.location() == "t/0/9"
    assert values(parse(batch, check_crc=False)) == [(8, b"a"), (9, b"b")]


def test_a_gzip_batch_is_read_and_a_broken_one_is_undecodable() -> None:
    good = encode_batch([RawRecord(b"a", headers=[(BAD_KEY, None)]), RawRecord(b"b")], gzip=True)
    assert values(parse(good)) == [(0, b"a"), (1, b"b")]
    broken = bytearray(good)
    broken[-12:-4] = b"\x00" * 8  # inside the gzip stream: a checksum error (CRC not checked below)
    [whole] = parse(bytes(broken), check_crc=False)
    assert isinstance(whole, Undecodable)
    assert whole.reason.startswith("record batch does not decompress (codec 1)")


def test_a_missing_codec_library_is_not_dead_lettered(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_shared_stream_provider.producers import kafka_records

    batch = bytearray(encode_batch([RawRecord(b"a")]))
    batch[22] |= 0x04  # attributes: zstd
    monkeypatch.setattr(kafka_records, "has_zstd", lambda: False)
    with pytest.raises(UnsupportedCodecError):
        parse(bytes(batch), check_crc=False)


def test_find_batch_finds_a_batch_among_the_fetched_bytes() -> None:
    first = at(encode_batch([RawRecord(b"a"), RawRecord(b"b")]), 0)
    second = at(encode_batch([RawRecord(b"c")]), 2)
    fetched = first + second + second[:20]  # a fetch may end inside a batch
    assert find_batch(fetched, 2) == second
    assert find_batch(fetched, 0) == first
    assert find_batch(fetched, 7) is None


def read_all(
    fetched: bytes, *, keep_bytes: bool = True, fetch_offset: int = 0, check_crc: bool = True
) -> tuple[list[Any], int]:
    """What aiokafka's fetcher would hand getmany from one fetch, through the tolerant iterator."""
    tp = TopicPartition("t", 0)
    original = PartitionRecords(tp, MemoryRecords(fetched), [], fetch_offset, None, None, check_crc, 0)
    records = _TolerantPartitionRecords(original, fetched if keep_bytes else None)
    items = list(records)
    return items, records.next_fetch_offset


def test_the_fetched_records_iterator_reads_past_every_bad_batch() -> None:
    fetched = (
        at(encode_batch([RawRecord(b"a")]), 0)
        + at(encode_batch([RawRecord(b"b"), RawRecord(b"c", headers=[(BAD_KEY, b"")]), RawRecord(b"d")]), 1)
        + at(encode_batch([RawRecord(b"e"), RawRecord(body=MALFORMED_AT_DELTA_1), RawRecord(b"g")]), 4)
        + at(encode_batch([RawRecord(b"h"), RawRecord(b"i")], corrupt_crc=True), 7)
        + at(encode_batch([RawRecord(b"j")]), 9)
    )
    items, next_offset = read_all(fetched)
    assert [i.location() if isinstance(i, Undecodable) else i.value for i in items] == [
        b"a", b"b", b"c", b"d", b"e", "t/0/5", b"g", "t/0/7-8", b"j",
    ]  # fmt: skip
    assert items[2].headers == ((BAD_KEY, b""),)
    assert next_offset == 10


def test_without_the_fetched_bytes_the_iterator_stops_at_the_bad_record() -> None:
    fetched = at(encode_batch([RawRecord(b"a"), RawRecord(b"b", headers=[(BAD_KEY, b"")])]), 0)
    fetched += at(encode_batch([RawRecord(b"c")]), 2)
    items, next_offset = read_all(fetched, keep_bytes=False)
    assert [i.value for i in items] == [b"a"]
    assert next_offset == 1  # aiokafka fetches again from the unread record


def test_a_fetch_starting_inside_a_batch_yields_nothing_twice() -> None:
    fetched = at(encode_batch([RawRecord(b"a"), RawRecord(b"b", headers=[(BAD_KEY, b"")]), RawRecord(b"c")]), 0)
    items, next_offset = read_all(fetched, fetch_offset=2)
    assert [(i.offset, i.value) for i in items] == [(2, b"c")]
    assert next_offset == 3


@settings(max_examples=300, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=10_000),
    replacement=st.binary(min_size=1, max_size=4),
    check_crc=st.booleans(),
)
def test_no_bytes_make_the_reader_raise(position: int, replacement: bytes, check_crc: bool) -> None:
    batch = bytearray(
        at(
            encode_batch(
                [RawRecord(b"a", key=b"k", headers=[(b"h", b"v")]), RawRecord(b"bb", headers=[(BAD_KEY, None)])]
            ),
            0,
        )
    )
    index = 12 + position % (len(batch) - 12)  # past baseOffset and length: those delimit the batch
    batch[index : index + len(replacement)] = replacement
    try:
        items, _ = read_all(bytes(batch), check_crc=check_crc)
    except UnsupportedCodecError:
        # Only for a codec whose library is missing here (configuration: it ends the stream).
        assert not check_crc
        assert batch[22] & 0x07 in MISSING_CODECS
        return
    offsets = [i.last_offset if isinstance(i, Undecodable) else i.offset for i in items]
    assert offsets == sorted(set(offsets))  # in order, nothing twice


def test_a_senders_dead_letter_headers_are_renamed_and_binary_names_rendered() -> None:
    headers: list[tuple[str | bytes, bytes | None]] = [
        ("x-dead-letter-reason", b"forged"),
        ("X-DEAD-LETTER-SOURCE", b"elsewhere"),
        ("x-dead-letters", b"kept: not the prefix"),
        (BAD_KEY, b"v"),
        ("plain", None),
    ]
    assert original_headers(headers) == [
        ("x-original-x-dead-letter-reason", b"forged"),
        ("x-original-X-DEAD-LETTER-SOURCE", b"elsewhere"),
        ("x-dead-letters", b"kept: not the prefix"),
        ("base64://4=", b"v"),
        ("plain", None),
    ]
