"""
Fuzzed input through the real brokers (issue 15): the shared strategies, oracle and checks.

Each broker's ``test_fuzz.py`` publishes hypothesis-generated batches through its real broker and
consumes them with the real ``SharedStreamManager`` (through :class:`devkit.runner.RunnerSim`) and
our producer, on one or more streams that live for the whole test (a Kafka group takes ~10 s to
form, so a stream per example would not fit in CI). Every stream has three watchers:

* ``all``: no filter, fires on every message that is not dead-lettered for its size;
* ``raiser``: ``filter_function=raise_on_marked`` with the default ``on_filter_error="reject"``:
  raises on the messages carrying the :data:`RAISE_ATTRIBUTE` attribute, so those are
  dead-lettered with the reason ``filter raised FuzzFilterError: ...``;
* ``match``: ``match={"body.kind": ["a", 1]}`` on bodies of any shape.

The property, per example and per stream (:meth:`FuzzStream.verify`):

* no group crashes: no ``runner.failures``, every watcher still running;
* every message ends exactly once either as an envelope delivered to the watchers or in the
  dead-letter target (intact bytes) with a reason: oversize messages (``max_payload_bytes=2048``)
  only in the dead-letter target with ``payload too large``, marked messages in both (``all``
  fired before the reject won) with ``filter raised``, the others delivered and not dead-lettered;
* none stuck: ``adapter.unsettled() == 0``;
* every event payload serialises with ``json.dumps``, Airflow's serde and ``BaseSerialization``
  from a caller 200 frames deep (:func:`serialise_deep`);
* every event payload is strict JSON (no NaN, no tuples, string keys), at most
  ``max_payload_bytes`` (UTF-8 bytes of its compact JSON), and each envelope carries the body as
  the documented decoding of the published bytes (an oracle independent of the provider's code)
  and the published attributes.

Known provider bugs found by this fuzzing are kept out of the generated input (:func:`known_bug`
and each broker's own) or, for payloads over the cap, tolerated only where the known bug explains
them (:func:`known_over_cap`, counted as hypothesis events). Each names its
``xfail(strict=True)`` reproduction; remove it with the fix (the reproduction then XPASSes and
fails, as a reminder).

``FUZZ_EXAMPLES=200`` runs a longer hunt with the same fixed seed.

What every broker shares lives here too, so that a broker's ``test_fuzz.py`` holds only what is
its own: a :class:`FuzzTargetBase` subclass (how one message is published, how its dead letters
are read back, what its envelopes and dead letters must carry), its strategies and limits, and a
``fuzz_targets`` fixture. It imports the ``session`` fixture from here, and its test is
``await session.run(batch)`` under :func:`fuzz_test` (its messages, its explicit batches).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Protocol, TypeVar

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from airflow_shared_stream_provider._core.batching import BATCH_OVERHEAD
from airflow_shared_stream_provider.brokers import BROKER_NAMES
from devkit.runner import RunnerSim

MAX_PAYLOAD_BYTES: Final = 2048
RAISE_ATTRIBUTE: Final = "fuzz-raise"
MATCH_KINDS: Final = ("a", 1)
FAST_PATH_BYTES: Final = (MAX_PAYLOAD_BYTES - 512) // 6
"""Bodies + attributes up to this size skip the exact size check in ``build_envelope`` (6x + 512)."""
HUGE_MIN_BYTES: Final = 2600
MAX_DEEP: Final = 1100
"""Nesting depth of generated JSON: past the 64-level cap and msgspec's ~990-level limit."""
ACCOUNT_TIMEOUT: Final = 45.0

WATCHERS: Final = ("all", "raiser", "match")
DEAD_LETTER_PREFIX: Final = "x-dead-letter-"
"""What the provider's dead-letter attributes are named with (``x-dead-letter-reason``, ``-source``...)."""
DEAD_LETTER_REASON: Final = DEAD_LETTER_PREFIX + "reason"
FUZZ_TIMEOUT: Final = 300
"""Seconds for a whole fuzz test: its streams live across every example (see the module doc)."""

FUZZ_SETTINGS: Final = settings(
    # FUZZ_EXAMPLES=200 for a longer local hunt (same fixed seed: still deterministic).
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "15")),
    deadline=None,
    derandomize=True,  # a fixed seed per test: CI runs the same examples every time
    database=None,
    # No shrinking: the streams live across examples, and a failure is reported as generated.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=(
        HealthCheck.function_scoped_fixture,  # the streams are meant to outlive the examples
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.large_base_example,
    ),
    print_blob=False,
)


