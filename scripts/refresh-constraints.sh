#!/usr/bin/env bash
# Regenerate the pinned dependency files in constraints/ from PyPI (uv pip compile): the build
# backends (constraints/build.txt, from build.in: the build constraints of setup.sh and of the
# packaging test) and, for every Python the package supports, two files per Python 3.X:
#
#   constraints/dev-py3.X.txt     the checkout's lock: pyproject.toml with every extra and every
#                                 dependency group (dev, spark, bench) plus constraints/dev.in (the
#                                 tested Airflow, uv). scripts/setup.sh installs against it.
#   constraints/airflow-<airflow version>-py3.X.txt
#                                 what a user installs: apache-airflow at the tested version plus this
#                                 provider with every extra, nothing else. It stands in for Airflow's
#                                 own constraints file (see the header written below);
#                                 tests/packaging/test_installed_wheel.py installs the wheel with it.
#
# Without arguments the existing pins are kept (uv prefers the versions already in the output file):
# only what pyproject.toml or dev.in added, removed or re-ranged changes. Arguments go to every
# dev compile: `--upgrade` moves everything to the newest allowed versions, `--upgrade-package NAME`
# moves one. The user files are resolved *within* the dev lock (-c), so they always carry the
# versions the test suite runs on. After a refresh: bash scripts/setup.sh, then the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHONS=${PYTHONS:-"3.10 3.11 3.12 3.13"}
MAIN_PYTHON=3.11 # scripts/setup.sh's first choice; the lock a new Python's file starts from
UV=${UV:-}
if [ -z "$UV" ]; then
  if [ -x .venv/bin/uv ]; then UV=.venv/bin/uv; else UV=$(command -v uv) || { echo "refresh-constraints: no uv (run scripts/setup.sh first)" >&2; exit 1; }; fi
fi

AIRFLOW_VERSION=$(sed -n 's/^apache-airflow==\([^ #]*\).*/\1/p' constraints/dev.in)
[ -n "$AIRFLOW_VERSION" ] || { echo "refresh-constraints: constraints/dev.in pins no apache-airflow==X" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# uv resolves for a target Python and platform without that interpreter: Linux x86_64, as on the
# development and CI machines (a resolution for one platform, like Airflow's own constraints files),
# and for the minor's oldest patch (--python-version 3.11 is 3.11.0), so a lock fits every 3.11.x.
compile() {  # compile OUTPUT PYTHON_VERSION ARGS...: keep OUTPUT's pins as preferences
  local output=$1 python_version=$2
  shift 2
  local scratch="$work/$(basename "$output")"
  rm -f "$scratch"
  if [ -f "$output" ]; then cp "$output" "$scratch"; fi
  "$UV" pip compile --quiet --python-version "$python_version" --python-platform x86_64-unknown-linux-gnu \
    --annotation-style line --custom-compile-command "bash scripts/refresh-constraints.sh" -o "$scratch" "$@"
}

# Pure-Python build backends: one file for every Python, resolved for the oldest one.
compile constraints/build.txt 3.10 constraints/build.in "$@"
{
  echo "# The build backends' pins (constraints/build.in): build constraints of scripts/setup.sh and of"
  echo "# tests/packaging. Regenerate with bash scripts/refresh-constraints.sh; never edit by hand."
  cat "$work/build.txt"
} >constraints/build.txt

refresh_python() {  # refresh_python 3.X: that Python's dev lock, then its user constraints
  local py=$1 dev user stale
  shift
  dev=constraints/dev-py$py.txt
  compile "$dev" "$py" pyproject.toml constraints/dev.in --all-extras \
    --group pyproject.toml:dev --group pyproject.toml:bench "$@"
  {
    echo "# The development lock for Python $py: every extra and dependency group of pyproject.toml, and"
    echo "# constraints/dev.in. scripts/setup.sh installs against it (uv pip install -c)."
    echo "# Regenerate with bash scripts/refresh-constraints.sh (docs/development.md); never edit by hand."
    cat "$work/$(basename "$dev")"
  } >"$dev"

  user=constraints/airflow-$AIRFLOW_VERSION-py$py.txt
  compile "$user" "$py" pyproject.toml --all-extras -c "$dev"
  {
    echo "# Constraints for installing this provider into apache-airflow==$AIRFLOW_VERSION on Python $py: the"
    echo "# stand-in for Airflow's own constraints file of that release (constraints-$py.txt at the"
    echo "# constraints-$AIRFLOW_VERSION tag of Airflow's repository), which is published on GitHub, not on"
    echo "# PyPI, and cannot be fetched from the machines this project is built and tested on (they reach"
    echo "# PyPI, Debian and npm only). Same role and format: every transitive dependency of"
    echo "# apache-airflow==$AIRFLOW_VERSION and of this provider with every extra, one exact pin each,"
    echo "# resolved from PyPI within constraints/dev-py$py.txt (the versions the test suite runs on)."
    echo "# It holds no test or development tool. tests/packaging/test_installed_wheel.py installs the"
    echo "# built wheel into a clean virtualenv with it. A user with access to Airflow's file uses that one."
    echo "# Regenerate with bash scripts/refresh-constraints.sh; never edit by hand."
    cat "$work/$(basename "$user")"
  } >"$user"
  # A pin moved to another Airflow: the old version's user file goes.
  for stale in constraints/airflow-*-py"$py".txt; do
    [ "$stale" = "$user" ] || rm -f "$stale"
  done
  echo "refresh-constraints: Python $py: $dev ($(grep -c '^[a-zA-Z]' "$dev") pins), $user ($(grep -c '^[a-zA-Z]' "$user") pins)"
}

# The Pythons are independent (each file keeps its own pins): resolve them side by side, since uv
# spends its time waiting for PyPI's metadata.
# A Python without a lock yet starts from the main Python's pins (same versions where they fit).
for py in $PYTHONS; do
  if [ ! -f "constraints/dev-py$py.txt" ] && [ -f "constraints/dev-py$MAIN_PYTHON.txt" ]; then
    cp "constraints/dev-py$MAIN_PYTHON.txt" "constraints/dev-py$py.txt"
  fi
done
pids=()
for py in $PYTHONS; do
  refresh_python "$py" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
exit $status
