"""
The package as users install it: one version source, metadata of an Airflow provider, extras that
hold only broker SDKs, and Airflow's optional-feature error for a missing SDK.
"""

from __future__ import annotations

import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from importlib.metadata import metadata, version
from pathlib import Path

import yaml
from packaging.requirements import Requirement

import airflow_shared_stream_provider
from airflow_shared_stream_provider.brokers import BROKERS
from airflow_shared_stream_provider.get_provider_info import get_provider_info

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DIST = "airflow-shared-stream-provider"


def test_one_version_source() -> None:
    """__init__.py's __version__ is the version: hatch reads it, provider.yaml and the changelog name it."""
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "airflow_shared_stream_provider/__init__.py"
    current = airflow_shared_stream_provider.__version__
    # The installed metadata is what hatch computed from __init__.py (the editable install).
    assert version(DIST) == current
    # Airflow's convention: provider.yaml lists every released version, newest first.
    versions = yaml.safe_load((ROOT / "provider.yaml").read_text())["versions"]
    assert versions[0] == current
    assert get_provider_info()["versions"][0] == current
    [top] = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)[:1]
    assert top == current, "CHANGELOG.md's newest section is not the current version"


def test_metadata_is_an_airflow_providers() -> None:
    meta = metadata(DIST)
    classifiers = set(meta.get_all("Classifier") or [])
    assert {"Framework :: Apache Airflow", "Framework :: Apache Airflow :: Provider", "Typing :: Typed"} <= classifiers
    assert "airflow-provider" in (meta["Keywords"] or "").split(",")
    assert meta["License-Expression"] == "Apache-2.0"
    assert set(meta.get_all("License-File") or []) == {"LICENSE", "NOTICE"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert (ROOT / "airflow_shared_stream_provider" / "py.typed").exists()


def test_airflow_is_pinned_to_the_tested_minor() -> None:
    [airflow] = [
        Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "apache-airflow"
    ]
    assert airflow.specifier.contains("3.3.2") and not airflow.specifier.contains("3.3.1")
    assert not airflow.specifier.contains("3.4.0")
    import airflow as installed

    assert airflow.specifier.contains(installed.__version__), "the installed (tested) Airflow is outside the pin"


def test_extras_hold_only_broker_sdks_and_tools_are_dependency_groups() -> None:
    """A user's ``pip install '...[x]'`` never pulls in moto, psycopg2, test brokers or PySpark."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    # One extra per registry broker (plus all); test_broker_registry.py checks that each installs
    # only distributions providing that broker's SDK modules, and that all names every one.
    assert set(extras) == {*(spec.extra for spec in BROKERS), "all"}
    groups = PYPROJECT["dependency-groups"]
    assert {"dev", "bench", "spark"} <= set(groups)
    published = {Requirement(r).name for reqs in extras.values() for r in reqs} - {DIST}
    assert published == {Requirement(r).name for spec in BROKERS for r in extras[spec.extra]}
    # The installed metadata agrees (what PyPI would publish).
    assert set(metadata(DIST).get_all("Provides-Extra") or []) == set(extras)
