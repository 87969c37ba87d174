#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the provider with every extra and the dev tools.
# Idempotent: re-running only installs what changed. Used by scripts/demo.sh, scripts/test.sh and CI.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3.12 python3.13 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PYTHON=$candidate
      break
    fi
  done
fi
[ -n "$PYTHON" ] || { echo "setup: Python >= 3.11 is required" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -x .venv/bin/uv ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check uv
fi
.venv/bin/uv pip install --quiet --python .venv/bin/python -e ".[dev]"

# Java runs PySpark and the Pub/Sub emulator; the emulator itself is a Debian package of the
# machine image (google-cloud-cli-pubsub-emulator). Say clearly when either is missing.
command -v java >/dev/null 2>&1 || echo "setup: warning: no java on PATH (PySpark and the Pub/Sub emulator need Java 17)" >&2
