"""
Every broker's docs page lists every option its trigger takes, with the default the code has
(issue 21, "each setting written once": the code is the source, the docs table is checked against
it). Parametrized over the broker registry, so a new broker's page is checked too.

An option is a field of the broker's settings dataclass (the producer side, the stream key), an
argument of its trigger's ``__init__`` or of the base trigger's (the watcher side: ``match``,
``filter_function``...). A row is ``| `name` | default | meaning |`` in the page's ``## Options``
section; the default cell starts with the value as Python writes it (strings may be quoted or
not), or ``required``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger
from airflow_shared_stream_provider.brokers import BROKERS, BrokerSpec, load

DOCS = Path(__file__).resolve().parents[2] / "docs"
REQUIRED = object()
ROW = re.compile(r"^\| `(?P<name>[a-z_]+)`(?: / `[a-z_]+`)* \| (?P<default>[^|]*) \|")


def documented_defaults(broker: str) -> dict[str, str]:
    """``option -> default cell`` of the ``## Options`` table of ``docs/<broker>.md``."""
    text = (DOCS / f"{broker}.md").read_text()
    assert "\n## Options" in text, f"docs/{broker}.md has no '## Options' section"
    section = text.split("\n## Options", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            for name in re.findall(r"`([a-z_]+)`", line.split(" | ", 1)[0]):
                rows[name] = match.group("default").strip()
    return rows


def parameters(function: Any) -> dict[str, Any]:
    return {
        p.name: REQUIRED if p.default is p.empty else p.default
        for p in inspect.signature(function).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }


def options_of(spec: BrokerSpec) -> dict[str, Any]:
    """Every option of the broker's trigger and its default in the code (:data:`REQUIRED` if none)."""
    options = parameters(SharedStreamTrigger.__init__)
    for field in dataclasses.fields(load(spec.settings)):
        if field.default is not dataclasses.MISSING:
            options[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            options[field.name] = field.default_factory()
        else:
            options[field.name] = REQUIRED
    options.update(parameters(load(spec.trigger).__init__))
    return options


def default_matches(cell: str, value: Any) -> bool:
    first = cell.split(" ", 1)[0].rstrip(":,;").strip("`")
    if value is REQUIRED:
        return cell.startswith("required")
    if value is None or isinstance(value, bool):
        return first == str(value)
    if isinstance(value, str):
        return first.strip('"') == value
    if isinstance(value, int | float):
        try:
            return float(first) == float(value)
        except ValueError:
            return False
    return True  # containers: shown as prose (an empty mapping is "none")


@pytest.mark.parametrize("spec", BROKERS, ids=[spec.name for spec in BROKERS])
def test_every_option_is_documented_with_its_default(spec: BrokerSpec) -> None:
    documented = documented_defaults(spec.name)
    options = options_of(spec)
    undocumented = sorted(set(options) - set(documented))
    assert not undocumented, f"docs/{spec.name}.md, Options: no row for {undocumented}"
    wrong = {
        name: (documented[name], "required" if value is REQUIRED else repr(value))
        for name, value in options.items()
        if not default_matches(documented[name], value)
    }
    assert not wrong, f"docs/{spec.name}.md, Options: default cell vs the code: {wrong}"
    unknown = sorted(set(documented) - set(options))
    assert not unknown, f"docs/{spec.name}.md, Options: rows for options the trigger does not take: {unknown}"


def test_the_check_catches_a_wrong_default() -> None:
    assert default_matches('`"reject"` text', "reject") and default_matches("`reject`", "reject")
    assert not default_matches("`5`", 6)
    assert not default_matches("`None`", 0)
    assert default_matches("`67108864` (64 MiB)", 64 * 1024 * 1024)
    assert not default_matches("—", REQUIRED)
