#!/usr/bin/env bash
# The main job: the whole event-driven pipeline on embedded defaults (local Kafka-compatible
# broker, SQLite metadata DB, real Airflow processes, PySpark). Extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m devkit.demo "$@"
