"""The provider as Airflow sees it: metadata, entry point, common-messaging schemes."""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from airflow_shared_stream_provider.brokers import BROKERS
from airflow_shared_stream_provider.get_provider_info import get_provider_info

ROOT = Path(__file__).resolve().parents[2]
# The upstream providers' connection types our producers read (the registry's connection_type).
UPSTREAM_CONNECTION_TYPES = {spec.connection_type for spec in BROKERS}
UPSTREAM_SCHEMES = {"kafka", "sqs", "google+pubsub", "azure+servicebus", "redis+pubsub"}


def test_get_provider_info_is_provider_yaml() -> None:
    assert get_provider_info() == yaml.safe_load((ROOT / "provider.yaml").read_text())


def test_the_entry_point_is_registered() -> None:
    [entry] = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_shared_stream")]
    assert entry.load() is get_provider_info


def test_no_upstream_connection_type_is_declared() -> None:
    info = get_provider_info()
    declared = {c.get("connection-type") for c in info.get("connection-types", [])}
    assert not declared & UPSTREAM_CONNECTION_TYPES
    assert "hook-class-names" not in info


def test_every_declared_module_and_class_imports() -> None:
    import importlib

    info = get_provider_info()
    for trigger in info["triggers"]:
        for module in trigger["python-modules"]:
            importlib.import_module(module)
    schemes = set()
    for path in info["queues"]:
        module_name, _, name = path.rpartition(".")
        provider = getattr(importlib.import_module(module_name), name)()
        assert provider.trigger_class().__name__.endswith("SharedStreamTrigger")
        schemes.add(provider.scheme)
    assert schemes == {spec.queue_scheme for spec in BROKERS}  # each shared+<name> (test_broker_registry.py)
    assert not schemes & UPSTREAM_SCHEMES


def test_airflow_lists_the_provider_and_its_triggers() -> None:
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "airflow-shared-stream-provider" in manager.providers
    manager.initialize_providers_queues()
    assert "airflow_shared_stream_provider.queues.KafkaSharedStreamQueueProvider" in manager.queue_class_names
    trigger_modules = {t.package_name for t in manager.trigger}
    assert "airflow-shared-stream-provider" in trigger_modules


def test_message_queue_trigger_builds_and_serializes_our_trigger_with_the_same_key() -> None:
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger

    from airflow_shared_stream_provider.triggers.kafka import KafkaSharedStreamTrigger

    generic = MessageQueueTrigger(scheme="shared+kafka", topics=["orders"], match={"body.region": "eu"})
    classpath, kwargs = generic.serialize()
    assert classpath == "airflow_shared_stream_provider.triggers.kafka.KafkaSharedStreamTrigger"
    rebuilt = KafkaSharedStreamTrigger(**kwargs)
    direct = KafkaSharedStreamTrigger(topics=["orders"])
    assert rebuilt.shared_stream_key() == direct.shared_stream_key()
    assert rebuilt.match == {"body.region": "eu"}