class FuzzFilterError(Exception):
    """What the ``raiser`` watcher's filter raises on marked messages."""


def raise_on_marked(envelope: Mapping[str, Any]) -> bool:
    """``filter_function`` of the ``raiser`` watcher: raises on messages carrying :data:`RAISE_ATTRIBUTE`."""
    text = envelope["attributes"].get(RAISE_ATTRIBUTE)
    if text is None:
        return True
    raise FuzzFilterError(text + str(envelope["body"])[:24])


class UnprintableError(Exception):
    """An exception whose text cannot be rendered (a buggy ``__str__``, as some libraries' have)."""

    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be rendered as text")


def raise_unprintable_on_marked(envelope: Mapping[str, Any]) -> bool:
    """``filter_function`` raising :class:`UnprintableError` on messages carrying :data:`RAISE_ATTRIBUTE`."""
    if RAISE_ATTRIBUTE in envelope["attributes"]:
        raise UnprintableError()
    return True


def filter_reason(raise_text: str, body: Any) -> str:
    """The dead-letter reason :func:`raise_on_marked` leads to (one watcher rejects: ``filter raised <Type>: ...``)."""
    return f"rejected by 1 watcher(s): filter raised FuzzFilterError: {raise_text}{str(body)[:24]}"


_OVERSIZE_REASON: Final = re.compile(r"rejected by \d+ watcher\(s\): payload too large: envelope is (\d+) bytes")
_FILTER_REASON: Final = re.compile(r"rejected by 1 watcher\(s\): filter raised FuzzFilterError: ", re.DOTALL)


# -- the generated input --------------------------------------------------------------------------
@dataclass(frozen=True)
class FuzzMessage:
    """
    One generated message: its body (``None``: a Kafka tombstone), the text that marks it for the
    raising filter (``None``: not marked), whether it was generated to be clearly over the size
    cap, and what only its broker has (headers, key, message attributes, ordering key, ids...).
    """

    body: bytes | None
    raise_text: str | None = None
    huge: bool = False
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        body = self.body if self.body is None or len(self.body) <= 80 else self.body[:80] + b"...(%d)" % len(self.body)
        return f"FuzzMessage(body={body!r}, raise_text={self.raise_text!r}, huge={self.huge}, extras={self.extras!r})"


MakeMessage = Callable[..., FuzzMessage]
"""A broker's plain message: ``make(body, **its extras, **FuzzMessage fields)``, extras at their defaults."""


def standard_examples(make: MakeMessage) -> list[FuzzMessage]:
    """
    The bodies every broker's explicit example batch carries (hypothesis runs it before anything
    generated, on every run): binary, deep JSON, NaN in JSON on a marked message, clearly oversize.
    """
    return [
        make(b"\x00\xff\xfe"),
        make(b"[" * 500 + b"]" * 500),
        make(b'{"v": NaN, "kind": "a"}', raise_text="nan"),
        make(b'{"kind":"a","blob":"' + b"x" * HUGE_MIN_BYTES + b'"}', huge=True),
    ]


# -- strategies ---------------------------------------------------------------------------------------
_INVALID_UTF8: Final = (b"\xff", b"\xfe\xff", b"\xc3", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80")


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.integers(min_value=-(2**200), max_value=2**200)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=16)
        | st.sampled_from(MATCH_KINDS)
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=6) | st.just("kind"), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


@st.composite
def json_texts(draw: st.DrawFn, values: st.SearchStrategy[Any] | None = None) -> bytes:
    value = draw(values if values is not None else json_values())
    ascii_only = draw(st.booleans())
    layout = draw(st.sampled_from(["compact", "default", "indent"]))
    separators = (",", ":") if layout == "compact" else None
    text = json.dumps(value, ensure_ascii=ascii_only, separators=separators, indent=2 if layout == "indent" else None)
    padding = draw(st.sampled_from(["", " ", "\n", "\t \r\n"]))
    return (padding + text + padding).encode()


@st.composite
def deep_json(draw: st.DrawFn) -> bytes:
    depth = draw(st.sampled_from([MAX_DEEP, 500, 64, 65, 990]) | st.integers(min_value=2, max_value=MAX_DEEP))
    kind = draw(st.sampled_from(["list", "object", "mixed"]))
    if kind == "list":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    opening = b"".join(b'[{"k":' if i % 2 else b"[" for i in range(depth))
    closing = b"".join(b"}]" if i % 2 else b"]" for i in reversed(range(depth)))
    return opening + b"0" + closing


