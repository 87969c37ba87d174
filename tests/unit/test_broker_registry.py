"""
The broker registry (``airflow_shared_stream_provider/brokers.py``) against the code it points at.

Every check is parametrized over :data:`BROKERS`, so a new entry is checked without an edit here:
its settings name it, its trigger sits at ``triggers.<name>`` and imports no SDK, its producer
does import the SDK the entry names (so the SDK prefixes are not vacuous) and a missing SDK names
the entry's extra, its scheme is registered, its extra and pytest marker exist, its harness paths
resolve. The reverse is checked too: a trigger module without an entry fails.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from airflow_shared_stream_provider._core.producer import SharedStreamProducerBase
from airflow_shared_stream_provider._core.settings import StreamSettings
from airflow_shared_stream_provider._core.trigger import SharedStreamTrigger, _stream_name
from airflow_shared_stream_provider.brokers import (
    BROKER_NAMES,
    BROKERS,
    BrokerSpec,
    Harness,
    HarnessTable,
    broker_spec,
    find_broker,
    load,
    sdk_module_prefixes,
)
from airflow_shared_stream_provider.get_provider_info import get_provider_info
from airflow_shared_stream_provider.queues import SharedStreamQueueProvider
from scripts import provider_info

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "airflow_shared_stream_provider"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DIST = "airflow-shared-stream-provider"

by_name = pytest.mark.parametrize("spec", BROKERS, ids=[spec.name for spec in BROKERS])


# -- one entry ---------------------------------------------------------------------------------------
@by_name
def test_the_settings_declare_the_entrys_name(spec: BrokerSpec) -> None:
    settings = load(spec.settings)
    assert issubclass(settings, StreamSettings)
    assert settings.broker == spec.name
    fields = {f.name: f for f in dataclasses.fields(settings)}
    assert set(spec.source_fields) <= set(fields), f"source_fields {spec.source_fields} are not settings fields"
    assert spec.conn_id_arg in fields, f"{spec.conn_id_arg} is not a field of {settings.__name__}"
    assert fields[spec.conn_id_arg].default == spec.default_conn_id


@by_name
def test_the_trigger_is_at_its_public_path_and_names_the_producer(spec: BrokerSpec) -> None:
    assert spec.trigger_module == f"{PACKAGE}.triggers.{spec.name}"  # users' Dags import this path
    trigger = load(spec.trigger)
    assert issubclass(trigger, SharedStreamTrigger)
    assert f"{trigger.__module__}.{trigger.__qualname__}" == spec.trigger_path  # what serialize() writes
    assert trigger.settings_class is load(spec.settings)
    assert trigger.producer_class_path == spec.producer_path


@by_name
def test_the_producer_takes_its_broker_from_the_settings(spec: BrokerSpec) -> None:
    assert spec.producer.startswith(f"{PACKAGE}.producers.{spec.name}:")
    producer = load(spec.producer)
    assert issubclass(producer, SharedStreamProducerBase)
    declared = [cls.__name__ for cls in producer.__mro__ if "broker" in vars(cls)]
    assert not declared, f"broker is declared on {declared}: the settings' ClassVar is the one declaration"


# -- what a fresh interpreter loads (one subprocess for every broker: tests/unit/import_probe.py) --------
# A trigger each broker's probe builds (construct, serialize, key) with the SDK absent from sys.modules.
EXAMPLE_TRIGGER_ARGUMENTS: dict[str, dict[str, object]] = {
    "kafka": {"topics": ["orders"]},
    "sqs": {"queue_url": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders"},
    "pubsub": {"subscription": "projects/p-1/subscriptions/orders"},
    "servicebus": {"queue_name": "orders"},
    "redis": {"stream": "orders"},
}
CORE_MODULES = sorted(f"{PACKAGE}._core.{path.stem}" for path in (ROOT / PACKAGE / "_core").glob("*.py"))


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, Any]:
    assert set(EXAMPLE_TRIGGER_ARGUMENTS) == set(BROKER_NAMES), "a new broker needs its example trigger arguments"
    assert f"{PACKAGE}._core.producer" in CORE_MODULES
    request = {
        "sdk_prefixes": list(sdk_module_prefixes()),
        "quiet_modules": [PACKAGE, f"{PACKAGE}.brokers", f"{PACKAGE}.queues", *CORE_MODULES],
        "producers_package": f"{PACKAGE}.producers",
        "brokers": [
            {
                "name": spec.name,
                "trigger": spec.trigger,
                "example": EXAMPLE_TRIGGER_ARGUMENTS[spec.name],
                "producer_module": spec.producer.partition(":")[0],
                "sdk_modules": list(spec.sdk_modules),
            }
            for spec in BROKERS
        ],
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.unit.import_probe"],
        input=json.dumps(request),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("IMPORT_PROBE=")]
    answer: dict[str, Any] = json.loads(line.partition("=")[2])
    return answer


def test_dag_file_imports_load_no_broker_sdk(fresh_imports: dict[str, Any]) -> None:
    """The package root, the registry, queues, every ``_core`` module and every broker's trigger, built."""
    assert fresh_imports["quiet"] == [], f"broker SDK modules loaded by Dag-file imports: {fresh_imports['quiet']}"