# -- provider.yaml is the one source: generated module, Airflow's schema ------------------------------
def test_get_provider_info_py_is_generated_from_provider_yaml() -> None:
    """The committed module is exactly what scripts/provider_info.py writes (scripts/test.sh runs --check too)."""
    result = subprocess.run(
        [sys.executable, "-m", "scripts.provider_info", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_check_fails_on_drift_and_the_generator_fixes_it(tmp_path: Path) -> None:
    edited = (ROOT / "provider.yaml").read_text().replace('default: "60.0"', 'default: "61.0"', 1)
    assert 'default: "61.0"' in edited
    (tmp_path / "provider.yaml").write_text(edited)
    module = tmp_path / "get_provider_info.py"
    shutil.copy(ROOT / "airflow_shared_stream_provider" / "get_provider_info.py", module)
    command = [sys.executable, "-m", "scripts.provider_info", "--provider-yaml", str(tmp_path / "provider.yaml")]
    command += ["--output", str(module)]

    drift = subprocess.run([*command, "--check"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert drift.returncode == 1
    assert "out of date" in drift.stderr and '+                        "default": "61.0",' in drift.stderr

    subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert subprocess.run([*command, "--check"], check=False, cwd=ROOT, capture_output=True, timeout=60).returncode == 0
    namespace: dict[str, Any] = {}
    exec(compile(module.read_text(), str(module), "exec"), namespace)
    assert namespace["get_provider_info"]() == yaml.safe_load(edited)


def test_provider_info_validates_against_airflows_schema() -> None:
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_an_invalid_provider_info_fails_the_schema() -> None:
    """The schema test above can fail: a config option without its required fields is refused."""
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    del info["config"]["shared_stream_provider"]["options"]["cohort_settle"]["type"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(info, schema)


# -- config defaults: provider.yaml, the code's fallbacks and the tutorial agree -----------------------
SECTION = "shared_stream_provider"
PACKAGE = ROOT / "airflow_shared_stream_provider"


def _config_reads() -> dict[tuple[str, str], list[tuple[str, Any]]]:
    """
    Every ``conf.get*(section, option, fallback=...)`` in the package: ``(section, option)`` ->
    ``[(where, fallback value)]``. The fallback is a literal or a module-level name (resolved by
    importing the module), so the value compared is the one the code would use.
    """
    reads: dict[tuple[str, str], list[tuple[str, Any]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "conf"
                and node.func.attr.startswith("get")
                and len(node.args) >= 2
            ):
                continue
            module = importlib.import_module(module_name)
            section, option = (_value(module, arg) for arg in node.args[:2])
            fallbacks = [_value(module, k.value) for k in node.keywords if k.arg == "fallback"]
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            reads.setdefault((section, option), []).append((where, fallbacks[0] if fallbacks else _NO_FALLBACK))
    return reads


_NO_FALLBACK = object()


def _value(module: Any, node: ast.expr) -> Any:
    if isinstance(node, ast.Name):
        return getattr(module, node.id)
    return ast.literal_eval(node)


def _typed(option: dict[str, Any]) -> Any:
    """provider.yaml's default (a string, as in Airflow's config templates) as the option's type."""
    default, kind = option["default"], option["type"]
    if kind == "boolean":
        assert default in ("True", "False"), default
        return default == "True"
    return {"float": float, "integer": int, "string": str}[kind](default)


def test_every_provider_option_is_read_with_provider_yamls_default() -> None:
    options = yaml.safe_load((ROOT / "provider.yaml").read_text())["config"][SECTION]["options"]
    reads = _config_reads()
    ours = {option for section, option in reads if section == SECTION}
    assert ours == set(options), "options read in code vs declared in provider.yaml differ"
    for name, option in options.items():
        for where, fallback in reads[(SECTION, name)]:
            assert fallback is not _NO_FALLBACK, f"{where}: [{SECTION}] {name} is read without a fallback"
            assert type(fallback) is type(_typed(option)) and fallback == _typed(option), (
                f"{where}: [{SECTION}] {name} falls back to {fallback!r}, provider.yaml says {option['default']!r}"
            )


def test_airflow_options_we_read_fall_back_to_airflows_own_default() -> None:
    from airflow.configuration import conf

    for (section, name), uses in _config_reads().items():
        if section == SECTION:
            continue
        shipped = conf.get_default_value(section, name)
        assert shipped is not None, f"[{section}] {name} is not an Airflow option"
        for where, fallback in uses:
            assert fallback is _NO_FALLBACK or float(fallback) == float(shipped), (
                f"{where}: [{section}] {name} falls back to {fallback!r}, Airflow's default is {shipped!r}"
            )


def test_the_tutorial_lists_every_provider_option_with_its_default() -> None:
    options = yaml.safe_load((ROOT / "provider.yaml").read_text())["config"][SECTION]["options"]
    rows = dict(
        re.findall(rf"^\| `\[{SECTION}\] (\w+)` \| `([^`]*)` \|", (ROOT / "docs" / "tutorial.md").read_text(), re.M)
    )
    assert set(rows) == set(options), "docs/tutorial.md's option table vs provider.yaml"
    for name, option in options.items():
        assert rows[name] == option["default"], (
            f"docs/tutorial.md says {name} = {rows[name]}, provider.yaml {option['default']}"
        )
