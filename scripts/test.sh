#!/usr/bin/env bash
# The test command: lint, format check, types, then every test suite (unit, integration against
# real local brokers, end to end with real Airflow processes). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy airflow_shared_stream_provider devkit tests bench example_dags
echo "== pytest"; .venv/bin/python -m pytest "$@"
