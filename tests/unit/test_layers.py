"""
Layers that say what they are (docs/development.md, "Layout of the core"): a ``_core`` module is
used by the core itself or by two or more brokers; what one broker alone uses sits beside its
producer, in ``producers/<broker>_<what>.py``. The brokers come from the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

from airflow_shared_stream_provider.brokers import BROKERS
from tests.unit import test_import_hygiene as hygiene

PACKAGE = "airflow_shared_stream_provider"
CORE = f"{PACKAGE}._core."
PRODUCERS = f"{PACKAGE}.producers."


def broker_of_name(module: str) -> str | None:
    """The broker a ``producers`` module names (``<broker>`` or ``<broker>_<what>``), if any."""
    stem = module.removeprefix(PRODUCERS)
    for spec in BROKERS:
        if stem == spec.name or stem.startswith(f"{spec.name}_"):
            return spec.name
    return None


def producer_brokers(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The package's import graph reversed (module -> its importers), and each producers module's brokers."""
    graph = hygiene.import_graph(root, [PACKAGE])
    importers: dict[str, set[str]] = {module: set() for module in graph}
    for module, targets in graph.items():
        for target in targets:
            importers[target].add(module)

    def brokers_of(module: str, seen: frozenset[str] = frozenset()) -> set[str]:
        # A producers module named after no broker (aws_connection, aws_session) serves the
        # brokers of the producers modules that import it.
        if (named := broker_of_name(module)) is not None:
            return {named}
        return {
            broker
            for user in importers[module]
            if user.startswith(PRODUCERS) and user not in seen
            for broker in brokers_of(user, seen | {module})
        }

    return importers, {module: brokers_of(module) for module in graph if module.startswith(PRODUCERS)}


def layer_violations(root: Path) -> list[str]:
    """Each ``_core`` module that only one broker's producer modules (or none) use, with its users."""
    importers, brokers = producer_brokers(root)
    violations = []
    for module in sorted(m for m in importers if m.startswith(CORE)):
        users = importers[module]
        core_users = sorted(user for user in users if not user.startswith(PRODUCERS))
        served = set().union(*(brokers[user] for user in users if user.startswith(PRODUCERS)))
        if not core_users and len(served) < 2:
            violations.append(f"{module.removeprefix(CORE)}: only {sorted(served)} ({sorted(users)})")
    return violations


def test_core_modules_serve_the_core_or_two_brokers() -> None:
    assert layer_violations(hygiene.REPO_ROOT) == [], (
        "a _core module serves one broker: move it beside that broker's producer "
        "(producers/<broker>_<what>.py) and update docs/development.md's layout table"
    )


def test_every_producers_module_serves_a_broker() -> None:
    graph = hygiene.import_graph(hygiene.REPO_ROOT, [PACKAGE])
    stems = sorted(m.removeprefix(PRODUCERS) for m in graph if m.startswith(PRODUCERS))
    assert "aws_connection" in stems and "pubsub_connection" in stems and "servicebus_connection" in stems
    for stem in stems:
        # aws_* are SQS's (named after the connection type they read; a second AWS broker would share them).
        assert broker_of_name(PRODUCERS + stem) is not None or stem.startswith("aws_"), stem


def connection_names_by_broker(root: Path) -> dict[str, set[str]]:
    """Each name of ``_core.connections`` the producers use (``from ... import name`` or
    ``connections.name``) -> the brokers whose producers modules use it."""
    _, brokers = producer_brokers(root)
    module = f"{CORE}connections"
    used: dict[str, set[str]] = {}
    for producer, served in brokers.items():
        path = root / (producer.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module == CORE.rstrip("."):
                aliases.update(alias.asname or alias.name for alias in node.names if alias.name == "connections")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                names.add(node.attr)
        for name in names:
            used.setdefault(name, set()).update(served)
    return used


def test_core_connections_holds_what_two_brokers_use() -> None:
    """No connection type's reader in ``_core/connections.py``: each sits beside its producer."""
    used = connection_names_by_broker(hygiene.REPO_ROOT)
    assert {"config_error", "read_connection", "read_extras", "register_secrets"} <= set(used)
    one_broker = {name: sorted(brokers) for name, brokers in used.items() if len(brokers) < 2}
    assert one_broker == {}, "move these beside their broker's producer (producers/<broker>_connection.py)"