@st.composite
def huge_json(draw: st.DrawFn) -> bytes:
    """Compact JSON of at least :data:`HUGE_MIN_BYTES`: its envelope is over the cap whatever it decodes to."""
    size = draw(st.integers(min_value=HUGE_MIN_BYTES, max_value=8000))
    shape = draw(st.sampled_from(["blob", "numbers", "nested"]))
    if shape == "blob":
        value: Any = {"kind": "a", "blob": "x" * size}
    elif shape == "numbers":
        value = [1_000_000 + i for i in range(size // 8 + 1)]  # "1000000," per item
    else:
        value = [{"kind": 1, "i": i, "s": "é" * 8} for i in range(size // 40)]
    text = json.dumps(value, separators=(",", ":"))
    assert len(text) >= HUGE_MIN_BYTES
    return text.encode()


def nonstrict_json() -> st.SearchStrategy[bytes]:
    """What ``json.loads`` takes and RFC 8259 does not: delivered as text, never as a JSON body."""
    fixed = st.sampled_from(
        [
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b'{"v": NaN}',
            b"[Infinity, -Infinity, NaN]",
            b"1e400",
            b"-1e999",
            b'{"kind": "a", "n": 1e400}',
            b'"\\ud800"',
            b'{"\\udc00": 1}',
            b"[1,]",
            b"01",
            b"\xef\xbb\xbf{}",
        ]
    )
    built = st.builds(
        lambda value, bad: json.dumps({"kind": "a", "v": value, "bad": bad}).encode(),
        json_values(4),
        st.sampled_from([math.nan, math.inf, -math.inf]),
    )
    return fixed | built


def random_bytes() -> st.SearchStrategy[bytes]:
    specials = st.sampled_from([b"", b"\x00", b"\x00" * 17, b"a\x00b", *_INVALID_UTF8, b"\xff\xfe\x00binary"])
    spliced = st.builds(
        lambda head, bad, tail: head + bad + tail,
        st.binary(max_size=16),
        st.sampled_from(_INVALID_UTF8),
        st.binary(max_size=16),
    )
    return specials | st.binary(max_size=64) | spliced


def almost_json() -> st.SearchStrategy[bytes]:
    """JSON-looking bytes with invalid UTF-8 inside a string (delivered as base64)."""
    return st.builds(
        lambda opening, bad, closing: opening + bad + closing,
        st.sampled_from([b'"', b'["', b'{"', b'{"k":"', b' "']),
        st.sampled_from(_INVALID_UTF8),
        st.sampled_from([b'"', b'"]', b'":1}', b'"}', b""]),
    )


def texts() -> st.SearchStrategy[bytes]:
    """UTF-8 text: control characters, NUL, astral planes, combining marks, RTL, text around the size bound."""
    odd = st.text(st.characters(codec="utf-8"), max_size=48)
    controls = st.text(st.characters(min_codepoint=0, max_codepoint=31), min_size=1, max_size=FAST_PATH_BYTES)
    boundary = st.integers(min_value=FAST_PATH_BYTES - 8, max_value=FAST_PATH_BYTES).map(lambda n: "\x01" * n)
    return (odd | controls | boundary).map(str.encode)


def bodies() -> st.SearchStrategy[tuple[bytes, bool]]:
    """``(body, huge)``: every category of the brief, huge ones flagged."""
    return st.one_of(
        random_bytes().map(lambda b: (b, False)),
        texts().map(lambda b: (b, False)),
        json_texts().map(lambda b: (b, False)),
        deep_json().map(lambda b: (b, False)),
        nonstrict_json().map(lambda b: (b, False)),
        almost_json().map(lambda b: (b, False)),
        huge_json().map(lambda b: (b, True)),
        st.binary(min_size=HUGE_MIN_BYTES, max_size=6000).map(lambda b: (b, True)),
    )


def raise_texts(alphabet: st.SearchStrategy[str] | None = None, max_size: int = 64) -> st.SearchStrategy[str | None]:
    """``None`` (not marked) most of the time, else the text the raising filter puts in its exception."""
    chars = alphabet if alphabet is not None else st.characters(codec="utf-8")
    return st.none() | st.none() | st.text(chars, min_size=1, max_size=max_size)


# -- the oracle -----------------------------------------------------------------------------------------
class _NotStrict(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotStrict(name)


def _check_strict(value: Any) -> None:
    """RFC 8259 and the metadata DB: finite numbers, no lone surrogates (iteratively: bodies nest deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise _NotStrict("number out of range")
        if isinstance(item, str) and re.search("[\ud800-\udfff]", item):
            raise _NotStrict("lone surrogate")
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())


def expected_decoding(raw: bytes | None) -> tuple[str, Any]:
    """
    ``(body_encoding, body)`` the envelope must carry for ``raw``, per docs/envelope.md: parsed JSON
    if the bytes are strict JSON, else UTF-8 text, else base64. Computed with the standard library,
    independently of the provider's msgspec decoder.
    """
    if raw is None:
        return "json", None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "base64", base64.b64encode(raw).decode("ascii")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
        _check_strict(value)
    except (ValueError, RecursionError):
        return "text", text
    if json_depth(value) > JSON_DEPTH_LIMIT:
        return "text", text
    return "json", value


def marked_reason(message: FuzzMessage) -> str | None:
    """The reason a marked ``message`` is dead-lettered with (:func:`filter_reason`); None if it is not marked."""
    if message.raise_text is None:
        return None
    _, body = expected_decoding(message.body)
    return filter_reason(message.raise_text, body)


JSON_DEPTH_LIMIT: Final = 64
"""docs/envelope.md: JSON nested deeper than 64 levels is delivered as text (``body_depth_exceeded``)."""


def json_depth(value: Any) -> int:
    """Containers nested in a decoded JSON value (``1`` is 0, ``[]`` 1, ``[[1]]`` 2), iteratively."""
    depth = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in item)
    return depth


CALLER_FRAMES: Final = 200
"""How deep the caller of a payload's serialiser is assumed to be already (issue 20)."""


def _at_stack_depth(frames: int, call: Callable[[], None]) -> None:
    if frames > 0:
        _at_stack_depth(frames - 1, call)
    else:
        call()


def serialise_deep(payload: Any, *, frames: int = CALLER_FRAMES) -> None:
    """
    Serialise an event payload as the triggerer and a Dag may, from ``frames`` frames deep:
    ``json.dumps`` (the metadata DB's JSON column), Airflow's serde (``airflow.sdk.serde``) and
    ``BaseSerialization`` (``airflow.serialization``), which recurse 1-2 frames per level.
    Raises (``RecursionError``) what would fail there.
    """
    from airflow.sdk.serde import serialize
    from airflow.serialization.serialized_objects import BaseSerialization

    def serialise() -> None:
        json.dumps(payload)
        serialize(payload)
        BaseSerialization.serialize(payload)

    _at_stack_depth(frames, serialise)


def canonical(encoding: str, body: Any) -> str:
    """One comparable text per decoded body (JSON bodies compared as values, key order ignored)."""
    if encoding == "json":
        return "json:" + json.dumps(body, sort_keys=True, allow_nan=False)
    return f"{encoding}:{body}"


def message_key(message: FuzzMessage) -> str:
    return canonical(*expected_decoding(message.body))


def matches_kind(value: Any) -> bool:
    """What ``match={"body.kind": ["a", 1]}`` fires on (numbers by value, booleans only as booleans)."""
    if not isinstance(value, dict) or "kind" not in value:
        return False
    kind = value["kind"]
    if isinstance(kind, bool):
        return False
    return kind == "a" or (isinstance(kind, int | float) and kind == 1)


def payload_size(payload: Any) -> int:
    """UTF-8 bytes of the compact JSON of an event payload; raises on anything not strict JSON."""
    return len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode())


def known_bug(message: FuzzMessage) -> str | None:
    """
    Why ``message`` is left out of the fuzzed input, or None: each entry is a provider bug this
    fuzzing found, reproduced by an ``xfail(strict=True)`` test. Remove an entry with its fix.
    (None open: invalid UTF-8 inside a JSON string, the last one, is fixed and now generated.)
    """
    return None


def known_over_cap(envelopes: Sequence[Mapping[str, Any]], messages: Sequence[FuzzMessage]) -> str | None:
    """
    Which known bug explains an event payload over ``max_payload_bytes``, or None. Both have
    ``xfail(strict=True)`` reproductions (tests/integration/<broker>/test_fuzz.py); remove with the fix.
    """
    if len(envelopes) != 1 or len(messages) != 1:
        return None
    envelope, message = envelopes[0], messages[0]
    if payload_size(envelope) <= MAX_PAYLOAD_BYTES:
        # The Batcher counts {"messages":[...]} only when a second envelope joins a batch: a batch of
        # one envelope near the cap is up to 15 bytes over it
        # (sqs/test_fuzz.py::test_a_batch_of_one_envelope_near_the_cap_is_over_it).
        return "batch of one envelope over the cap"
    raw = message.body or b""
    try:
        raw_size = len(raw.decode("utf-8"))  # brokers with text bodies count characters
    except UnicodeDecodeError:
        raw_size = len(raw)
    attribute_size = sum(len(k) + len(v) for k, v in envelope["attributes"].items())
    if (raw_size + attribute_size) * 6 + 512 <= MAX_PAYLOAD_BYTES:
        # build_envelope skips its exact size check when body + attributes are small, counting
        # 512 bytes for everything else although source, message_id and metadata (Kafka key,
        # FIFO group id, ordering key, Service Bus ids) may be larger
        # (pubsub/test_fuzz.py::test_small_body_with_long_metadata_is_delivered_over_the_cap).
        return "size check skipped: metadata not counted"
    return None


# -- what a broker provides ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DeadRecord:
    """One message in a dead-letter target: an identity stable across reads, its bytes and reason."""

    ident: Any
    body: bytes | None
    reason: str | None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    key: bytes | None = None


class FuzzTarget(Protocol):
    """One stream of one broker (an adapter of the contract plus what fuzzing needs)."""

    name: str
    batch_size: int

    def make_trigger(self, **kwargs: Any) -> Any: ...

    async def publish(self, messages: Sequence[FuzzMessage]) -> None: ...

    async def unsettled(self) -> int: ...

    async def dead_letters(self) -> list[DeadRecord]: ...

    def expected_attributes(self, message: FuzzMessage) -> dict[str, str] | None:
        """The envelope's ``attributes`` for ``message`` (None: not checked)."""

    def reason_may_be_missing(self, message: FuzzMessage) -> bool:
        """True when the broker's attribute limit leaves no room for the ``x-dead-letter-*`` reason."""

    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        """Broker-specific checks of a dead-lettered message (original kept, broker limits respected)."""


class _ContractAdapter(Protocol):
    """What :class:`FuzzTargetBase` uses of a broker's contract adapter (tests/integration/<broker>/conftest.py)."""

    def make_trigger(self, **kwargs: Any) -> Any: ...

    async def unsettled(self) -> int: ...


AdapterT = TypeVar("AdapterT", bound=_ContractAdapter)
TargetT = TypeVar("TargetT", bound="FuzzTargetBase[Any]")


class FuzzTargetBase(ABC, Generic[AdapterT]):
    """
    A :class:`FuzzTarget` less what only its broker knows: the contract adapter it wraps (its
    triggers and its count of unsettled messages are the adapter's), the stream's name in reports
    and the watchers' batch size. A broker's subclass adds the abstract methods and, where its
    attribute limit can leave no room for the reason, :meth:`reason_may_be_missing`.
    """

    def __init__(self, adapter: AdapterT, name: str, *, batch_size: int = 1) -> None:
        self.adapter = adapter
        self.name = name
        self.batch_size = batch_size

    @classmethod
    def of(cls: type[TargetT], target: FuzzTargetBase[Any]) -> TargetT:
        """
        ``target``'s stream through this subclass (a hostile test's own publishing or reading of
        dead letters), for a subclass whose constructor takes what this one does.
        """
        return cls(target.adapter, target.name, batch_size=target.batch_size)

    def make_trigger(self, **kwargs: Any) -> Any:
        return self.adapter.make_trigger(**kwargs)

    async def publish(self, messages: Sequence[FuzzMessage]) -> None:
        """One call per message, in order: each has its own extras, an adapter's ``publish`` one set per call."""
        for message in messages:
            await self.publish_one(message)

    @abstractmethod
    async def publish_one(self, message: FuzzMessage) -> None:
        """Publish ``message`` as the broker's own sender would: body, marker and extras."""

    async def unsettled(self) -> int:
        return await self.adapter.unsettled()

    @abstractmethod
    async def dead_letters(self) -> list[DeadRecord]:
        """Every message in the dead-letter target so far, each with an identity stable across reads."""

    @abstractmethod
    def expected_attributes(self, message: FuzzMessage) -> dict[str, str] | None:
        """The envelope's ``attributes`` for ``message`` (None: not checked)."""

    def reason_may_be_missing(self, message: FuzzMessage) -> bool:
        """False: the broker always has room for the ``x-dead-letter-*`` reason (override where it has not)."""
        return False

    @abstractmethod
    def check_dead_record(self, message: FuzzMessage, record: DeadRecord) -> None:
        """Broker-specific checks of a dead-lettered message (original kept, broker limits respected)."""


# -- the property -------------------------------------------------------------------------------------
@dataclass
class _Mark:
    persisted: dict[int, int]
    dead: set[Any]


@dataclass
class FuzzStream:
    """One target with its three watchers on the shared runner."""

    target: FuzzTarget
    base_id: int
    max_payload_bytes: int = MAX_PAYLOAD_BYTES
    # ids of the payloads already checked by serialise_deep (they stay alive in runner.persisted)
    _serialised: set[int] = field(default_factory=set)

    def trigger_id(self, watcher: str) -> int:
        return self.base_id + WATCHERS.index(watcher)

    def add_watchers(self, runner: RunnerSim) -> None:
        options: dict[str, Any] = {"max_payload_bytes": self.max_payload_bytes}
        if self.target.batch_size > 1:
            options.update(batch_size=self.target.batch_size, batch_timeout=0.2)
        runner.add(self.trigger_id("all"), self.target.make_trigger(**options))
        runner.add(
            self.trigger_id("raiser"),
            self.target.make_trigger(filter_function="tests.integration.fuzz.raise_on_marked", **options),
        )
        runner.add(
            self.trigger_id("match"), self.target.make_trigger(match={"body.kind": list(MATCH_KINDS)}, **options)
        )

    async def mark(self, runner: RunnerSim) -> _Mark:
        persisted = {self.trigger_id(w): runner.count(self.trigger_id(w)) for w in WATCHERS}
        return _Mark(persisted, {record.ident for record in await self.target.dead_letters()})

    def payloads(self, runner: RunnerSim, watcher: str, since: _Mark) -> list[list[dict[str, Any]]]:
        """The envelopes of each event ``watcher`` fired since ``since`` (one each, or a batch's)."""
        trigger_id = self.trigger_id(watcher)
        payloads = runner.persisted.get(trigger_id, [])[since.persisted[trigger_id] :]
        for payload in payloads:
            assert json.loads(json.dumps(payload)) == payload, f"{self.target.name}: payload does not round-trip"
            if id(payload) not in self._serialised:
                serialise_deep(payload)
                self._serialised.add(id(payload))
        if self.target.batch_size == 1:
            return [[payload] for payload in payloads]
        for payload in payloads:
            assert set(payload) == {"messages"} and 1 <= len(payload["messages"]) <= self.target.batch_size
        return [payload["messages"] for payload in payloads]

    def check_size(self, envelopes: list[dict[str, Any]], published: Mapping[str, FuzzMessage]) -> None:
        """An event payload is at most max_payload_bytes, but for the known bugs (see :func:`known_over_cap`)."""
        payload = envelopes[0] if self.target.batch_size == 1 else {"messages": envelopes}
        size = payload_size(payload)
        if size <= MAX_PAYLOAD_BYTES:
            return
        messages = [published.get(canonical(e["body_encoding"], e["body"])) for e in envelopes]
        bug = known_over_cap(envelopes, [m for m in messages if m is not None])
        assert bug is not None, f"{self.target.name}: event payload of {size} bytes: {messages!r}"
        event(f"known bug tolerated: {bug}")

    async def verify(self, runner: RunnerSim, messages: Sequence[FuzzMessage], since: _Mark) -> None:
        name = self.target.name
        unsettled = await self.target.unsettled()
        assert unsettled == 0, f"{name}: {unsettled} message(s) stuck (neither settled nor dead-lettered)"
        dead = [r for r in await self.target.dead_letters() if r.ident not in since.dead]
        published = {message_key(m): m for m in messages}
        fired: dict[str, list[dict[str, Any]]] = {}
        for watcher in WATCHERS:
            payloads = self.payloads(runner, watcher, since)
            for envelopes in payloads:
                self.check_size(envelopes, published)
            fired[watcher] = [envelope for envelopes in payloads for envelope in envelopes]
        for envelope in fired["all"]:
            self.check_envelope(envelope)
        by_key: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for watcher, envelopes in fired.items():
            for envelope in envelopes:
                key = canonical(envelope["body_encoding"], envelope["body"])
                by_key.setdefault(key, {w: [] for w in WATCHERS})[watcher].append(envelope)
        unexpected = set(by_key) - set(published)
        assert not unexpected, f"{name}: envelopes for nothing published (or mis-decoded): {sorted(unexpected)[:3]}"
        remaining_dead = list(dead)
        for message in messages:
            encoding, body = expected_decoding(message.body)
            seen = by_key.get(canonical(encoding, body), {w: [] for w in WATCHERS})
            records = [r for r in remaining_dead if r.body == message.body]
            for found in records:
                remaining_dead.remove(found)
            where = f"{name}: {message!r}"
            assert len(records) <= 1, f"{where}: dead-lettered {len(records)} times"
            record = records[0] if records else None
            reason = record.reason if record is not None else None
            if record is not None:
                self.target.check_dead_record(message, record)
                if reason is None:
                    assert self.target.reason_may_be_missing(message), f"{where}: dead-lettered without a reason"
            # Oversize: the reason says so, or (no room for a reason) nothing fired on it.
            size_match = _OVERSIZE_REASON.match(reason or "")
            oversize = record is not None and (size_match is not None or (reason is None and not seen["all"]))
            if message.huge:
                assert oversize, f"{where}: clearly over max_payload_bytes, not dead-lettered as such ({reason!r})"
            if oversize:
                if size_match is not None:
                    size = int(size_match.group(1))
                    # In batch mode one envelope is capped so that a batch of it alone fits:
                    # max_payload_bytes less {"messages":[...]} (BATCH_OVERHEAD).
                    cap = MAX_PAYLOAD_BYTES - (BATCH_OVERHEAD if self.target.batch_size > 1 else 0)
                    assert size > cap, f"{where}: dead-lettered as oversize at {size} bytes (cap {cap})"
                assert not any(seen.values()), f"{where}: an oversize message fired events"
                continue
            assert len(seen["all"]) == 1, f"{where}: delivered {len(seen['all'])} times to the watcher without filter"
            expected_attributes = self.target.expected_attributes(message)
            if expected_attributes is not None:
                attributes = seen["all"][0]["attributes"]
                assert attributes == expected_attributes, f"{where}: attributes {attributes!r}"
            if message.raise_text is not None:
                assert record is not None, f"{where}: the filter raised, not dead-lettered"
                if reason is not None:
                    assert _FILTER_REASON.match(reason), f"{where}: reason {reason!r}"
                assert not seen["raiser"], f"{where}: the raising watcher fired"
            else:
                assert record is None, f"{where}: dead-lettered ({reason!r}) although every watcher accepted it"
                assert len(seen["raiser"]) == 1, f"{where}: the raising watcher fired {len(seen['raiser'])} times"
            expected_match = 1 if matches_kind(body) else 0
            assert len(seen["match"]) == expected_match, f"{where}: match watcher fired {len(seen['match'])} times"
        assert not remaining_dead, f"{name}: dead letters for nothing published: {remaining_dead[:3]}"

    def check_envelope(self, envelope: Mapping[str, Any]) -> None:
        assert envelope["broker"] in BROKER_NAMES
        assert isinstance(envelope["message_id"], str) and isinstance(envelope["source"], str)
        assert envelope["body_encoding"] in ("json", "text", "base64")
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in envelope["attributes"].items())
        assert envelope["published_at"] is None or isinstance(envelope["published_at"], str)
        assert envelope["delivery_attempt"] == 1, f"{self.target.name}: redelivered without a failure: {envelope}"
        assert isinstance(envelope["metadata"], dict)


class FuzzSession:
    """
    The streams of one test and the runner driving them, across hypothesis examples. Not a
    dataclass: hypothesis would print its fields (every persisted event) with each example.
    """

    def __init__(self, runner: RunnerSim, streams: list[FuzzStream], settle_timeout: float = ACCOUNT_TIMEOUT) -> None:
        self.runner = runner
        self.streams = streams
        self.settle_timeout = settle_timeout

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"FuzzSession({', '.join(stream.target.name for stream in self.streams)})"

    @classmethod
    def start(
        cls, runner: RunnerSim, targets: Sequence[FuzzTarget], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
    ) -> FuzzSession:
        streams = [FuzzStream(target, 100 * (index + 1), max_payload_bytes) for index, target in enumerate(targets)]
        for stream in streams:
            stream.add_watchers(runner)
        return cls(runner, streams)

    def assert_healthy(self) -> None:
        assert not self.runner.failures, f"a watcher failed: {self.runner.failures!r}"
        for stream in self.streams:
            for watcher in WATCHERS:
                assert self.runner.alive(stream.trigger_id(watcher)), f"{stream.target.name}/{watcher} stopped"

    async def run(self, messages: Sequence[FuzzMessage]) -> None:
        """Publish ``messages`` on every stream and check the property once all are accounted for."""
        self.assert_healthy()
        marks = [await stream.mark(self.runner) for stream in self.streams]
        for stream in self.streams:
            await stream.target.publish(messages)
        await asyncio.gather(
            *(self._settled(stream, messages, mark) for stream, mark in zip(self.streams, marks, strict=True))
        )
        self.assert_healthy()

    async def _settled(self, stream: FuzzStream, messages: Sequence[FuzzMessage], mark: _Mark) -> None:
        """Retry :meth:`FuzzStream.verify` until it passes or the timeout: then its failure is the report."""
        await retry_assertion(lambda: stream.verify(self.runner, messages, mark), timeout=self.settle_timeout)


@contextlib.asynccontextmanager
async def fuzz_session(
    targets: Sequence[FuzzTarget], *, max_payload_bytes: int = MAX_PAYLOAD_BYTES
) -> AsyncIterator[FuzzSession]:
    """
    A :class:`FuzzSession` on ``targets``: the real manager (a 60 s ack timeout: a batch that fans
    out slowly is not a stuck one) and a runner persisting every 50 ms, for a whole test.
    """
    async with RunnerSim(SharedStreamManager(ack_timeout=60), confirm_interval=0.05) as runner:
        yield FuzzSession.start(runner, targets, max_payload_bytes=max_payload_bytes)


@pytest.fixture
async def session(fuzz_targets: Sequence[FuzzTarget]) -> AsyncIterator[FuzzSession]:
    """
    Every broker's fuzz session, on its ``fuzz_targets`` fixture; a broker's ``test_fuzz.py``
    imports it. Function-scoped but alive across hypothesis examples, on purpose (see
    :data:`FUZZ_SETTINGS`): a stream per example would not fit in CI.
    """
    async with fuzz_session(fuzz_targets) as started:
        yield started


def fuzz_test(
    messages: st.SearchStrategy[FuzzMessage], *explicit: list[FuzzMessage]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """
    The decorators of every broker's ``test_fuzzed_input_is_delivered_or_dead_lettered``: a
    :data:`FUZZ_TIMEOUT`, :data:`FUZZ_SETTINGS`, :func:`batches` of ``messages`` and the
    ``explicit`` example batches, run first and in this order. The test itself stays in the
    broker's module, as ``await session.run(batch)``: its source is what hypothesis derives the
    fixed seed from (decorators excluded), so moving it would change what CI generates.
    """

    def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
        for batch in reversed(explicit):  # hypothesis runs the last one added first
            test = example(batch=batch)(test)
        return pytest.mark.timeout(FUZZ_TIMEOUT)(FUZZ_SETTINGS(given(batch=batches(messages))(test)))

    return decorate


async def retry_assertion(check: Callable[[], Awaitable[None]], *, timeout: float, interval: float = 0.2) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            await check()
            return
        except AssertionError:
            if loop.time() >= deadline:
                raise
        await asyncio.sleep(interval)


async def settle_or_fail(runner: RunnerSim, unsettled: Callable[[], Awaitable[int]], *, timeout: float = 20.0) -> None:
    """For the reproductions of bugs: wait until nothing is unsettled, a watcher failed, or ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not runner.failures and loop.time() < deadline:
        if await unsettled() == 0:
            return
        await asyncio.sleep(0.2)


def batches(messages: st.SearchStrategy[FuzzMessage], max_size: int = 5) -> st.SearchStrategy[list[FuzzMessage]]:
    """Small batches of distinct messages (distinct decoded bodies: each is traced by its body)."""
    return st.lists(
        messages.filter(lambda m: known_bug(m) is None), min_size=1, max_size=max_size, unique_by=message_key
    )