@by_name
def test_the_producer_loads_the_sdk_the_entry_names(spec: BrokerSpec, fresh_imports: dict[str, Any]) -> None:
    """The other half: an SDK prefix the producer never loads would make the hygiene check vacuous."""
    assert fresh_imports["producers"][spec.name], f"{spec.producer} loads nothing under {spec.sdk_modules}"


@by_name
def test_a_missing_sdk_names_the_entrys_extra(spec: BrokerSpec, fresh_imports: dict[str, Any]) -> None:
    """
    Every module under the entry's SDK prefixes unimportable: the producer raises Airflow's optional
    feature error (``ProvidersManager`` reports a disabled feature, not a broken provider), which is
    also an ``ImportError``, naming the extra to install.
    """
    blocked = fresh_imports["blocked"][spec.name]
    assert {"MissingBrokerSDKError", "AirflowOptionalProviderFeatureException", "ImportError"} <= set(
        blocked["classes"]
    ), blocked
    assert f"pip install 'airflow-shared-stream-provider[{spec.extra}]'" in blocked["message"], blocked


@by_name
def test_the_queue_scheme_is_registered_and_builds_the_trigger(spec: BrokerSpec) -> None:
    assert spec.queue_scheme == f"shared+{spec.name}"
    provider = load(spec.queue_provider)
    assert issubclass(provider, SharedStreamQueueProvider)
    assert provider.broker == spec.name and provider.scheme == spec.queue_scheme
    assert provider().trigger_class() is load(spec.trigger)
    assert all(prefix.startswith(spec.queue_scheme) for prefix in provider.queue_prefixes)
    info = get_provider_info()
    assert spec.queue_provider_path in info["queues"]
    assert any(spec.trigger_module in t["python-modules"] for t in info["triggers"])
    assert spec.integration_name in {i["integration-name"] for i in info["integrations"]}


@by_name
def test_the_extra_installs_the_sdk_and_nothing_else(spec: BrokerSpec) -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert spec.extra in extras, f"pyproject.toml has no extra {spec.extra!r}"
    in_all = {extra for r in map(Requirement, extras["all"]) if r.name == DIST for extra in r.extras}
    assert spec.extra in in_all, f"the all extra does not include {spec.extra}"
    # Each requirement is an installed distribution providing the SDK's top-level package.
    tops = {prefix.partition(".")[0] for prefix in spec.sdk_modules}
    for requirement in extras[spec.extra]:
        name = Requirement(requirement).name
        offers = top_level_modules(name)
        assert offers & tops, f"extra {spec.extra}: {name} provides {sorted(offers)}, none of the SDK's {sorted(tops)}"


def top_level_modules(distribution: str) -> set[str]:
    """
    The importable top-level names an installed distribution provides: its ``top_level.txt``, else
    the first part of each file it installed. (Python 3.10's ``packages_distributions()`` reads only
    ``top_level.txt``, which wheels built by newer backends, aiobotocore's and redis's, no longer have.)
    """
    dist = importlib.metadata.distribution(distribution)
    declared = dist.read_text("top_level.txt")
    if declared:
        return {line.strip() for line in declared.splitlines() if line.strip()}
    tops: set[str] = set()
    for file in dist.files or ():
        first = file.parts[0]
        if first.endswith((".dist-info", ".egg-info", ".data")) or first in {"..", "__pycache__"}:
            continue
        tops.add(first.removesuffix(".py") if len(file.parts) == 1 else first)
    return tops


