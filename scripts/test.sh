#!/usr/bin/env bash
# The test command: lint, format check, types, then every test suite (unit, integration against
# real local brokers, end to end with real Airflow processes) on the main Python, then the unit and
# SQS suites on Python 3.10 and 3.13 (scripts/test-pythons.sh). Extra args go to the main pytest;
# with any, the other Pythons are skipped (a focused run), as they are with EXTRA_PYTHONS="".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== provider info"; .venv/bin/python -m scripts.provider_info --check
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy airflow_shared_stream_provider devkit tests bench example_dags scripts
echo "== pytest"; .venv/bin/python -m pytest "$@"
if [ $# -eq 0 ]; then bash scripts/test-pythons.sh; fi
