#!/usr/bin/env bash
# The other ends of the supported Python range (Airflow 3.3 and this provider: 3.10 to 3.13): for
# each, a virtualenv of its own (.venv-py3.X, set up by scripts/setup.sh exactly as .venv is) runs
# the unit tests (which drive the real SharedStreamManager); the oldest (3.10, Airflow's floor) also
# runs the SQS integration suite against a real moto server (CI's time budget). The fuzz and
# hostile corpus run on the main Python only (same code; they are the slow part). A Python that is not on
# this machine is reported and skipped, so a fresh clone without pyenv still passes; CI machines
# have pyenv's 3.10.13 and 3.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # the first working python3.X: on PATH, else under pyenv's versions
  local version=$1 candidate
  for candidate in "python$version" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/"python$version"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys' >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

for version in ${EXTRA_PYTHONS:-3.10 3.13}; do
  if ! python=$(find_python "$version"); then
    echo "== python $version: not found on this machine, skipped"
    continue
  fi
  venv=.venv-py$version
  echo "== python $version ($python): setup"
  SETUP_VENV=$venv PYTHON=$python bash scripts/setup.sh
  if [ "$version" = "3.10" ]; then
    echo "== python $version: unit tests and the SQS integration suite"
    "$venv/bin/python" -m pytest -q tests/unit tests/integration/sqs -k "not (test_fuzz or test_hostile)"
  else
    echo "== python $version: unit tests"
    "$venv/bin/python" -m pytest -q tests/unit
  fi
done