@by_name
def test_the_pytest_marker_and_docs_page_exist(spec: BrokerSpec) -> None:
    markers = {line.split(":", 1)[0].strip() for line in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    assert spec.name in markers, f"no pytest marker {spec.name!r} in pyproject.toml (its integration suite uses it)"
    assert (ROOT / "docs" / f"{spec.name}.md").is_file()
    assert f"(docs/{spec.name}.md)" in (ROOT / "README.md").read_text(), "README's docs index does not link it"


@by_name
def test_harness_paths_resolve(spec: BrokerSpec) -> None:
    """Found without importing (test brokers and harnesses are heavy): the module's file defines the name."""
    for kind in (f.name for f in dataclasses.fields(Harness)):
        path = getattr(spec.harness, kind)
        if path is None:
            continue
        module, _, attribute = path.partition(":")
        found = importlib.util.find_spec(module)
        assert found is not None and found.origin is not None, f"harness.{kind}: no module {module}"
        if attribute:
            tree = ast.parse(Path(found.origin).read_text())
            names = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}
            assert attribute in names, f"harness.{kind}: {module} defines no {attribute}"


@by_name
def test_a_streams_log_name_uses_the_entrys_source_field(spec: BrokerSpec) -> None:
    fields = tuple((name, f"source-of-{spec.name}") for name in spec.source_fields[:1])
    assert _stream_name(("ns", spec.name, (*fields, ("other", "x")))) == f"{spec.name} 'source-of-{spec.name}'"


# -- the registry as a whole -------------------------------------------------------------------------
def test_every_trigger_module_has_an_entry() -> None:
    """The reverse direction: a broker written without its registry entry is found here."""
    modules = sorted(p.stem for p in (ROOT / PACKAGE / "triggers").glob("*.py") if p.stem != "__init__")
    assert modules, "no trigger modules found"
    missing = [name for name in modules if find_broker(name) is None]
    assert not missing, f"trigger modules without a registry entry in {PACKAGE}/brokers.py: {missing}"


def test_names_schemes_and_extras_are_unique() -> None:
    for attribute in ("name", "queue_scheme", "extra", "settings", "trigger", "producer", "queue_provider"):
        values = [getattr(spec, attribute) for spec in BROKERS]
        assert len(set(values)) == len(values), f"two entries share a {attribute}"
    assert tuple(spec.name for spec in BROKERS) == BROKER_NAMES
    with pytest.raises(KeyError, match="known: kafka"):
        broker_spec("nosuch")


def test_the_memory_test_broker_has_its_own_name_and_is_no_user_broker() -> None:
    from devkit.memory import MemorySharedStreamTrigger

    trigger = MemorySharedStreamTrigger(broker_name="registry-test")
    assert trigger.settings.broker == "memory"
    assert find_broker("memory") is None and "memory" not in BROKER_NAMES
    key = trigger.shared_stream_key()
    assert isinstance(key, tuple) and key[1] == "memory"


def test_a_harness_table_lists_without_loading_and_loads_on_lookup() -> None:
    table = HarnessTable("kill_loop")
    assert list(table) == [spec.name for spec in BROKERS if spec.harness.kill_loop]
    with pytest.raises(KeyError, match="no kill_loop harness"):
        table["nosuch"]
    with pytest.raises(ValueError, match="no harness kind"):
        HarnessTable("nosuch")


def test_provider_yamls_broker_sections_are_written_from_the_registry(tmp_path: Path) -> None:
    """The block between the markers is the registry's: a broker edited out by hand is a --check failure."""
    text = (ROOT / "provider.yaml").read_text()
    assert provider_info.with_broker_block(text, ROOT / "provider.yaml") == text
    info = yaml.safe_load(text)
    for section, items in provider_info.broker_sections().items():
        assert info[section] == items
    spec = BROKERS[-1]
    drifted = text.replace(f"  - {spec.queue_provider_path}\n", "", 1)
    assert drifted != text
    (tmp_path / "provider.yaml").write_text(drifted)
    module = tmp_path / "get_provider_info.py"
    module.write_text((ROOT / PACKAGE / "get_provider_info.py").read_text())
    args = ["--provider-yaml", str(tmp_path / "provider.yaml"), "--output", str(module)]
    assert provider_info.main([*args, "--check"]) == 1
    assert provider_info.main(args) == 0  # rewrites the block (and the module from it)
    assert (tmp_path / "provider.yaml").read_text() == text
    assert provider_info.main([*args, "--check"]) == 0
